"""jlp.compression.sync (jlp/compression/casync.py: CaSync PS and ring) on 8 emulated CPU devices.

References: `casync_refs.simulate`, a plain-Python simulation of the protocol over 8 ranks (loops
over ranks, partitions, owners, chunks and hops; it calls only a compressor's own encode / decode
and `to_bytes`), compared bit for bit on every rank's result and every rank's new state;
`lax.psum` for the uncompressed leaves; wire bytes computed by hand.
"""

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))  # casync_refs (--import-mode=importlib)
import casync_refs  # noqa: E402
import references as ref  # noqa: E402
import jlp.compression as jc  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")
W = 8
F32 = np.float32
TOPOLOGIES = ("ps", "ring")
# The test tree, in flattening order: "a" has MIN_SIZE + 1 elements (compressed, K = W), "b" is a
# scalar and "e" has exactly MIN_SIZE elements (both summed by psum), "u" is large but the plan
# keeps it uncompressed, "v" is compressed in K = 3 partitions of 1000 (K < W; long enough that
# a codec's reductions sum differently batched and alone).
MIN_SIZE = 34
SHAPES = {"a": (5, 7), "b": (), "e": (2, 17), "u": (40,), "v": (3000,)}
PLAN = {"['u']": (False, 8), "['v']": (True, 3)}
# How the tree is routed (path, size, compress, K), by hand from the rules above.
ROUTES = [("['a']", 35, True, 8), ("['b']", 1, False, 8), ("['e']", 34, False, 8),
          ("['u']", 40, False, 8), ("['v']", 3000, True, 3)]
# Parameters under which the sparse compressors keep several values of these partitions, and
# TernGrad draws random numbers.
PARAMS = {"dgc": dict(density=0.25, sample_rate=0.5),
          "graddrop": dict(drop_ratio=0.75, sample_rate=0.5),
          "terngrad": dict(stochastic=True), "tbq": dict(threshold=0.5)}


def compressor(name, **kwargs):
  return jc.get(name, **{**PARAMS.get(name, {}), **kwargs})


def mesh():
  return Mesh(np.array(jax.devices()[:W]), ("r",))


def shapes_tree(shapes=SHAPES):
  return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


def random_tree(seed):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal((W,) + s).astype(F32) for k, s in SHAPES.items()}


def stacked_state(comp, topology):
  one = jc.init_state(shapes_tree(), comp, W, topology=topology, min_size=MIN_SIZE, plan=PLAN)
  return jax.tree.map(lambda s: jnp.stack([s] * W), one)


@functools.lru_cache(maxsize=None)
def compiled(name, topology):
  """jit(shard_map) of one sync: (tree, stacked state, key) -> (sum, state, wire bytes, lax.psum
  of the tree), every rank's values on a leading axis. The ring passes the state as its
  shard_map block, PS without the block's leading axis (both forms of the API)."""
  comp = compressor(name)

  def body(tree, state, key):
    tree = jax.tree.map(lambda x: x[0], tree)
    if topology == "ps":
      state = jax.tree.map(lambda s: s[0], state)
    out, new, wire = jc.sync_with_bytes(tree, "r", comp, state, topology=topology,
                                        min_size=MIN_SIZE, plan=PLAN, key=key)
    if topology == "ps":
      new = jax.tree.map(lambda s: s[None], new)
    return (jax.tree.map(lambda x: x[None], out), new, wire[None],
            jax.tree.map(lambda x: x[None], lax.psum(tree, "r")))
  return jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("r"), P("r"), P()),
                               out_specs=P("r")))


def per_rank(stacked):
  return [jax.tree.map(lambda s, r=r: np.asarray(s)[r], stacked) for r in range(W)]


def assert_tree_bits(got, want, msg):
  got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
  assert len(got_leaves) == len(jax.tree.leaves(want)), msg
  for (path, g), w in zip(got_leaves, jax.tree.leaves(want), strict=True):
    ref.assert_same_bits(np.asarray(g), np.asarray(w), msg=f"{msg}{jax.tree_util.keystr(path)}")


