"""Runs of jlp.collectives.allreduce on emulated CPU devices, compiled once per (W, options)
and shared by the test modules of this folder (one process compiles each case once)."""

import functools

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jlp.collectives import allreduce

# Leaf shapes whose sizes (35, 1, 16) do not all divide by 3 or 8; a scalar included.
SHAPES = [(5, 7), (), (16,)]


def mesh_of(w: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:w]), ("r",))


def stack(nodes):
  """nodes[r][i] -> per leaf i an array [W, ...]."""
  return [np.stack([node[i] for node in nodes]) for i in range(len(nodes[0]))]


def random_nodes(n, shapes=SHAPES, seed=0, scale_exp=(-3, 3)):
  rng = np.random.default_rng(seed)
  return [[(rng.standard_normal(s) * 2.0 ** rng.integers(*scale_exp, s)).astype(np.float32)
           for s in shapes] for _ in range(n)]


@functools.lru_cache(maxsize=None)
def _compiled(w, options):
  def body(*xs):
    out = allreduce([x[0] for x in xs], "r", **dict(options))
    return tuple(o[None] for o in out)
  return jax.jit(jax.shard_map(body, mesh=mesh_of(w), in_specs=P("r"), out_specs=P("r")))


def on_ranks(nodes, **options):
  """allreduce over len(nodes) devices (check_vma on); per leaf every rank's result [W, ...]."""
  fn = _compiled(len(nodes), tuple(sorted(options.items())))
  return [np.asarray(o) for o in fn(*stack(nodes))]
