"""Regenerates tests/data/pipeline_equal_speeds.npz: what `jlp.pipeline.Pipeline` computed before
its pipelines progressed by their own clocks (issue 20), with equal speeds and no stalls, for
tests/pipeline/executor_test.py::test_equal_speeds_reduce_to_the_lockstep_numbers.

This script is a standalone tool, NOT part of the test suite. The goldens were made at commit
9617706 (the lockstep executor: every pipeline ran mini-batch b at the same tick) with

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python \
        tests/data/make_pipeline_goldens.py

Every case: N = 2 pipelines x S = 4 stages of tests/pipeline/executor_test.py's model, SGD with
momentum, 6 mini-batches as one `run` followed by `flush`, default cost model (no stalls: delay_s
= 0), HetPipe pulling every 3rd mini-batch. Stored per case: the parameters and optimizer states
(packed [N, S, L]), the per-mini-batch losses and virtual times, and the group sizes.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pipeline"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

SYNCS = ("allreduce", "none", "preduce", "adpsgd", "hetpipe")
SCHEDULES = ("1f1b", "gpipe")
BATCHES = 6


def case_name(schedule: str, sync: str) -> str:
  return f"{schedule}_{sync}"


def run_case(schedule: str, sync: str, mesh) -> dict[str, np.ndarray]:
  """One case with the code now installed: the arrays stored per case (module docstring)."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jlp.pipeline import HetPipe, Pipeline  # pylint: disable=g-import-not-at-top
  import executor_test as et  # pylint: disable=g-import-not-at-top
  xs, ys = et._data(BATCHES, seed=11)  # pylint: disable=protected-access
  pipe = Pipeline(et.STAGES, et.loss_fn, optax.sgd(0.1, momentum=0.9), mesh, schedule=schedule,
                  num_microbatches=2 if schedule == "gpipe" else 1, sync=sync,
                  hetpipe=HetPipe(pull_every=3))
  state, first = pipe.run(pipe.init(et._params(seed=5)), xs, ys)  # pylint: disable=protected-access
  state, rest = pipe.flush(state)
  out = {k: np.concatenate([np.asarray(first[k]), np.asarray(rest[k])])
         for k in ("batch", "loss", "virtual_time", "group_sizes")}
  out["params"] = np.asarray(state.params["float32"])
  for k, leaf in enumerate(jax.tree.leaves(state.opt_state)):
    out[f"opt_{k}"] = np.asarray(leaf)
  return out


def main() -> None:
  from jlp.pipeline import pipeline_mesh  # pylint: disable=g-import-not-at-top
  import executor_test as et  # pylint: disable=g-import-not-at-top
  mesh = pipeline_mesh(et.N, et.S)
  arrays = {}
  for schedule in SCHEDULES:
    for sync in SYNCS:
      for k, v in run_case(schedule, sync, mesh).items():
        arrays[f"{case_name(schedule, sync)}/{k}"] = v
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_equal_speeds.npz")
  np.savez_compressed(path, **arrays)
  print(f"wrote {path}: {len(arrays)} arrays")


if __name__ == "__main__":
  main()
