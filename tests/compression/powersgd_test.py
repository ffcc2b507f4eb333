"""jlp.compression.PowerSGD with sync(..., topology="allreduce") on 8 emulated CPU devices.

Reference: `ref_step`, a float64 numpy model of PyTorch's PowerSGD hook written from its rules
(M = T reshaped (n, m); M += E; Q orthonormalized; P = sum_w M_w Q, orthonormalized;
Q = sum_w M_w^T P / W; A = P Q^T; E = M - A), given the Q that init_state drew.
"""

import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jlp.compression as jc
from jlp.compression import transport
from jlp.compression.powersgd import leaf_plan
from jlp.sync import GradSync

pytestmark = pytest.mark.usefixtures("fast_compile")
W = 8
F32 = np.float32
# "a": (16, 12), r=min(16,12,rank); "c": a conv kernel (8, 27); "b": a bias; "s": a small matrix
# (3, 3) that the rule leaves dense at rank 1 ((3+3)*1*2 = 12 >= 9).
SHAPES = {"a": (16, 12), "b": (16,), "c": (8, 3, 3, 3), "s": (3, 3)}


# -- the numpy reference ----------------------------------------------------------------------

def ref_orth(a, eps=0.0):
  a = np.array(a, np.float64)
  r = a.shape[1]
  if r > 2:
    return np.linalg.qr(a)[0]
  for i in range(r):
    a[:, i] = a[:, i] / (np.linalg.norm(a[:, i]) + eps)
    for j in range(i + 1, r):
      a[:, j] -= np.dot(a[:, i], a[:, j]) * a[:, i]
  return a


def ref_step(grads, q, errors, eps=0.0, error_feedback=True):
  """One compressed step of W ranks: grads [W, n, m], q (m, r) shared, errors [W, n, m].
  Returns (A, new q, new errors)."""
  w = len(grads)
  ms = [np.asarray(g, np.float64) + (e if error_feedback else 0) for g, e in zip(grads, errors)]
  q = ref_orth(q, eps)
  p = ref_orth(sum(m @ q for m in ms), eps)
  q = sum(m.T @ p for m in ms) / w
  a = p @ q.T
  return a, q, [m - a for m in ms]


def rule(n, m, rank, rate):
  r = min(n, m, rank)
  return (n + m) * r * rate < n * m


# -- running the sync ---------------------------------------------------------------------------

def mesh(w=W):
  return Mesh(np.array(jax.devices()[:w]), ("r",))


def runner(comp, shapes, w=W, key=False):
  """jit(shard_map) of one sync: (stacked grads, stacked state[, key]) -> (sums, state, report)."""
  def body(g, s, *k):
    out, s, rep = jc.sync_with_bytes(jax.tree.map(lambda x: x[0], g), "r", comp, s,
                                     topology="allreduce", key=k[0] if k else None)
    return (jax.tree.map(lambda x: x[None], out), s,
            jax.tree.map(lambda x: jnp.asarray(x)[None], rep))
  specs = (P("r"), P("r")) + ((P(),) if key else ())
  return jax.jit(jax.shard_map(body, mesh=mesh(w), in_specs=specs, out_specs=P("r")))


def stacked_state(comp, shapes, w=W, seed=0):
  tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  one = jc.init_state(tree, comp, w, topology="allreduce", seed=seed)
  # Placed as the runner's outputs are (sharded over the ranks): a state fed back into the runner
  # hits the executable of its first call, instead of compiling it again for another sharding.
  return one, jax.device_put(jax.tree.map(lambda a: np.stack([np.asarray(a)] * w), one),
                             NamedSharding(mesh(w), P("r")))


def grads(shapes, seed=0, w=W):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal((w,) + s).astype(F32) for k, s in shapes.items()}


def mat(x):
  return np.asarray(x, np.float64).reshape(x.shape[0], -1)


