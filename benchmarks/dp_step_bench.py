"""Data-parallel `jlp.train.TrainStep` on 8 emulated CPU devices: gradient syncs and node layouts.

Run: python -m benchmarks.dp_step_bench [--steps=30] [--width=16] [--batch=256]

One SGD step (momentum 0.9, donated state) of the digits CNN (`jlp.models.small_cnn`,
8x8x1 inputs, a random global batch of --batch) for each case below, all in one run:

  devices x nodes each | all-reduce                    | node_map
  8 x 1                | float32 sequential (baseline) | unroll
  8 x 1                | e4m3 + APS sequential         | unroll
  8 x 1                | e4m3 + APS ring               | unroll
  1 x 8                | float32 sequential            | unroll / scan / vmap

Reported per case: compile + first step (s), the median step time over --steps
steps, and that median / the baseline's median from the same run. The 8 devices
are emulated on this machine's cores (XLA_FLAGS is set below, before jax loads).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import jlp.train as jt  # noqa: E402
from jlp.models import small_cnn  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 30, "timed steps per case after the first.")
_WIDTH = flags.DEFINE_integer("width", 16, "digits CNN width.")
_BATCH = flags.DEFINE_integer("batch", 256, "global batch (a multiple of 8).")

CASES = (  # (devices, GradSync arguments)
    (8, dict()),
    (8, dict(fmt="e4m3", aps=True)),
    (8, dict(fmt="e4m3", aps=True, algorithm="ring")),
    (1, dict(emulate_nodes=8, node_map="unroll")),
    (1, dict(emulate_nodes=8, node_map="scan")),
    (1, dict(emulate_nodes=8, node_map="vmap")),
)


def describe(devices: int, sync: jt.GradSync) -> str:
  fmt = "float32" if sync.fmt is None else f"e{sync.fmt.exp}m{sync.fmt.man}"
  aps = " + APS" if sync.aps else ""
  return (f"{devices} x {sync.emulate_nodes}  {fmt}{aps} {sync.algorithm}, "
          f"node_map={sync.node_map}")


def time_case(devices: int, sync: jt.GradSync, batch: dict, steps: int) -> tuple[float, float]:
  """(compile + first step seconds, median step seconds)."""
  model = small_cnn(width=_WIDTH.value)
  model.train()
  mesh = jt.data_mesh(jax.devices()[:devices])
  optimizer = jt.torch_sgd(0.05, momentum=0.9)
  graphdef, state = jt.init_train_state(model, optimizer, mesh)
  step = jt.TrainStep(graphdef, optimizer, mesh, sync, donate=True)
  t0 = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  first = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if len(jax.devices()) != 8:
    raise app.UsageError(f"expected 8 devices, found {len(jax.devices())} "
                         "(XLA_FLAGS set too late?)")
  if _BATCH.value <= 0 or _BATCH.value % 8:
    raise app.UsageError(f"--batch={_BATCH.value} is not allowed; expected a positive multiple "
                         "of 8.")
  rng = np.random.default_rng(0)
  batch = {"image": rng.standard_normal((_BATCH.value, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, _BATCH.value).astype(np.int32)}
  print(f"jax {jax.__version__}, 8 emulated {jax.default_backend()} devices on {os.cpu_count()} "
        f"cores; digits CNN width {_WIDTH.value}, global batch {_BATCH.value}, median of "
        f"{_STEPS.value} steps\n")
  print(f"{'case':48s} {'compile+1st s':>13s} {'step ms':>8s} {'ratio':>6s}")
  baseline = None
  for devices, kwargs in CASES:
    sync = jt.GradSync(**kwargs)
    first, step = time_case(devices, sync, batch, _STEPS.value)
    baseline = baseline or step
    print(f"{describe(devices, sync):48s} {first:13.1f} {step * 1e3:8.1f} {step / baseline:5.2f}x",
          flush=True)


if __name__ == "__main__":
  app.run(main)
