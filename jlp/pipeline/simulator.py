"""Virtual time and SD-PIPE's group scheduler: a seeded discrete-event model of N pipelines x S
stages (sdpipe.md §7.4), host-side, pure Python/NumPy.

An SPMD program runs every pipeline in lockstep, so stragglers cannot show in wall-clock on one
host. `simulate` replays the schedule in virtual time instead and decides, for the lockstep
executor, the mixing matrix mix[b, s] (row i = pipeline i's new weights as a combination of all
pipelines' weights, applied after the local update of mini-batch b at stage s) and the virtual
time at which every mini-batch's update has finished.

Cost model (`Hetero`; Hetu's `--hetero h`, sdpipe.md §4, when `slowdown` is None):
  * op k of stage s of pipeline i lasts base * slowdown[i][s] + delay_s * stall, with base = fwd_s
    or bwd_s (divided by M for a GPipe micro-batch) and stall = 1 when u < probability for one uniform draw u per op; the draws are
    `np.random.default_rng(seed).random((K, N, S))[k, i, s]` (K ops per stage), so a longer run
    starts with the same draws. (Hetu sleeps before the op while it may still wait for its input;
    here the stall is part of the op.)
  * the op order of a stage is `schedules.stage_order`: "1f1b" covers all B mini-batches and
    every backward is its own update; "gpipe" repeats the one-mini-batch table B times and the
    update follows the stage's last backward of each mini-batch.
  * F(b, m) at stage s starts after F(b, m) at stage s - 1 finished + p2p_s; B(b, m) at stage s
    after B(b, m) at stage s + 1 finished + p2p_s (the last stage: after its own F, by the order);
    a stage runs one op at a time, in order.
  * the end of an update op is the stage's arrival at the sync; its next op starts when it leaves:
      "none"      at once.
      "allreduce" when all N pipelines' stage s arrived for update b, + alpha + beta (N - 1).
      "preduce"   when its group closes (the scheduler below), + alpha + beta (|g| - 1).
      "adpsgd"    when its partner of round b arrived too (both block), + alpha + beta.
      "hetpipe"   + alpha (the push); with `HetPipe.barrier`, at a pull ((first_batch + b + 1) %
                  pull_every == 0, counted over the whole training as the executor pulls) only
                  when all N x S (pipeline, stage) pairs arrived, + alpha.
  times[b] is the latest time any (pipeline, stage) leaves the sync of update b.

The PReduce scheduler (`ReduceStat::getPartner` of the reference, sdpipe.md §2.1-2.2), one
instance per stage, processes arrivals in virtual-time order:
  * the first arrival opens a window with deadline t + wait_ms / 1000 (its own wait_ms, truncated
    to whole microseconds as the reference does); the group closes at the deadline or when it has
    `max_group` members (the reference: N), and every member leaves at the close + the cost.
  * wait_ms per (pipeline, stage): x wait_ms_grow (<= wait_ms_max) after a group smaller than
    `alone_below`, else x wait_ms_shrink (>= wait_ms_min) (§2.1).
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
  * a forced window whose missing pipelines have all made their last arrival at the stage closes
    at once (the end of the simulated run).
  Ties: events at the same virtual time run op completions first, by (pipeline, stage, op index),
  then window deadlines by stage; an arrival exactly at the deadline joins the window.

`PReduce.compat="sdpipe"` reproduces the reference's quirks instead: an already connected union
graph makes the forced window close at once with its first arrival alone; the global owner is
claimed even when the availability check then cancels the forced window (released only by that
stage's next forced window); with N > pairwise_above the union-find never merges pairs (every
forced window waits for all N); after a stop S updates average alone (the drain and the next
epoch's first update, whose partner the reference does not reset).

Mapping groups onto the lockstep executor (an approximation): a group formed at stage s holds
arrivals (i, b_i) that may belong to different mini-batches (fast pipelines run ahead). It is
assigned to round r = max_i b_i, and mix[r, s] = G_k @ ... @ G_1 over the groups assigned to (r, s)
in formation order (G = 1/|g| inside group g, identity elsewhere), so the executor averages the
members' models as they are after update r instead of after their own update b_i. Updates without a
group keep identity rows. "adpsgd": mix[b, s] = the pairing matrix of round b
(`adpsgd_matchings(N, B, seed=seed)`) at every stage. "allreduce" (the executor averages
gradients), "none" and "hetpipe" (the executor keeps the parameter-server copy): identity.
"""

