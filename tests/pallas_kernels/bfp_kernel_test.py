"""The BFP Pallas kernel (interpret mode) against its XLA path, bit for bit.

Reference: `jlp.numerics.bfp.bfp_quantize`. Results are compared as uint32 bit
patterns. Grids stay at <= 16 steps.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.formats import BFPFormat
from jlp.numerics import bfp as xla_bfp
from pallas_kernels.bfp import bfp_quantize

SPECIAL_BITS = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                         0x7F800001, 0xFFFFFFFF, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF],
                        np.uint32)


def sample(shape, seed: int = 0) -> np.ndarray:
  """float32 values of varied range inside groups, with specials and tiny regions.

  In row-major order: the first tenth zeros and float32 subnormals (groups whose
  largest exponent field is 0); then N(0,1) * 2^k with k in [-20, 20] (elements
  far below their group's largest one); in the last 40%, 10% of the elements
  random bit patterns and 2% specials (±0, ±inf, NaNs, subnormals, extremes).
  """
  rng = np.random.default_rng(seed)
  n = int(np.prod(shape))
  u = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 21, n)).astype(np.float32).view(np.uint32)
  tail = np.arange(n) >= 0.6 * n
  pick = np.where(tail, rng.random(n), 1.0)
  u[pick < 0.1] = rng.integers(0, 2 ** 32, int((pick < 0.1).sum()), dtype=np.uint64).astype(np.uint32)
  u[pick < 0.02] = rng.choice(SPECIAL_BITS, int((pick < 0.02).sum()))
  head = n // 10
  tiny = rng.integers(0, 1 << 20, head, dtype=np.uint32) | (rng.integers(0, 2, head, dtype=np.uint32) << 31)
  u[:head] = np.where(rng.random(head) < 0.3, tiny & 0x80000000, tiny)
  return u.view(np.float32).reshape(shape)


def random_bits(shape, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32)


def _quantizers(fmts: tuple, quantize_fn):
  """One jitted function applying `quantize_fn` for every format (one compile for all)."""
  return jax.jit(lambda x, r: [quantize_fn(x, f, r if f.rounding == "stochastic" else None)
                               for f in fmts])


@functools.lru_cache(maxsize=None)
def _kernel_fn(fmts: tuple, rows_per_tile):
  return _quantizers(fmts, functools.partial(bfp_quantize, interpret=True,
                                             rows_per_tile=rows_per_tile))


@functools.lru_cache(maxsize=None)
def _xla_fn(fmts: tuple):
  return _quantizers(fmts, xla_bfp.bfp_quantize)


def check(shape, fmts, rows_per_tile, seed: int = 0):
  """Kernel == XLA path for each format (grouped so that they share one compile)."""
  fmts = tuple(fmts)
  x = sample(shape, seed)
  rbits = random_bits(shape, seed + 1)
  got_all = _kernel_fn(fmts, rows_per_tile)(x, rbits)
  want_all = _xla_fn(fmts)(x, rbits)
  for fmt, got, want in zip(fmts, got_all, want_all, strict=True):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == x.shape
    got, want = got.view(np.uint32).ravel(), want.view(np.uint32).ravel()
    bad = np.flatnonzero(got != want)
    if bad.size:
      xb = x.view(np.uint32).ravel()
      detail = [(i, hex(xb[i]), hex(want[i]), hex(got[i])) for i in bad[:8]]
      raise AssertionError(f"{fmt}: {bad.size} of {got.size} differ; (i, x, want, got): {detail}")


ROUNDINGS = ("truncate", "nearest", "stochastic")


@pytest.mark.parametrize("shape,block,man,rows_per_tile", [
    # rank 2, groups of 16 along rows: G = 37 * 4 = 148 (ragged last group), 10 tiles.
    ((37, 50), (1, 16), 8, 16),
    # rank 2, square 8x8 boxes, ragged on both axes: G = 3 * 4 = 12, 6 tiles.
    ((20, 30), (8, 8), 4, 2),
    # rank 4, FB12-style NCHW block (1, 24, 3, 3): 216 elements -> P = 256, G = 2*2*2*2 = 16.
    ((2, 48, 6, 6), (1, 24, 3, 3), 12, 1),
    # rank 4, the same in NHWC with ragged H, W and C: G = 2 * 2 * 3 * 2 = 24, 12 tiles.
    ((2, 5, 7, 30), (1, 3, 3, 24), 12, 2),
], ids=str)
def test_matches_xla_path_every_rounding(shape, block, man, rows_per_tile):
  check(shape, [BFPFormat(man, block, r) for r in ROUNDINGS], rows_per_tile)


def test_extreme_mantissas_default_tiles():
  # Default rows_per_tile: 4096 // 32 = 128 rows per tile, G = 64 * 8 = 512 -> 4 tiles.
  fmts = [BFPFormat(1, (1, 32), "nearest"), BFPFormat(24, (1, 32), "stochastic"),
          BFPFormat(2, (1, 32), "truncate"), BFPFormat(24, (1, 32), "nearest")]
  check((64, 250), fmts, None, seed=5)


def test_block_larger_than_array_and_one_group():
  check((3, 5), [BFPFormat(8, (4, 8), "nearest")], None)


def test_empty_array():
  out = bfp_quantize(jnp.zeros((0, 4), jnp.float32), BFPFormat(8, (1, 4)), interpret=True)
  assert out.shape == (0, 4) and out.dtype == jnp.float32


def test_argument_errors():
  x = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(ValueError, match="rbits"):
    bfp_quantize(x, BFPFormat(8, (1, 8), "stochastic"), interpret=True)
  with pytest.raises(ValueError, match="block"):
    bfp_quantize(x, BFPFormat(8, (8,)), interpret=True)
  with pytest.raises(ValueError, match="rows_per_tile"):
    bfp_quantize(x, BFPFormat(8, (1, 8)), interpret=True, rows_per_tile=3)
  with pytest.raises(TypeError):
    bfp_quantize(x, "e4m3", interpret=True)