def assert_same_q(got, want, rtol=1e-4, atol=1e-5):
  """Q up to the sign of each column (QR's signs are LAPACK's choice; A does not depend on them)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  signs = np.sign(np.sum(got * want, axis=0))
  np.testing.assert_allclose(got * signs, want, rtol=rtol, atol=atol)


# -- tests ------------------------------------------------------------------------------------

# rank 2 runs in the slow tier: rank 1 keeps Gram-Schmidt's warm start and error feedback over
# two steps, rank 3 QR's; test_exact_when_rank_covers_the_matrix[shape0-2] keeps Gram-Schmidt's
# projection step (r = 2) against the reference (the mean), test_wire_bytes rank 2's payload.
@pytest.mark.parametrize("rank", [1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_two_steps_match_reference(rank):
  """Two compressed steps (warm start, error feedback) on 8 ranks against ref_step: every rank's
  result (sum / W = A, the same on all ranks), the dense leaves' sums, Q and every rank's E."""
  comp = jc.PowerSGD(rank=rank, start_iter=0)
  one, state = stacked_state(comp, SHAPES)
  compressed = {k for k, s in SHAPES.items() if len(s) > 1
                and rule(s[0], int(np.prod(s[1:])), rank, 2.0)}
  assert set(one["leaves"]) == {f"['{k}']" for k in compressed}
  fn = runner(comp, SHAPES)
  qs = {k: np.asarray(one["leaves"][f"['{k}']"]["q"]) for k in compressed}
  es = {k: [np.zeros(mat(np.zeros(SHAPES[k])).shape)] * W for k in compressed}
  for step in range(2):
    g = grads(SHAPES, seed=step)
    out, state, rep = fn(g, state)
    for k in SHAPES:
      got = np.asarray(out[k])
      np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))  # same on all ranks
      if k not in compressed:
        np.testing.assert_allclose(got[0], g[k].sum(0), rtol=1e-5, atol=1e-5)
        continue
      a, qs[k], es[k] = ref_step([mat(x) for x in g[k]], qs[k], es[k])
      np.testing.assert_allclose(mat(got[0]) / W, a, rtol=1e-4, atol=1e-5)
      leaf = jax.tree.map(np.asarray, state["leaves"][f"['{k}']"])  # ranks cut in numpy
      for w in range(W):
        assert_same_q(leaf["q"][w], qs[k])
        np.testing.assert_allclose(leaf["error"][w], es[k][w], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(state["step"], np.full(W, step + 1))
  assert float(rep["nonfinite"][0]) == 0


def test_wire_bytes():
  """r(n+m)*4 bytes per compressed leaf in two psums, the dense leaves in P's psum, and the
  bookkeeping psum; before start_iter every leaf by the ring all-reduce."""
  comp = jc.PowerSGD(rank=2, start_iter=1)
  _, state = stacked_state(comp, SHAPES)
  fn = runner(comp, SHAPES)
  _, state, before = fn(grads(SHAPES), state)
  _, _, after = fn(grads(SHAPES, 1), state)
  # rank 2: a (16, 12) and c (8, 27) compressed; b (16) and s (3, 3) dense.
  book = transport.psum_bytes(4 * 3, W)
  low = (transport.psum_bytes(4 * (2 * (16 + 8) + 16 + 9), W)
         + transport.psum_bytes(4 * 2 * (12 + 27), W))
  assert float(after["payload_bytes"][0]) == pytest.approx(low)
  assert float(after["wire_bytes"][0]) == pytest.approx(low + book)
  full = transport.ring_allreduce_bytes(16 * 12 + 16 + 8 * 27 + 9, W)
  assert float(before["wire_bytes"][0]) == pytest.approx(full + book)
  # the payload itself: r (n + m) floats per compressed leaf
  assert 2 * (16 + 12) * 4 + 2 * (8 + 27) * 4 == 504


def test_a_compressed_call_is_three_psums():
  """The bookkeeping psum, P's (the dense leaves with it, as torch's hook batches them) and Q's:
  no ring of ppermutes for the dense leaves (a latency per hop on a slow link)."""
  comp = jc.PowerSGD(rank=2, start_iter=0)
  _, state = stacked_state(comp, SHAPES)

  def body(g, s):
    out, s, _ = jc.sync_with_bytes(jax.tree.map(lambda x: x[0], g), "r", comp, s,
                                   topology="allreduce")
    return jax.tree.map(lambda x: x[None], out), s
  closed = jax.make_jaxpr(jax.shard_map(body, mesh=mesh(), in_specs=P("r"), out_specs=P("r")))(
      grads(SHAPES), state)

  def collectives(jaxpr):  # in order, nested calls included, a cond's branches not
    found = []
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name.replace("psum_invariant", "psum")  # jax's name under shard_map
      if name in ("psum", "ppermute", "all_gather", "all_to_all"):
        found.append(name)
      elif eqn.primitive.name != "cond":
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          found += collectives(sub)
    return found

  def conds(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
      found += [eqn] if eqn.primitive.name == "cond" else []
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        found += conds(sub)
    return found

  # the step's cond (the others count non-finite values, no collective)
  (cond,) = [c for c in conds(closed.jaxpr)
             if any(collectives(branch.jaxpr) for branch in c.params["branches"])]
  plain, compressed = (branch.jaxpr for branch in cond.params["branches"])
  assert collectives(compressed) == ["psum", "psum"]
  assert "ppermute" in collectives(plain)  # before start_iter: the float32 ring of every leaf
  assert collectives(closed.jaxpr) == ["psum"]  # the bookkeeping, outside the cond


def test_linearity_w_ranks_equal_one_rank_on_the_mean():
  """P and Q are summed: 8 ranks with a shared Q give what one rank gives on the mean gradient
  (float32 rounding apart), result, Q and the mean of the errors."""
  shapes = {"a": (16, 12)}
  comp = jc.PowerSGD(rank=2, start_iter=0)
  _, state8 = stacked_state(comp, shapes)
  _, state1 = stacked_state(comp, shapes, w=1)
  g = grads(shapes, seed=3)
  out8, s8, _ = runner(comp, shapes)(g, state8)
  mean = {"a": g["a"].mean(0, keepdims=True)}
  out1, s1, _ = runner(comp, shapes, w=1)(mean, state1)
  np.testing.assert_allclose(np.asarray(out8["a"][0]) / W, out1["a"][0], rtol=1e-4, atol=1e-5)
  assert_same_q(s8["leaves"]["['a']"]["q"][0], s1["leaves"]["['a']"]["q"][0])
  np.testing.assert_allclose(np.mean(s8["leaves"]["['a']"]["error"], 0),
                             s1["leaves"]["['a']"]["error"][0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape,rank", [((2, 8), 2), ((4, 6), 4), ((4, 6), 7)])
def test_exact_when_rank_covers_the_matrix(shape, rank):
  """r >= min(n, m): A is the mean gradient (Gram-Schmidt at r = 2, QR at r = 4)."""
  shapes = {"a": shape}
  comp = jc.PowerSGD(rank=rank, start_iter=0, min_compression_rate=0.5)
  assert leaf_plan({"a": jax.ShapeDtypeStruct(shape, jnp.float32)}, comp)[0][3]
  _, state = stacked_state(comp, shapes)
  g = grads(shapes, seed=4)
  out, state, _ = runner(comp, shapes)(g, state)
  np.testing.assert_allclose(np.asarray(out["a"][0]) / W, g["a"].mean(0), rtol=1e-5, atol=1e-5)
  # E = M_w - A: each rank's distance to the mean, zero on average over the ranks.
  errors = np.asarray(state["leaves"]["['a']"]["error"])
  np.testing.assert_allclose(errors, g["a"] - g["a"].mean(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(errors.mean(0), 0, atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_zero_column_and_eps(eps):
  """A zero gradient makes P's column zero: Gram-Schmidt divides 0 by 0 without eps (NaN, as
  torch's hook), and gives a zero approximation with it. The reference agrees."""
  shapes = {"a": (16, 12)}
  comp = jc.PowerSGD(rank=1, start_iter=0, eps=eps)
  one, state = stacked_state(comp, shapes)
  g = {"a": np.zeros((W, 16, 12), F32)}
  out, state, rep = runner(comp, shapes)(g, state)
  with np.errstate(invalid="ignore"):
    a, _, _ = ref_step([np.zeros((16, 12))] * W, one["leaves"]["['a']"]["q"],
                       [np.zeros((16, 12))] * W, eps=eps)
  if eps == 0:
    assert np.isnan(a).all() and np.isnan(np.asarray(out["a"])).all()
  else:
    np.testing.assert_array_equal(a, 0)
    np.testing.assert_array_equal(out["a"], 0)
    assert np.isfinite(np.asarray(state["leaves"]["['a']"]["q"])).all()
  assert int(rep["nonfinite"][0]) == 0  # the gradient itself was finite


