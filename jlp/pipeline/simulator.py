"""Virtual time: a seeded discrete-event model of N pipelines x S stages
(docs/sdpipe.md#virtual-time), host-side, pure Python/NumPy, and the sync it decides for the
lockstep executor.

An SPMD program runs every pipeline in lockstep, so stragglers cannot show in wall-clock on one
host. `simulate` replays the schedule in virtual time instead and decides, for the lockstep
executor, the mixing matrix mix[b, s] (row i = pipeline i's new weights as a combination of all
pipelines' weights, applied after the local update of mini-batch b at stage s) and the virtual
time at which every mini-batch's update has finished.

The parts: `jlp.pipeline.costs` (the configuration; the cost model: every op's duration, the cost
of an average), `jlp.pipeline.preduce` (SD-PIPE's group scheduler), `jlp.pipeline.rounds` (the
groups onto the executor's rounds: mix[b, s]), `jlp.pipeline.timeline` (the event engine that
routes the events between them: a run of B mini-batches is its timeline with that end, the stalls
drawn per op position). This module checks the arguments, runs the model to its end and
re-exports the parts' public names.

The model (op durations, seeded, and alpha, beta: the cost model of `jlp.pipeline.costs`):
  * the op order of a stage is `schedules.stage_order`: "1f1b" covers all B mini-batches and
    every backward is its own update; "gpipe" repeats the one-mini-batch table B times and the
    update follows the stage's last backward of each mini-batch.
  * "gpipe" runs the pipelines in lockstep, as the executor does: F(b, 0), the first op of
    mini-batch b at a stage, starts only once every (pipeline, stage) has left the sync of update
    b - 1 (mini-batch 0: at the latest `start`), so every group holds one mini-batch's updates.
    "1f1b" lets every pipeline run freely.
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
import math
import random
from typing import Any

import numpy as np

from jlp._checks import invalid, is_int
from jlp.pipeline import rounds, schedules
from jlp.pipeline.costs import (COMPAT, SYNC_MODES, HetPipe, Hetero, PReduce, check_float,
                                check_int, check_sizes)
from jlp.pipeline.preduce import FORCED, ORDINARY, PERIOD_END
from jlp.pipeline.timeline import Timeline

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
  (docs/sdpipe.md#syncs-across-pipelines): one `random.Random(seed)` shuffles the sorted list
  [0, N) anew every round and pairs positions (0, 1), (2, 3), ... N must be even."""
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
  hetero_model = Hetero(delay_s=float(hetero))
  _check_model("1f1b", "preduce", num_pipelines, 1, num_rounds + 1, 1, seed=seed,
               hetero=hetero_model, preduce=config, hetpipe=HetPipe())
  timeline = Timeline("1f1b", "preduce", num_pipelines, 1, 1, seed=seed, hetero=hetero_model,
                      preduce=config, hetpipe=HetPipe(), first_batch=0,
                      start=np.zeros((num_pipelines, 1)), total=num_rounds + 1,
                      stalls_by_position=True)
  timeline.advance(lambda: len(timeline.windows) >= num_rounds)  # N*B arrivals, <= N each
  return np.stack([rounds.window_mix(window, num_pipelines)
                   for window in timeline.windows[:num_rounds]]).astype(np.float32)


def simulate(schedule: str, sync: str, num_pipelines: int, num_stages: int, num_batches: int,
             num_microbatches: int = 1, *, seed: int = 0, hetero: Hetero = Hetero(),
             preduce: PReduce = PReduce(), hetpipe: HetPipe = HetPipe(),
             first_batch: int = 0, start: Any = None) -> SyncPlan:
  """Replays `schedule` for N pipelines x S stages x B mini-batches in virtual time under `sync`
  (module docstring) and returns the mixing matrices and times for the lockstep executor.
  `first_batch`: the number of mini-batches trained before these (HetPipe's pulls count them).
  `start`: [N][S] virtual seconds at which each (pipeline, stage) is free to start (None: all 0),
  e.g. the previous plan's `finish[-1]`, so that pipelines keep their lead from one `run` to the
  next (1F1B; GPipe's lockstep starts everywhere at the latest); the times returned are on the
  same clock."""
  check_int("first_batch", first_batch, 0)
  start = np.zeros((num_pipelines, num_stages)) if start is None else np.asarray(start, np.float64)
  if start.shape != (num_pipelines, num_stages) or not np.all(np.isfinite(start)) or \
      np.any(start < 0):
    raise invalid("start", start, f"finite times >= 0 of shape ({num_pipelines}, {num_stages})")
  N, S, B = _check_model(schedule, sync, num_pipelines, num_stages, num_batches,
                         num_microbatches, seed=seed, hetero=hetero, preduce=preduce,
                         hetpipe=hetpipe)
  timeline = Timeline(schedule, sync, N, S, num_microbatches, seed=seed, hetero=hetero,
                      preduce=preduce, hetpipe=hetpipe, first_batch=first_batch, start=start,
                      total=B, stalls_by_position=True)
  timeline.decide([(b, j) for b in range(B) for j in range(S)])
  groups = timeline.groups
  finish = np.stack([timeline.finish[b] for b in range(B)])
  members = np.zeros((len(groups), N), bool)
  for g, group in enumerate(groups):
    members[g, list(group.members)] = True
  matchings = adpsgd_matchings(N, B, seed=seed) if sync == "adpsgd" else None
  return SyncPlan(mix=rounds.round_mix(sync, groups, matchings, N, S, B),
                  times=finish.max(axis=(1, 2)), finish=finish,
                  group_sizes=np.array([len(g.members) for g in groups], np.int32),
                  group_stage=np.array([g.stage for g in groups], np.int32),
                  group_round=np.array([g.round for g in groups], np.int32),
                  group_members=members,
                  group_open=np.array([g.opened for g in groups], np.float64),
                  group_close=np.array([g.closed for g in groups], np.float64),
                  group_kind=np.array([g.kind for g in groups], np.int8))


def _check_model(schedule: str, sync: str, num_pipelines: int, num_stages: int,
                 num_batches: int, num_microbatches: int, *, seed: int, hetero: Hetero,
                 preduce: PReduce, hetpipe: HetPipe) -> tuple[int, int, int]:
  """(N, S, B), or ValueError naming the first bad argument, in this order: sync, N, the
  configuration objects, seed, the schedule's (S, B, M), then `costs.check_sizes`."""
  if sync not in SYNC_MODES:
    raise invalid("sync", sync, f"one of {SYNC_MODES}")
  check_int("num_pipelines", num_pipelines, 1)
  for name, value, kind in (("hetero", hetero, Hetero), ("preduce", preduce, PReduce),
                            ("hetpipe", hetpipe, HetPipe)):
    if not isinstance(value, kind):
      raise invalid(name, value, f"a jlp.pipeline.{kind.__name__}")
  if not is_int(seed):
    raise invalid("seed", seed, "an integer")
  if schedule == "gpipe":
    schedules.stage_order("gpipe", num_stages, 1, num_microbatches)
    check_int("num_batches", num_batches, 1)
  else:
    schedules.stage_order(schedule, num_stages, num_batches, num_microbatches)
  N, S, B = int(num_pipelines), int(num_stages), int(num_batches)
  check_sizes(sync, hetero, preduce, N, S)
  return N, S, B
