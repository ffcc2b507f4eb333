"""The simulator's configuration and cost model (docs/sdpipe.md#virtual-time), seconds throughout:
the dataclasses `Hetero` (the costs), `PReduce` (the group scheduler's knobs, jlp.pipeline.preduce)
and `HetPipe` (HetPipe's pulls) with their validation, the sync modes (`SYNC_MODES`, the rules in
jlp.pipeline.simulator), `check_sizes` (the knobs against N x S) and `group_costs` (the cost of
one average).

Cost model (`Hetero`; Hetu's `--hetero h` when `slowdown` is None):
  * op k of stage s of pipeline i lasts base * slowdown[i][s] + delay_s * stall, with base = fwd_s
    or bwd_s and stall = 1 when u < probability for one uniform draw u per op; a GPipe
    micro-batch op takes base / M and delay_s / M, and the M micro-batch forwards (backwards) of
    a mini-batch at a stage share one draw, so a stall costs delay_s per mini-batch, stage and
    direction whatever M, as in 1F1B (`jlp.pipeline.timeline`: per op position for `simulate`,
    `np.random.default_rng(seed).random((K, N, S))[k, i, s]` for K ops per stage (GPipe: its 2B
    forward and backward blocks), so a longer run starts with the same draws; per op id for a
    Pipeline's timeline). (Hetu sleeps before the op while it may still wait for its input; here
    the stall is part of the op.)
  * one (group) average or all-reduce of m members costs allreduce_alpha_s + allreduce_beta_s
    (m - 1); which syncs pay it, and when: jlp.pipeline.simulator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jlp._checks import invalid, is_int

__all__ = ["COMPAT", "SYNC_MODES", "HetPipe", "Hetero", "PReduce", "check_float", "check_int",
           "check_max_group", "check_sizes", "group_costs"]

SYNC_MODES = ("allreduce", "none", "preduce", "adpsgd", "hetpipe")
COMPAT = (None, "sdpipe")


def check_int(field: str, value: Any, low: int, high: int | None = None) -> None:
  """Raises the one-line error of `field` unless value is an integer in [low, high]."""
  if not is_int(value) or value < low or (high is not None and value > high):
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    raise invalid(field, value, allowed)


def check_float(field: str, value: Any, low: float, high: float | None = None, *,
                low_open: bool = False) -> None:
  """Raises the one-line error of `field` unless value is a finite real number >= low (> low with
  low_open) and <= high."""
  ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
        and math.isfinite(value) and (value > low if low_open else value >= low)
        and (high is None or value <= high))
  if not ok:
    bound = f"> {low}" if low_open else f">= {low}"
    allowed = f"a finite number {bound}" + ("" if high is None else f" and <= {high}")
    raise invalid(field, value, allowed)


@dataclasses.dataclass(frozen=True)
class Hetero:
  """The virtual-time cost model (module docstring; docs/sdpipe.md#virtual-time), in seconds.

  delay_s, probability: Hetu's `--hetero h`: before every op, a stall of delay_s with probability
    `probability` (one draw per op; GPipe: one per mini-batch's M forwards or backwards at a
    stage, delay_s / M on each).
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
      check_float(f"Hetero.{name}", getattr(self, name), 0.0)
    check_float("Hetero.probability", self.probability, 0.0, 1.0)
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
  """The partial-reduce scheduler's knobs (jlp.pipeline.preduce's docstring; defaults of
  the reference, docs/sdpipe.md#preduce-scheduler).

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
      check_int("PReduce.max_group", self.max_group, 1)
    check_int("PReduce.connect_every", self.connect_every, 1)
    check_int("PReduce.pairwise_above", self.pairwise_above, 1)
    check_float("PReduce.wait_ms_min", self.wait_ms_min, 0.0, low_open=True)
    check_float("PReduce.wait_ms_max", self.wait_ms_max, self.wait_ms_min)
    check_float("PReduce.wait_ms_init", self.wait_ms_init, self.wait_ms_min, self.wait_ms_max)
    check_float("PReduce.wait_ms_grow", self.wait_ms_grow, 1.0)
    check_float("PReduce.wait_ms_shrink", self.wait_ms_shrink, 0.0, 1.0, low_open=True)
    check_int("PReduce.alone_below", self.alone_below, 1)
    if self.epoch_updates is not None:
      check_int("PReduce.epoch_updates", self.epoch_updates, 1)
    if self.compat not in COMPAT:
      raise invalid("PReduce.compat", self.compat, f"one of {COMPAT}")


@dataclasses.dataclass(frozen=True)
class HetPipe:
  """HetPipe's timing (docs/sdpipe.md#syncs-across-pipelines): a pull every `pull_every` batches;
  `barrier` = a wave barrier over every (pipeline, stage) at each pull (the seed's BERT run,
  bsp=0): the pipelines that make that pull meet there (after a flush that left them at other
  counts, or at a fill's end, the others do not wait for it)."""
  pull_every: int = 10
  barrier: bool = False

  def __post_init__(self):
    check_int("HetPipe.pull_every", self.pull_every, 1)
    if not isinstance(self.barrier, bool):
      raise invalid("HetPipe.barrier", self.barrier, "True or False")


def check_max_group(preduce: PReduce, num_pipelines: int) -> None:
  """ValueError unless PReduce.max_group <= N."""
  N = num_pipelines
  if preduce.max_group is not None and preduce.max_group > N:
    raise invalid("PReduce.max_group", preduce.max_group, f"an integer in [1, num_pipelines={N}]")


def check_sizes(sync: str, hetero: Hetero, preduce: PReduce, num_pipelines: int,
                num_stages: int) -> None:
  """ValueError unless `sync` and the knobs fit N pipelines x S stages, checked in this order: an
  even N for "adpsgd" (it pairs pipelines), PReduce.max_group <= N for "preduce", and
  Hetero.slowdown (when set) an [N][S] table."""
  N, S = num_pipelines, num_stages
  if sync == "adpsgd" and N % 2:
    raise invalid("num_pipelines", N, "an even number with sync='adpsgd'")
  if sync == "preduce":
    check_max_group(preduce, N)
  if hetero.slowdown is not None and np.shape(hetero.slowdown) != (N, S):
    raise invalid("Hetero.slowdown", hetero.slowdown,
                  f"a [num_pipelines={N}][num_stages={S}] table")


def group_costs(hetero: Hetero, num_pipelines: int) -> list[float]:
  """[N + 1] seconds: entry m is the cost of one average or all-reduce of m members."""
  alpha, beta = hetero.allreduce_alpha_s, hetero.allreduce_beta_s
  return [alpha + beta * (size - 1) for size in range(num_pipelines + 1)]
