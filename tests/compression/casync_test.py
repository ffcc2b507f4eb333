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
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))  # casync_refs (--import-mode=importlib)
import casync_refs  # noqa: E402
from draw_recorder import DrawRecorder  # noqa: E402
import hlo_bytes  # noqa: E402
import references as ref  # noqa: E402
import jlp.compression as jc  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")
W = 8
F32 = np.float32
TOPOLOGIES = ("ps", "ring")
#: The compressors CaSync runs (PowerSGD runs with topology "allreduce": powersgd_test.py).
CASYNC = sorted(n for n, c in jc.COMPRESSORS.items() if "ps" in c.topologies)
# The test tree, in flattening order: "a" has MIN_SIZE + 1 elements (compressed, K = W), "b" is a
# scalar and "e" has exactly MIN_SIZE elements (both summed by psum), "u" is large but the plan
# keeps it uncompressed, "v" is compressed in K = 3 partitions of 1000 (K < W; long enough that
# a codec's reductions sum differently batched and alone).
MIN_SIZE = 34
SHAPES = {"a": (5, 7), "b": (), "e": (2, 17), "u": (40,), "v": (3000,)}
PLAN = {"['u']": (False, 8), "['v']": (True, 3)}
# How the tree is routed (path, size, compress, K), by hand from the rules above.
ROUTES = [("['a']", 35, True, 8), ("['b']", 1, False, 1), ("['e']", 34, False, 8),
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


def on_ranks(stacked, w=W):
  """Stacked per-rank values placed as the programs' outputs are (sharded over the ranks): a
  state fed back into a program then hits the executable its first call compiled (one placed
  on one device would compile the program a second time for the other input sharding)."""
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:w]), ("r",)), P("r"))
  return jax.device_put(stacked, sharding)


def stacked_state(comp, topology):
  one = jc.init_state(shapes_tree(), comp, W, topology=topology, min_size=MIN_SIZE, plan=PLAN)
  return on_ranks(jax.tree.map(lambda s: np.stack([np.asarray(s)] * W), one))


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
    out, new, report = jc.sync_with_bytes(tree, "r", comp, state, topology=topology,
                                          min_size=MIN_SIZE, plan=PLAN, key=key)
    if topology == "ps":
      new = jax.tree.map(lambda s: s[None], new)
    return (jax.tree.map(lambda x: x[None], out), new, jax.tree.map(lambda b: b[None], report),
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


# The default tier runs one pair per path of casync.py: TBQ on PS (a dense codec with an
# error-feedback state and no key: the unkeyed vmap of the worker encodes, the dense merge), QSGD
# on the ring (a dense keyed codec with an empty state: the ring's fori_loop hops for K = W and
# unrolled ones for K < W) and DGC on PS (a sparse keyed codec, scatter-add merges, the stateless
# server; K < W and K = W). test_matches_simulation_three_ranks keeps, on 3 ranks, DGC's stateless
# server on the ring and GradDrop on the ring (a sparse codec merged by a stateful server); every
# other pair (the same paths with another codec) runs in the slow tier.
DEFAULT_PAIRS = {("tbq", "ps"), ("qsgd", "ring"), ("dgc", "ps")}
SLOW_PAIRS = {(n, t) for n in CASYNC for t in TOPOLOGIES} - DEFAULT_PAIRS


@pytest.mark.parametrize("name,topology", [
    pytest.param(n, t, id=f"{n}-{t}", marks=[pytest.mark.slow] if (n, t) in SLOW_PAIRS else [])
    for n in CASYNC for t in TOPOLOGIES])
def test_matches_simulation_two_steps(name, topology):
  """Two successive calls (state carried) against casync_refs.simulate, bit for bit on every rank:
  the compressed leaves (K = W for "a", K = 3 for "v"), the uncompressed ones (the float32 ring
  of casync_refs.ring_sum, close to lax.psum), every rank's new state and the wire bytes; the
  same call again gives the same bits."""
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
    want, sim_states, want_payload, want_moved = casync_refs.simulate(ranks, comp, sim_states,
                                                                      key, ROUTES, topology)
    for i, (path, _, compress, _) in enumerate(ROUTES):
      leaf = path[2:-2]
      got = np.asarray(out[leaf])
      ref.assert_same_bits(got, want[i], msg=f"step {step} {path}")
      if compress:
        assert not np.array_equal(got[0], np.asarray(psum[leaf])[0])
      else:
        np.testing.assert_allclose(got, np.asarray(psum[leaf]), rtol=1e-5, atol=1e-6)
    for r, (got, want_state) in enumerate(zip(per_rank(state), sim_states, strict=True)):
      assert_tree_bits(got, want_state, f"step {step} rank {r} state")
    assert np.all(np.asarray(wire["payload_bytes"]) == F32(want_payload)), (wire, want_payload)
    assert np.all(np.asarray(wire["wire_bytes"]) == F32(want_moved)), (wire, want_moved)
    assert np.all(np.asarray(wire["nonfinite"]) == 0)
  again = fn(tree, before, key)
  assert_tree_bits(again[:3], (out, state, wire), "the same call again")
  if comp.needs_key:  # the key reaches the codecs' draws: another key, other bits
    other = fn(tree, before, jax.random.key(7))
    assert not np.array_equal(np.asarray(other[0]["v"]), np.asarray(out["v"]))


@functools.lru_cache(maxsize=None)
def _one_call_program(comp, topology, min_size, plan):
  """The jitted program of one_call (one per options: the calls of a test share its trace)."""
  def body(tree, key):
    out, _, report = jc.sync_with_bytes(jax.tree.map(lambda x: x[0], tree), "r", comp,
                                        topology=topology, min_size=min_size,
                                        plan=dict(plan) or None, key=key)
    return jax.tree.map(lambda x: x[None], out), jax.tree.map(lambda b: b[None], report)
  return jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("r"), P()), out_specs=P("r")))