def test_routes_follow_min_size_and_plan():
  tree = {k: np.zeros(s, F32) for k, s in SHAPES.items()}
  routes = jc.leaf_routes(tree, W, min_size=MIN_SIZE, plan=PLAN)
  assert [tuple(r) for r in routes] == ROUTES
  assert [r.compress for r in jc.leaf_routes(tree, W, min_size=0)] == [True] * 5
  assert [r.compress for r in jc.leaf_routes(tree, W)] == [False] * 5  # HiPress's 262144
  assert jc.leaf_routes(shapes_tree(), 4, min_size=0, plan={"['b']": (False, 2)})[1] == (
      "['b']", 1, False, 2)


def test_init_state_is_one_ranks_zero_slots():
  comp = compressor("dgc")
  state = jc.init_state(shapes_tree(), comp, W, min_size=MIN_SIZE, plan=PLAN)
  assert sorted(state) == ["['a']", "['v']"]
  assert {k: v.shape for k, v in state["['a']"].items()} == {"u": (8, 5), "v": (8, 5)}
  assert {k: v.shape for k, v in state["['v']"].items()} == {"u": (3, 1000), "v": (3, 1000)}
  assert all(not np.asarray(leaf).any() for leaf in jax.tree.leaves(state))
  assert jc.init_state(shapes_tree(), compressor("qsgd"), W, min_size=MIN_SIZE) == {
      "['a']": {}, "['u']": {}, "['v']": {}}  # QSGD has no state; "u" follows min_size here


# Every compressor and both topologies run in the default tier; the three slowest pairs to compile
# (their other topology stays) run in the slow tier.
SLOW_PAIRS = {("dgc", "ring"), ("graddrop", "ps"), ("terngrad", "ring")}


@pytest.mark.parametrize("name,topology", [
    pytest.param(n, t, id=f"{n}-{t}", marks=[pytest.mark.slow] if (n, t) in SLOW_PAIRS else [])
    for n in sorted(jc.COMPRESSORS) for t in TOPOLOGIES])
def test_matches_simulation_two_steps(name, topology):
  """Two successive calls (state carried) against casync_refs.simulate, bit for bit on every rank:
  the compressed leaves (K = W for "a", K = 3 for "v"), every rank's new state and the wire
  bytes; the uncompressed leaves equal lax.psum; the same call again gives the same bits."""
  comp = compressor(name)
  fn = compiled(name, topology)
  state = stacked_state(comp, topology)
  sim_states = per_rank(state)
  for step in range(2):
    tree = random_tree(seed=step)
    key = jax.random.key(step)
    before = state
    out, state, wire, psum = fn(tree, state, key)
    ranks = [[tree[k][r] for k in sorted(SHAPES)] for r in range(W)]
    want, sim_states, want_wire = casync_refs.simulate(ranks, comp, sim_states, key, ROUTES,
                                                     topology)
    for i, (path, _, compress, _) in enumerate(ROUTES):
      leaf = path[2:-2]
      got = np.asarray(out[leaf])
      if compress:
        ref.assert_same_bits(got, want[i], msg=f"step {step} {path}")
        assert not np.array_equal(got[0], np.asarray(psum[leaf])[0])
      else:
        ref.assert_same_bits(got, np.asarray(psum[leaf]), msg=f"step {step} {path} psum")
    for r, (got, want_state) in enumerate(zip(per_rank(state), sim_states, strict=True)):
      assert_tree_bits(got, want_state, f"step {step} rank {r} state")
    assert np.all(np.asarray(wire) == F32(want_wire)), (np.asarray(wire), want_wire)
  again = fn(tree, before, key)
  assert_tree_bits(again[:3], (out, state, wire), "the same call again")


def one_call(comp, topology, tree, min_size, plan=None, key=None):
  """sync_with_bytes over the 8 devices of per-rank leaves tree[k][r]: (sums, wire bytes)."""
  def body(tree, key):
    out, _, wire = jc.sync_with_bytes(jax.tree.map(lambda x: x[0], tree), "r", comp,
                                      topology=topology, min_size=min_size, plan=plan, key=key)
    return jax.tree.map(lambda x: x[None], out), wire[None]
  fn = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("r"), P()), out_specs=P("r")))
  out, wire = fn(tree, key)
  wire = np.asarray(wire)
  assert (wire == wire[0]).all()
  return out, float(wire[0])


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_wire_bytes_dense_by_hand(topology):
  """TBQ (2 bits per element, no header): "a" 35 elements in 8 partitions of 5 (2 bytes each),
  "c" 100 elements in 3 of 34 (9 bytes), "b" 3 elements by psum (2 * 7/8 * 4 * 3 = 21 bytes).
  PS: K(W-1) worker and K(W-1) server messages; ring: K per reduce hop (7 hops) and K(W-1)
  forwarded; either way 2K(W-1) messages over W devices."""
  tree = {"a": np.ones((W, 5, 7), F32), "b": np.ones((W, 3), F32), "c": np.ones((W, 100), F32)}
  _, wire = one_call(jc.get("tbq"), topology, tree, min_size=10, plan={"['c']": (True, 3)})
  assert wire == 2 * 8 * 7 * 2 / 8 + 2 * 3 * 7 * 9 / 8 + 21  # 28 + 47.25 + 21 = 96.25


