"""Virtual time: a seeded discrete-event model of N pipelines x S stages (sdpipe.md §7.4),
host-side, pure Python/NumPy, and the sync it decides for the lockstep executor.

An SPMD program runs every pipeline in lockstep, so stragglers cannot show in wall-clock on one
host. `simulate` replays the schedule in virtual time instead and decides, for the lockstep
executor, the mixing matrix mix[b, s] (row i = pipeline i's new weights as a combination of all
pipelines' weights, applied after the local update of mini-batch b at stage s) and the virtual
time at which every mini-batch's update has finished.

The parts: `jlp.pipeline.costs` (the configuration; the cost model: every op's duration, the cost
of an average), `jlp.pipeline.preduce` (SD-PIPE's group scheduler), `jlp.pipeline.rounds` (the
groups onto the executor's rounds: mix[b, s]). This module is the event engine that routes the
events between them; it re-exports their public names.

The model (op durations, seeded, and alpha, beta: the cost model of `jlp.pipeline.costs`):
  * the op order of a stage is `schedules.stage_order`: "1f1b" covers all B mini-batches and
    every backward is its own update; "gpipe" repeats the one-mini-batch table B times and the
    update follows the stage's last backward of each mini-batch.
  * F(b, m) at stage s starts after F(b, m) at stage s - 1 finished + p2p_s; B(b, m) at stage s
    after B(b, m) at stage s + 1 finished + p2p_s (the last stage: after its own F, by the order);
    a stage runs one op at a time, in order.
  * the end of an update op is the stage's arrival at the sync; its next op starts when it leaves:
      "none"      at once.
      "allreduce" when all N pipelines' stage s arrived for update b, + alpha + beta (N - 1).
      "preduce"   when its group closes (the scheduler, `jlp.pipeline.preduce`),
                  + alpha + beta (|g| - 1).
      "adpsgd"    when its partner of round b arrived too (both block), + alpha + beta.
      "hetpipe"   + alpha (the push); with `HetPipe.barrier`, at a pull ((first_batch + b + 1) %
                  pull_every == 0, counted over the whole training as the executor pulls) only
                  when all N x S (pipeline, stage) pairs arrived, + alpha.
  times[b] is the latest time any (pipeline, stage) leaves the sync of update b.
  Ties: events at the same virtual time run op completions first, by (pipeline, stage, op index),
  then window deadlines by stage; an arrival exactly at the deadline joins the window.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from typing import Any

import numpy as np

from jlp._checks import invalid, is_int
from jlp.pipeline import rounds, schedules
from jlp.pipeline.costs import (COMPAT, SYNC_MODES, HetPipe, Hetero, PReduce, check_float,
                                check_int, group_costs, op_durations)
from jlp.pipeline.preduce import FORCED, ORDINARY, PERIOD_END, Group, Outcome, Scheduler

__all__ = ["COMPAT", "FORCED", "ORDINARY", "PERIOD_END", "SYNC_MODES", "HetPipe", "Hetero",
           "PReduce", "SyncPlan", "adpsgd_matchings", "preduce_schedule", "simulate"]


@dataclasses.dataclass(frozen=True, eq=False)
class SyncPlan:
  """What `simulate` decided (module docstring; mix: jlp.pipeline.rounds). G = the number of
  groups formed (preduce: per ordinary window, or per pair when N > pairwise_above; adpsgd: per
  pair, round and stage).

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
  check_int("num_pipelines", num_pipelines, 1)
  if num_pipelines % 2:
    raise invalid("num_pipelines", num_pipelines, "an even number (AD-PSGD pairs pipelines)")
  check_int("num_rounds", num_rounds, 1)
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
  """float32 [num_rounds, N, N]: the PReduce scheduler (jlp.pipeline.preduce) alone on one stage,
  one matrix per window in formation order (jlp.pipeline.rounds.window_mix): workers loop forward
  (fwd_s), backward (bwd_s), arrive, get a group, average (allreduce_alpha_s), with `Hetero()`'s
  costs and a stall of `hetero` seconds with probability 0.1 before every forward and every
  backward. Each matrix is symmetric and doubly stochastic: 1/|g| inside each group g of the window
  (the pairs when N > 8), identity elsewhere. Same seed -> same output."""
  check_int("num_pipelines", num_pipelines, 1)
  check_int("num_rounds", num_rounds, 1)
  check_float("hetero", hetero, 0.0)
  if max_group is not None:
    check_int("max_group", max_group, 1, num_pipelines)
  config = PReduce(max_group=max_group, connect_every=connect_every, compat=compat)
  # One batch more than rounds: every pipeline's last arrival comes after its num_rounds earlier
  # windows, so the end of the run (a forced window closed early) cannot touch them.
  engine = _Engine("1f1b", "preduce", num_pipelines, 1, num_rounds + 1, 1, seed=seed,
                   hetero=Hetero(delay_s=float(hetero)), preduce=config, hetpipe=HetPipe(),
                   stop_after_windows=num_rounds)
  engine.run()
  assert len(engine.windows) == num_rounds, "fewer windows than rounds"  # N*B arrivals, <= N each
  return np.stack([rounds.window_mix(window, num_pipelines)
                   for window in engine.windows]).astype(np.float32)


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
  check_int("first_batch", first_batch, 0)
  start = np.zeros((num_pipelines, num_stages)) if start is None else np.asarray(start, np.float64)
  if start.shape != (num_pipelines, num_stages) or not np.all(np.isfinite(start)) or \
      np.any(start < 0):
    raise invalid("start", start, f"finite times >= 0 of shape ({num_pipelines}, {num_stages})")
  engine = _Engine(schedule, sync, num_pipelines, num_stages, num_batches, num_microbatches,
                   seed=seed, hetero=hetero, preduce=preduce, hetpipe=hetpipe,
                   first_batch=first_batch, start=start)
  engine.run()
  return engine.plan()



