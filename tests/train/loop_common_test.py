"""jlp.train.loop_common: what a metrics row's window measures."""
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.train.loop_common import CompileClock, LogWindow


@jax.jit
def _slow_loss(x):
  """A scalar that takes a while to compute: a chain of dependent matrix products."""
  return lax.fori_loop(0, 200, lambda _, m: jnp.tanh(m @ m), x).mean()


def test_the_window_ends_when_the_steps_device_work_ends():
  x = jnp.full((384, 384), 1e-3, jnp.float32)
  accuracy = jnp.float32(0.5)
  jax.block_until_ready(_slow_loss(x))  # compiled and warm
  begin = time.perf_counter()
  jax.block_until_ready(_slow_loss(x))
  device_seconds = time.perf_counter() - begin

  with CompileClock() as clock:
    window = LogWindow(clock)
    window.restart()
    loss = _slow_loss(x)  # dispatched: returns before the device work ends
    window.add(loss, accuracy, examples=100)
    row = window.close()
  window_seconds = 100 / row["throughput"]
  # Without waiting for the device work the window lasts a dispatch (well under a millisecond).
  assert window_seconds >= 0.25 * device_seconds, (window_seconds, device_seconds)
  assert row["train_loss"] == float(loss) and row["train_accuracy"] == 0.5
  assert row["compile_seconds"] == 0.0 and row["save_seconds"] == 0.0


def test_a_window_without_steps_reports_nan_means():
  with CompileClock() as clock:
    row = LogWindow(clock).close(throughput=1.0)
  assert np.isnan(row["train_loss"]) and np.isnan(row["train_accuracy"])
  assert row["throughput"] == 1.0
