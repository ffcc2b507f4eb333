"""The event engine of virtual time, and one fill of a `Pipeline` decided as the pipeline runs:
the model `jlp.pipeline.simulator` describes (op costs, p2p, the syncs' waits, SD-PIPE's
scheduler), for mini-batches that keep coming, so that where a `run` ends changes nothing
(docs/sdpipe.md#virtual-time); `simulate` runs it with an end.

A fill is what the pipelines train between two flushes (usually the whole training): mini-batches
0, 1, 2, ... counted from the fill's first one. `Timeline` simulates them with no last mini-batch
(`total=None`): every stage keeps its never-ending op order (1F1B: warm-up, then one forward, one
backward; GPipe: one mini-batch's table after the other), so the group a window forms, and when
every update leaves its sync, do not depend on how many mini-batches the executor has been fed.
`advance(until)` processes events in virtual-time order until the updates asked for are all
decided (left their sync); a decision never changes once taken, and processing is deterministic,
so decisions asked for in one call or in many are the same. The executor's flush ends the fill:
`Timeline(total=fed)` replays it with the ops of later mini-batches left out (their forwards never
happen, so the drain runs as in a table of `fed` mini-batches), and the drain's updates take their
decisions from that replay. The replay agrees with the never-ending timeline on every op that comes
before the first forward left out at its stage; a decision of the drain that depended on an
earlier arrival decided otherwise there (a window spanning both) would follow the replay.

1F1B's pipelines run freely: each (pipeline, stage) starts its next op when it is free and its
input has arrived, whatever the other pipelines do (`jlp.pipeline.placement` places that on the
executor's ticks). GPipe's run in lockstep, as the executor runs them (`Pipeline._execute`: the
program scans mini-batch b's whole table, then every stage's update of b with its sync, then
mini-batch b + 1's table): the first op of mini-batch b >= 1 at (pipeline i, stage s) starts only
once every pipeline has left the sync of update b - 1 at every stage, and mini-batch 0 of the
fill starts everywhere at the latest of `start` (where the barrier after the update before the
fill puts it). So every pipeline runs mini-batch b between the same two barriers and is at
update b - 1 while it does, every pipeline's clock waits for the slowest (mini-batch b starts at
`time(b - 1)`), and a group (preduce, adpsgd) holds its members at one update, the round at which
the executor applies it. The barrier covers all stages, not only stage s. A per-stage one would
also start every op after the update its own stage's weights need, but it would let stage s start
mini-batch b while another stage is still in its sync of b - 1, which the executor never does:
it would model an executor that overlaps one mini-batch's syncs with the next one's table. The
two differ only when a stage other than 0 leaves last: never with none, allreduce, adpsgd or
hetpipe (a pipeline's stage 0 arrives after its other stages, and their syncs keep that order),
but a PReduce window of a later stage may close after stage 0's, and the times it shifts change
the later windows. The whole barrier makes the timeline's order the executor's order. With equal
speeds and no stalls every sync already leaves together, and nothing changes. The PReduce
scheduler then opens a forced window only at a round's first arrival at the stage
(`jlp.pipeline.preduce`, `lockstep`): one opened later in a round would wait for pipelines that
cannot arrive again before it closes.

Op costs are drawn per op, not per position in a stage's order, so that an op costs the same
with or without an end. One draw per (pipeline i, stage s, op id): the op id is 2b for the
forward of mini-batch b and 2b + 1 for its backward, in both schedules, and the op stalls when
u < probability, u uniform from
`np.random.default_rng([seed, id // 1024]).random((1024, N, S))[id % 1024, i, s]`. GPipe's M
micro-batch forwards (backwards) of mini-batch b at a stage share that draw, and each takes 1/M
of the base cost and, when stalled, 1/M of the delay: a stall costs a (mini-batch, stage,
direction) delay_s in total whatever M, as one 1F1B op, and with one seed GPipe and 1F1B stall
the same (pipeline, stage, mini-batch, direction)s, so comparing them under `--hetero` does not
depend on M. AD-PSGD's partners of round b are `adpsgd_matchings`'s row b. Pulls of HetPipe
count mini-batches over the whole training (`first_batch`).
"""