def one_call(comp, topology, tree, min_size, plan=None, key=None):
  """sync_with_bytes over the 8 devices of per-rank leaves tree[k][r]: (sums, the report with
  each entry checked equal on every rank)."""
  fn = _one_call_program(comp, topology, min_size, tuple(sorted((plan or {}).items())))
  out, report = fn(tree, key)
  report = {k: np.asarray(v) for k, v in report.items()}
  assert all((v == v[0]).all() for v in report.values())
  return out, {k: v[0].item() for k, v in report.items()}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_wire_bytes_dense_by_hand(topology):
  """TBQ (2 bits per element, no header): "a" 35 elements in 8 partitions of 5 (2 bytes each),
  "c" 100 elements in 3 of 34 (9 bytes), "b" 3 elements by the float32 ring (7 hops and an
  all_gather of a chunk of ceil(3/8) = 1 float32: 2 * 7 * 4 = 56 bytes).
  PS: K(W-1) worker and K(W-1) server messages; ring: K per reduce hop (7 hops) and K(W-1)
  forwarded; either way 2K(W-1) messages over W devices. A dense payload moves as it is on the
  wire, so wire_bytes = payload_bytes + the bookkeeping psum of 2 + 2 int32 (2 * 7/8 * 16)."""
  tree = {"a": np.ones((W, 5, 7), F32), "b": np.ones((W, 3), F32), "c": np.ones((W, 100), F32)}
  _, report = one_call(jc.get("tbq"), topology, tree, min_size=10, plan={"['c']": (True, 3)})
  assert report["payload_bytes"] == 2 * 8 * 7 * 2 / 8 + 2 * 3 * 7 * 9 / 8 + 56  # 131.25
  assert report["wire_bytes"] == 131.25 + 28
  assert report["nonfinite"] == 0