def _stage_orders(schedule: str, num_stages: int, num_batches: int, num_microbatches: int
                  ) -> tuple[list[list[schedules.Op]], list[list[int]]]:
  """The op order of every stage over all B mini-batches (module docstring) and, per op, the
  update it ends (-1: none)."""
  if schedule == "gpipe":
    base = schedules.stage_order("gpipe", num_stages, 1, num_microbatches)
    check_int("num_batches", num_batches, 1)
    orders = [[(kind, b, m) for b in range(num_batches) for kind, _, m in base[s]]
              for s in range(num_stages)]
    per = 2 * num_microbatches
    updates = [[(k // per if k % per == per - 1 else -1) for k in range(len(o))] for o in orders]
  else:
    orders = schedules.stage_order(schedule, num_stages, num_batches, num_microbatches)
    updates = [[(b if kind == schedules.BWD else -1) for kind, b, _ in o] for o in orders]
  return orders, updates


class _Engine:
  """The discrete-event simulation (module docstring). Heap entries: (time, 0, pipeline, stage,
  op index) for an op's end, (time, 1, stage, window id, 0) for a window deadline."""

  def __init__(self, schedule: str, sync: str, num_pipelines: int, num_stages: int,
               num_batches: int, num_microbatches: int, *, seed: int, hetero: Hetero,
               preduce: PReduce, hetpipe: HetPipe, stop_after_windows: int | None = None,
               first_batch: int = 0, start: np.ndarray | None = None):
    self.first_batch = first_batch
    self.start = start
    if sync not in SYNC_MODES:
      raise invalid("sync", sync, f"one of {SYNC_MODES}")
    check_int("num_pipelines", num_pipelines, 1)
    for name, value, kind in (("hetero", hetero, Hetero), ("preduce", preduce, PReduce),
                              ("hetpipe", hetpipe, HetPipe)):
      if not isinstance(value, kind):
        raise invalid(name, value, f"a jlp.pipeline.{kind.__name__}")
    if not is_int(seed):
      raise invalid("seed", seed, "an integer")
    orders, self.update_of = _stage_orders(schedule, num_stages, num_batches, num_microbatches)
    N, S, B = int(num_pipelines), int(num_stages), int(num_batches)
    if sync == "adpsgd" and N % 2:
      raise invalid("num_pipelines", N, "an even number with sync='adpsgd'")
    self.cost = group_costs(hetero, N)
    # The last two checks, in this order: PReduce.max_group <= N, then Hetero.slowdown's shape.
    self.scheduler = Scheduler(preduce, N, S, B, self.cost) if sync == "preduce" else None
    self.duration = op_durations(orders, hetero, N, seed=seed, schedule=schedule,
                                 num_microbatches=num_microbatches)  # [N][S][K]
    self.N, self.S, self.B = N, S, B
    self.sync, self.hetero, self.hetpipe = sync, hetero, hetpipe
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

    self.heap: list[tuple] = []
    self.pos = [[0] * S for _ in range(N)]
    self.done = [[[-1.0] * K for _ in range(S)] for _ in range(N)]
    self.waiting: list[list[float | None]] = [[None] * S for _ in range(N)]
    self.finish = np.full((B, N, S), np.nan)
    self.groups: list[Group] = []  # in formation order
    self.windows: list[tuple[Group, ...]] = []  # preduce: the groups of every window closed
    self.stop_after_windows = stop_after_windows
    self.matchings: np.ndarray | None = None
    if sync == "allreduce":
      self.arrived = [[0] * B for _ in range(S)]
    elif sync == "adpsgd":
      self.matchings = adpsgd_matchings(N, B, seed=seed)
      self.partner = self.matchings.tolist()
      self.pending = [[(-1, 0.0)] * N for _ in range(S)]
    elif sync == "hetpipe":
      self.arrived_all = [0] * B

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
        self._carry_out(self.scheduler.deadline(a, s, t))
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
        self.groups.append(Group((min(i, j), max(i, j)), s, b, other_time, t, ORDINARY))
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
      self._carry_out(self.scheduler.arrive(i, s, b, t))

  def _carry_out(self, outcome: Outcome) -> None:
    """Routes what the PReduce scheduler decided: departures, deadlines to queue, groups."""
    for i, s, b, t in outcome.departures:
      self._leave(i, s, b, t)
    for t, s, window_id in outcome.deadlines:
      heapq.heappush(self.heap, (t, 1, s, window_id, 0))
    for window in outcome.windows:
      self.groups.extend(window)
      self.windows.append(window)

  # -- the result --------------------------------------------------------------------------------
  def plan(self) -> SyncPlan:
    N, S, B, groups = self.N, self.S, self.B, self.groups
    members = np.zeros((len(groups), N), bool)
    for g, group in enumerate(groups):
      members[g, list(group.members)] = True
    return SyncPlan(mix=rounds.round_mix(self.sync, groups, self.matchings, N, S, B),
                    times=self.finish.max(axis=(1, 2)), finish=self.finish,
                    group_sizes=np.array([len(g.members) for g in groups], np.int32),
                    group_stage=np.array([g.stage for g in groups], np.int32),
                    group_round=np.array([g.round for g in groups], np.int32),
                    group_members=members,
                    group_open=np.array([g.opened for g in groups], np.float64),
                    group_close=np.array([g.closed for g in groups], np.float64),
                    group_kind=np.array([g.kind for g in groups], np.int8))
