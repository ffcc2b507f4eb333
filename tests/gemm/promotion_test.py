"""Accumulation with promotion (`promote_every`) against plain-numpy loops written from the spec.

Spec (issue §4; DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv:2412.19437 §3.3.2): k is
split into consecutive runs of n_c products (the last one shorter when n_c does not divide
K); within a run, s = q(fl32(s + q(fl32(a[i,k] * b[k,j])))) from s = +0 (the chunk = 1 plain
step of cpd.md §2.1); at the end of each run, acc = fl32(acc + s) in IEEE float32 (round to
nearest even, gradual underflow) and s restarts at +0; the result is acc.

The references below use numpy float32 operations (IEEE, subnormals kept: numpy does not
flush) and q = `references.round_to_format`, a float64 reference cast of the format. They
never call jlp's accumulation code.
"""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from jlp.formats import FloatFormat
from jlp.gemm import GemmQuant, matmul, qconv, qdot_general
import references as ref

f32 = np.float32
HOPPER = FloatFormat(8, 13, rounding="truncate")   # ~14 significant bits, truncating
E5M2 = FloatFormat.from_name("e5m2")
E4M3 = FloatFormat.from_name("e4m3")


def promoted_loop(a, b, fmt, n_c):
  """The spec above for all (i, j) at once, k in a Python loop; n_c=None: no promotion.

  Without promotion (one run, no float32 addition) this is cpd.md §2.1's plain loop.
  """
  q = lambda v: ref.round_to_format(v, fmt)
  m, k = a.shape
  n = b.shape[1]
  acc = np.zeros((m, n), f32)
  s = np.zeros((m, n), f32)
  with np.errstate(all="ignore"):
    for kk in range(k):
      p = q(a[:, kk, None] * b[None, kk, :])            # float32 products, then cast
      s = q(s + p)
      if n_c is not None and (kk % n_c == n_c - 1 or kk == k - 1):
        acc = acc + s                                   # one IEEE float32 addition
        s = np.zeros((m, n), f32)
  return s if n_c is None else acc


def promoted_sum(terms, fmt, n_c):
  """One output element from its (a, b) terms in order (the spec above, scalar by scalar)."""
  qq = lambda v: ref.round_to_format(np.array([v], f32), fmt)[0]
  acc, s = f32(0), f32(0)
  with np.errstate(all="ignore"):
    for t, (x, y) in enumerate(terms):
      s = qq(f32(s + qq(f32(f32(x) * f32(y)))))
      if t % n_c == n_c - 1 or t == len(terms) - 1:
        acc, s = f32(acc + s), f32(0)
  return acc


def fp8_operands(m, k, n, seed, mean=1.0):
  """e4m3fn-rounded N(mean, 1) data (FP8 inputs as in DeepSeek-V3's GEMMs)."""
  rng = np.random.default_rng(seed)
  e4m3 = lambda x: x.astype(ml_dtypes.float8_e4m3fn).astype(f32)
  return (e4m3(rng.normal(mean, 1.0, (m, k)).astype(f32)),
          e4m3(rng.normal(mean, 1.0, (k, n)).astype(f32)))


@pytest.fixture(scope="module")
def xla_matmul():
  return jax.jit(matmul, static_argnames=("accum", "kahan", "chunk", "promote_every", "impl"))


@pytest.mark.parametrize("k", [1, 5, 127, 128, 129, 300, 384])
def test_hopper_matches_spec_loop(k, xla_matmul):
  """n_c = 128 (DeepSeek-V3), K below, at and past multiples of it: the last run K mod 128."""
  a, b = fp8_operands(3, k, 4, seed=k)
  want = promoted_loop(a, b, HOPPER, 128)
  ref.assert_same_bits(np.asarray(xla_matmul(a, b, accum=HOPPER, promote_every=128, impl="xla")),
                       want, msg=f"K={k}")


# Default: Hopper's format with n_c = 1, 3 (a shorter last run), 50 (one run) and 64 (> K), and
# each other format once (E5M2 at 7, E4M3 at 16, (5, 10) at 3); the other pairs are slow (the
# same branches of the promotion loop, other constants).
_RUNS_DEFAULT = {("HOPPER", 1), ("HOPPER", 3), ("HOPPER", 50), ("HOPPER", 64), ("E5M2", 7),
                 ("E4M3", 16), ("E5M10", 3)}


@pytest.mark.parametrize("n_c,fmt", [
    pytest.param(n_c, fmt, id=f"{fmt!r}-{n_c}",
                 marks=() if (name, n_c) in _RUNS_DEFAULT else pytest.mark.slow)
    for n_c in [1, 3, 7, 16, 50, 64]
    for name, fmt in [("HOPPER", HOPPER), ("E5M2", E5M2), ("E4M3", E4M3),
                      ("E5M10", FloatFormat(5, 10))]])
