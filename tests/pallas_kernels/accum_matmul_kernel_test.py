"""The K-blocked accumulating-matmul Pallas kernel (interpret mode), bit for bit.

References: `jlp.gemm.accum.matmul(..., impl="xla")`, the kernel's XLA twin, for K
around the K block tk (1, tk - 1, tk, tk + 1, 2 tk, 3 tk + 5), chunk sizes that
divide tk, are multiples of it or neither, plain and Kahan, several accumulator
formats; and, on tiny cases, `spec_loop`: a plain-numpy loop over k written from
cpd.md §2.1 and the chunk rule of `jlp.gemm.accum` (numpy float32 operations,
q = `references.round_to_format`, a float64 reference cast). Results are compared
as float32 bit patterns. Grids stay at <= 16 steps.
"""

import jax
import numpy as np
import pytest

from jlp.formats import FloatFormat
from jlp.gemm.accum import matmul
from pallas_kernels.accum_matmul import accum_matmul
import references as ref

f32 = np.float32
TK = 4  # tile_k in these tests


def spec_loop(a, b, fmt, kahan, chunk):
  """cpd.md §2.1, all (i, j) at once; chunk > 1: float32 sums of `chunk` raw products, k order."""
  q = lambda v: ref.round_to_format(v, fmt)
  m, k = a.shape
  s = np.zeros((m, b.shape[1]), f32)
  c = np.zeros_like(s)
  with np.errstate(all="ignore"):
    for k0 in range(0, k, chunk):
      partial = a[:, k0, None] * b[None, k0, :]
      for kk in range(k0 + 1, min(k0 + chunk, k)):
        partial = partial + a[:, kk, None] * b[None, kk, :]
      p = q(partial)
      if kahan:
        y = q(p - c)
        t = q(s + y)
        c = q(q(t - s) - y)
        s = t
      else:
        s = q(s + p)
  return s


def operands(m, k, n, seed, scale=4.0):
  rng = np.random.default_rng(seed)
  return ((rng.standard_normal((m, k)) * scale).astype(f32),
          rng.standard_normal((k, n)).astype(f32))


# Both paths jitted: one compile per case instead of one per eager op (pads, slices).
_kernel_jit = jax.jit(accum_matmul, static_argnums=2,
                      static_argnames=("kahan", "chunk", "interpret", "tile_k", "tile_m", "tile_n"))
_xla_jit = jax.jit(matmul, static_argnames=("accum", "kahan", "chunk", "impl"))


def kernel(a, b, fmt, kahan, chunk, **tiles):
  return np.asarray(_kernel_jit(a, b, fmt, kahan=kahan, chunk=chunk, interpret=True,
                                **dict(dict(tile_k=TK), **tiles)))


def xla(a, b, fmt, kahan, chunk):
  return np.asarray(_xla_jit(a, b, accum=fmt, kahan=kahan, chunk=chunk, impl="xla"))


E5M2 = FloatFormat.from_name("e5m2")
E4M3 = FloatFormat.from_name("e4m3")
E4M3_TRUNCATE = FloatFormat.from_name("e4m3", rounding="truncate")
KS = [1, TK - 1, TK, TK + 1, 2 * TK, 3 * TK + 5]
_ids = lambda v: repr(v) if isinstance(v, FloatFormat) else str(v)


# Each K once in the default tier: plain at K = 1 (one padded K block), tk and 2 tk (whole
# blocks), Kahan with chunks of 3 at K = tk - 1, tk + 1 and 3 tk + 5 (padded, one and several
# blocks); the other (K, configuration) pairs are slow.
_EVERY_K_DEFAULT = {(1, False), (TK, False), (2 * TK, False),
                    (TK - 1, True), (TK + 1, True), (3 * TK + 5, True)}


@pytest.mark.parametrize("k,kahan,chunk,fmt", [
    pytest.param(k, kahan, chunk, fmt, id=f"{kahan}-{chunk}-{fmt!r}-{k}",
                 marks=() if (k, kahan) in _EVERY_K_DEFAULT else pytest.mark.slow)
    for kahan, chunk, fmt in [
        (False, 1, E5M2),
        (True, 3, E4M3_TRUNCATE),  # chunk starts and ends tested at every step
    ] for k in KS])
def test_matches_xla_for_every_k(k, kahan, chunk, fmt):
  a, b = operands(5, k, 6, seed=k * 7 + chunk)
  ref.assert_same_bits(kernel(a, b, fmt, kahan, chunk), xla(a, b, fmt, kahan, chunk),
                       msg=f"K={k}")


@pytest.mark.slow
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kahan,chunk,fmt", [
    (True, 1, E4M3),
    (True, TK // 2, E5M2),                 # tk a multiple of chunk
    (False, 2 * TK, FloatFormat(8, 7)),    # chunk a multiple of tk
    (False, 3, E5M2),
], ids=_ids)
def test_matches_xla_for_every_k_more_chunks(k, kahan, chunk, fmt):
  a, b = operands(5, k, 6, seed=k * 7 + chunk)
  ref.assert_same_bits(kernel(a, b, fmt, kahan, chunk), xla(a, b, fmt, kahan, chunk),
                       msg=f"K={k}")