def test_compress_or_not_rule():
  """(n + m) r rate < n m decides, with n the first dimension and m the product of the rest;
  vectors, scalars and empty leaves stay dense."""
  cases = [((16, 12), 1, 2.0), ((3, 3), 1, 2.0), ((4, 4), 1, 1.0), ((4, 4), 1, 1.9),
           ((8, 3, 3, 3), 4, 2.0), ((8, 3, 3, 3), 6, 2.0), ((100,), 1, 2.0), ((), 1, 2.0),
           ((0, 5), 1, 2.0), ((64, 64), 15, 2.0), ((64, 64), 16, 2.0), ((64, 64), 17, 2.0)]
  for shape, rank, rate in cases:
    comp = jc.PowerSGD(rank=rank, min_compression_rate=rate)
    [(_, (n, m), r, compressed)] = leaf_plan({"x": jax.ShapeDtypeStruct(shape, jnp.float32)}, comp)
    size = int(np.prod(shape))
    want = size > 0 and len(shape) > 1 and rule(shape[0], size // shape[0], rank, rate)
    assert compressed == want, (shape, rank, rate)
    assert n == (shape[0] if shape else 1) and r == min(n, m, rank)
  # boundary: (4+4)*1*2 = 16 == 16 is not < 16
  assert not leaf_plan({"x": jnp.zeros((4, 4))}, jc.PowerSGD(rank=1))[0][3]
  assert leaf_plan({"x": jnp.zeros((4, 4))}, jc.PowerSGD(rank=1, min_compression_rate=1.9))[0][3]


def test_start_iter():
  """Calls before start_iter sum every leaf uncompressed and leave Q and E alone (the step
  counter counts); the first compressed call matches the reference from the initial Q."""
  shapes = {"a": (16, 12), "b": (16,)}
  comp = jc.PowerSGD(rank=1, start_iter=2)
  one, state = stacked_state(comp, shapes)
  fn = runner(comp, shapes)
  q0 = np.asarray(one["leaves"]["['a']"]["q"])
  for step in range(2):
    g = grads(shapes, seed=10 + step)
    out, state, _ = fn(g, state)
    np.testing.assert_allclose(out["a"][0], g["a"].sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state["leaves"]["['a']"]["q"][3], q0)
    np.testing.assert_array_equal(state["leaves"]["['a']"]["error"], 0)
    assert int(state["step"][0]) == step + 1
  g = grads(shapes, seed=12)
  out, state, _ = fn(g, state)
  a, _, _ = ref_step(list(np.asarray(g["a"], np.float64)), q0, [np.zeros((16, 12))] * W)
  np.testing.assert_allclose(np.asarray(out["a"][0]) / W, a, rtol=1e-4, atol=1e-5)


def test_without_warm_start_and_error_feedback():
  """warm_start=False redraws Q from the call's key (required); error_feedback=False keeps no E."""
  shapes = {"a": (16, 12)}
  comp = jc.PowerSGD(rank=2, start_iter=0, warm_start=False, error_feedback=False)
  assert comp.needs_key
  one, state = stacked_state(comp, shapes)
  assert set(one["leaves"]["['a']"]) == {"q"}
  g = grads(shapes, seed=5)
  key = jax.random.key(7)
  out, state, _ = runner(comp, shapes, key=True)(g, state, key)
  q = jax.random.normal(jax.random.fold_in(key, 0), (12, 2), jnp.float32)
  a, q1, _ = ref_step(list(g["a"]), np.asarray(q), [0] * W, error_feedback=False)
  np.testing.assert_allclose(np.asarray(out["a"][0]) / W, a, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="key"):
    runner(comp, shapes)(g, state)


def test_seed_draws_q_identically():
  shapes = {"a": (16, 12)}
  comp = jc.PowerSGD()
  q = lambda seed: np.asarray(stacked_state(comp, shapes, seed=seed)[0]["leaves"]["['a']"]["q"])
  assert q(0).dtype == np.float32 and q(0).shape == (12, 1)
  np.testing.assert_array_equal(q(0), q(0))
  assert not np.array_equal(q(0), q(1))


def test_nonfinite_gradient_leaves_no_trace():
  """A NaN in one rank's compressed leaf: that leaf is NaN on every rank, the other leaves are
  summed, every rank's state (step included) comes back bit for bit, nonfinite counts it; the
  next finite call gives the bits it would have given without it."""
  shapes = {"a": (16, 12), "c": (8, 3, 3, 3), "b": (16,)}
  comp = jc.PowerSGD(rank=1, start_iter=0)
  _, state = stacked_state(comp, shapes)
  fn = runner(comp, shapes)
  _, state, _ = fn(grads(shapes, 20), state)
  g = grads(shapes, 21)
  clean_out, clean_state, _ = fn(g, state)
  bad = {k: v.copy() for k, v in g.items()}
  bad["a"][5, 3, 4] = np.inf
  out, new_state, rep = fn(bad, state)
  assert np.isnan(np.asarray(out["a"])).all()
  assert np.isfinite(np.asarray(out["c"])).all() and np.isfinite(np.asarray(out["b"])).all()
  assert int(rep["nonfinite"][0]) == 1
  for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
    np.testing.assert_array_equal(x, y)
  again, again_state, _ = fn(g, new_state)
  for x, y in zip(jax.tree.leaves((again, again_state)), jax.tree.leaves((clean_out, clean_state))):
    np.testing.assert_array_equal(x, y)


def test_empty_leaves_pass_through():
  comp = jc.PowerSGD(rank=1, start_iter=0)

  def body(g):
    g = g[0]
    tree = {"e0": g[:0, 0] * 2, "e1": jnp.zeros((3, 0), jnp.float32) + g[0, 0], "a": g}
    out, _, _ = jc.sync_with_bytes(tree, "r", comp, topology="allreduce")
    assert out["e0"].shape == (0,) and out["e1"].shape == (3, 0)
    return out["a"][None]
  g = grads({"a": (16, 12)})["a"]
  out = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=P("r"), out_specs=P("r")))(g)
  np.testing.assert_allclose(np.asarray(out[0]) / W, ref_step(
      list(g), np.asarray(stacked_state(comp, {"a": (16, 12)})[0]["leaves"]["['a']"]["q"]),
      [0] * W)[0], rtol=1e-4, atol=1e-5)

  def alone(g):
    out, _, rep = jc.sync_with_bytes({"e": g[0, :0]}, "r", comp, topology="allreduce")
    assert out["e"].shape == (0, 12)
    return rep["wire_bytes"][None]
  jaxpr = str(jax.make_jaxpr(jax.shard_map(alone, mesh=mesh(), in_specs=P("r"),
                                           out_specs=P("r")))(g))
  assert not re.search("psum|ppermute|all_gather|all_to_all", jaxpr), jaxpr