@pytest.mark.parametrize("topology, want", [("ps", 560 + 21), ("ring", 728 + 21)])
def test_wire_bytes_sparse_by_hand(topology, want):
  """DGC with density 1 (capacity 16 of a 16-element partition) and sample_rate 1: the threshold
  is the smallest of 16 sampled magnitudes. Rank r's every partition holds a 10 at position r and
  fifteen 1s, so the threshold is 1 (unless all 16 draws hit the 10) and a worker payload keeps
  exactly the 10: 4 + 8*1 = 12 bytes (the count, not the capacity of 16, is counted).
  DGCServer keeps every non-zero of a merge of m encoded contributions: m distinct positions,
  4 + 8*m bytes.
    PS: 8*7 worker messages (12 B) and 8*7 server messages (m = 8: 68 B) over 8 devices:
      7*(12 + 68) = 560 per device.
    ring: per chunk, the first reduce hop sends a worker payload (12 B), the next 6 server
      payloads of m = 2..7 contributions (6*4 + 8*27 = 240 B); the last encode (m = 8, 68 B) is
      forwarded 7 times (476 B): 728 B per chunk, 8 chunks over 8 devices.
  Plus 21 bytes for a 3-element psum leaf (2 * 7/8 * 4 * 3)."""
  flat = np.ones((W, 8, 16), F32)
  for r in range(W):
    flat[r, :, r] = 10.0
  tree = {"g": flat.reshape(W, 128), "s": np.ones((W, 3), F32)}
  comp = jc.get("dgc", density=1.0, sample_rate=1.0)
  out, wire = one_call(comp, topology, tree, min_size=3, key=jax.random.key(3))
  assert wire == want
  assert np.isfinite(np.asarray(out["g"])).all()


def test_key_fold_makes_draws_depend_on_the_key():
  """Stochastic TernGrad: the same key gives the same bits, another key other bits."""
  comp = compressor("terngrad")
  tree = {"g": np.random.default_rng(1).standard_normal((W, 64)).astype(F32)}
  a = np.asarray(one_call(comp, "ps", tree, min_size=0, key=jax.random.key(0))[0]["g"])
  b = np.asarray(one_call(comp, "ps", tree, min_size=0, key=jax.random.key(0))[0]["g"])
  c = np.asarray(one_call(comp, "ps", tree, min_size=0, key=jax.random.key(1))[0]["g"])
  ref.assert_same_bits(a, b)
  assert not np.array_equal(a, c)


def trace(tree, comp, state=None, axis="r", **options):
  """Traces sync inside an 8-device shard_map (no compile): raises what sync raises."""
  def body(tree):
    return jc.sync(jax.tree.map(lambda x: x[0], tree), axis, comp, state, **options)[0]
  jax.eval_shape(jax.shard_map(body, mesh=mesh(), in_specs=P("r"), out_specs=P("r"),
                               check_vma=False), tree)


@pytest.mark.parametrize("options, match", [
    (dict(topology="tree"), "topology='tree' is not allowed"),
    (dict(min_size=-1), "min_size=-1"),
    (dict(min_size=True), "min_size=True"),
    (dict(min_size=1.5), "min_size=1.5"),
    (dict(plan=[("['w']", True, 8)]), "plan="),
    (dict(plan={"['x']": (True, 8)}), re.escape("""plan path="['x']" is not allowed""")),
    (dict(plan={"['w']": (True, 0)}), re.escape("""plan["['w']"] K=0 is not allowed""")),
    (dict(plan={"['w']": (True, 9)}), re.escape("K=9 is not allowed; expected an int in [1, 8]")),
    (dict(plan={"['w']": ("yes", 8)}), "compress='yes'"),
    (dict(plan={"['w']": (True,)}), "a pair"),
    (dict(axis="data"), "axis_name='data'"),
])
def test_bad_options_rejected(options, match):
  tree = {"w": jax.ShapeDtypeStruct((W, 64), jnp.float32)}
  axis = options.pop("axis", "r")
  with pytest.raises(ValueError, match=match):
    trace(tree, jc.get("tbq"), axis=axis, min_size=options.pop("min_size", 0), **options)


