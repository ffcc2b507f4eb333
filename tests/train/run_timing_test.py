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


def test_time_to_accuracy_is_steps_times_seconds_per_step():
  assert run_timing.steps_to_accuracy(ROWS, 0.97) == 15
  assert run_timing.time_to_accuracy(ROWS, 0.97, 128, after_step=5) == 30.0
  assert run_timing.time_to_accuracy(ROWS, 0.995, 128, after_step=5) is None


def test_no_rows_after_the_warmup_is_an_error():
  with pytest.raises(ValueError, match="after_step=20 is not allowed"):
    run_timing.seconds_per_step(ROWS, 128, after_step=20)