def test_one_line_errors():
  def trace(comp, topology):
    def body(g):
      return jc.sync({"a": g[0]}, "r", comp, topology=topology)[0]["a"][None]
    jax.eval_shape(jax.shard_map(body, mesh=mesh(), in_specs=P("r"), out_specs=P("r")),
                   jax.ShapeDtypeStruct((W, 16, 12), jnp.float32))
  for topology in ("ps", "ring"):
    with pytest.raises(ValueError, match="allreduce") as e:
      trace(jc.PowerSGD(), topology)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="allreduce") as e:
      GradSync(compression="powersgd", topology=topology)
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="allreduce") as e:
    trace(jc.get("tbq"), "allreduce")
  assert "\n" not in str(e.value) and "TBQ" in str(e.value)
  with pytest.raises(ValueError, match="allreduce"):
    GradSync(compression="onebit", topology="allreduce")
  with pytest.raises(ValueError, match="allreduce"):
    jc.init_state({"a": jnp.zeros((16, 12))}, jc.PowerSGD(), W, topology="ps")
  with pytest.raises(ValueError, match="rank"):
    jc.PowerSGD(rank=0)
  with pytest.raises(ValueError, match="allreduce"):
    jc.PowerSGD().encode(jnp.zeros(4))
  GradSync(compression="powersgd", topology="allreduce")  # fine


def test_runner_trains_digits(tmp_path):
  """The runner path: config.compression.name=powersgd with topology allreduce trains digits on
  the 8 emulated devices (compressed from step 1), logging finite losses and the wire bytes.
  (In this process: the CLI's flag parsing and exit statuses are tested on experiments.train's
  own process in tests/train/.)"""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from configs import digits  # pylint: disable=g-import-not-at-top
  from jlp.train import loop  # pylint: disable=g-import-not-at-top
  from jlp.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 8
  c = digits.get_config("local")
  c.max_steps, c.log_every, c.eval_every = 3, 1, 0
  c.compression.name, c.compression.topology = "powersgd", "allreduce"
  c.compression.kwargs = ml_collections.ConfigDict({"rank": 2, "start_iter": 1})
  loop.train_and_evaluate(c, str(tmp_path), progress=False)
  rows = [m for m in read_metrics(str(tmp_path)) if "wire_bytes" in m]
  assert len(rows) >= 2 and all(np.isfinite(m["loss"]) for m in rows if "loss" in m)
  assert rows[-1]["wire_bytes"] > 0
  assert rows[-1]["wire_bytes"] < rows[0]["wire_bytes"]  # compressed after the first step
