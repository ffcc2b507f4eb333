"""Seconds per step and time to accuracy from metrics rows (jlp.train.run_timing)."""

import pytest

from jlp.train import run_timing

ROWS = [  # batch 128: the first row includes compilation
    {"step": 5, "throughput": 10.0, "eval_accuracy": 0.5},
    {"step": 10, "throughput": 64.0, "eval_accuracy": 0.96},
    {"step": 15, "throughput": 128.0, "eval_accuracy": 0.975},
    {"step": 20, "throughput": 32.0, "eval_accuracy": 0.99},
]


def test_seconds_per_step_is_the_median_after_the_first_interval():
  assert run_timing.seconds_per_step(ROWS, 128, after_step=5) == 2.0  # median of 2, 1, 4
  assert run_timing.seconds_per_step(ROWS, 128, after_step=0) == pytest.approx((2.0 + 4.0) / 2)


def test_time_to_accuracy_is_steps_times_the_mean_seconds_per_step_up_to_it():
  assert run_timing.steps_to_accuracy(ROWS, 0.97) == 15
  # Steps 6-10 at 2 s, 11-15 at 1 s: 15 s over 10 steps; the interval after the target is not read.
  assert run_timing.mean_seconds_per_step(ROWS, 128, after_step=5, until_step=15) == 1.5
  assert run_timing.time_to_accuracy(ROWS, 0.97, 128, after_step=5) == 15 * 1.5
  assert run_timing.time_to_accuracy(ROWS, 0.995, 128, after_step=5) is None
  # Reached within the warm-up interval: that interval is all there is to time it by.
  assert run_timing.time_to_accuracy(ROWS, 0.5, 128, after_step=5) == 5 * 12.8
  # Not reached: the whole run after the warm-up (steps 6-20 at 2, 1 and 4 s).
  assert run_timing.seconds_per_step_to(ROWS, None, 128, after_step=5) == (10 + 5 + 20) / 15


def test_a_cost_that_only_some_intervals_carry_counts_in_the_time_to_accuracy():
  """DiLoCo H = 10 logged every 5 steps: every second interval carries the outer sync (here 9 s
  per step against 1 s). The median of the intervals is 1 s per step and hides it; the time to
  accuracy counts it: 20 steps after the first interval at (5 * 1 + 5 * 9) / 10 = 5 s each."""
  rows = [{"step": 5 * k, "throughput": 128.0 / (9.0 if k % 2 == 0 else 1.0)} for k in range(1, 6)]
  rows[-1]["eval_accuracy"] = 0.98
  assert run_timing.seconds_per_step(rows, 128, after_step=5) == 5.0  # median of 9, 1, 9, 1
  assert run_timing.mean_seconds_per_step(rows, 128, after_step=5) == 5.0
  rows.append({"step": 30, "throughput": 128.0})  # one more sync-free interval: the median drops
  assert run_timing.seconds_per_step(rows, 128, after_step=5) == 1.0
  assert run_timing.time_to_accuracy(rows, 0.97, 128, after_step=5) == 25 * 5.0


def test_no_rows_after_the_warmup_is_an_error():
  with pytest.raises(ValueError, match="after_step=20 is not allowed"):
    run_timing.seconds_per_step(ROWS, 128, after_step=20)
  with pytest.raises(ValueError, match="after_step=15 is not allowed with until_step=15"):
    run_timing.mean_seconds_per_step(ROWS, 128, after_step=15, until_step=15)
