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
the executor may cut the fill into runs anywhere: `frontier` says up to which tick everything is
placed. Stage 0's forwards take the training stream's chunks (one pipeline's rows of a
mini-batch) in the order of their ticks, pipelines in index order within a tick: a pipeline that
is slower in virtual time takes fewer. With equal speeds this is the lockstep table of
`schedules.continuous_1f1b` on every pipeline, and chunk c goes to pipeline c mod N.
"""

from __future__ import annotations

import bisect
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
    self.preds: dict[Node, list[tuple[Node, int]]] = {}
    self.ticks: dict[Node, int] = {}
    self._complete_after: dict[Node, float] = {}  # preds known once the timeline passes this
    self._members: dict[Node, int] = {}  # ("ar", s, m) -> its members so far
    self._ar_members: dict[Node, list[Node]] = {}
    self.device_ops: list[list[list[Node]]] = [[[] for _ in range(S)] for _ in range(N)]
    self._after_sync: list[list[Node | None]] = [[None] * S for _ in range(N)]
    self._waiting: dict[tuple[int, int], Node] = {}  # (i, s) -> the update in its sync
    self.groups: list[tuple[Any, Node]] = []  # (Group, its mix node), formation order
    self.pulls: list[Node] = []
    self._pushes: list[list[tuple[float, int, Node]]] = [[] for _ in range(S)]  # by arrival
    self._push_times: list[list[float]] = [[] for _ in range(S)]
    self.push_index: dict[Node, int] = {}  # a push's place in its stage's arrival order
    self._pull_times: list[list[float]] = [[] for _ in range(S)]
    self._pull_nodes: list[list[Node]] = [[] for _ in range(S)]
    self.times: dict[Node, tuple[float, float]] = {}  # op -> (start, end); push: arrival
    self._unplaced: list[Node] = []
    self.by_tick: dict[int, list[Node]] = {}  # the placed ops, averages and pulls
    self.keys: dict[Node, float] = {}  # virtual time, made monotone along the constraints
    self._pool: list[Node] = []  # placed ops, averages and pulls no run has taken yet
    self.forwards0: list[tuple[tuple, Node]] = []  # stage 0's forwards by sortkey

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
        self._waiting[(i, s)] = node
        if hetpipe:
          self.push_index[node] = len(self._pushes[s])
          self._pushes[s].append((t, i, node))
          self._push_times[s].append(t)
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
        self.pulls.append(node)
        self._add(node, [(("op", i, s, sched.BWD, m), 0)], complete_after=t)
        self.times[node] = (t, t)
        self._after_sync[i][s] = node

  def _all_preds(self, node: Node) -> list[tuple[Node, int]]:
    """node's predecessors, with HetPipe's server order resolved (its events must be known)."""
    kind = node[0]
    if kind == "op" and node[3] == sched.BWD and self.timeline.sync == "hetpipe" and \
        not self.aligned:
      s, end = node[2], self.times[node][1]
      before = bisect.bisect_left(self._pull_times[s], end)
      return self.preds[node] + [(("pulls", s, before), 1),
                                 (("pushes", s, self.push_index[node]), 0)]
    if kind == "pull":
      s, t = node[2], self.times[node][0]
      arrived = bisect.bisect_right(self._push_times[s], t)
      return self.preds[node] + [(("pushes", s, arrived), 0)]
    if kind == "pushes":
      _, s, k = node
      return [] if k == 0 else [(("pushes", s, k - 1), 0), (self._pushes[s][k - 1][2], 0)]
    if kind == "pulls":
      _, s, k = node
      return [] if k == 0 else [(("pulls", s, k - 1), 0), (self._pull_nodes[s][k - 1], 0)]
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
        t = self.ticks[top] = max([base] + [self.ticks[p] + w for p, w in preds])
        self.keys[top] = max([self._time(top)] + [self.keys[p] for p, _ in preds])
        if top[0] in ("op", "mix", "pull"):
          self.by_tick.setdefault(t, []).append(top)
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
    def known(_) -> bool:
      return len(self.forwards0) > chunks and self.timeline.now > self.forwards0[chunks][0][0]
    self.advance(known)
    return self.forwards0[chunks][0]

  def chunks_below(self, cut: tuple) -> list[tuple[int, int]]:
    """(pipeline, m) of the stage-0 forwards before `cut`, in chunk order."""
    stop = bisect.bisect_left(self.forwards0, (cut,))
    return [(node[1], node[4]) for _, node in self.forwards0[:stop]]

  def take(self, cut: tuple | None) -> list[Node]:
    """The placed ops, averages and pulls before `cut` (None: all) that no earlier `take`
    returned, in cut order."""
    pool = [(self.sortkey(node), node) for node in self._pool]
    taken = sorted(p for p in pool if cut is None or p[0] < cut)
    self._pool = [node for key, node in pool if not (cut is None or key < cut)]
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
