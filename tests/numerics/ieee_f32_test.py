"""`ieee_add` against numpy's float32 addition (IEEE 754, round to nearest even, no flushing).

Inputs are random bit patterns weighted toward the cases the backend's flush-to-zero would
break: float32 subnormals, small normals around the 2^-60 switch of `ieee_add`, and pairs that
cancel to a subnormal; plus signed zeros, infinities and NaN.
"""

import jax
import numpy as np
import pytest

from jlp.numerics.ieee_f32 import ieee_add
import references as ref

f32 = np.float32


def _patterns(rng, n):
  sign = rng.integers(0, 2, n).astype(np.uint32) << 31
  frac = rng.integers(0, 2 ** 23, n).astype(np.uint32)
  any_bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
  small = (rng.integers(0, 80, n).astype(np.uint32) << 23) | frac   # exponent field < 80: < 2^-47
  subnormal = frac
  kind = rng.integers(0, 3, n)
  return np.where(kind == 0, any_bits, sign | np.where(kind == 1, small, subnormal)).view(f32)


def test_matches_numpy_float32_addition():
  rng = np.random.default_rng(0)
  n = 400_000
  x, y = _patterns(rng, n), _patterns(rng, n)
  q = n // 4  # y = -x (1 + d 2^-23): cancellation, many subnormal and tiny results
  with np.errstate(all="ignore"):
    y[:q] = (-x[:q].astype(np.float64) * (1 + rng.integers(-3, 4, q) * 2.0 ** -23)).astype(f32)
    want = x + y
  tiny = (want != 0) & (np.abs(want) < 2.0 ** -126)
  assert tiny.sum() > 10_000  # the data exercises subnormal results
  got = np.asarray(jax.jit(ieee_add)(x, y))
  ref.assert_same_bits(got, want)


@pytest.mark.parametrize("x,y,want", [
    (2.0 ** -126 * (1 + 2.0 ** -23), -(2.0 ** -126), 2.0 ** -149),    # subnormal result
    (2.0 ** -149, 2.0 ** -126, 2.0 ** -126 + 2.0 ** -149),            # subnormal operand
    (-(2.0 ** -149), -(2.0 ** -149), -(2.0 ** -148)),
    (2.0 ** -149, -(2.0 ** -149), 0.0),                               # +0, not -0
    (-0.0, -0.0, -0.0),
    (0.0, -0.0, 0.0),
    (2.0 ** -61, 2.0 ** -85, 2.0 ** -61),                              # 2^-85 < half an ulp
    (1.0, 2.0 ** -24, 1.0),                                            # a tie: to even
    (1.0 + 2.0 ** -23, 2.0 ** -24, 1.0 + 2.0 ** -22),                  # a tie: to even (up)
    (np.inf, 2.0 ** -149, np.inf),
    (np.inf, -np.inf, np.nan),
    (3.0e38, 3.0e38, np.inf),
], ids=str)
def test_cases(x, y, want):
  got = np.asarray(jax.jit(ieee_add)(np.array([x], f32), np.array([y], f32)))
  if np.isnan(want):  # the default NaN's sign is the hardware's
    assert np.isnan(got[0])
  else:
    ref.assert_same_bits(got, np.array([want], f32))