from __future__ import annotations

import collections
import collections.abc
import heapq
import math
import random
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from jlp.pipeline import schedules
from jlp.pipeline.costs import HetPipe, Hetero, PReduce, group_costs
from jlp.pipeline.preduce import ORDINARY, Group, Outcome, Scheduler

__all__ = ["Timeline"]

_CHUNK = 1024
_ENDLESS = 2 ** 62  # a last mini-batch that never comes (the scheduler's end rule never fires)

Op = tuple[int, int, int]  # (kind, mini-batch, micro-batch)


class Timeline:
  """The virtual-time model of one fill (module docstring).

  Args:
    schedule, sync, num_pipelines, num_stages, num_microbatches: as `Pipeline`'s.
    seed: this fill's seed (op costs, AD-PSGD's matchings).
    hetero, preduce, hetpipe: the cost model and the syncs' knobs (jlp.pipeline.costs).
    first_batch: the mini-batches each pipeline trained before the fill (an int, or one per
      pipeline: HetPipe's pulls count a pipeline's own mini-batches over the whole training).
    start: [N, S] virtual seconds at which each (pipeline, stage) is free.
    total: None (mini-batches keep coming) or the number of mini-batches in the fill (an int, or
      one per pipeline: each pipeline's own count).
    log: keep `log`, the record `jlp.pipeline.placement` places on the executor's ticks: in
      processing order, ("op", i, s, op, start, end) when an op starts, ("arrive", i, s, b, t)
      when an update reaches its sync, ("group", Group, {member: its update}) when a group forms
      (before its members leave), ("pull", i, s, b, t) when HetPipe decides that pipeline i's
      stage s pulls at t after update b, and ("leave", i, s, b, t).
    stalls_by_position: draw the stalls as `jlp.pipeline.simulate` does (it runs this model with an
      end): `default_rng(seed).random((2 * total, N, S))[k, i, s]`, k the op's position in its
      stage's order (1F1B), or for GPipe the position of its mini-batch's forwards (backwards) in
      the order F(0), B(0), F(1), ... of a stage's stage-ops, 2b (2b + 1): the op id; needs
      `total`. Default: per op id (module docstring).
  """

  def __init__(self, schedule: str, sync: str, num_pipelines: int, num_stages: int,
               num_microbatches: int, *, seed: int, hetero: Hetero, preduce: PReduce,
               hetpipe: HetPipe, first_batch: int | Sequence[int], start: np.ndarray,
               total: int | Sequence[int] | None = None, stalls_by_position: bool = False,
               log: bool = False):
    N, S, M = num_pipelines, num_stages, num_microbatches
    self.schedule, self.sync, self.N, self.S, self.M = schedule, sync, N, S, M
    self.seed, self.hetero, self.hetpipe = seed, hetero, hetpipe
    per_pipeline = lambda v: [int(v)] * N if np.ndim(v) == 0 else [int(x) for x in v]
    self.first_batch = per_pipeline(first_batch)
    self.total = total
    self.totals = None if total is None else per_pipeline(total)
    self.log: list[tuple] | None = [] if log else None
    self.now = -np.inf  # the time of the last event processed
    self.slowdown = (np.ones((N, S)) if hetero.slowdown is None
                     else np.asarray(hetero.slowdown, np.float64)).tolist()
    self.cost = group_costs(hetero, N)
    last = [_ENDLESS] * N if total is None else self.totals
    # GPipe: every pipeline runs mini-batch b's table between the same two barriers (module
    # docstring), so every pipeline has the same counts.
    self.lockstep = schedule == "gpipe"
    if self.lockstep and (len(set(self.first_batch)) > 1
                          or (self.totals is not None and len(set(self.totals)) > 1)):
      raise ValueError(f"first_batch={first_batch!r}, total={total!r} are not allowed with "
                       "schedule='gpipe'; expected one count for every pipeline (GPipe's "
                       "pipelines run in lockstep).")
    self.scheduler = (Scheduler(preduce, N, S, last, self.cost, lockstep=self.lockstep)
                      if sync == "preduce" else None)
    self.base_order = schedules.stage_order("gpipe", S, 1, M) if schedule == "gpipe" else None
    self._stalls: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
    self._position_stalls: np.ndarray | None = None
    if stalls_by_position:  # two draws per mini-batch and stage (module docstring)
      self._position_stalls = (np.random.default_rng(int(seed)).random((2 * max(self.totals),
                                                                         N, S))
                               < hetero.probability)
    self.started = [[0] * S for _ in range(N)]  # ops started: the position of the next one
    self._rng = random.Random(int(seed))  # AD-PSGD: one shuffle per round, in round order
    self._partners: list[list[int]] = []  # from round `_partners_base` on
    self._partners_base = 0
    self.heap: list[tuple] = []
    self.pos = [[0] * S for _ in range(N)]  # position in the stage's order of its next op
    self.current: list[list[Op | None]] = [[None] * S for _ in range(N)]
    self.waiting: list[list[float | None]] = [[None] * S for _ in range(N)]
    # (pipeline, stage, op) -> end time, until the op that waits for it starts
    self.done: dict[tuple[int, int, Op], float] = {}
    # Per pipeline: update b -> its stages' leave times (nan: not yet); `finish` shows them.
    self._left: list[dict[int, list[float]]] = [{} for _ in range(N)]
    self._needed: set[tuple[int, int]] = set()  # the updates `decide` waits for
    self.groups: list[Group] = []
    self.windows: list[tuple[Group, ...]] = []  # preduce: the groups of every window closed
    self.groups_at: dict[tuple[int, int], list[Group]] = {}  # (round, stage) -> its groups
    self.arrived: dict[tuple[int, int], int] = {}  # (stage, update) -> count
    self._at_barrier: dict[tuple[int, int], list] = {}  # HetPipe's pull: who waits there
    self.pending = [[(-1, 0.0)] * N for _ in range(S)]
    # GPipe's lockstep barriers: update b -> when its last (pipeline, stage) left its sync, and
    # the (pipeline, stage, free from) whose first op of mini-batch b + 1 waits for that.
    self._all_left: dict[int, float] = {}
    self._at_lockstep: dict[int, list[tuple[int, int, float]]] = {}
    # GPipe's first mini-batch comes after every device's last update before the fill.
    first = float(np.max(start)) if self.lockstep else None
    for i in range(N):
      for s in range(S):
        self._start(i, s, float(start[i][s]) if first is None else first)

  # -- the never-ending orders ---------------------------------------------------------------------
  def _endless_op(self, s: int, k: int) -> Op:
    """Op k of stage s's order with no end."""
    if self.schedule == "gpipe":
      per = len(self.base_order[s])
      kind, _, m = self.base_order[s][k % per]
      return (kind, k // per, m)
    warm = self.S - s
    if k < warm:
      return (schedules.FWD, k, 0)
    if (k - warm) % 2 == 0:
      return (schedules.BWD, (k - warm) // 2, 0)
    return (schedules.FWD, warm + (k - warm) // 2, 0)

  def _next(self, i: int, s: int, k: int) -> int | None:
    """The first position >= k of an op of pipeline i in the fill (None: its ops are over). With
    an end, 1F1B's forwards of later mini-batches are left out, so the backwards that followed
    them come one after the other (the drain); the first later backward ends the order."""
    while True:
      kind, b, _ = self._endless_op(s, k)
      if self.totals is None or b < self.totals[i]:
        return k
      if self.schedule == "gpipe" or kind == schedules.BWD:
        return None
      k += 1

  @staticmethod
  def _op_id(op: Op) -> int:
    """The id of op's draw: 2b for the forward(s) of mini-batch b, 2b + 1 for its backward(s)
    (GPipe: its M micro-batch ops of one kind share it)."""
    kind, b, _ = op
    return 2 * b + (kind == schedules.BWD)

  def _stalled(self, i: int, s: int, op: Op) -> bool:
    if self._position_stalls is not None:
      # GPipe's stage-ops of a stage come in the order F(0), B(0), F(1), ...: position = id.
      k = self._op_id(op) if self.lockstep else self.started[i][s]
      return bool(self._position_stalls[k, i, s])
    op_id = self._op_id(op)
    chunk = op_id // _CHUNK
    if chunk in self._stalls:
      self._stalls.move_to_end(chunk)
    else:  # the draws of the chunks in use (a few per pipeline), recomputed when needed again
      draws = np.random.default_rng([int(self.seed), chunk]).random((_CHUNK, self.N, self.S))
      self._stalls[chunk] = draws < self.hetero.probability
      if len(self._stalls) > 2 * self.N + 2:
        self._stalls.popitem(last=False)
    return bool(self._stalls[chunk][op_id % _CHUNK, i, s])

  def _duration(self, i: int, s: int, op: Op) -> float:
    base = self.hetero.fwd_s if op[0] == schedules.FWD else self.hetero.bwd_s
    delay = self.hetero.delay_s
    if self.schedule == "gpipe":  # a micro-batch op: 1/M of its mini-batch's stage-op
      base, delay = base / self.M, delay / self.M
    return base * self.slowdown[i][s] + delay * self._stalled(i, s, op)

  def _update_of(self, s: int, op: Op) -> int:
    """The update op ends (its mini-batch), or -1."""
    kind, b, m = op
    if self.schedule == "gpipe":
      return b if op[:1] + (0, m) == self.base_order[s][-1] else -1
    return b if kind == schedules.BWD else -1

  def _dependency(self, s: int, op: Op) -> int:
    """The stage whose same op this op waits for (-1: none)."""
    other = s - 1 if op[0] == schedules.FWD else s + 1
    return other if 0 <= other < self.S else -1

  # -- the events ----------------------------------------------------------------------------------
  def _start(self, i: int, s: int, free: float) -> None:
    """Starts (pipeline i, stage s)'s next op, free from `free` on, once its dependency is done
    (else it waits for it)."""
    k = self._next(i, s, self.pos[i][s])
    if k is None:
      return
    op = self._endless_op(s, k)
    if self.lockstep and op[1] > 0 and k % len(self.base_order[s]) == 0:
      # GPipe's first op of mini-batch b >= 1: once every (pipeline, stage) left update b - 1.
      left = self._all_left.get(op[1] - 1)
      if left is None:
        self._at_lockstep.setdefault(op[1] - 1, []).append((i, s, free))
        return
      free = max(free, left)
    start = free
    ds = self._dependency(s, op)
    if ds >= 0:
      ready = self.done.pop((i, ds, op), None)  # an op has one dependent: it is read once
      if ready is None:
        self.current[i][s], self.waiting[i][s] = op, free
        return
      start = max(free, ready + self.hetero.p2p_s)
    self.pos[i][s] = k + 1
    self.current[i][s], self.waiting[i][s] = None, None
    end = start + self._duration(i, s, op)
    heapq.heappush(self.heap, (end, 0, i, s, k, op))
    if self.log is not None:
      self.log.append(("op", i, s, op, start, end))
    self.started[i][s] += 1

  def advance(self, until: Callable[[], bool]) -> None:
    """Processes events in virtual-time order until `until()` holds (checked before each)."""
    while not until():
      if not self.heap:
        raise AssertionError("the timeline ran out of events")  # a bug, not input
      t, event, a, s, _, op = heapq.heappop(self.heap)
      self.now = t
      if event == 1:  # a deadline: a = stage, s = window id
        self._carry_out(self.scheduler.deadline(a, s, t))
        continue
      i = a
      dependent = s + 1 if op[0] == schedules.FWD else s - 1
      if 0 <= dependent < self.S:  # an op the next (forward) or previous (backward) stage needs
        self.done[(i, s, op)] = t
        if self.current[i][dependent] == op:
          self._start(i, dependent, self.waiting[i][dependent])
      b = self._update_of(s, op)
      if b < 0 or self.sync == "none":
        if b >= 0:
          self._record_leave(i, s, b, t)
        self._start(i, s, t)
      else:
        self._arrive(i, s, b, t)

  def _record_leave(self, i: int, s: int, b: int, t: float) -> None:
    """(pipeline i, stage s) left the sync of update b at t."""
    self._left[i].setdefault(b, [math.nan] * self.S)[s] = t
    if self.log is not None:
      self.log.append(("leave", i, s, b, t))
    if self.decided(b, s):
      self._needed.discard((b, s))
      if self.lockstep and all(self.decided(b, s2) for s2 in range(self.S)):
        # GPipe: the barrier after update b.
        self._all_left[b] = self.time(b)
        self._all_left.pop(b - 1, None)  # every op of mini-batch b has started
        for j, s2, free in self._at_lockstep.pop(b, ()):
          self._start(j, s2, free)

  def _leave(self, i: int, s: int, b: int, t: float) -> None:
    self._record_leave(i, s, b, t)
    self._start(i, s, t)

  def partners(self, b: int) -> list[int]:
    """AD-PSGD's partner of every pipeline in round b (adpsgd_matchings's rule)."""
    if b < self._partners_base:
      raise AssertionError(f"AD-PSGD round {b} was pruned")  # a bug
    while self._partners_base + len(self._partners) <= b:
      order = list(range(self.N))
      self._rng.shuffle(order)
      row = [0] * self.N
      for p in range(0, self.N, 2):
        row[order[p]], row[order[p + 1]] = order[p + 1], order[p]
      self._partners.append(row)
    return self._partners[b - self._partners_base]

  def _arrive(self, i: int, s: int, b: int, t: float) -> None:
    N = self.N
    if self.log is not None:
      self.log.append(("arrive", i, s, b, t))
    if self.sync == "allreduce":
      count = self.arrived[(s, b)] = self.arrived.get((s, b), 0) + 1
      if count == N:
        del self.arrived[(s, b)]
        for j in range(N):
          self._leave(j, s, b, t + self.cost[N])
    elif self.sync == "adpsgd":
      j = self.partners(b)[i]
      other_batch, other_time = self.pending[s][j]
      if other_batch == b:
        self.pending[s][j] = (-1, 0.0)
        self._formed(Group((min(i, j), max(i, j)), s, b, other_time, t, ORDINARY), {i: b, j: b})
        self._leave(i, s, b, t + self.cost[2])
        self._leave(j, s, b, t + self.cost[2])
      else:
        self.pending[s][i] = (b, t)
    elif self.sync == "hetpipe":
      own = self.first_batch[i] + b + 1  # the pipeline's mini-batches over the training
      pull = own % self.hetpipe.pull_every == 0
      if self.hetpipe.barrier and pull:
        # Every (pipeline, stage) that makes this pull in the fill meets there.
        key = (-1, own // self.hetpipe.pull_every)
        self._at_barrier.setdefault(key, []).append((i, s, b))
        if len(self._at_barrier[key]) == self.S * len(self.wave_members(key[1])):
          for j, s2, b2 in self._at_barrier.pop(key):
            self._pull(j, s2, b2, t + self.cost[1])
            self._leave(j, s2, b2, t + self.cost[1])
      else:
        if pull:
          self._pull(i, s, b, t + self.cost[1])
        self._leave(i, s, b, t + self.cost[1])
    else:
      self._carry_out(self.scheduler.arrive(i, s, b, t))

  def wave_members(self, wave: int) -> list[int]:
    """HetPipe's barrier: the pipelines that make pull `wave` (counted over the training) in this
    fill: not before it (a previous fill may have left the pipelines at other counts) and not
    after its end (`total`)."""
    at = wave * self.hetpipe.pull_every
    return [j for j in range(self.N) if self.first_batch[j] < at and
            (self.totals is None or at <= self.first_batch[j] + self.totals[j])]

  def _pull(self, i: int, s: int, b: int, t: float) -> None:
    if self.log is not None:
      self.log.append(("pull", i, s, b, t))

  def _carry_out(self, outcome: Outcome) -> None:
    # The groups first: a member's next op starts when it leaves, after its group.
    update = {(i, s): b for i, s, b, _ in outcome.departures}
    for window in outcome.windows:
      self.windows.append(window)
      for group in window:
        self._formed(group, {i: update[(i, group.stage)] for i in group.members})
    for i, s, b, t in outcome.departures:
      self._leave(i, s, b, t)
    for t, s, window_id in outcome.deadlines:
      heapq.heappush(self.heap, (t, 1, s, window_id, 0, None))

  def _formed(self, group: Group, updates: dict[int, int]) -> None:
    self.groups.append(group)
    self.groups_at.setdefault((group.round, group.stage), []).append(group)
    if self.log is not None:
      self.log.append(("group", group, updates))

  # -- what the executor asks ----------------------------------------------------------------------
  def decided(self, b: int, s: int) -> bool:
    """Whether every pipeline's update b of stage s has left its sync."""
    return all(b in left and not math.isnan(left[b][s]) for left in self._left)

  def left_at(self, i: int, b: int) -> np.ndarray:
    """float64 [S]: when pipeline i's stages left the sync of update b (nan: not yet)."""
    row = self._left[i].get(b)
    return np.full((self.S,), np.nan) if row is None else np.array(row)

  @property
  def finish(self) -> _Finish:
    """Update b -> float64 [N, S]: when each (pipeline, stage) left its sync (nan: not yet), for
    the updates some pipeline left."""
    return _Finish(self)

  def decide(self, updates: Iterable[tuple[int, int]]) -> None:
    """Advances until every (mini-batch, stage) update of `updates` is decided."""
    self._needed = {(b, s) for b, s in updates if not self.decided(b, s)}
    self.advance(lambda: not self._needed)

  def mix(self, b: int, s: int) -> np.ndarray:
    """float32 [N, N]: the mixing matrix of update b at stage s (decided): preduce, the groups of
    round b at stage s in formation order; adpsgd, round b's pairs; identity otherwise."""
    N = self.N
    if self.sync == "adpsgd":
      out = np.eye(N) * 0.5
      out[np.arange(N), self.partners(b)] += 0.5
      return out.astype(np.float32)
    out = np.eye(N)
    if self.sync == "preduce":
      for group in self.groups_at.get((b, s), ()):
        if len(group.members) > 1:
          rows = list(group.members)
          out[rows] = out[rows].mean(axis=0)
    return out.astype(np.float32)

  def time(self, b: int) -> float:
    """When update b has left its sync everywhere (decided at every stage)."""
    return max(max(left[b]) for left in self._left)

  def prune(self, keep_from: Sequence[int]) -> None:
    """For a 1F1B fill the executor runs (`jlp.pipeline.placement` reads the groups from `log`):
    forgets each pipeline i's leave times of updates before keep_from[i], the groups' records
    (`groups`, `windows`, `groups_at`) and AD-PSGD's rounds before the earliest of them. A long
    fill's host memory then stays flat, however far a fast pipeline runs ahead of a slow one."""
    for left, keep in zip(self._left, keep_from, strict=True):
      for b in [b for b in left if b < keep]:
        del left[b]
    self.groups.clear()
    self.windows.clear()
    self.groups_at.clear()
    drop = min(min(keep_from) - self._partners_base, len(self._partners))
    if drop > 0:
      del self._partners[:drop]
      self._partners_base += drop


class _Finish(collections.abc.Mapping):
  """`Timeline.finish`: update b -> float64 [N, S] leave times, assembled from the pipelines'
  own records."""

  def __init__(self, timeline: Timeline):
    self._timeline = timeline

  def __getitem__(self, b: int) -> np.ndarray:
    if b not in self:
      raise KeyError(b)
    return np.stack([self._timeline.left_at(i, b) for i in range(self._timeline.N)])

  def __contains__(self, b: object) -> bool:
    return any(b in left for left in self._timeline._left)  # pylint: disable=protected-access

  def __iter__(self):
    return iter(sorted(set().union(*self._timeline._left)))  # pylint: disable=protected-access

  def __len__(self) -> int:
    return len(set().union(*self._timeline._left))  # pylint: disable=protected-access