# Slow: chunk == K (one chunk over all of K, as in the chunk 5 tk > K case).
@pytest.mark.parametrize("kahan,chunk,fmt", [
    (True, 1, FloatFormat(5, 2, compat="cpd")),
    (True, TK // 2, E5M2),                                          # tk a multiple of chunk
    (False, TK, FloatFormat.from_name("e5m2", subnormals=False)),   # chunk == tk
    (False, 2 * TK, FloatFormat(8, 7)),                             # chunk a multiple of tk
    (True, 5 * TK, FloatFormat(3, 0)),                              # one chunk, longer than K
    pytest.param(False, 3 * TK + 5, E4M3, marks=pytest.mark.slow),  # chunk == K
], ids=_ids)
def test_chunk_sizes_and_formats_match_xla(kahan, chunk, fmt):
  """K = 3 tk + 5: three full K blocks and a partial one."""
  a, b = operands(5, 3 * TK + 5, 6, seed=chunk)
  ref.assert_same_bits(kernel(a, b, fmt, kahan, chunk), xla(a, b, fmt, kahan, chunk))


# Slow: (False, 1): the plain chunk-1 loop of the kernel against the XLA path in
# test_matches_xla_for_every_k, of the XLA path against a triple loop in tests/gemm/accum_test.py.
@pytest.mark.parametrize("kahan,chunk", [pytest.param(False, 1, marks=pytest.mark.slow),
                                         (True, 1), (True, 3), (False, 8)])
def test_matches_spec_loop(kahan, chunk):
  """K = 3 tk + 5; chunks of 3 and 8 straddle the K blocks, the last one incomplete."""
  a, b = operands(3, 3 * TK + 5, 4, seed=chunk + 10)
  want = spec_loop(a, b, E5M2, kahan, chunk)
  ref.assert_same_bits(kernel(a, b, E5M2, kahan, chunk), want)
  ref.assert_same_bits(xla(a, b, E5M2, kahan, chunk), want)


# Slow: (True, 1); the padding of M and N does not depend on the accumulation (Kahan and chunk 1
# run on unpadded tiles in test_matches_xla_for_every_k and test_matches_spec_loop).
@pytest.mark.parametrize("kahan,chunk", [pytest.param(True, 1, marks=pytest.mark.slow),
                                         (False, 3)])
def test_padded_grid_matches_xla(kahan, chunk):
  """(37, 17) @ (17, 45) in 16 x 16 tiles: grid (3, 3), M, N and K (17 = 3 tk + 5) padded."""
  a, b = operands(37, 3 * TK + 5, 45, seed=chunk, scale=8.0)
  ref.assert_same_bits(kernel(a, b, E4M3, kahan, chunk, tile_m=16, tile_n=16),
                       xla(a, b, E4M3, kahan, chunk))


# Each of kahan and chunk once in the default tier; the other two pairs are slow.
@pytest.mark.parametrize("kahan,chunk", [(False, 1), (True, 2),
                                         pytest.param(False, 2, marks=pytest.mark.slow),
                                         pytest.param(True, 1, marks=pytest.mark.slow)])
def test_specials_and_signed_zeros_match_xla(kahan, chunk):
  """±0, ±inf, NaN and values near the format's min normal (no subnormals: sums flush to ±0).

  Row 0 makes s = -0 before a last, incomplete chunk of -0 products.
  """
  fmt = FloatFormat.from_name("e5m2", subnormals=False)
  t = 2.0 ** -14  # e5m2's min normal
  a, b = operands(6, 13, 5, seed=3)
  a[0] = [t, 0, -1.25 * t, -0.0] + [-0.0] * 9
  b[:, 0] = 1.0
  a[1, 4], a[2, 7], a[3, 2], a[3, 9] = np.inf, np.nan, -np.inf, np.inf
  a[4] *= t
  b[5, 1:3] = -0.0
  ref.assert_same_bits(kernel(a, b, fmt, kahan, chunk), xla(a, b, fmt, kahan, chunk))


def test_under_jit_and_vmap():
  a, b = operands(2 * 5, TK + 3, 6, seed=4)
  a, b = a.reshape(2, 5, -1), np.stack([b, -b])
  f = jax.jit(jax.vmap(lambda x, y: accum_matmul(x, y, E5M2, kahan=True, chunk=2, interpret=True,
                                                 tile_k=TK)))
  got = np.asarray(f(a, b))
  for i in range(2):
    ref.assert_same_bits(got[i], xla(a[i], b[i], E5M2, True, 2))


@pytest.mark.parametrize("name,value", [("tile_k", 12), ("tile_k", 0), ("tile_m", 3)])
def test_bad_tiles(name, value):
  a, b = operands(2, 3, 2, seed=0)
  with pytest.raises(ValueError, match=f"{name}={value!r} is not allowed"):
    accum_matmul(a, b, E5M2, **{name: value})
