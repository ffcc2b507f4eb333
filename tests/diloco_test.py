"""jlp.sync.DiLoCo (DiLoCo and Streaming DiLoCo) on 8 emulated devices, against numpy models of the
rules (DiLoCo, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512), written from them:

  inner step n = 1, 2, ...: p_r <- p_r - lr * g_r (inner SGD) on every replica r;
  fragment f (leaves cut as `fragment_bounds` documents) syncs after step n iff
  (n - (f * H) // P) % H == 0: Delta = mean_r (outer - p_r), outer <- outer - lr_o * Delta
  (outer SGD), and tau steps later p_r <- alpha * p_r + (1 - alpha) * outer (assigned for alpha=0).

Where a test asks for bits (data-parallel SGD, FedAvg), the values lie on a coarse binary grid,
so that every float32 operation of both sides is exact and the algebraic identity holds bit for
bit."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jlp.diloco import DiLoCo as DiLoCoDirect
from jlp.diloco import fragment_bounds
from jlp.sync import DiLoCo, GradSync

pytestmark = pytest.mark.usefixtures("fast_compile")

W = 8
SHAPES = [(3, 4), (5,), (7,), (2, 3), (4,)]  # 12, 5, 7, 6, 4 elements: N = 34


def _mesh():
  return Mesh(np.array(jax.devices()[:W]), ("data",))


@functools.lru_cache(maxsize=None)
def _runner(d, steps, check_vma=True):
  """Step 1 traced on its own (from the replicated params `init` sees), steps 2..T as one
  lax.scan over the carried (params, state): the step's syncs and merges are lax.conds on the
  traced step count, so one traced step serves them all (compile time no longer grows with T).
  check_vma=False: as jlp.train's step runs its shard_map."""
  def step(carry, grads_t):
    params, state = d.step(carry[0], grads_t, carry[1], axis_name="data")
    return (params, state), (params, state.wire_bytes)

  def body(params, grads):
    grads = [g[:, 0] for g in grads]
    carry, first = step((params, d.init(params)), [g[0] for g in grads])
    (_, state), rest = lax.scan(step, carry, [g[1:] for g in grads])
    hist = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b])[None], first, rest)
    return hist, jax.tree.map(lambda x: x[None], state)
  return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P(), P(None, "data")),
                               out_specs=P("data"), check_vma=check_vma))


def run(d, params, grads):
  """(per step: params [W, T, ...] per leaf, wire bytes [W, T]; final state [W, ...])."""
  (hist_params, hist_bytes), state = _runner(d, grads[0].shape[0])(params, grads)
  return [np.asarray(x) for x in hist_params], np.asarray(hist_bytes), state


def grid_data(steps, seed=0):
  """params on the grid k/8 and per-replica gradients [T, W, ...] on k/16 (small k)."""
  rng = np.random.default_rng(seed)
  params = [(rng.integers(-64, 65, s) / 8).astype(np.float32) for s in SHAPES]
  grads = [(rng.integers(-4, 5, (steps, W) + s) / 16).astype(np.float32) for s in SHAPES]
  return params, grads