def test_run_lengths_and_formats_match_spec_loop(fmt, n_c, xla_matmul):
  """K = 50: n_c = 3 and 7 leave shorter last runs, 50 is one run, 64 > K."""
  a, b = fp8_operands(4, 50, 3, seed=n_c, mean=0.3)
  a = a * f32(0.25)  # keeps e4m3's sums of 50 products finite
  want = promoted_loop(a, b, fmt, n_c)
  ref.assert_same_bits(np.asarray(xla_matmul(a, b, accum=fmt, promote_every=n_c, impl="xla")), want)


@pytest.mark.parametrize("k", [300, 1000])
def test_without_promotion_matches_spec_loop_and_differs(k, xla_matmul):
  """promote_every=None is the plain chunk = 1 loop; promotion changes the result at K > 128."""
  a, b = fp8_operands(3, k, 4, seed=k + 1)
  plain = np.asarray(xla_matmul(a, b, accum=HOPPER, impl="xla"))
  ref.assert_same_bits(plain, promoted_loop(a, b, HOPPER, None))
  promoted = np.asarray(xla_matmul(a, b, accum=HOPPER, promote_every=128, impl="xla"))
  assert not np.array_equal(plain, promoted)


def test_one_run_is_the_unpromoted_sum(xla_matmul):
  """n_c >= K: a single run added once to +0, i.e. the unpromoted result (no -0 arises here)."""
  a, b = fp8_operands(3, 40, 5, seed=2)
  plain = np.asarray(xla_matmul(a, b, accum=HOPPER, impl="xla"))
  for n_c in (40, 41, 10_000):
    ref.assert_same_bits(np.asarray(xla_matmul(a, b, accum=HOPPER, promote_every=n_c, impl="xla")),
                         plain, msg=f"n_c={n_c}")


def test_promotion_reduces_the_error():
  """Positive-mean FP8 data, K = 2048: the error against float64 drops by more than 10x."""
  a, b = fp8_operands(4, 2048, 4, seed=5)
  exact = a.astype(np.float64) @ b.astype(np.float64)
  err = lambda c: np.max(np.abs(np.asarray(c, np.float64) - exact) / np.abs(exact))
  plain = err(matmul(a, b, accum=HOPPER, impl="xla"))
  promoted = err(matmul(a, b, accum=HOPPER, promote_every=128, impl="xla"))
  assert plain > 10 * promoted, (plain, promoted)


def test_float32_promotion_keeps_subnormals():
  """The promotion additions are IEEE float32 with gradual underflow, on XLA:CPU as well.

  Runs of one product (n_c = 1) with a float32-exact accum: acc = x, then x - 2^-126 = 2^-149
  (a subnormal result; flushing gives 0), then 2^-149 + 2^-126 (a subnormal operand; flushing
  gives 2^-126), then - 2^-126 (back to 2^-149).
  """
  t = 2.0 ** -126
  col = np.array([t * (1 + 2.0 ** -23), -t, t, -t], f32)
  a = np.stack([col, -col])
  b = np.ones((4, 1), f32)
  want = promoted_loop(a, b, FloatFormat(8, 23), 1)
  assert want[0, 0] == f32(2.0 ** -149) and want[1, 0] == -f32(2.0 ** -149)  # numpy keeps them
  for impl in ("xla", "pallas"):
    ref.assert_same_bits(np.asarray(matmul(a, b, accum=FloatFormat(8, 23), promote_every=1,
                                           impl=impl)), want, msg=impl)


def test_vmap_and_names():
  a, b = fp8_operands(2 * 3, 20, 4, seed=6)
  a3, b3 = a.reshape(2, 3, 20), np.stack([b, -b])
  # jitted: one compile (eagerly, each op of the vmapped loop compiles on its own)
  got = np.asarray(jax.jit(jax.vmap(lambda x, y: matmul(x, y, accum="e5m2", promote_every=6)))(
      a3, b3))
  for i in range(2):
    ref.assert_same_bits(got[i], promoted_loop(a3[i], b3[i], E5M2, 6), msg=f"batch {i}")


