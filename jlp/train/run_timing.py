"""Wall-clock speed of a training run, read from its metrics rows (`jlp.train.metrics`): seconds
per step and time to accuracy, as the cluster study (`python -m experiments.cluster_study`)
reports them.

Each logged row carries `throughput`: examples per wall-clock second since the previous row,
evaluation, logging, checkpoint saves and compilation excluded (the data-parallel loop's
`LogWindow`; the pipelined loop times each `Pipeline.run` call, less its compilation), and the
excluded `compile_seconds` and `save_seconds`. A step's seconds are therefore `batch_size /
throughput`. The first interval still warms caches and the data prefetcher, so its rows can be left
out (`after_step`). Time to accuracy is the steps to the first evaluation that reaches the target
times the mean seconds per step of the intervals up to it (their summed seconds over their steps):
the training time, without compilation and evaluation, with every step's cost counted, including
a cost that only some intervals carry (DiLoCo's outer sync every H steps), which a median of the
intervals leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["mean_seconds_per_step", "seconds_per_step", "seconds_per_step_to",
           "steps_to_accuracy", "time_to_accuracy"]


def seconds_per_step(rows: Sequence[dict[str, Any]], batch_size: int, after_step: int) -> float:
  """Median wall seconds per step over the rows logged after `after_step` (ValueError if none)."""
  times = [batch_size / r["throughput"] for r in rows
           if r["step"] > after_step and r.get("throughput")]
  if not times:
    raise ValueError(f"after_step={after_step} is not allowed; expected a step before the last "
                     f"logged row with a throughput (rows end at step "
                     f"{rows[-1]['step'] if rows else None}).")
  return float(np.median(times))


def mean_seconds_per_step(rows: Sequence[dict[str, Any]], batch_size: int, after_step: int,
                          until_step: int | None = None) -> float:
  """Wall seconds per step of the intervals logged after `after_step` up to `until_step` (None:
  all): their summed seconds (steps x batch_size / throughput each, an interval being the steps
  since the previous logged row) over their steps. ValueError if there are none."""
  logged = sorted((r for r in rows if r.get("throughput")), key=lambda r: r["step"])
  seconds = steps = 0.0
  previous = 0
  for r in logged:
    if after_step < r["step"] and (until_step is None or r["step"] <= until_step):
      n = r["step"] - previous
      seconds += n * batch_size / r["throughput"]
      steps += n
    previous = r["step"]
  if not steps:
    raise ValueError(f"after_step={after_step} is not allowed with until_step={until_step}; "
                     "expected a logged row with a throughput between them (rows end at step "
                     f"{logged[-1]['step'] if logged else None}).")
  return seconds / steps


def steps_to_accuracy(rows: Sequence[dict[str, Any]], target: float) -> int | None:
  """The step of the first evaluation with eval_accuracy >= target; None if none reaches it."""
  for r in rows:
    if r.get("eval_accuracy") is not None and r["eval_accuracy"] >= target:
      return int(r["step"])
  return None


def seconds_per_step_to(rows: Sequence[dict[str, Any]], steps: int | None, batch_size: int,
                        after_step: int) -> float:
  """`mean_seconds_per_step` of the intervals after `after_step` up to step `steps` (None: the
  whole run), or of all of them up to it when `steps` is within the first `after_step` steps."""
  if steps is not None and steps <= after_step:
    after_step = 0
  return mean_seconds_per_step(rows, batch_size, after_step, until_step=steps)


def time_to_accuracy(rows: Sequence[dict[str, Any]], target: float, batch_size: int,
                     after_step: int) -> float | None:
  """Training seconds to `target`: steps_to_accuracy x the mean seconds per step of the intervals
  after `after_step` up to that step (`seconds_per_step_to`); None if not reached."""
  steps = steps_to_accuracy(rows, target)
  return None if steps is None else steps * seconds_per_step_to(rows, steps, batch_size, after_step)