def random_data(steps, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
  grads = [(rng.standard_normal((steps, W) + s) * scale).astype(np.float32) for s in SHAPES]
  return params, grads


def _ceil_log2(m):
  mant, ex = np.frexp(np.float64(m))
  return int(ex - 1) if mant == 0.5 else int(ex)


def model(params, grads, *, inner_lr, outer_lr, period, fragments_leaves, tau=0, alpha=0.0,
          quant=None):
  """The numpy model: per step, every replica's params. fragments_leaves: the leaf indices of
  each fragment (hand-written from the splitting rule). quant: (cast, emax) to send Delta as a
  format's values with one power-of-two scale per fragment."""
  steps = grads[0].shape[0]
  n_frag = len(fragments_leaves)
  p = [[x.copy() for x in params] for _ in range(W)]
  outer = [x.copy() for x in params]
  merge_at = {}
  hist = []
  lr, lr_o = np.float32(inner_lr), np.float32(outer_lr)
  for n in range(1, steps + 1):
    for r in range(W):
      p[r] = [x - lr * g[n - 1, r] for x, g in zip(p[r], grads)]
    for f, leaves in enumerate(fragments_leaves):
      off = (f * period) // n_frag
      if (n - off) % period == 0:
        deltas = [[outer[i] - p[r][i] for i in leaves] for r in range(W)]
        if quant is None:
          sums = [functools.reduce(lambda a, b: a + b, [deltas[r][k] for r in range(W)])
                  for k in range(len(leaves))]
          means = [s / np.float32(W) for s in sums]
        else:
          cast, emax = quant
          m = max(float(np.max(np.abs(d))) for dr in deltas for d in dr)
          factor = np.float32(2.0 ** np.clip(emax - _ceil_log2(m), -126, 126))
          sent = [[cast(d * factor) for d in dr] for dr in deltas]
          sums = [functools.reduce(lambda a, b: a + b, [sent[r][k] for r in range(W)])
                  for k in range(len(leaves))]
          means = [(s / factor) / np.float32(W) for s in sums]
        for i, mean in zip(leaves, means):
          outer[i] = outer[i] + (-lr_o) * mean
        merge_at[f] = n + tau
      if merge_at.get(f) == n:
        for r in range(W):
          for i in leaves:
            p[r][i] = (outer[i].copy() if alpha == 0 else
                       np.float32(alpha) * p[r][i] + np.float32(1 - alpha) * outer[i])
    hist.append([[x.copy() for x in pr] for pr in p])
  return hist  # [T][W][leaf]


def assert_matches(got, want, exact=True):
  for t in range(len(want)):
    for r in range(W):
      for i in range(len(SHAPES)):
        if exact:
          np.testing.assert_array_equal(got[i][r, t], want[t][r][i], err_msg=f"t={t} r={r} i={i}")
        else:
          np.testing.assert_allclose(got[i][r, t], want[t][r][i], rtol=2e-6, atol=2e-6,
                                     err_msg=f"t={t} r={r} i={i}")


def test_fragments_split_by_leaf_order_into_about_equal_sizes():
  sizes = [int(np.prod(s)) for s in SHAPES]  # 12, 5, 7, 6, 4
  assert fragment_bounds(sizes, 1) == (0, 5)
  assert fragment_bounds(sizes, 2) == (0, 2, 5)  # 17 | 17
  assert fragment_bounds(sizes, 4) == (0, 1, 2, 3, 5)  # 12 | 5 | 7 | 10
  assert fragment_bounds([100, 1, 1], 3) == (0, 1, 2, 3)  # never an empty fragment
  with pytest.raises(ValueError, match="fragments"):
    fragment_bounds([3, 3], 3)


def test_period_one_is_data_parallel_sgd_bit_for_bit():
  params, grads = grid_data(5)
  d = DiLoCo(optax.sgd(0.5), optax.sgd(1.0), period=1)
  got, _, _ = run(d, params, grads)
  p = [x.copy() for x in params]
  for t in range(5):
    p = [x - np.float32(0.5) * (g[t].sum(0) / np.float32(W)) for x, g in zip(p, grads)]
    for i in range(len(SHAPES)):
      for r in range(W):
        np.testing.assert_array_equal(got[i][r, t], p[i])


def test_outer_sgd_lr_one_is_fedavg_bit_for_bit():
  params, grads = grid_data(9, seed=1)
  d = DiLoCo(optax.sgd(0.5), optax.sgd(1.0), period=3)
  got, _, _ = run(d, params, grads)
  p = [[x.copy() for x in params] for _ in range(W)]
  for t in range(9):
    p = [[x - np.float32(0.5) * g[t, r] for x, g in zip(p[r], grads)] for r in range(W)]
    if (t + 1) % 3 == 0:  # FedAvg: the replicas' params averaged
      avg = [sum(p[r][i] for r in range(W)) / np.float32(W) for i in range(len(SHAPES))]
      p = [[a.copy() for a in avg] for _ in range(W)]
    for r in range(W):
      for i in range(len(SHAPES)):
        np.testing.assert_array_equal(got[i][r, t], p[r][i], err_msg=f"t={t} r={r} i={i}")


def test_delta_sign_moves_outer_params_toward_the_replicas_mean():
  """Delta = outer - local: outer SGD with lr 0.5 lands halfway between the old outer params
  and the replicas' mean (the flipped sign, local - outer, would move away from it)."""
  params, grads = grid_data(2, seed=2)
  d = DiLoCo(optax.sgd(0.5), optax.sgd(0.5), period=2)
  got, _, state = run(d, params, grads)
  for i in range(len(SHAPES)):
    local = [params[i] - np.float32(0.5) * grads[i][0, r] - np.float32(0.5) * grads[i][1, r]
             for r in range(W)]
    mean = sum(local) / np.float32(W)
    want = params[i] + np.float32(0.5) * (mean - params[i])
    np.testing.assert_array_equal(np.asarray(state.outer_params[i])[0], want)
    np.testing.assert_array_equal(got[i][:, 1], np.broadcast_to(want, got[i][:, 1].shape))
    moved = np.abs(want - mean) <= np.abs(params[i] - mean)
    assert moved.all()
    assert (np.abs(want - mean) < np.abs(params[i] - mean)).any()


# outer_lr=1.0 runs in the slow tier: test_outer_sgd_lr_one_is_fedavg_bit_for_bit takes the same
# path (one fragment, outer SGD with lr 1) bit for bit.
@pytest.mark.parametrize("outer_lr", [pytest.param(1.0, marks=pytest.mark.slow), 0.7])
def test_diloco_matches_the_numpy_model(outer_lr):
  params, grads = random_data(8, seed=3)
  d = DiLoCo(optax.sgd(0.1), optax.sgd(outer_lr), period=4)
  got, nbytes, _ = run(d, params, grads)
  want = model(params, grads, inner_lr=0.1, outer_lr=outer_lr, period=4,
               fragments_leaves=[[0, 1, 2, 3, 4]])
  assert_matches(got, want)
  n = sum(int(np.prod(s)) for s in SHAPES)
  np.testing.assert_array_equal(nbytes[0], [0, 0, 0, 4 * 7 * n, 0, 0, 0, 4 * 7 * n])


def test_replicas_are_bit_identical_after_an_outer_step_with_nesterov():
  params, grads = random_data(6, seed=4)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  d = DiLoCo(optax.adamw(1e-2), outer, period=3)
  got, _, state = run(d, params, grads)
  for i in range(len(SHAPES)):
    for t in (2, 5):
      for r in range(W):
        np.testing.assert_array_equal(got[i][r, t], np.asarray(state.outer_params[i])[0]
                                      if t == 5 else got[i][0, t])
    assert not np.array_equal(got[i][0, 1], got[i][1, 1])  # local steps differ in between


def test_inner_states_stay_per_replica():
  params, grads = random_data(4, seed=5)
  d = DiLoCo(optax.sgd(0.1, momentum=0.9), optax.sgd(1.0), period=2)
  _, _, state = run(d, params, grads)
  trace = state.inner_state[0].trace
  for i in range(len(SHAPES)):
    for r in range(W):
      t = np.zeros(SHAPES[i], np.float32)
      for s in range(4):  # optax's trace: g + 0.9 * t, over this replica's gradients only
        t = grads[i][s, r] + np.float32(0.9) * t
      np.testing.assert_allclose(np.asarray(trace[i])[r], t, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(np.asarray(trace[i])[0], np.asarray(trace[i])[1])


@pytest.mark.parametrize("fragments, leaves", [(2, [[0, 1], [2, 3, 4]]),
                                               (4, [[0], [1], [2], [3, 4]])])
def test_streaming_fragments_sync_at_their_own_steps(fragments, leaves):
  # 8 steps: every fragment syncs twice (with 4 fragments at steps 1-4 and 5-8).
  params, grads = random_data(8, seed=6)
  d = DiLoCo(optax.sgd(0.1), optax.sgd(0.7), period=4, fragments=fragments)
  got, nbytes, _ = run(d, params, grads)
  want = model(params, grads, inner_lr=0.1, outer_lr=0.7, period=4, fragments_leaves=leaves)
  assert_matches(got, want)
  sizes = [sum(int(np.prod(SHAPES[i])) for i in f) for f in leaves]
  expect = np.zeros(8)
  for f, size in enumerate(sizes):
    off = (f * 4) // fragments
    for n in range(1, 9):
      if (n - off) % 4 == 0:
        expect[n - 1] += 4 * 7 * size
  np.testing.assert_array_equal(nbytes[0], expect)
  assert d.wire_bytes(params, W, 4) == 4 * 7 * sizes[0]
  # Between its syncs a fragment differs across replicas; right after one it does not.
  for f, fl in enumerate(leaves):
    n = (f * 4) // fragments or 4
    for i in fl:
      np.testing.assert_array_equal(got[i][0, n - 1], got[i][3, n - 1])


# (2, 0.5) runs in the slow tier: (1, 0.0) keeps the merge tau > 0 steps later, (0, 0.5) the
# alpha blend, and test_same_bits_without_check_vma the blend tau = 1 step later.
@pytest.mark.parametrize("tau, alpha", [(1, 0.0), pytest.param(2, 0.5, marks=pytest.mark.slow),
                                        (0, 0.5)])
def test_overlap_merges_tau_steps_later_with_alpha(tau, alpha):
  # 8 steps: fragment 1 syncs at steps 2 and 6, fragment 0 at 4 and 8 (each merged tau later).
  params, grads = random_data(8, seed=7)
  d = DiLoCo(optax.sgd(0.1), optax.sgd(0.7), period=4, fragments=2, overlap=tau, alpha=alpha)
  got, _, _ = run(d, params, grads)
  want = model(params, grads, inner_lr=0.1, outer_lr=0.7, period=4,
               fragments_leaves=[[0, 1], [2, 3, 4]], tau=tau, alpha=alpha)
  assert_matches(got, want, exact=alpha == 0.0)


@pytest.mark.parametrize("name, dtype", [("e4m3", ml_dtypes.float8_e4m3),
                                         ("float4_e2m1fn", ml_dtypes.float4_e2m1fn)])
def test_outer_format_sends_scaled_format_values(name, dtype):
  # Tiny gradients: an unscaled Delta (~1e-7) would round to zero in either format. Six steps:
  # fragment 1 syncs at steps 2 and 6 (the second time from moved outer params), fragment 0 at 4.
  params, grads = random_data(6, seed=8, scale=1e-6)
  d = DiLoCo(optax.sgd(0.1), optax.sgd(1.0), period=4, fragments=2, outer_format=name)
  got, nbytes, _ = run(d, params, grads)
  emax = {"e4m3": 7, "float4_e2m1fn": 2}[name]

  def cast(x):
    return x.astype(dtype).astype(np.float32)
  want = model(params, grads, inner_lr=0.1, outer_lr=1.0, period=4,
               fragments_leaves=[[0, 1], [2, 3, 4]], quant=(cast, emax))
  assert_matches(got, want)
  assert not np.array_equal(got[0][0, 3], params[0])  # the outer step moved the params
  # A fragment's 17 codes as one vector: one byte each for e4m3, two to a byte for e2m1.
  per = 7 * (17 if name == "e4m3" else 9)
  np.testing.assert_array_equal(nbytes[0], [0, per, 0, per, 0, per])
  hlo = _runner(d, 6).lower(params, grads).as_text()
  gathered = hlo.split("all_gather", 1)[1][:400]
  assert "all_gather" in hlo and f"{W}x{17 if name == 'e4m3' else 9}xui8" in gathered


def test_outer_sync_gradsync_packed_aps():
  params, grads = random_data(4, seed=9)
  sync = GradSync(fmt="e5m2", aps=True)
  assert sync.packed
  d = DiLoCo(optax.sgd(0.1), optax.sgd(1.0), period=4, outer_sync=sync)
  got, nbytes, state = run(d, params, grads)
  # The APS sum (per leaf: scale by 2^(emax - ceil(log2(max|Delta| * W))), cast, fold in rank
  # order with a cast after each add, unscale), then / W.
  cast = lambda x: x.astype(ml_dtypes.float8_e5m2).astype(np.float32)  # noqa: E731
  local = [[params[i] - np.float32(0.1) * grads[i][0, r] for i in range(5)] for r in range(W)]
  for s in range(1, 4):
    local = [[local[r][i] - np.float32(0.1) * grads[i][s, r] for i in range(5)] for r in range(W)]
  for i in range(len(SHAPES)):
    deltas = [params[i] - local[r][i] for r in range(W)]
    m = max(float(np.max(np.abs(x))) for x in deltas) * W
    f = np.float32(2.0 ** (15 - _ceil_log2(np.float32(m))))
    acc = cast(deltas[0] * f)
    for r in range(1, W):
      acc = cast(acc + cast(deltas[r] * f))
    want = params[i] + (-np.float32(1.0)) * ((acc / f) / np.float32(W))
    np.testing.assert_array_equal(got[i][:, 3], np.broadcast_to(want, got[i][:, 3].shape))
  n = sum(int(np.prod(s)) for s in SHAPES)
  assert nbytes[0, 3] == 7 * n and d.fragment_wire_bytes(params, W) == (7 * n,)


def test_average_state_averages_model_state_at_outer_steps():
  d = DiLoCo(optax.sgd(0.1), optax.sgd(1.0), period=2, average_state=True)
  keep = DiLoCo(optax.sgd(0.1), optax.sgd(1.0), period=2)
  ms = np.arange(W * 3, dtype=np.float32).reshape(W, 3)

  def body(ms, step):
    state = d.init([jnp.zeros(2)])._replace(step=step)
    return d.sync_model_state(ms, state), keep.sync_model_state(ms, state)
  fn = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P("data"), P()),
                             out_specs=P("data")))
  avg, same = fn(ms, jnp.int32(2))
  np.testing.assert_array_equal(np.asarray(avg), np.broadcast_to(ms.sum(0) / np.float32(W),
                                                                 ms.shape))
  np.testing.assert_array_equal(np.asarray(same), ms)
  avg, _ = fn(ms, jnp.int32(3))
  np.testing.assert_array_equal(np.asarray(avg), ms)