@pytest.mark.parametrize("kwargs,match", [
    (dict(promote_every=0), r"promote_every=0 is not allowed; expected None or an int >= 1"),
    (dict(promote_every=-128), r"promote_every=-128 is not allowed"),
    (dict(promote_every=128.0), r"promote_every=128.0 is not allowed"),
    (dict(promote_every=True), r"promote_every=True is not allowed"),
    (dict(promote_every="128"), r"promote_every='128' is not allowed"),
    (dict(promote_every=128, kahan=True), r"kahan=True is not allowed; expected False with "
                                          r"promote_every=128"),
    (dict(promote_every=128, chunk=4), r"chunk=4 is not allowed; expected 1 with promote_every=128"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_promote_every(kwargs, match):
  a, b = fp8_operands(2, 3, 2, seed=0)
  with pytest.raises(ValueError, match=match):
    matmul(a, b, accum=HOPPER, **kwargs)
  if "chunk" not in kwargs:  # the kernel has the same checks
    from pallas_kernels.accum_matmul import accum_matmul  # pylint: disable=g-import-not-at-top
    with pytest.raises(ValueError, match=match):
      accum_matmul(a, b, HOPPER, interpret=True, **kwargs)


# ----------------------------------------------------------------------------- GemmQuant, layers


@pytest.mark.parametrize("kwargs,match", [
    (dict(promote_every=128), r"promote_every=128 is not allowed with accum=None; expected"),
    (dict(accum=HOPPER, promote_every=0), r"promote_every=0 is not allowed"),
    (dict(accum=HOPPER, promote_every=2.5), r"promote_every=2.5 is not allowed"),
    (dict(accum=HOPPER, kahan=True, promote_every=128), r"kahan=True is not allowed; expected False"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_gemmquant_validates_promote_every(kwargs, match):
  with pytest.raises(ValueError, match=match):
    GemmQuant(**kwargs)


def test_gemmquant_is_static():
  """Frozen and hashable, equal configs hash alike; from_dict / replace know the field."""
  cfg = GemmQuant(accum=HOPPER, promote_every=128)
  assert cfg == GemmQuant.from_dict({"accum": HOPPER, "promote_every": 128})
  assert hash(cfg) == hash(GemmQuant(accum=FloatFormat(8, 13, rounding="truncate"), promote_every=128))
  assert cfg != cfg.replace(promote_every=64) and cfg.replace(promote_every=None).promote_every is None
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.promote_every = 1  # type: ignore[misc]


def _vjp(f, x, w, g):
  y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
  return (y,) + vjp(jnp.asarray(g))


def test_dense_layer_and_gradients_match_loops():
  """(B, in)·(in, out) under jit: forward K = in = 7 (runs 3, 3, 1), dgrad K = out = 4 (3, 1),
  wgrad K = B = 5 (3, 2), each output element the spec's promoted sum (cpd.md §2.3 K orders)."""
  x, w = fp8_operands(5, 7, 4, seed=8, mean=0.5)
  g = fp8_operands(5, 4, 1, seed=9)[0]
  n_c = 3
  cfg = GemmQuant(accum=E5M2, promote_every=n_c)
  f = jax.jit(lambda a, b: qdot_general(a, b, (((1,), (0,)), ((), ())), cfg))
  y, dx, dw = _vjp(f, x, w, g)
  ry = [[promoted_sum([(x[i, k], w[k, j]) for k in range(7)], E5M2, n_c) for j in range(4)]
        for i in range(5)]
  rdx = [[promoted_sum([(g[i, o], w[k, o]) for o in range(4)], E5M2, n_c) for k in range(7)]
         for i in range(5)]
  rdw = [[promoted_sum([(x[b, k], g[b, j]) for b in range(5)], E5M2, n_c) for j in range(4)]
         for k in range(7)]
  for name, got, want in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
    ref.assert_same_bits(np.asarray(got), np.array(want, f32), msg=name)


def _qdot_test_module():
  path = os.path.join(os.path.dirname(__file__), "qdot_test.py")
  spec = importlib.util.spec_from_file_location("_promotion_qdot_test", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_conv_and_gradients_match_loops():
  """Strided, padded, dilated NHWC conv: forward K (c, kh, kw) = 12, wgrad K (n, oh, ow) = 12,
  dgrad K o = 3; each element the promoted sum with n_c = 5 (qdot_test's im2col loops, their
  per-element sum replaced by this file's `promoted_sum`)."""
  loops = _qdot_test_module()
  n_c = 5
  loops.acc_sum = lambda terms, fmt, kahan: promoted_sum(terms, fmt, n_c)
  rng = np.random.default_rng(10)
  x = rng.standard_normal((2, 5, 4, 2)).astype(f32)
  w = rng.standard_normal((2, 3, 2, 3)).astype(f32)
  stride, pad, dil = (2, 1), ((1, 1), (2, 0)), (1, 2)
  kw = dict(window_strides=stride, padding=pad, rhs_dilation=dil,
            dimension_numbers=("NHWC", "HWIO", "NHWC"))
  g = rng.standard_normal(jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kw),
                                         x, w).shape).astype(f32)
  cfg = GemmQuant(accum=E4M3, promote_every=n_c)
  got = _vjp(jax.jit(lambda a, b: qconv(a, b, cfg=cfg, **kw)), x, w, g)
  want = loops.conv_loops(x, w, g, stride, pad, dil, E4M3, False)
  for name, gt, wt in zip(("y", "dx", "dw"), got, want, strict=True):
    ref.assert_same_bits(np.asarray(gt), wt, msg=name)
