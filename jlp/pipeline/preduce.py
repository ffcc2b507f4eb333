"""SD-PIPE's partial-reduce group scheduler (`ReduceStat::getPartner` of the reference,
docs/sdpipe.md#preduce-scheduler) in virtual time, host-side, apart from any event queue or
executor.

`Scheduler` holds one instance of the rules below per stage, plus what the stages share (the
forced window's owner, the epoch stops). Its caller (the event engine, jlp.pipeline.timeline)
delivers in virtual-time order every update's arrival at the sync (`arrive`) and every deadline
the scheduler asked for (`deadline`); at equal times the arrivals come first, so an arrival exactly
at the deadline joins the window. Each call returns an `Outcome` for the caller to carry out: the
departures (pipeline, stage, update, the time it leaves the sync), the deadlines to deliver
(time, stage, window id) and the windows closed, each a tuple of the `Group`s it formed.

The PReduce scheduler, one instance per stage, processes arrivals in virtual-time order:
  * the first arrival opens a window with deadline t + wait_ms / 1000 (its own wait_ms, truncated
    to whole microseconds as the reference does); the group closes at the deadline or when it has
    `max_group` members (the reference: N), and every member leaves at the close + the cost.
  * wait_ms per (pipeline, stage): x wait_ms_grow (<= wait_ms_max) after a group smaller than
    `alone_below`, else x wait_ms_shrink (>= wait_ms_min).
  * connectivity: a union-find holds the union graph of the groups since the last connected check;
    after the stage's accumulated group members cross a multiple of connect_every * N, the next
    window (if every pipeline has arrived at the stage at least once and none is stopped) ends the
    period: when the union graph is already connected it is an ordinary window that resets the
    union-find at its close, otherwise a *forced* window that waits without timeout until the union
    graph is connected (N > pairwise_above: until its members cover every component), then resets.
    Only one stage at a time holds a forced window (the reference's global owner).
  * N > pairwise_above: the sorted members of an ordinary window are split into adjacent pairs
    (r0, r1), (r2, r3), ...; an odd last member is alone. A forced window is not split.
  * epoch stop (`epoch_updates` E): after the last stage's accumulated members cross a multiple of
    N * E, the next N distinct pipelines arriving at the last stage are stopped at that update
    (the other stages stop the same pipeline at the same update); a stopped pipeline still averages
    with that group, then its next S - 1 updates (the drain) average alone without calling the
    scheduler, and it is not counted as available for a connectivity check until it arrives again.
  * a forced window whose missing pipelines have all made their last arrival at the stage (update
    B - 1) closes at once (the end of the simulated run).
  * `lockstep` (GPipe's pipelines, which run mini-batch b + 1 only once every pipeline has left
    the sync of update b): only a round's first arrival at the stage opens a forced window. Later
    in a round the pipelines that have left it cannot arrive again before the window closes, so
    the window is ordinary and the period's end waits for the next round, where the forced
    window closes at the latest with the round's last arrival (all N then in it).

`PReduce.compat="sdpipe"` reproduces the reference's quirks instead: an already connected union
graph makes the forced window close at once with its first arrival alone; the global owner is
claimed even when the availability check then cancels the forced window (released only by that
stage's next forced window); with N > pairwise_above the union-find never merges pairs (every
forced window waits for all N); after a stop S updates average alone (the drain and the next
epoch's first update, whose partner the reference does not reset).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from jlp.pipeline.costs import PReduce, check_max_group

__all__ = ["FORCED", "ORDINARY", "PERIOD_END", "Deadline", "Departure", "Group", "Outcome",
           "Scheduler"]

#: SyncPlan.group_kind: an ordinary window, one that ended a connectivity period (the union graph
#: was already connected), and a forced window (waited without timeout for connectivity).
ORDINARY, PERIOD_END, FORCED = 0, 1, 2


class Group(NamedTuple):
  """One group formed at `stage`: its sorted `members`, the `round` it is assigned to (the largest
  update among its members' arrivals), when its window `opened` and `closed`, and the window's
  `kind` (ORDINARY, PERIOD_END, FORCED)."""
  members: tuple[int, ...]
  stage: int
  round: int
  opened: float
  closed: float
  kind: int


class Departure(NamedTuple):
  """(pipeline, stage) leaves the sync of `update` at `time`."""
  pipeline: int
  stage: int
  update: int
  time: float


class Deadline(NamedTuple):
  """Deliver `Scheduler.deadline(stage, window_id, time)` at `time`."""
  time: float
  stage: int
  window_id: int


@dataclasses.dataclass
class Outcome:
  """What one `arrive` or `deadline` call did: departures and deadline requests in the order they
  arose, and the windows it closed (each the tuple of its groups, in formation order)."""
  departures: list[Departure] = dataclasses.field(default_factory=list)
  deadlines: list[Deadline] = dataclasses.field(default_factory=list)
  windows: list[tuple[Group, ...]] = dataclasses.field(default_factory=list)


class _Stage:
  """One stage's scheduler state (`ReduceStat` of the reference)."""

  def __init__(self, num_pipelines: int):
    n = num_pipelines
    self.parent = list(range(n))  # union-find over pipelines
    self.ready: list[int] = []
    self.ready_batch: list[int] = []
    self.ready_stop: list[bool] = []
    self.accumulated = 0
    self.need_sync = False
    self.stop_count = 0
    self.stopped: set[int] = set()
    self.avail: set[int] = set()
    self.calls = [0] * n  # the reference's batch_id: scheduler calls per pipeline
    self.alone_left = [0] * n
    self.retired: set[int] = set()
    self.window_id = 0
    self.window_kind = ORDINARY
    self.window_open_time = 0.0
    self.round = -1  # the largest update arrived at the stage

  def find(self, x: int) -> int:
    parent = self.parent
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  def union(self, x: int, y: int) -> None:
    self.parent[self.find(x)] = self.find(y)

  def connected(self) -> bool:
    head = self.find(0)
    return all(self.find(x) == head for x in range(1, len(self.parent)))

  def covers_components(self) -> bool:
    roots = {self.find(x) for x in range(len(self.parent))}
    return roots <= {self.find(x) for x in self.ready}


class Scheduler:
  """The scheduler of every stage (module docstring) for N pipelines x S stages x B updates.
  (B: one count for every pipeline or one per pipeline: its last update ends its arrivals).
  `cost_s[m]`: the seconds a group of m members takes to average (jlp.pipeline.costs.group_costs),
  m = 0..N. `lockstep`: the pipelines arrive round by round (module docstring). Raises when
  config.max_group > N."""

  def __init__(self, config: PReduce, num_pipelines: int, num_stages: int,
               num_batches: int | Sequence[int],
               cost_s: Sequence[float], *, lockstep: bool = False):
    N = num_pipelines
    check_max_group(config, N)
    self.config, self.N, self.S = config, N, num_stages
    self.lockstep = lockstep
    # Each pipeline's last update (num_batches: one count for all, or one per pipeline).
    self.last_batch = ([int(num_batches) - 1] * N if isinstance(num_batches, int)
                       else [int(b) - 1 for b in num_batches])
    self.cost_s = cost_s
    self.stages = [_Stage(N) for _ in range(num_stages)]
    self.max_group = N if config.max_group is None else config.max_group
    self.pairwise = N > config.pairwise_above
    self.compat = config.compat == "sdpipe"
    self.wait_ms = [[config.wait_ms_init] * num_stages for _ in range(N)]
    self.owner = -1  # the stage holding the forced window (the reference's graph_sync_stage_)
    self.stop_at: dict[int, int] = {}  # pipeline -> the scheduler call at which it stops

  def arrive(self, i: int, s: int, b: int, t: float) -> Outcome:
    """Pipeline i's stage s arrives at the sync of its update b at time t."""
    out, stage = Outcome(), self.stages[s]
    first_of_round = b > stage.round
    stage.round = max(stage.round, b)
    if stage.alone_left[i] > 0:  # draining after an epoch stop: alone, no scheduler call
      stage.alone_left[i] -= 1
      out.departures.append(Departure(i, s, b, t))
    else:
      stage.calls[i] += 1
      call = stage.calls[i]
      stage.ready.append(i)
      stage.ready_batch.append(b)
      if not self.pairwise:
        stage.union(i, stage.ready[0])
      if s == self.S - 1 and stage.stop_count > 0 and i not in stage.stopped:
        stage.stop_count -= 1
        stage.stopped.add(i)
        self.stop_at[i] = call
      stage.ready_stop.append(self.stop_at.get(i) == call)
      stage.avail.add(i)
      if len(stage.ready) == 1:
        self._open(s, i, t, out, may_force=first_of_round or not self.lockstep)
      if stage.window_kind == FORCED:
        if stage.covers_components() if self.pairwise else stage.connected():
          self._close(s, t, out)
      elif len(stage.ready) >= self.max_group:
        self._close(s, t, out)
    if b == self.last_batch[i]:
      stage.retired.add(i)
    if stage.ready and stage.window_kind == FORCED and all(
        j in stage.retired or j in stage.ready for j in range(self.N)):
      self._close(s, t, out)  # nobody else can arrive at this stage
    return out

  def deadline(self, s: int, window_id: int, t: float) -> Outcome:
    """The deadline of stage s's window `window_id` (a `Deadline` request) at time t: closes the
    window unless it has closed already."""
    out, stage = Outcome(), self.stages[s]
    if stage.ready and stage.window_id == window_id:
      self._close(s, t, out)
    return out

  def _open(self, s: int, i: int, t: float, out: Outcome, may_force: bool) -> None:
    stage = self.stages[s]
    kind = ORDINARY
    if stage.need_sync:
      everyone = len(stage.avail) == self.N
      if self.compat:
        if self.owner == -1:
          self.owner = s
        if self.owner == s and everyone and may_force:
          kind = FORCED
      elif everyone:
        if stage.connected():
          kind = PERIOD_END
        elif self.owner in (-1, s) and may_force:
          self.owner = s
          kind = FORCED
    stage.window_kind = kind
    stage.window_open_time = t
    stage.window_id += 1
    if kind != FORCED:
      deadline = t + int(self.wait_ms[i][s] * 1000) * 1e-6
      out.deadlines.append(Deadline(deadline, s, stage.window_id))

  def _close(self, s: int, t: float, out: Outcome) -> None:
    stage, config, N = self.stages[s], self.config, self.N
    kind = stage.window_kind
    entries = sorted(zip(stage.ready, stage.ready_batch, stage.ready_stop))
    if self.pairwise and kind != FORCED:
      groups = [entries[p:p + 2] for p in range(0, len(entries), 2)]
    else:
      groups = [entries]
    window = []
    for group in groups:
      members = tuple(i for i, _, _ in group)
      size = len(members)
      r = max(b for _, b, _ in group)
      window.append(Group(members, s, r, stage.window_open_time, t, kind))
      if size > 1 and self.pairwise and kind != FORCED and not self.compat:
        stage.union(members[0], members[1])
      for i, b, stop in group:
        wait = self.wait_ms[i][s]
        if size < config.alone_below:
          self.wait_ms[i][s] = min(wait * config.wait_ms_grow, config.wait_ms_max)
        else:
          self.wait_ms[i][s] = max(wait * config.wait_ms_shrink, config.wait_ms_min)
        if stop:
          stage.alone_left[i] = self.S if self.compat else self.S - 1
          stage.avail.discard(i)
        out.departures.append(Departure(i, s, b, t + self.cost_s[size]))
    out.windows.append(tuple(window))
    if kind != ORDINARY:
      stage.parent = list(range(N))
      stage.need_sync = False
      if kind == FORCED:
        self.owner = -1
    total = stage.accumulated + len(entries)
    period = config.connect_every * N
    if total // period > stage.accumulated // period:
      stage.need_sync = True
    if config.epoch_updates is not None:
      epoch = config.epoch_updates * N
      if total // epoch > stage.accumulated // epoch:
        stage.stop_count = N
        stage.stopped.clear()
    stage.accumulated = total
    stage.ready, stage.ready_batch, stage.ready_stop = [], [], []
    stage.window_kind = ORDINARY