def test_bad_inputs_rejected():
  tree = {"w": jax.ShapeDtypeStruct((W, 64), jnp.float32)}
  with pytest.raises(ValueError, match="key=None is not allowed"):
    trace(tree, jc.get("dgc"), min_size=0)
  trace(tree, jc.get("dgc"), min_size=64)  # nothing compressed: no key needed
  with pytest.raises(ValueError, match=r"tree\['i'\].dtype='int32'"):
    trace({"i": jax.ShapeDtypeStruct((W, 64), jnp.int32)}, jc.get("tbq"))
  with pytest.raises(ValueError, match=r"tree\['h'\].dtype='bfloat16'"):
    trace({"h": jax.ShapeDtypeStruct((W, 64), jnp.bfloat16)}, jc.get("tbq"))
  with pytest.raises(ValueError, match="compressor='tbq' is not allowed"):
    trace(tree, "tbq")
  wrong = {"['w']": {"residual": jnp.zeros((8, 9), jnp.float32)}}
  with pytest.raises(ValueError, match="state="):
    trace(tree, jc.get("tbq"), state=wrong, min_size=0)
  with pytest.raises(ValueError, match="axis_name='r'"):
    jc.sync({"w": jnp.ones(64)}, "r", jc.get("tbq"), min_size=0)  # no enclosing shard_map
  with pytest.raises(ValueError, match=re.escape("""plan["['w']"] compress=True""")):
    jc.leaf_routes({"w": np.zeros((0,), F32)}, W, min_size=0, plan={"['w']": (True, 8)})
  with pytest.raises(ValueError, match="num_ranks=0"):
    jc.leaf_routes({"w": np.zeros((4,), F32)}, 0, min_size=0)


@pytest.mark.parametrize("name, topology", [("dgc", "ring"), ("tbq", "ring"), ("onebit", "ps")])
def test_matches_simulation_three_ranks(name, topology):
  """W = 3 (a looped ring hop; DGC's servers differ per hop), one call against
  casync_refs.simulate: every rank's result and state, and the wire bytes."""
  w, comp = 3, compressor(name)
  shapes = {"a": (5, 7), "b": (3,)}
  routes = [("['a']", 35, True, 3), ("['b']", 3, False, 3)]
  rng = np.random.default_rng(7)
  tree = {k: rng.standard_normal((w,) + s).astype(F32) for k, s in shapes.items()}
  one = jc.init_state(shapes_tree(shapes), comp, w, topology=topology, min_size=4)
  state = jax.tree.map(lambda s: jnp.stack([s] * w), one)
  key = jax.random.key(5)

  def body(tree, state, key):
    out, new, wire = jc.sync_with_bytes(jax.tree.map(lambda x: x[0], tree), "r", comp, state,
                                        topology=topology, min_size=4, key=key)
    return jax.tree.map(lambda x: x[None], out), new, wire[None]
  fn = jax.jit(jax.shard_map(body, mesh=Mesh(np.array(jax.devices()[:w]), ("r",)),
                             in_specs=(P("r"), P("r"), P()), out_specs=P("r")))
  out, new, wire = fn(tree, state, key)
  ranks = [[tree[k][r] for k in sorted(shapes)] for r in range(w)]
  sim_states = [jax.tree.map(lambda s, r=r: np.asarray(s)[r], state) for r in range(w)]
  want, want_states, want_wire = casync_refs.simulate(ranks, comp, sim_states, key, routes,
                                                    topology)
  ref.assert_same_bits(np.asarray(out["a"]), want[0], msg="a")
  for r in range(w):
    assert_tree_bits(jax.tree.map(lambda s, r=r: np.asarray(s)[r], new), want_states[r],
                     f"rank {r} state")
  assert np.all(np.asarray(wire) == F32(want_wire)), (np.asarray(wire), want_wire)
