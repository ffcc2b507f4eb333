"""Run by tests/train/cluster_test.py on every host of the cluster launcher (and in-process as the
single-process reference): e4m3 ring all-reduces with Kahan and APS over all devices, on the
packed wire and on the float32 wire. Host 0 writes OUT/allreduce.npz."""

import os
import sys

import numpy as np


def inputs(num_devices: int) -> np.ndarray:
  rng = np.random.default_rng(7)
  return (rng.standard_normal((num_devices, 1000)) *
          2.0 ** rng.integers(-10, 6, (num_devices, 1000))).astype(np.float32)


def reduce_all(devices) -> dict[str, np.ndarray]:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import (  # pylint: disable=g-import-not-at-top
      Mesh, NamedSharding, PartitionSpec as P)
  from jlp.collectives import allreduce  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(devices), ("r",))
  x = inputs(len(devices))
  global_x = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("r")), lambda i: x[i])
  out = {}
  for wire in ("packed", "float32"):
    f = jax.jit(jax.shard_map(
        lambda v, wire=wire: allreduce(v, "r", fmt="e4m3", algorithm="ring", kahan=True,
                                       aps=True, wire=wire),
        mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    result = f(global_x)
    out[wire] = np.asarray(multihost_utils.process_allgather(result, tiled=True))
  return out


if __name__ == "__main__":
  from jlp.train import distributed  # pylint: disable=g-import-not-at-top
  info = distributed.initialize()
  import jax  # pylint: disable=g-import-not-at-top
  results = reduce_all(jax.devices())
  if info["process_index"] == 0:
    np.savez(os.path.join(sys.argv[1], "allreduce.npz"), **results)