def test_hashable_static_argument_and_validation():
  inner, outer = optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True)
  a = DiLoCo(inner, outer, period=4, fragments=2, outer_format="e4m3")
  b = DiLoCo(inner, outer, period=4, fragments=2, outer_format="e4m3")
  assert a == b and hash(a) == hash(b) and DiLoCo is DiLoCoDirect
  for kwargs, field in [(dict(period=0), "period"), (dict(period=2, fragments=3), "fragments"),
                        (dict(period=2, overlap=2), "overlap"), (dict(period=2, alpha=1.5),
                                                                  "alpha"),
                        (dict(period=2, outer_format="e8m23"), "outer_format"),
                        (dict(period=2, outer_sync="ring"), "outer_sync"),
                        (dict(period=2, outer_sync=GradSync(), outer_format="e4m3"),
                         "outer_format")]:
    with pytest.raises(ValueError, match=field):
      DiLoCo(inner, outer, **kwargs)


def test_same_bits_without_check_vma():
  """jlp.train's step runs its shard_map with check_vma=False: the same bits there, at every
  step. Three steps: fragment 1 syncs at steps 1 and 3 and is blended at step 2, fragment 0
  syncs at step 2 and is blended at step 3."""
  params, grads = random_data(3, seed=10)
  d = DiLoCo(optax.adamw(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True), period=2,
             fragments=2, overlap=1, alpha=0.5, outer_format="e2m1")
  # Both runs as one program: one compile (and one dispatch) instead of two.
  both = jax.jit(lambda p, g: (_runner(d, 3)(p, g), _runner(d, 3, check_vma=False)(p, g)))
  (((checked, _), _), ((unchecked, _), _)) = both(params, grads)
  for i, (x, want) in enumerate(zip(unchecked, checked, strict=True)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(want), err_msg=f"leaf {i}")