from __future__ import annotations

import dataclasses
from typing import Any
import heapq
import math
import random

import numpy as np

from jlp._checks import invalid, is_int
from jlp.pipeline import schedules

__all__ = ["COMPAT", "FORCED", "ORDINARY", "PERIOD_END", "SYNC_MODES", "HetPipe", "Hetero",
           "PReduce", "SyncPlan", "adpsgd_matchings", "preduce_schedule", "simulate"]

SYNC_MODES = ("allreduce", "none", "preduce", "adpsgd", "hetpipe")
COMPAT = (None, "sdpipe")

#: SyncPlan.group_kind: an ordinary window, one that ended a connectivity period (the union graph
#: was already connected), and a forced window (waited without timeout for connectivity).
ORDINARY, PERIOD_END, FORCED = 0, 1, 2


def _check_int(field: str, value, low: int, high: int | None = None) -> None:
  if not is_int(value) or value < low or (high is not None and value > high):
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    raise invalid(field, value, allowed)


def _check_float(field: str, value, low: float, high: float | None = None, *,
                 low_open: bool = False) -> None:
  ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
        and math.isfinite(value) and (value > low if low_open else value >= low)
        and (high is None or value <= high))
  if not ok:
    bound = f"> {low}" if low_open else f">= {low}"
    allowed = f"a finite number {bound}" + ("" if high is None else f" and <= {high}")
    raise invalid(field, value, allowed)


@dataclasses.dataclass(frozen=True)
class Hetero:
  """The virtual-time cost model (module docstring; sdpipe.md §4, §7.4). Seconds throughout.

  delay_s, probability: Hetu's `--hetero h`: before every op, a stall of delay_s with probability
    `probability` (one draw per op).
  slowdown: a persistent factor per [pipeline][stage] on fwd_s / bwd_s (an extension); None = 1.
  fwd_s, bwd_s: base forward / backward time of one mini-batch on one stage (a GPipe
    micro-batch op takes 1/M of it).
  p2p_s: activation / gradient transfer between stages.
  allreduce_alpha_s, allreduce_beta_s: one (group) average or all-reduce costs alpha + beta
    (members - 1).
  """
  delay_s: float = 0.0
  probability: float = 0.1
  slowdown: tuple[tuple[float, ...], ...] | None = None
  fwd_s: float = 0.01
  bwd_s: float = 0.02
  p2p_s: float = 0.001
  allreduce_alpha_s: float = 0.001
  allreduce_beta_s: float = 0.0

  def __post_init__(self):
    for name in ("delay_s", "fwd_s", "bwd_s", "p2p_s", "allreduce_alpha_s", "allreduce_beta_s"):
      _check_float(f"Hetero.{name}", getattr(self, name), 0.0)
    _check_float("Hetero.probability", self.probability, 0.0, 1.0)
    if self.slowdown is not None:
      allowed = "None or a non-empty [pipeline][stage] table of finite numbers > 0"
      try:
        rows = tuple(tuple(float(v) for v in row) for row in self.slowdown)
      except (TypeError, ValueError):
        raise invalid("Hetero.slowdown", self.slowdown, allowed) from None
      if (not rows or not rows[0] or any(len(row) != len(rows[0]) for row in rows)
          or not all(math.isfinite(v) and v > 0 for row in rows for v in row)):
        raise invalid("Hetero.slowdown", self.slowdown, allowed)
      object.__setattr__(self, "slowdown", rows)


