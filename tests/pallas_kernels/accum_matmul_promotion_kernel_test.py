"""The accumulating-matmul kernel with promotion (`promote_every`), interpret mode, bit for bit.

References: `jlp.gemm.accum.matmul(..., impl="xla")` (the kernel's XLA twin) for K around the
K block tk (1, tk - 1, tk, tk + 1, 2 tk, 4 tk + 1) and run lengths n_c that divide tk, equal it,
are multiples of it, are neither, or exceed K; and `spec_loop`, a plain-numpy loop written from
the spec (issue §4; DeepSeek-V3, arXiv:2412.19437 §3.3.2): runs of n_c products accumulated as
s = q(fl32(s + q(fl32(a b)))) from +0, each run then added to a float32 accumulator with one
IEEE float32 addition (numpy float32, no flushing), q = `references.round_to_format` (a float64
reference cast). Grids stay at <= 16 steps. The lowering tier lowers the kernel for cuda under
an abstract H100 (kernel_lowering_test.py).
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.formats import FloatFormat
from jlp.gemm.accum import matmul
from pallas_kernels.accum_matmul import accum_matmul
import references as ref

f32 = np.float32
TK = 4  # tile_k in these tests
HOPPER = FloatFormat(8, 13, rounding="truncate")
E5M2 = FloatFormat.from_name("e5m2")


def spec_loop(a, b, fmt, n_c):
  """The spec above for all (i, j) at once."""
  q = lambda v: ref.round_to_format(v, fmt)
  m, k = a.shape
  acc = np.zeros((m, b.shape[1]), f32)
  s = np.zeros_like(acc)
  with np.errstate(all="ignore"):
    for kk in range(k):
      s = q(s + q(a[:, kk, None] * b[None, kk, :]))
      if kk % n_c == n_c - 1 or kk == k - 1:
        acc, s = acc + s, np.zeros_like(s)
  return acc


def operands(m, k, n, seed, scale=4.0):
  rng = np.random.default_rng(seed)
  return ((rng.standard_normal((m, k)) * scale).astype(f32),
          (rng.standard_normal((k, n)) + 0.5).astype(f32))


# Jitted: one compile per case instead of one per eager op (pads, zeros, scans, slices).
_kernel_jit = jax.jit(accum_matmul, static_argnums=2,
                      static_argnames=("promote_every", "interpret", "tile_k", "tile_m", "tile_n"))
_xla_jit = jax.jit(matmul, static_argnames=("accum", "promote_every", "impl"))


def kernel(a, b, fmt, n_c, **tiles):
  return np.asarray(_kernel_jit(a, b, fmt, promote_every=n_c, interpret=True,
                                **dict(dict(tile_k=TK), **tiles)))


def xla(a, b, fmt, n_c):
  return np.asarray(_xla_jit(a, b, accum=fmt, promote_every=n_c, impl="xla"))


KS = [1, TK - 1, TK, TK + 1, 2 * TK, 4 * TK + 1]


# Each K once in the default tier: runs of 2 tk at K = 1 (one padded K block), tk and 2 tk (whole
# blocks), runs of 3 at K = tk - 1, tk + 1 and 4 tk + 1 (padded, one and several blocks); the
# other (K, n_c) pairs are slow.
_EVERY_K_DEFAULT = {(1, 2 * TK), (TK, 2 * TK), (2 * TK, 2 * TK),
                    (TK - 1, 3), (TK + 1, 3), (4 * TK + 1, 3)}


@pytest.mark.parametrize("k,n_c", [
    pytest.param(k, n_c, id=f"{n_c}-{k}",
                 marks=() if (k, n_c) in _EVERY_K_DEFAULT else pytest.mark.slow)
    # run ends tested at every step / once per K block
    for n_c in [3, 2 * TK] for k in KS])
def test_matches_xla_for_every_k(k, n_c):
  a, b = operands(5, k, 6, seed=k * 7 + n_c)
  ref.assert_same_bits(kernel(a, b, HOPPER, n_c), xla(a, b, HOPPER, n_c), msg=f"K={k}")


@pytest.mark.parametrize("n_c,fmt", [
    (1, HOPPER),
    (TK // 2, E5M2),                                   # tk a multiple of n_c
    (TK, FloatFormat.from_name("e4m3")),               # n_c == tk
    (3 * TK, HOPPER),                                  # a multiple of tk, last run shorter
    (5, FloatFormat(5, 10)),                           # neither
    (100, HOPPER),                                     # one run, longer than K
], ids=str)
def test_run_lengths_and_formats_match_spec_loop(n_c, fmt):
  """K = 4 tk + 1 = 17: four full K blocks and a partial one."""
  a, b = operands(3, 4 * TK + 1, 4, seed=n_c)
  want = spec_loop(a, b, fmt, n_c)
  ref.assert_same_bits(kernel(a, b, fmt, n_c), want, msg="kernel")
  ref.assert_same_bits(xla(a, b, fmt, n_c), want, msg="xla")


# Slow: n_c = 16 (a multiple of tk, as 2 tk and 3 tk on unpadded tiles); the padding of M and N
# does not depend on the run length.
@pytest.mark.parametrize("n_c", [3, pytest.param(16, marks=pytest.mark.slow)])
def test_padded_grid_matches_xla(n_c):
  """(37, 17) @ (17, 45) in 16 x 16 tiles: grid (3, 3), M, N and K (17 = 4 tk + 1) padded."""
  a, b = operands(37, 4 * TK + 1, 45, seed=n_c, scale=8.0)
  ref.assert_same_bits(kernel(a, b, HOPPER, n_c, tile_m=16, tile_n=16), xla(a, b, HOPPER, n_c))


# Slow: n_c = 2 (a divisor of tk, as in test_run_lengths_and_formats_match_spec_loop); runs of one
# product and runs ending at every third step stay in the default tier.
@pytest.mark.parametrize("n_c", [1, 3, pytest.param(2, marks=pytest.mark.slow)])
def test_specials_signed_zeros_and_subnormals_match_xla(n_c):
  """±0, ±inf, NaN, and float32 promotions whose sums or operands are float32 subnormals."""
  t = 2.0 ** -126
  a, b = operands(6, 9, 5, seed=3)
  a[0] = [-0.0] * 9
  a[1, 4], a[2, 7], a[3, 2], a[3, 8] = np.inf, np.nan, -np.inf, np.inf
  a[4] = [t * (1 + 2.0 ** -23), -t, t, -t, 0.0, t, -t * (1 + 2.0 ** -22), t, -t]
  b[:, 0] = 1.0
  fmt = FloatFormat(8, 23)
  got = kernel(a, b, fmt, n_c)
  ref.assert_same_bits(got, xla(a, b, fmt, n_c), msg=f"n_c={n_c}")
  if n_c == 1:
    # Runs of one product: the promotions of row 4, column 0 pass through 2^-149 and
    # 2^-126 + 2^-149 (float32 subnormal sum and operand), as IEEE float32 has it.
    ref.assert_same_bits(got[4:5, :1], spec_loop(a[4:5], b[:, :1], fmt, 1))


def test_under_jit_and_vmap():
  a, b = operands(2 * 5, TK + 3, 6, seed=4)
  a, b = a.reshape(2, 5, -1), np.stack([b, -b])
  f = jax.jit(jax.vmap(lambda x, y: accum_matmul(x, y, HOPPER, promote_every=3, interpret=True,
                                                 tile_k=TK)))
  got = np.asarray(f(a, b))
  for i in range(2):
    ref.assert_same_bits(got[i], spec_loop(a[i], b[i], HOPPER, 3), msg=f"batch {i}")


def _lowering_module():
  path = os.path.join(os.path.dirname(__file__), "kernel_lowering_test.py")
  spec = importlib.util.spec_from_file_location("_promotion_kernel_lowering", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_LOWERING = _lowering_module()


@pytest.mark.lowering
@pytest.mark.parametrize("m,k,n,padded_k,grid,n_c", _LOWERING.covering_grid([
    (64, 4096, 64, 4096, (2, 2)),
    (100, 4101, 130, 4112, (4, 5)),    # ragged M, N (tiles padded) and K (to a multiple of 16)
], [(128,), (3,), (8,), (10_000,)]))  # tk | n_c, neither, n_c | tk, > K
def test_kernel_lowers_to_triton(n_c, m, k, n, padded_k, grid):
  lowering = _LOWERING
  sds = jax.ShapeDtypeStruct
  hlo = lowering.lower_for_h100(lambda a, b: accum_matmul(a, b, HOPPER, promote_every=n_c),
                                sds((m, k), jnp.float32), sds((k, n), jnp.float32))
  assert hlo.count(lowering.TRITON_CALL) == 1
  assert f"grid_x = {grid[0]} " in hlo and f"grid_y = {grid[1]} " in hlo
  assert f"tensor<{-(-m // 32) * 32}x{padded_k}xf32>" in hlo
  assert f"_promote{min(n_c, k)}" in hlo