# The ring case (3 s here) runs in the slow tier: test_matches_simulation_three_ranks[dgc-ring]
# checks DGC's payload_bytes (HiPress's count) and wire_bytes (capacity) on the ring against
# casync_refs.simulate, which counts every message from the codec's own to_bytes / wire_bytes.
@pytest.mark.parametrize("topology, want", [
    ("ps", 560 + 56), pytest.param("ring", 728 + 56, marks=pytest.mark.slow)])
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
  Plus 56 bytes for a 3-element leaf by the float32 ring (2 * 7 * 4 * ceil(3/8)). That is
  payload_bytes; wire_bytes moves every payload at capacity (16 pairs: 132 B; 2K(W-1)/W = 14
  messages per device, either topology), the ring leaf, and the bookkeeping psum of 3 int32
  (2 * 7/8 * 12 = 21 B)."""
  flat = np.ones((W, 8, 16), F32)
  for r in range(W):
    flat[r, :, r] = 10.0
  tree = {"g": flat.reshape(W, 128), "s": np.ones((W, 3), F32)}
  comp = jc.get("dgc", density=1.0, sample_rate=1.0)
  out, report = one_call(comp, topology, tree, min_size=3, key=jax.random.key(3))
  assert report["payload_bytes"] == want
  assert report["wire_bytes"] == 14 * 132 + 56 + 21
  assert np.isfinite(np.asarray(out["g"])).all()


# Slow tier: test_matches_simulation_two_steps (dgc-ps, qsgd-ring) checks, on the programs it
# has compiled already, that the same key gives the same bits and another key other bits.
@pytest.mark.slow
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
  wrong = {"['w']": {"v": jnp.zeros((8, 9), jnp.float32)}}
  with pytest.raises(ValueError, match="state="):
    trace(tree, jc.get("tbq"), state=wrong, min_size=0)
  with pytest.raises(ValueError, match="axis_name='r'"):
    jc.sync({"w": jnp.ones(64)}, "r", jc.get("tbq"), min_size=0)  # no enclosing shard_map
  with pytest.raises(ValueError, match=re.escape("""plan["['w']"] compress=True""")):
    jc.leaf_routes({"w": np.zeros((0,), F32)}, W, min_size=0, plan={"['w']": (True, 8)})
  with pytest.raises(ValueError, match="num_ranks=0"):
    jc.leaf_routes({"w": np.zeros((4,), F32)}, 0, min_size=0)


# onebit on PS runs in the slow tier: W = 3 changes nothing on PS but the partition count, and
# test_matches_simulation_two_steps[tbq-ps] runs the same PS path (a dense codec with an
# error-feedback state, unkeyed) with K = W and K < W; onebit's encode is codecs_test.py's.
# TBQ on the ring is slow too: the looped W = 3 hop with a worker state carried on the ring is
# the graddrop-ring case's, and the ring's dense merges are two_steps[qsgd-ring]'s.
@pytest.mark.parametrize("name, topology", [
    ("dgc", "ring"), pytest.param("tbq", "ring", marks=pytest.mark.slow),
    pytest.param("onebit", "ps", marks=pytest.mark.slow), ("graddrop", "ring")])
def test_matches_simulation_three_ranks(name, topology):
  """W = 3 (a looped ring hop; DGC's servers differ per hop), one call against
  casync_refs.simulate: every rank's result and state, and the wire bytes (HiPress's payload
  bytes, sparse messages at their count, and the bytes moved)."""
  w, comp = 3, compressor(name)
  shapes = {"a": (5, 7), "b": (3,)}
  routes = [("['a']", 35, True, 3), ("['b']", 3, False, 3)]
  rng = np.random.default_rng(7)
  tree = {k: rng.standard_normal((w,) + s).astype(F32) for k, s in shapes.items()}
  one = jc.init_state(shapes_tree(shapes), comp, w, topology=topology, min_size=4)
  state = jax.tree.map(lambda s: np.stack([np.asarray(s)] * w), one)
  key = jax.random.key(5)

  def body(tree, state, key):
    out, new, report = jc.sync_with_bytes(jax.tree.map(lambda x: x[0], tree), "r", comp, state,
                                          topology=topology, min_size=4, key=key)
    return (jax.tree.map(lambda x: x[None], out), new,
            jnp.stack([report["payload_bytes"], report["wire_bytes"]])[None])
  fn = jax.jit(jax.shard_map(body, mesh=Mesh(np.array(jax.devices()[:w]), ("r",)),
                             in_specs=(P("r"), P("r"), P()), out_specs=P("r")))
  out, new, wire = fn(tree, state, key)
  ranks = [[tree[k][r] for k in sorted(shapes)] for r in range(w)]
  sim_states = [jax.tree.map(lambda s, r=r: np.asarray(s)[r], state) for r in range(w)]
  want, want_states, want_payload, want_wire = casync_refs.simulate(
      ranks, comp, sim_states, key, routes, topology)
  ref.assert_same_bits(np.asarray(out["a"]), want[0], msg="a")
  for r in range(w):
    assert_tree_bits(jax.tree.map(lambda s, r=r: np.asarray(s)[r], new), want_states[r],
                     f"rank {r} state")
  wire = np.asarray(wire)
  # (the sync divides a byte count by W = 3 in float32: equal to within its rounding)
  np.testing.assert_allclose(wire[:, 0], want_payload, rtol=1e-6)
  assert np.all(wire[:, 1] == F32(want_wire)), (wire, want_wire)


# -- invariants (issue 19) -------------------------------------------------------------------------

@pytest.mark.parametrize("name,topology", [
    pytest.param(n, t, id=f"{n}-{t}", marks=[pytest.mark.slow] if (n, t) in SLOW_PAIRS else [])
    for n in CASYNC for t in TOPOLOGIES])
def test_nonfinite_gradient_leaves_no_trace(name, topology):
  """A NaN or an infinity in one rank's leaf (compressed "a" with K = W, compressed "v" with
  K = 3, or the psum leaf "e"): that leaf's sum is non-finite on every rank, every rank's state
  comes back bit for bit as it went in, `nonfinite` counts the bad element, and the next call
  with finite gradients gives the bits it gives without the bad call."""
  comp = compressor(name)
  fn = compiled(name, topology)
  state = fn(random_tree(seed=0), stacked_state(comp, topology), jax.random.key(0))[1]
  good, key = random_tree(seed=1), jax.random.key(1)
  want = fn(good, state, key)
  for leaf, rank, where, value in (("a", 3, (2, 4), np.nan), ("v", 5, (1234,), np.inf),
                                   ("e", 0, (1, 16), -np.inf)):
    bad = random_tree(seed=2)
    bad[leaf][(rank,) + where] = value
    out, new, report, _ = fn(bad, state, jax.random.key(2))
    got = np.asarray(out[leaf])
    assert all(not np.isfinite(got[r]).all() for r in range(W)), (leaf, name, topology)
    assert_tree_bits(new, state, f"{leaf}: the state after the bad call")
    assert (np.asarray(report["nonfinite"]) == 1).all()
    after = fn(good, new, key)
    assert_tree_bits(after[:3], want[:3], f"{leaf}: the next call")


def one_leaf_program(comp, topology, n, k, key=None):
  """(the compiled HLO text, wire_bytes, payload_bytes) of one sync over 8 devices of a leaf of n
  elements in K partitions beside a 3-element psum leaf."""
  def body(tree, key):
    out, _, report = jc.sync_with_bytes(jax.tree.map(lambda x: x[0], tree), "r", comp,
                                        topology=topology, min_size=3,
                                        plan={"['g']": (True, k)}, key=key)
    return jax.tree.map(lambda x: x[None], out), jax.tree.map(lambda b: b[None], report)
  fn = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("r"), P()), out_specs=P("r")))
  tree = {"g": np.random.default_rng(k).standard_normal((W, n)).astype(F32),
          "s": np.ones((W, 3), F32)}
  program = fn.lower(tree, key).compile()  # the program whose HLO is read is the one that runs
  _, report = program(tree, key)
  return program.as_text(), float(np.asarray(report["wire_bytes"])[0]), float(
      np.asarray(report["payload_bytes"])[0])


# DGC (about 40 s here on the ring, 8 s on PS) runs in the slow tier: TBQ keeps the HLO check
# on both topologies, and test_wire_bytes_sparse_by_hand checks DGC's wire_bytes on both.
@pytest.mark.parametrize("name,topology", [
    (n, t) if n == "tbq" else pytest.param(n, t, marks=pytest.mark.slow)
    for n in ("tbq", "dgc") for t in TOPOLOGIES])
def test_a_plan_never_adds_traffic(name, topology):
  """A leaf of 4096 elements in K = 8, 2, 1 partitions (K = W, 1 < K < W and K = 1; K = 4 takes
  K = 2's path, one program less): the bytes per device (averaged) that
  the compiled program's collectives move, read from its HLO (hlo_bytes), do not grow as K
  shrinks (HiPress moves about 2(W-1)/W of a payload per device whatever K is), and
  `wire_bytes` is exactly that number."""
  comp = compressor(name, **({"density": 0.01} if name == "dgc" else {}))
  key = jax.random.key(0) if comp.needs_key else None
  moved = []
  for k in (8, 2, 1):
    hlo, wire, payload = one_leaf_program(comp, topology, 4096, k, key)
    hlo_total, found = hlo_bytes.collective_bytes(hlo, W)
    assert wire == pytest.approx(hlo_total, rel=1e-6, abs=1e-3), (k, found)
    assert payload <= wire
    moved.append(hlo_total)
  assert all(b <= a * (1 + 1e-6) for a, b in zip(moved, moved[1:])), moved


# The ring cases (7-8 s each here) run in the slow tier: the threshold that must not starve is
# the codecs' own (their encode, the same on either topology), kept on PS for DGC. GradDrop on PS
# is slow too: its workers and its root (its own server) run GradDrop's encode on these
# one-element partitions, which codecs_test.py::test_no_partition_starves[graddrop-default-1]
# runs 50 steps against codec_refs; the sync's routing of such partitions is the DGC case's.
@pytest.mark.parametrize("name,topology", [
    ("dgc", "ps"), pytest.param("graddrop", "ps", marks=pytest.mark.slow),
    pytest.param("dgc", "ring", marks=pytest.mark.slow),
    pytest.param("graddrop", "ring", marks=pytest.mark.slow)])
def test_no_partition_starves(name, topology):
  """1- and 7-element leaves, min_size=0 (partitions of one element: n * density < 1), the
  same constant gradient on every rank: every element is applied (its sum is non-zero) within 50
  steps. HiPress's sampled threshold (|v| > the sampled |v|) never selects a partition whose
  magnitudes all tie."""
  comp = jc.get(name)
  shapes = {"one": (1,), "seven": (7,)}  # 7 of 8 partitions padding, and 1 of 8
  state = on_ranks(jax.tree.map(lambda s: np.stack([np.asarray(s)] * W), jc.init_state(
      shapes_tree(shapes), comp, W, topology=topology, min_size=0)))

  def body(tree, state, key):
    out, new = jc.sync(jax.tree.map(lambda x: x[0], tree), "r", comp, state, topology=topology,
                       min_size=0, key=key)
    return jax.tree.map(lambda x: x[None], out), new
  fn = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("r"), P("r"), P()),
                             out_specs=P("r")), donate_argnums=1)
  tree = {k: np.full((W,) + s, 0.01, F32) for k, s in shapes.items()}
  applied = {k: np.zeros(s, bool) for k, s in shapes.items()}
  for step in range(50):
    out, state = fn(tree, state, jax.random.key(step))
    for k in shapes:
      applied[k] |= np.asarray(out[k])[0] != 0
    if all(a.all() for a in applied.values()):
      break  # every element applied: later steps cannot undo that
  assert all(a.all() for a in applied.values()), applied


def _equations(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _equations(sub)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_empty_leaves_pass_through(topology):
  """Empty leaves come back unchanged (shape and dtype) and reach no collective (XLA:CPU crashes
  on a psum of an empty array beside another one); a tree of empty leaves alone compiles to no
  collective at all. (The empty leaves are made inside the shard_map body: XLA:CPU also crashes
  on empty shard_map operands.)"""
  comp = jc.get("tbq", threshold=0.5)
  g = np.random.default_rng(0).standard_normal((W, 64)).astype(F32)

  def program(with_others):
    def body(g):
      g = g[0]
      tree = {"e0": g[:0] * 2, "e1": jnp.zeros((3, 0), jnp.float32) + g[0]}
      if with_others:
        tree.update(g=g, p=g[:2] * 0 + 1)
      out, _, report = jc.sync_with_bytes(tree, "r", comp, topology=topology, min_size=2)
      assert out["e0"].shape == (0,) and out["e1"].shape == (3, 0)
      assert out["e0"].dtype == out["e1"].dtype == jnp.float32
      kept = [out["p"], out["g"]] if with_others else [g]
      return jnp.concatenate(kept)[None], report["wire_bytes"][None]
    mapped = jax.shard_map(body, mesh=mesh(), in_specs=P("r"), out_specs=P("r"))
    # No collective of the traced program takes an empty operand (XLA may drop one later).
    assert not [e for e in _equations(jax.make_jaxpr(mapped)(g).jaxpr)
                if re.search("psum|gather|all_to_all|ppermute|pmax|pmin", str(e.primitive))
                and any(0 in getattr(v.aval, "shape", (1,)) for v in e.invars)]
    program = jax.jit(mapped).lower(g).compile()  # the program whose HLO is read runs
    return program(g), program.as_text()

  (out, wire), hlo = program(with_others=True)
  ref.assert_same_bits(np.asarray(out)[:, :2], np.full((W, 2), W, F32))
  assert np.isfinite(np.asarray(out)).all()
  collectives = [l for l in hlo.splitlines()
                 if re.search(r" (all-reduce|all-gather|all-to-all|collective-permute)\(", l)]
  assert collectives
  empty = re.compile(r"\b[a-z]+\d*\[(?:\d+,)*0(?:,\d+)*\]")
  assert not [l for l in collectives if empty.search(l.split("(")[0])], collectives
  assert float(np.asarray(wire)[0]) == pytest.approx(hlo_bytes.collective_bytes(hlo, W)[0])
  (out, wire), hlo = program(with_others=False)
  ref.assert_same_bits(np.asarray(out), g)
  assert hlo_bytes.collective_bytes(hlo, W) == (0, [])
  assert (np.asarray(wire) == 0).all()


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_draw_is_its_own(topology):
  """Every (leaf, partition, rank, step) encode draws its own numbers: the draws each rank's
  state slots keep after two calls with two keys are pairwise distinct."""
  comp = DrawRecorder()
  shapes = {"a": (40,), "b": (16,)}  # two leaves (K = W and K = 3) share partition ids 0-2
  plan = {"['b']": (True, 3)}
  state = jax.tree.map(lambda s: np.stack([np.asarray(s)] * W),
                       jc.init_state(shapes_tree(shapes), comp, W, topology=topology,
                                     min_size=0, plan=plan))

  def body(tree, state, key):
    return jc.sync(jax.tree.map(lambda x: x[0], tree), "r", comp, state, topology=topology,
                   min_size=0, plan=plan, key=key)[1]
  fn = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("r"), P("r"), P()),
                             out_specs=P("r")))
  tree = {k: np.ones((W,) + s, F32) for k, s in shapes.items()}
  draws = []
  for step in range(2):
    draws += [np.asarray(d).reshape(-1) for d in jax.tree.leaves(
        fn(tree, state, jax.random.fold_in(jax.random.key(0), step)))]
  draws = np.concatenate(draws)
  assert draws.size == 2 * W * (8 + 3) and np.unique(draws).size == draws.size