@dataclasses.dataclass(frozen=True)
class PReduce:
  """The partial-reduce scheduler's knobs (module docstring; defaults of sdpipe.md §2.4).

  max_group: early release at this many members (None = N, the reference).
  connect_every: the reference's P (ssp_bound): the union graph is made connected after every
    connect_every * N group members of a stage.
  pairwise_above: N above this splits ordinary groups into adjacent pairs.
  wait_ms_*: the adaptive window (ms): init, x grow up to max when alone (fewer than alone_below
    members), x shrink down to min otherwise.
  epoch_updates: the reference's E (batches per pipeline per epoch): the epoch stop after N * E
    last-stage members; None = never.
  compat: None (defaults that keep the paper's semantics) or "sdpipe" (the reference's quirks).
  """
  max_group: int | None = None
  connect_every: int = 10
  pairwise_above: int = 8
  wait_ms_init: float = 1.0
  wait_ms_grow: float = 2.0
  wait_ms_max: float = 10.0
  wait_ms_shrink: float = 0.9
  wait_ms_min: float = 0.01
  alone_below: int = 2
  epoch_updates: int | None = None
  compat: str | None = None

  def __post_init__(self):
    if self.max_group is not None:
      _check_int("PReduce.max_group", self.max_group, 1)
    _check_int("PReduce.connect_every", self.connect_every, 1)
    _check_int("PReduce.pairwise_above", self.pairwise_above, 1)
    _check_float("PReduce.wait_ms_min", self.wait_ms_min, 0.0, low_open=True)
    _check_float("PReduce.wait_ms_max", self.wait_ms_max, self.wait_ms_min)
    _check_float("PReduce.wait_ms_init", self.wait_ms_init, self.wait_ms_min, self.wait_ms_max)
    _check_float("PReduce.wait_ms_grow", self.wait_ms_grow, 1.0)
    _check_float("PReduce.wait_ms_shrink", self.wait_ms_shrink, 0.0, 1.0, low_open=True)
    _check_int("PReduce.alone_below", self.alone_below, 1)
    if self.epoch_updates is not None:
      _check_int("PReduce.epoch_updates", self.epoch_updates, 1)
    if self.compat not in COMPAT:
      raise invalid("PReduce.compat", self.compat, f"one of {COMPAT}")


@dataclasses.dataclass(frozen=True)
class HetPipe:
  """HetPipe's timing (sdpipe.md §3.2): a pull every `pull_every` batches; `barrier` = a wave
  barrier over every (pipeline, stage) at each pull (the seed's BERT run, bsp=0)."""
  pull_every: int = 10
  barrier: bool = False

  def __post_init__(self):
    _check_int("HetPipe.pull_every", self.pull_every, 1)
    if not isinstance(self.barrier, bool):
      raise invalid("HetPipe.barrier", self.barrier, "True or False")


@dataclasses.dataclass(frozen=True, eq=False)
class SyncPlan:
  """What `simulate` decided (module docstring). G = the number of groups formed (preduce: per
  ordinary window, or per pair when N > pairwise_above; adpsgd: per pair, round and stage).

  mix: float32 [B, S, N, N]: new weights of pipeline i = sum_j mix[b, s, i, j] x_j.
  times: float64 [B]: virtual seconds at which update b has left its sync everywhere.
  finish: float64 [B, N, S]: when (pipeline i, stage s) left the sync of update b.
  group_sizes, group_stage, group_round: int32 [G]; group_members: bool [G, N];
  group_open, group_close: float64 [G] (window opened / closed); group_kind: int8 [G] (ORDINARY,
  PERIOD_END, FORCED).
  """
  mix: np.ndarray
  times: np.ndarray
  finish: np.ndarray
  group_sizes: np.ndarray
  group_stage: np.ndarray
  group_round: np.ndarray
  group_members: np.ndarray
  group_open: np.ndarray
  group_close: np.ndarray
  group_kind: np.ndarray

  @property
  def mean_group_size(self) -> float:
    """The mean size over the groups formed (nan when none)."""
    return float(np.mean(self.group_sizes)) if self.group_sizes.size else math.nan

  @property
  def mean_partner(self) -> float:
    """The reference's `preduce.mean` (Train/Partner): the mean over members of their group's
    size, sum |g|^2 / sum |g| (nan when no group)."""
    sizes = self.group_sizes.astype(np.float64)
    return float(np.sum(sizes * sizes) / np.sum(sizes)) if sizes.size else math.nan


