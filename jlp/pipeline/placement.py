"""The executor's ticks from the virtual-time timeline: every op, group average and HetPipe pull of
one 1F1B fill placed on the ticks the devices run in lockstep, so that each pipeline progresses by
its own clock (docs/sdpipe.md#virtual-time).

`jlp.pipeline.timeline.Timeline` simulates the fill in virtual seconds: a slow pipeline's ops
start later, it reaches fewer updates in the same time, and a group averages the models its
members have at the group's close. The devices of the ("data", "stage") mesh run one program in
ticks. `Placement` gives every event of the timeline the earliest tick that keeps what the
timeline says happened before it (a longest path over these constraints, weights in ticks):

  * a device (pipeline i, stage s) runs its ops in its order, one per tick (+1);
  * a forward follows its input's forward at the stage above, a backward its output gradient's
    backward at the stage below (+1: the value arrives at the end of the tick);
  * "allreduce": update m of stage s runs at one tick on every pipeline (its collective);
  * "preduce" / "adpsgd": a group's average runs at or after its members' updates (0: the
    average comes after the step in a tick) and before their next ops (+1); the groups of one
    tick and stage have disjoint members, so one mixing matrix holds them;
  * "hetpipe": every update pushes its delta to the server in its own tick, a pull replaces the
    local weights by the server at or after its update (0); the server's events of a stage keep
    their virtual-time order: pushes in arrival order (0: a tick applies its pushes in that
    order), a pull at or after every push that arrived before it (0: pushes come before pulls in
    a tick) and before every push that arrives after it (+1), and the puller's next op comes
    after its pull (+1).

A node's tick depends only on what came before it, so the ticks never change once placed, and
the executor may cut the fill into runs anywhere (`chunk_cut`, `take`). `prune` then forgets what
the runs taken so far no longer need (everything below the cut but the last op of each device,
what later events may still name, and HetPipe's server order from the oldest push or pull still
to come), so the host memory of a long fill stays flat. Stage 0's forwards take the training
stream's chunks (one pipeline's rows of a mini-batch) in the order of their ticks, pipelines in
index order within a tick: a pipeline that is slower in virtual time takes fewer. With equal
speeds this is the lockstep table of `schedules.continuous_1f1b` on every pipeline, and chunk c
goes to pipeline c mod N.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from jlp.pipeline import schedules as sched
from jlp.pipeline.timeline import Timeline

__all__ = ["Placement"]

Node = tuple  # ("op", i, s, kind, m) | ("ar", s, m) | ("mix", s, members, their updates) |
#               ("pull", i, s, m) | ("pushes", s, k) | ("pulls", s, k): the first k pushes / pulls
#               of stage s. Every node is named by its content, so that two timelines of one fill
#               (the endless one and the flush's replay) name the same event alike.


class Placement:
  """The ticks of one fill's events (module docstring), placed as the timeline advances.

  Args:
    timeline: a `Timeline` made with `log=True`, schedule "1f1b".
    aligned: every update of a stage runs at one tick on every pipeline (sync="allreduce", or a
      plan that mixes at every update).
  """

  def __init__(self, timeline: Timeline, aligned: bool):
    if timeline.log is None or timeline.schedule != "1f1b":
      raise ValueError("Placement needs a 1F1B Timeline made with log=True.")
    self.timeline, self.aligned = timeline, aligned
    N, S = timeline.N, timeline.S
    self.N, self.S = N, S
    self._read = 0  # how much of the timeline's log is placed
    self.taken_chunks = 0  # the chunks whose runs `take` has returned (the executor's position)
    self.taken_counts = [0] * N  # of those, each pipeline's
    self.preds: dict[Node, list[tuple[Node, int]]] = {}
    self.ticks: dict[Node, int] = {}
    self._complete_after: dict[Node, float] = {}  # preds known once the timeline passes this
    self._members: dict[Node, int] = {}  # ("ar", s, m) -> its members so far
    self._ar_members: dict[Node, list[Node]] = {}
    self.device_ops: list[list[list[Node]]] = [[[] for _ in range(S)] for _ in range(N)]
    self._after_sync: list[list[Node | None]] = [[None] * S for _ in range(N)]
    self._in_sync: set[Node] = set()  # updates that arrived at their sync and have not left
    self.groups: list[tuple[Any, Node]] = []  # (Group, its mix node), formation order
    # HetPipe's server order per stage, from index `_push_base[s]` / `_pull_base[s]` on (what
    # `prune` dropped before it is summed up in the ticks of ("pushes", s, base) and so on).
    self._pushes: list[list[tuple[float, int, Node]]] = [[] for _ in range(S)]  # by arrival
    self._push_times: list[list[float]] = [[] for _ in range(S)]
    self._push_base = [0] * S
    self.push_index: dict[Node, int] = {}  # a push's place in its stage's arrival order
    self._pull_times: list[list[float]] = [[] for _ in range(S)]
    self._pull_nodes: list[list[Node]] = [[] for _ in range(S)]
    self._pull_base = [0] * S
    self.times: dict[Node, tuple[float, float]] = {}  # op -> (start, end); push: arrival
    self._unplaced: list[Node] = []
    self.keys: dict[Node, float] = {}  # virtual time, made monotone along the constraints
    self._pool: list[Node] = []  # placed ops, averages and pulls no run has taken yet
    # Stage 0's forwards by sortkey, from chunk `_forwards_base` of the fill on.
    self.forwards0: list[tuple[tuple, Node]] = []
    self._forwards_base = 0
    self._divergence: dict[Node, float] = {}  # `divergence`'s times of events since pruned

  # -- reading the timeline ------------------------------------------------------------------------
  def _add(self, node: Node, preds: list[tuple[Node, int]], complete_after: float | None = None
           ) -> None:
    self.preds[node] = preds
    if complete_after is not None:
      self._complete_after[node] = complete_after
    self._unplaced.append(node)

  def _read_log(self) -> None:
    log = self.timeline.log
    hetpipe = self.timeline.sync == "hetpipe"
    while self._read < len(log):
      event = log[self._read]
      self._read += 1
      if event[0] == "op":
        _, i, s, (kind, m, _), start, end = event
        node = ("op", i, s, kind, m)
        preds = []
        ops = self.device_ops[i][s]
        if ops:
          preds.append((ops[-1], 1))
        other = s - 1 if kind == sched.FWD else s + 1
        if 0 <= other < self.S:
          preds.append((("op", i, other, kind, m), 1))
        if self._after_sync[i][s] is not None:
          preds.append((self._after_sync[i][s], 1))
          self._after_sync[i][s] = None
        ops.append(node)
        self.times[node] = (start, end)
        if kind == sched.BWD and self.aligned:
          group = ("ar", s, m)
          self.preds.setdefault(group, [])
          self.preds[group] += preds
          self._ar_members.setdefault(group, []).append(node)
          self._members[group] = self._members.get(group, 0) + 1
          if self._members[group] == self.N:
            self._unplaced.append(group)
          self._add(node, [(group, 0)])
        elif kind == sched.BWD and hetpipe:
          # After every pull of its stage that comes before its push (resolved at the arrival).
          self._add(node, preds, complete_after=end)
        else:
          self._add(node, preds)
      elif event[0] == "arrive":
        _, i, s, m, t = event
        node = ("op", i, s, sched.BWD, m)
        self._in_sync.add(node)
        if hetpipe:
          self.push_index[node] = self._push_base[s] + len(self._pushes[s])
          self._pushes[s].append((t, i, node))
          self._push_times[s].append(t)
      elif event[0] == "leave":
        _, i, s, m, _ = event
        self._in_sync.discard(("op", i, s, sched.BWD, m))
      elif event[0] == "group":
        _, group, updates = event
        node = ("mix", group.stage, tuple(group.members),
                tuple(updates[i] for i in group.members))
        self.groups.append((group, node))
        self.times[node] = (group.closed, group.closed)
        self._add(node, [(("op", i, group.stage, sched.BWD, updates[i]), 0)
                         for i in group.members])
        for i in group.members:
          self._after_sync[i][group.stage] = node
      elif event[0] == "pull":
        _, i, s, m, t = event
        node = ("pull", i, s, m)
        self._pull_times[s].append(t)
        self._pull_nodes[s].append(node)
        self._add(node, [(("op", i, s, sched.BWD, m), 0)], complete_after=t)
        self.times[node] = (t, t)
        self._after_sync[i][s] = node

  def _all_preds(self, node: Node) -> list[tuple[Node, int]]:
    """node's predecessors, with HetPipe's server order resolved (its events must be known)."""
    kind = node[0]
    if kind == "op" and node[3] == sched.BWD and self.timeline.sync == "hetpipe" and \
        not self.aligned:
      s, end = node[2], self.times[node][1]
      before = self._pull_base[s] + bisect.bisect_left(self._pull_times[s], end)
      return self.preds[node] + [(("pulls", s, before), 1),
                                 (("pushes", s, self.push_index[node]), 0)]
    if kind == "pull":
      s, t = node[2], self.times[node][0]
      arrived = self._push_base[s] + bisect.bisect_right(self._push_times[s], t)
      return self.preds[node] + [(("pushes", s, arrived), 0)]
    if kind == "pushes":
      _, s, k = node
      if k == 0:
        return []
      if k <= self._push_base[s]:
        raise AssertionError(f"{node} was pruned before it was placed")  # a bug
      return [(("pushes", s, k - 1), 0), (self._pushes[s][k - 1 - self._push_base[s]][2], 0)]
    if kind == "pulls":
      _, s, k = node
      if k == 0:
        return []
      if k <= self._pull_base[s]:
        raise AssertionError(f"{node} was pruned before it was placed")  # a bug
      return [(("pulls", s, k - 1), 0), (self._pull_nodes[s][k - 1 - self._pull_base[s]], 0)]
    return self.preds[node]

  def _known(self, node: Node) -> bool:
    """Whether node's predecessors are all known."""
    if node[0] == "ar":
      return self._members.get(node, 0) == self.N
    if node[0] in ("pushes", "pulls"):
      return True
    if node not in self.preds:
      return False
    after = self._complete_after.get(node)
    return after is None or self.timeline.now > after or not self.timeline.heap

  def tick(self, node: Node) -> int | None:
    """node's tick, or None while something before it is unknown."""
    if node in self.ticks:
      return self.ticks[node]
    stack, on_path = [(node, False)], set()
    while stack:
      top, expanded = stack.pop()
      if top in self.ticks:
        continue
      if expanded:
        on_path.discard(top)
        base = -1 if top[0] in ("pushes", "pulls") else 0
        preds = self._all_preds(top)
        self.ticks[top] = max([base] + [self.ticks[p] + w for p, w in preds])
        self.keys[top] = max([self._time(top)] + [self.keys[p] for p, _ in preds])
        if top[0] in ("op", "mix", "pull"):
          self._pool.append(top)
        if top[0] == "op" and top[2] == 0 and top[3] == sched.FWD:
          bisect.insort(self.forwards0, (self.sortkey(top), top))
        continue
      if not self._known(top):
        return None
      if top in on_path:
        raise AssertionError(f"the placement's constraints form a cycle at {top}")  # a bug
      on_path.add(top)
      stack.append((top, True))
      stack.extend((p, False) for p, _ in self._all_preds(top) if p not in self.ticks)
    return self.ticks[node]

  def _place(self) -> None:
    self._read_log()
    left = []
    for node in self._unplaced:
      if self.tick(node) is None:
        left.append(node)
    self._unplaced = left

  def _time(self, node: Node) -> float:
    """When node happens in virtual time: an op's end (a push: its arrival), a group's close, a
    pull's time."""
    if node[0] == "ar":
      return max(self.times[m][1] for m in self._ar_members[node])
    if node[0] in ("pushes", "pulls"):
      return -np.inf
    return self.times[node][1]

  _RANK = {"ar": 0, "op": 1, "mix": 2, "pull": 3}

  def sortkey(self, node: Node) -> tuple:
    """The order runs are cut in: (virtual time made monotone along the constraints, fill tick,
    kind, ids); an aligned update goes with its whole group."""
    unit = node
    if node[0] == "op" and node[3] == sched.BWD and self.aligned:
      unit = ("ar", node[2], node[4])
    return (self.keys[unit], self.ticks[unit], self._RANK[unit[0]]) + tuple(unit[1:])

  def advance(self, until) -> None:
    """Advances the timeline (a few events at a time) until `until(self)` holds."""
    self._place()
    while not until(self):
      if not self.timeline.heap:
        raise AssertionError("the timeline ran out of events")  # a bug, not input
      count = [0]

      def step() -> bool:
        count[0] += 1
        return count[0] > 64 or not self.timeline.heap
      self.timeline.advance(step)
      self._place()

  def finish(self) -> None:
    """Places everything (a timeline with an end)."""
    self.timeline.advance(lambda: not self.timeline.heap)
    self._place()
    if self._unplaced:
      raise AssertionError(f"unplaced events at the end: {self._unplaced[:4]}")  # a bug

  # -- what the executor reads ---------------------------------------------------------------------
  def chunk_cut(self, chunks: int) -> tuple:
    """The sortkey of the stage-0 forward that takes chunk `chunks` (0-based, counted in the
    fill): a run fed chunks [0, chunks) ends before it. Advances the timeline as far as needed:
    every later forward then ends after what it has processed."""
    k = chunks - self._forwards_base
    if k < 0:
      raise AssertionError(f"chunk {chunks} lies before the pruned fill's {self._forwards_base}")

    def known(_) -> bool:
      return len(self.forwards0) > k and self.timeline.now > self.forwards0[k][0][0]
    self.advance(known)
    return self.forwards0[k][0]

  def chunks_between(self, first: int, stop: int) -> list[tuple[int, int]]:
    """(pipeline, m) of the stage-0 forwards that take chunks [first, stop) of the fill, in chunk
    order (`chunk_cut(stop)` first)."""
    base = self._forwards_base
    if first < base:
      raise AssertionError(f"chunk {first} lies before the pruned fill's {base}")  # a bug
    return [(node[1], node[4]) for _, node in self.forwards0[first - base:stop - base]]

  def take(self, cut: tuple | None, chunks: int | None = None) -> list[Node]:
    """The placed ops, averages and pulls before `cut` (None: all) that no earlier `take`
    returned, in cut order. `chunks`: the chunks fed up to `cut` (`chunk_cut(chunks)`), which
    then count as taken (`taken_chunks`, `taken_counts`)."""
    pool = [(self.sortkey(node), node) for node in self._pool]
    taken = sorted(p for p in pool if cut is None or p[0] < cut)
    self._pool = [node for key, node in pool if not (cut is None or key < cut)]
    if chunks is not None:
      for i, _ in self.chunks_between(self.taken_chunks, chunks):
        self.taken_counts[i] += 1
      self.taken_chunks = chunks
    return [node for _, node in taken]

  def local_ticks(self, nodes: list[Node]) -> dict[Node, int]:
    """The ticks of one run's nodes (`take`'s, in cut order), counted from the run's first: the
    same constraints among them; what earlier runs did is done."""
    members = set(nodes)
    local: dict[Node, int] = {}
    hetpipe = self.timeline.sync == "hetpipe" and not self.aligned
    pushes: list[list[tuple[float, int]]] = [[] for _ in range(self.S)]
    pulls: list[list[tuple[float, int]]] = [[] for _ in range(self.S)]
    for node in nodes:
      if node in local:
        continue
      if node[0] == "op" and node[3] == sched.BWD and self.aligned:
        group = ("ar", node[2], node[4])
        preds, updates = self.preds[group], self._ar_members[group]
      else:
        preds, updates = self.preds[node], [node]
      t = max([0] + [local[p] + w for p, w in preds if p in members])
      if hetpipe and node[0] == "op" and node[3] == sched.BWD:
        end = self.times[node][1]
        t = max([t] + [u + 1 for time, u in pulls[node[2]] if time < end]
                + [u for _, u in pushes[node[2]]])
        pushes[node[2]].append((end, t))
      if node[0] == "pull":
        time = self.times[node][0]
        t = max([t] + [u for arrival, u in pushes[node[2]] if arrival <= time])
        pulls[node[2]].append((time, t))
      for update in updates:
        local[update] = t
    return local

  # -- a long fill ---------------------------------------------------------------------------------
  def agrees_with_its_end(self, start: Placement) -> bool:
    """Whether `start`, a copy of this placement made earlier, agrees with this fill replayed
    with its end at `taken_counts` (`end_at`, a flush) on everything it has processed: it has
    not started a stage-0 forward of a mini-batch not taken, and has processed no event at or
    after `divergence()`."""
    if not start.timeline.now < self.divergence():
      return False
    warm = self.S
    for i, count in enumerate(self.taken_counts):
      position = count if count < warm else warm + 2 * (count - warm) + 1  # F(count), stage 0
      if start.timeline.pos[i][0] > position:
        return False
    return True

  def divergence(self) -> float:
    """The earliest virtual time of an event at which this fill replayed with its end at
    `taken_counts` departs from this never-ending timeline, besides the forwards of mini-batches
    not taken (`agrees_with_its_end`): with preduce the arrivals of each pipeline's last update
    taken (the scheduler's end rule), and with HetPipe's wave barrier the arrivals at the first
    wave some pipeline no longer reaches. An event not known yet counts as the timeline's now;
    one pruned since keeps the time this method saw last."""
    timeline = self.timeline
    now, t = timeline.now, math.inf
    cache = self._divergence
    ends = []
    for i, count in enumerate(self.taken_counts):
      if timeline.sync == "preduce" and count:
        ends += [("op", i, s, sched.BWD, count - 1) for s in range(self.S)]
    if timeline.sync == "hetpipe" and timeline.hetpipe.barrier:
      ends += self._short_waves()
    for node in ends:
      if node in self.times:
        cache[node] = self.times[node][1]  # the arrival at its sync
      t = min(t, cache.get(node, now))
    self._divergence = {node: cache[node] for node in ends if node in cache}
    return t

  def _short_waves(self) -> list[Node]:
    """HetPipe's wave barrier with an end at `taken_counts`: a wave some pipeline no longer
    reaches closes without it, so the arrivals there of the pipelines that do reach it (their
    updates at each stage) are where the timeline with its end may depart."""
    timeline, every = self.timeline, self.timeline.hetpipe.pull_every
    first = timeline.first_batch
    short = min(f + c for f, c in zip(first, self.taken_counts, strict=True)) // every + 1
    out = []
    for i, count in enumerate(self.taken_counts):
      wave = max(short, first[i] // every + 1)
      b = wave * every - first[i] - 1  # pipeline i's update at that pull, in the fill
      if b < count:
        out += [("op", i, s, sched.BWD, b) for s in range(self.S)]
    return out

  def end_at(self, totals: list[int]) -> None:
    """Gives the never-ending timeline an end after `totals` mini-batches per pipeline, as
    `Timeline(total=totals)` has from its start: valid while it has processed nothing at or
    after `divergence()` for these totals."""
    timeline = self.timeline
    timeline.total = timeline.totals = [int(v) for v in totals]
    if timeline.scheduler is not None:
      timeline.scheduler.last_batch = [int(v) - 1 for v in totals]

  def prune(self, keep_updates_from: list[int]) -> None:
    """Forgets what no later run, placement or cut can need, after a `take` whose tables are
    made: the read part of the timeline's log, every taken node but the last op of each device,
    what later events may name (an op whose dependent has not started, an update in its sync,
    a device's latest average or pull), the predecessors of what is not placed yet, HetPipe's
    server order before the oldest push or pull a later node may count, and the timeline's
    record of each pipeline's updates before its `keep_updates_from` (`Timeline.prune`)."""
    timeline = self.timeline
    del timeline.log[:self._read]
    self._read = 0
    untaken = set(self._pool) | set(self._unplaced)
    live: set[Node] = set(untaken)
    live.update(node for node in self.preds if node[0] == "ar" and node not in self.ticks)
    for node in list(live):
      live.update(p for p, _ in self.preds.get(node, ()))
      if self.aligned and node[0] == "op" and node[3] == sched.BWD:
        group = ("ar", node[2], node[4])
        live.add(group)
        live.update(p for p, _ in self.preds.get(group, ()))
    for i in range(self.N):
      for s in range(self.S):
        ops = self.device_ops[i][s]
        del ops[:-1]
        live.update(ops)
        if self._after_sync[i][s] is not None:
          live.add(self._after_sync[i][s])
    live.update(("op", i, s, kind, m) for i, s, (kind, m, _) in timeline.done)
    live.update(self._in_sync)
    if timeline.sync == "hetpipe" and not self.aligned:
      self._prune_server(live)
    for table in (self.preds, self.ticks, self.keys, self.times, self._complete_after,
                  self.push_index, self._ar_members, self._members):
      for node in [n for n in table if n not in live]:
        del table[node]
    self.groups = [(group, node) for group, node in self.groups if node in live]
    taken = self.taken_chunks - self._forwards_base
    if taken > 0:
      del self.forwards0[:taken]
      self._forwards_base = self.taken_chunks
    timeline.prune(keep_updates_from)

  def _prune_server(self, live: set[Node]) -> None:
    """HetPipe: drops each stage's pushes and pulls before the oldest one a node not placed yet,
    or one still to come (its time is at least the timeline's now), may count; the tick of the
    count there stays, and ends the chains of later counts."""
    now = self.timeline.now
    unplaced = [node for node in self._unplaced if node not in self.ticks]
    for s in range(self.S):
      push_base, pull_base = self._push_base[s], self._pull_base[s]
      k0 = push_base + bisect.bisect_right(self._push_times[s], now)
      l0 = pull_base + bisect.bisect_left(self._pull_times[s], now)
      for node in unplaced:
        if node[0] == "pull" and node[2] == s:
          k0 = min(k0, push_base + bisect.bisect_right(self._push_times[s], self.times[node][0]))
        elif node[0] == "op" and node[2] == s and node[3] == sched.BWD:
          if node in self.push_index:
            k0 = min(k0, self.push_index[node])
          if node in self.times:
            l0 = min(l0, pull_base + bisect.bisect_left(self._pull_times[s], self.times[node][1]))
      while k0 > push_base and self.tick(("pushes", s, k0)) is None:
        k0 -= 1
      while l0 > pull_base and self.tick(("pulls", s, l0)) is None:
        l0 -= 1
      if k0 == push_base and ("pushes", s, k0) not in self.ticks:
        self.tick(("pushes", s, k0))
      if l0 == pull_base and ("pulls", s, l0) not in self.ticks:
        self.tick(("pulls", s, l0))
      del self._pushes[s][:k0 - push_base], self._push_times[s][:k0 - push_base]
      del self._pull_nodes[s][:l0 - pull_base], self._pull_times[s][:l0 - pull_base]
      self._push_base[s], self._pull_base[s] = k0, l0
      live.update((("pushes", s, k0), ("pulls", s, l0)))
      live.update(node for _, _, node in self._pushes[s])
      live.update(self._pull_nodes[s])
