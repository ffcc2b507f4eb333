"""jlp.compression.sync (CaSync PS and ring) on 8 emulated CPU devices.

References: `sync_refs.simulate`, a plain-Python simulation of the protocol over 8 ranks (Python
loops over ranks, partitions, owners, chunks and hops; it calls only a compressor's own encode /
decode on single partitions and `to_bytes` for the wire bytes), compared bit for bit on every
rank's result and every rank's new state; `lax.psum` for the uncompressed leaves; hand-computed
wire bytes.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))  # sync_refs (--import-mode=importlib)
import sync_refs  # noqa: E402
import references as ref  # noqa: E402
import jlp.compression as jc  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")
W = 8
F32 = np.float32
TOPOLOGIES = ("ps", "ring")
# Leaves of the test tree (flattening order a, b, e, u, v): "a" has MIN_SIZE + 1 elements (K = W),
# "e" exactly MIN_SIZE (psum), "b" a scalar (psum), "u" is large but the plan keeps it
# uncompressed, "v" is compressed in K = 3 partitions by the plan.
MIN_SIZE = 34
SHAPES = {"a": (5, 7), "b": (), "e": (2, 17), "u": (40,), "v": (100,)}
PLAN = {"['u']": (False, 8), "['v']": (True, 3)}
# Parameters that make the sparse compressors keep several values of these small partitions and
# that exercise TernGrad's random draws.
PARAMS = {"dgc": dict(density=0.25, sample_rate=0.5), "graddrop": dict(drop_ratio=0.75,
                                                                       sample_rate=0.5),
          "terngrad": dict(stochastic=True), "tbq": dict(threshold=0.5)}


def compressor(name):
  return jc.get(name, **PARAMS.get(name, {}))


def mesh():
  return Mesh(np.array(jax.devices()[:W]), ("r",))


def random_tree(seed):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal((W,) + s).astype(F32) for k, s in SHAPES.items()}


def stacked_state(comp, topology):
  one = jc.init_state({k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}, comp,
                      W, topology=topology, min_size=MIN_SIZE, plan=PLAN)
  return jax.tree.map(lambda s: jnp.stack([s] * W), one)


@functools.lru_cache(maxsize=None)
def compiled(name, topology):
  """jit(shard_map) of one sync step: (tree, stacked state, key) -> (sum, state, wire bytes,
  lax.psum of the tree), every rank's values on a leading axis."""
  comp = compressor(name)

  def body(tree, state, key):
    tree = jax.tree.map(lambda x: x[0], tree)
    state = jax.tree.map(lambda s: s[0], state)
    out, new, wire = jc.sync_with_bytes(tree, "r", comp, state, topology=topology,
                                        min_size=MIN_SIZE, plan=PLAN, key=key)
    psum = lax.psum(tree, "r")
    return jax.tree.map(lambda x: x[None], (out, new, wire, psum))
  return jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("r"), P("r"), P()),
                               out_specs=P("r")))


def per_rank_state(stacked):
  return [jax.tree.map(lambda s, r=r: np.asarray(s)[r], stacked) for r in range(W)]


def assert_tree_bits(got, want, msg):
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    ref.assert_same_bits(np.asarray(g), np.asarray(w), msg=f"{msg}{jax.tree_util.keystr(path)}")


def test_routes_follow_min_size_and_plan():
  tree = {k: np.zeros(s, F32) for k, s in SHAPES.items()}
  routes = jc.leaf_routes(tree, W, min_size=MIN_SIZE, plan=PLAN)
  assert [tuple(r) for r in routes] == [("['a']", 35, True, 8), ("['b']", 1, False, 8),
                                        ("['e']", 34, False, 8), ("['u']", 40, False, 8),
                                        ("['v']", 100, True, 3)]
  assert [r.compress for r in jc.leaf_routes(tree, W, min_size=0, plan=None)] == [True] * 5


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", sorted(jc.COMPRESSORS))
def test_matches_simulation_two_steps(name, topology):
  """Two successive calls (state carried) against sync_refs.simulate, bit for bit on every rank:
  the compressed leaves (K = W for "a", K = 3 for "v"), every rank's new state and the wire
  bytes; the uncompressed leaves equal lax.psum; a repeated call gives the same bits."""
  comp = compressor(name)
  fn = compiled(name, topology)
  routes = jc.leaf_routes({k: np.zeros(s, F32) for k, s in SHAPES.items()}, W, min_size=MIN_SIZE,
                          plan=PLAN)
  state = stacked_state(comp, topology)
  sim_states = per_rank_state(state)
  for path, size, compress, k in routes:
    if compress:
      for leaf in jax.tree.leaves(sim_states[0][path]):
        assert leaf.shape[0] == k and not leaf.any()
  for step in range(2):
    tree = random_tree(seed=step)
    key = jax.random.key(step)
    before = state
    out, state, wire, psum = fn(tree, state, key)
    ranks = [[tree[k][r] for k in sorted(SHAPES)] for r in range(W)]
    want, sim_states, want_wire = sync_refs.simulate(ranks, comp, sim_states, key, routes,
                                                     topology)
    for i, (path, size, compress, k) in enumerate(routes):
      got = np.asarray(out[path[2:-2]])
      if compress:
        ref.assert_same_bits(got, want[i], msg=f"step {step} {path}")
        assert not np.array_equal(got[0], np.asarray(psum[path[2:-2]])[0])
      else:
        ref.assert_same_bits(got, np.asarray(psum[path[2:-2]]), msg=f"step {step} {path} psum")
    for r in range(W):
      assert_tree_bits(per_rank_state(state)[r], sim_states[r], f"step {step} rank {r} state")
    assert np.all(np.asarray(wire) == np.float32(want_wire)), (np.asarray(wire), want_wire)
  again = fn(tree, before, key)
  assert_tree_bits(again[:3], (out, state, wire), "repeated call")