def adpsgd_matchings(num_pipelines: int, num_rounds: int, *, seed: int = 0) -> np.ndarray:
  """int32 [num_rounds, N]: the partner of every pipeline per round, the reference's rule
  (sdpipe.md §3.1): one `random.Random(seed)` shuffles the sorted list [0, N) anew every round and
  pairs positions (0, 1), (2, 3), ... N must be even."""
  _check_int("num_pipelines", num_pipelines, 1)
  if num_pipelines % 2:
    raise invalid("num_pipelines", num_pipelines, "an even number (AD-PSGD pairs pipelines)")
  _check_int("num_rounds", num_rounds, 1)
  if not is_int(seed):
    raise invalid("seed", seed, "an integer")
  rng = random.Random(int(seed))
  out = np.empty((num_rounds, num_pipelines), np.int32)
  for r in range(num_rounds):
    order = list(range(num_pipelines))
    rng.shuffle(order)
    for p in range(0, num_pipelines, 2):
      out[r, order[p]], out[r, order[p + 1]] = order[p + 1], order[p]
  return out


def preduce_schedule(num_pipelines: int, num_rounds: int, *, seed: int, hetero: float = 0.0,
                     max_group: int | None = None, connect_every: int = 10,
                     compat: str | None = None) -> np.ndarray:
  """float32 [num_rounds, N, N]: the PReduce scheduler alone on one stage, one matrix per window
  in formation order (module docstring): workers loop forward (fwd_s), backward (bwd_s), arrive,
  get a group, average (allreduce_alpha_s), with `Hetero()`'s costs and a stall of `hetero` seconds
  with probability 0.1 before every forward and every backward. Each matrix is symmetric and
  doubly stochastic: 1/|g| inside each group g of the window (the pairs when N > 8), identity
  elsewhere. Same seed -> same output."""
  _check_int("num_pipelines", num_pipelines, 1)
  _check_int("num_rounds", num_rounds, 1)
  _check_float("hetero", hetero, 0.0)
  if max_group is not None:
    _check_int("max_group", max_group, 1, num_pipelines)
  config = PReduce(max_group=max_group, connect_every=connect_every, compat=compat)
  # One batch more than rounds: every pipeline's last arrival comes after its num_rounds earlier
  # windows, so the end of the run (a forced window closed early) cannot touch them.
  engine = _Engine("1f1b", "preduce", num_pipelines, 1, num_rounds + 1, 1, seed=seed,
                   hetero=Hetero(delay_s=float(hetero)), preduce=config, hetpipe=HetPipe(),
                   stop_after_windows=num_rounds)
  engine.run()
  assert len(engine.windows) == num_rounds, "fewer windows than rounds"  # N*B arrivals, <= N each
  return np.stack(engine.windows).astype(np.float32)


def simulate(schedule: str, sync: str, num_pipelines: int, num_stages: int, num_batches: int,
             num_microbatches: int = 1, *, seed: int = 0, hetero: Hetero = Hetero(),
             preduce: PReduce = PReduce(), hetpipe: HetPipe = HetPipe(),
             first_batch: int = 0, start: Any = None) -> SyncPlan:
  """Replays `schedule` for N pipelines x S stages x B mini-batches in virtual time under `sync`
  (module docstring) and returns the mixing matrices and times for the lockstep executor.
  `first_batch`: the number of mini-batches trained before these (HetPipe's pulls count them).
  `start`: [N][S] virtual seconds at which each (pipeline, stage) is free to start (None: all 0),
  e.g. the previous plan's `finish[-1]`, so that pipelines keep their lead from one `run` to the
  next; the times returned are on the same clock."""
  _check_int("first_batch", first_batch, 0)
  start = np.zeros((num_pipelines, num_stages)) if start is None else np.asarray(start, np.float64)
  if start.shape != (num_pipelines, num_stages) or not np.all(np.isfinite(start)) or \
      np.any(start < 0):
    raise invalid("start", start, f"finite times >= 0 of shape ({num_pipelines}, {num_stages})")
  engine = _Engine(schedule, sync, num_pipelines, num_stages, num_batches, num_microbatches,
                   seed=seed, hetero=hetero, preduce=preduce, hetpipe=hetpipe,
                   first_batch=first_batch, start=start)
  engine.run()
  return engine.plan()


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


class _Engine:
  """The discrete-event simulation (module docstring). Heap entries: (time, 0, pipeline, stage,
  op index) for an op's end, (time, 1, stage, window id, 0) for a window deadline."""

  def __init__(self, schedule, sync, num_pipelines, num_stages, num_batches, num_microbatches, *,
               seed, hetero, preduce, hetpipe, stop_after_windows=None, first_batch=0,
               start=None):
    self.first_batch = first_batch
    self.start = start
    if sync not in SYNC_MODES:
      raise invalid("sync", sync, f"one of {SYNC_MODES}")
    _check_int("num_pipelines", num_pipelines, 1)
    for name, value, kind in (("hetero", hetero, Hetero), ("preduce", preduce, PReduce),
                              ("hetpipe", hetpipe, HetPipe)):
      if not isinstance(value, kind):
        raise invalid(name, value, f"a jlp.pipeline.{kind.__name__}")
    if not is_int(seed):
      raise invalid("seed", seed, "an integer")
    if schedule == "gpipe":
      base = schedules.stage_order("gpipe", num_stages, 1, num_microbatches)
      _check_int("num_batches", num_batches, 1)
      orders = [[(kind, b, m) for b in range(num_batches) for kind, _, m in base[s]]
                for s in range(num_stages)]
      per = 2 * num_microbatches
      updates = [[(k // per if k % per == per - 1 else -1) for k in range(len(o))] for o in orders]
    else:
      orders = schedules.stage_order(schedule, num_stages, num_batches, num_microbatches)
      updates = [[(b if kind == schedules.BWD else -1) for kind, b, _ in o] for o in orders]
    N, S, B = int(num_pipelines), int(num_stages), int(num_batches)
    if sync == "adpsgd" and N % 2:
      raise invalid("num_pipelines", N, "an even number with sync='adpsgd'")
    if sync == "preduce" and preduce.max_group is not None and preduce.max_group > N:
      raise invalid("PReduce.max_group", preduce.max_group,
                     f"an integer in [1, num_pipelines={N}]")
    slowdown = np.ones((N, S)) if hetero.slowdown is None else np.asarray(hetero.slowdown)
    if slowdown.shape != (N, S):
      raise invalid("Hetero.slowdown", hetero.slowdown,
                     f"a [num_pipelines={N}][num_stages={S}] table")
    self.N, self.S, self.B = N, S, B
    self.sync, self.hetero, self.config, self.hetpipe = sync, hetero, preduce, hetpipe
    self.K = K = len(orders[0])

    # Dependencies: dep_* = the op this op waits for, dependent_* = the op waiting for this one.
    index = [{op: k for k, op in enumerate(o)} for o in orders]
    self.dep_stage = [[-1] * K for _ in range(S)]
    self.dep_index = [[-1] * K for _ in range(S)]
    self.dependent_stage = [[-1] * K for _ in range(S)]
    self.dependent_index = [[-1] * K for _ in range(S)]
    for s in range(S):
      for k, (kind, b, m) in enumerate(orders[s]):
        other = s - 1 if kind == schedules.FWD else s + 1
        if 0 <= other < S:
          j = index[other][(kind, b, m)]
          self.dep_stage[s][k], self.dep_index[s][k] = other, j
          self.dependent_stage[other][j], self.dependent_index[other][j] = s, k
    self.update_of = updates

    kinds = np.array([[kind for kind, _, _ in o] for o in orders])  # [S, K]
    base = np.where(kinds == schedules.FWD, hetero.fwd_s, hetero.bwd_s)
    if schedule == "gpipe":  # a micro-batch op runs on 1/M of the mini-batch
      base = base / num_microbatches
    stall = np.random.default_rng(int(seed)).random((K, N, S)) < hetero.probability
    duration = base[None] * slowdown[:, :, None] + hetero.delay_s * stall.transpose(1, 2, 0)
    self.duration = duration.tolist()  # [N][S][K]

    self.heap: list[tuple] = []
    self.pos = [[0] * S for _ in range(N)]
    self.done = [[[-1.0] * K for _ in range(S)] for _ in range(N)]
    self.waiting: list[list[float | None]] = [[None] * S for _ in range(N)]
    self.finish = np.full((B, N, S), np.nan)
    self.mix = np.broadcast_to(np.eye(N), (B, S, N, N)).copy() if sync == "preduce" else None
    self.groups: list[tuple] = []  # (size, stage, round, members, open, close, kind)
    self.windows: list[np.ndarray] = []
    self.stop_after_windows = stop_after_windows

    alpha, beta = hetero.allreduce_alpha_s, hetero.allreduce_beta_s
    self.cost = [alpha + beta * (size - 1) for size in range(N + 1)]
    if sync == "allreduce":
      self.arrived = [[0] * B for _ in range(S)]
    elif sync == "adpsgd":
      partner = adpsgd_matchings(N, B, seed=seed)
      pairing = np.zeros((B, N, N))
      rounds, rows = np.arange(B)[:, None], np.arange(N)[None, :]
      pairing[rounds, rows, rows] = 0.5
      pairing[rounds, rows, partner] = 0.5
      self.mix = np.broadcast_to(pairing[:, None], (B, S, N, N))
      self.partner = partner.tolist()
      self.pending = [[(-1, 0.0)] * N for _ in range(S)]
    elif sync == "hetpipe":
      self.arrived_all = [0] * B
    elif sync == "preduce":
      self.stages = [_Stage(N) for _ in range(S)]
      self.max_group = N if preduce.max_group is None else preduce.max_group
      self.pairwise = N > preduce.pairwise_above
      self.compat = preduce.compat == "sdpipe"
      self.wait_ms = [[preduce.wait_ms_init] * S for _ in range(N)]
      self.owner = -1  # the stage holding the forced window (the reference's graph_sync_stage_)
      self.stop_at: dict[int, int] = {}

  # -- the event loop ----------------------------------------------------------------------------
  def run(self) -> None:
    for i in range(self.N):
      for s in range(self.S):
        self._start(i, s, 0.0 if self.start is None else float(self.start[i, s]))
    heap, done, update_of = self.heap, self.done, self.update_of
    dependent_stage, dependent_index = self.dependent_stage, self.dependent_index
    sync, limit = self.sync, self.stop_after_windows
    while heap:
      t, event, a, s, k = heapq.heappop(heap)
      if event == 1:  # a deadline: a = stage, s = window id
        stage = self.stages[a]
        if stage.ready and stage.window_id == s:
          self._close(a, t)
      else:
        i = a
        done[i][s][k] = t
        ds = dependent_stage[s][k]
        if ds >= 0:
          free = self.waiting[i][ds]
          if free is not None and self.pos[i][ds] == dependent_index[s][k]:
            self.waiting[i][ds] = None
            self._start(i, ds, free)
        b = update_of[s][k]
        if b < 0 or sync == "none":
          if b >= 0:
            self.finish[b, i, s] = t
          self._start(i, s, t)
        else:
          self._arrive(i, s, b, t)
      if limit is not None and len(self.windows) >= limit:
        return
    if any(p != self.K for row in self.pos for p in row) or np.isnan(self.finish).any():
      raise AssertionError("the simulation stopped before every op ran")  # a bug, not input

  def _start(self, i: int, s: int, free: float) -> None:
    k = self.pos[i][s]
    if k == self.K:
      return
    start = free
    ds = self.dep_stage[s][k]
    if ds >= 0:
      ready = self.done[i][ds][self.dep_index[s][k]]
      if ready < 0:
        self.waiting[i][s] = free
        return
      start = max(free, ready + self.hetero.p2p_s)
    self.pos[i][s] = k + 1
    heapq.heappush(self.heap, (start + self.duration[i][s][k], 0, i, s, k))

  def _leave(self, i: int, s: int, b: int, t: float) -> None:
    self.finish[b, i, s] = t
    self._start(i, s, t)

  def _arrive(self, i: int, s: int, b: int, t: float) -> None:
    N = self.N
    if self.sync == "allreduce":
      self.arrived[s][b] += 1
      if self.arrived[s][b] == N:
        for j in range(N):
          self._leave(j, s, b, t + self.cost[N])
    elif self.sync == "adpsgd":
      j = self.partner[b][i]
      other_batch, other_time = self.pending[s][j]
      if other_batch == b:
        self.pending[s][j] = (-1, 0.0)
        self._record((min(i, j), max(i, j)), s, b, other_time, t, ORDINARY)
        self._leave(i, s, b, t + self.cost[2])
        self._leave(j, s, b, t + self.cost[2])
      else:
        self.pending[s][i] = (b, t)
    elif self.sync == "hetpipe":
      pull = (self.first_batch + b + 1) % self.hetpipe.pull_every == 0
      if self.hetpipe.barrier and pull:
        self.arrived_all[b] += 1
        if self.arrived_all[b] == N * self.S:
          for j in range(N):
            for s2 in range(self.S):
              self._leave(j, s2, b, t + self.cost[1])
      else:
        self._leave(i, s, b, t + self.cost[1])
    else:
      self._preduce_arrive(i, s, b, t)

  def _record(self, members, s, r, opened, closed, kind) -> None:
    self.groups.append((len(members), s, r, members, opened, closed, kind))

  # -- PReduce (ReduceStat::getPartner) ----------------------------------------------------------
  def _preduce_arrive(self, i: int, s: int, b: int, t: float) -> None:
    stage, N = self.stages[s], self.N
    if stage.alone_left[i] > 0:  # draining after an epoch stop: alone, no scheduler call
      stage.alone_left[i] -= 1
      self._leave(i, s, b, t)
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
        self._open(s, i, t)
      if stage.window_kind == FORCED:
        if stage.covers_components() if self.pairwise else stage.connected():
          self._close(s, t)
      elif len(stage.ready) >= self.max_group:
        self._close(s, t)
    if b == self.B - 1:
      stage.retired.add(i)
    if stage.ready and stage.window_kind == FORCED and all(
        j in stage.retired or j in stage.ready for j in range(N)):
      self._close(s, t)  # nobody else can arrive at this stage

  def _open(self, s: int, i: int, t: float) -> None:
    stage = self.stages[s]
    kind = ORDINARY
    if stage.need_sync:
      everyone = len(stage.avail) == self.N
      if self.compat:
        if self.owner == -1:
          self.owner = s
        if self.owner == s and everyone:
          kind = FORCED
      elif everyone:
        if stage.connected():
          kind = PERIOD_END
        elif self.owner in (-1, s):
          self.owner = s
          kind = FORCED
    stage.window_kind = kind
    stage.window_open_time = t
    stage.window_id += 1
    if kind != FORCED:
      deadline = t + int(self.wait_ms[i][s] * 1000) * 1e-6
      heapq.heappush(self.heap, (deadline, 1, s, stage.window_id, 0))

  def _close(self, s: int, t: float) -> None:
    stage, config, N = self.stages[s], self.config, self.N
    kind = stage.window_kind
    entries = sorted(zip(stage.ready, stage.ready_batch, stage.ready_stop))
    if self.pairwise and kind != FORCED:
      groups = [entries[p:p + 2] for p in range(0, len(entries), 2)]
    else:
      groups = [entries]
    window = np.eye(N) if self.stop_after_windows is not None else None
    for group in groups:
      members = tuple(i for i, _, _ in group)
      size = len(members)
      r = max(b for _, b, _ in group)
      self._record(members, s, r, stage.window_open_time, t, kind)
      if size > 1:
        if self.mix is not None:
          rows = self.mix[r, s]
          rows[list(members)] = rows[list(members)].mean(axis=0)
        if window is not None:
          window[np.ix_(members, members)] = 1.0 / size
        if self.pairwise and kind != FORCED and not self.compat:
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
        self._leave(i, s, b, t + self.cost[size])
    if window is not None:
      self.windows.append(window)
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

  # -- the result --------------------------------------------------------------------------------
  def plan(self) -> SyncPlan:
    N, S, B = self.N, self.S, self.B
    mix = np.broadcast_to(np.eye(N, dtype=np.float32), (B, S, N, N)).copy() \
        if self.mix is None else self.mix.astype(np.float32)
    members = np.zeros((len(self.groups), N), bool)
    for g, entry in enumerate(self.groups):
      members[g, list(entry[3])] = True
    column = lambda j, dtype: np.array([entry[j] for entry in self.groups], dtype)
    return SyncPlan(mix=mix, times=self.finish.max(axis=(1, 2)), finish=self.finish,
                    group_sizes=column(0, np.int32), group_stage=column(1, np.int32),
                    group_round=column(2, np.int32), group_members=members,
                    group_open=column(4, np.float64), group_close=column(5, np.float64),
                    group_kind=column(6, np.int8))
