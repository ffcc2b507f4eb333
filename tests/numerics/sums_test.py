"""sequential_sum / kahan_sum against cpd.md §3.1 and a plain-Python fold.

Reference: the cases of cpd.md §3.1 and a Python loop over float32 scalars with
`references.round_to_format` as q (written from the spec, not from jlp).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlp
from jlp import FloatFormat
import references as ref


@pytest.mark.parametrize("values, fmt, plain, kahan", [
    ([1.0, 0.3, 0.3, 0.3], "e5m2", 1.75, 2.0),
    ([0.1] * 16, "e5m2", 1.0, 1.5),
    ([0.3] * 8, "e3m0", 1.0, 2.0),
])
def test_cpd_reference_cases(values, fmt, plain, kahan):
  x = jnp.asarray(values, jnp.float32)
  assert float(jlp.sequential_sum(x, fmt=fmt)) == plain
  assert float(jlp.kahan_sum(x, fmt=fmt)) == kahan


def python_fold(column, fmt, kahan):
  f32 = np.float32
  q = (lambda v: f32(v)) if fmt is None else (lambda v: ref.round_to_format(np.array([v], f32), fmt)[0])
  s = c = f32(0)
  for xi in column:
    if kahan:
      y = q(f32(xi) - c)
      t = q(s + y)
      c = q(q(t - s) - y)
      s = t
    else:
      s = q(s + f32(xi))
  return s


# Default: float32 (fmt None) plain and Kahan, and each format once, plain or Kahan in turn (the
# rounding of a partial sum is the same cast in both loops); the other pairs are slow.
_FOLD_FORMATS = [None, FloatFormat(5, 2), FloatFormat(4, 3), FloatFormat(3, 0), FloatFormat(8, 7),
                 FloatFormat(5, 2, overflow="saturate")]


@pytest.mark.parametrize("fmt,kahan", [
    pytest.param(fmt, kahan, id=f"{kahan}-{fmt!r}",
                 marks=() if fmt is None or kahan == bool(i % 2) else pytest.mark.slow)
    for kahan in (False, True) for i, fmt in enumerate(_FOLD_FORMATS)])
def test_matches_python_fold_along_any_axis(fmt, kahan):
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((6, 12, 5)) * 2.0 ** rng.integers(-6, 6, (6, 12, 5))).astype(np.float32)
  fn = jlp.kahan_sum if kahan else jlp.sequential_sum
  got = np.asarray(jax.jit(lambda v: fn(v, axis=1, fmt=fmt))(x))
  want = np.array([[python_fold(x[i, :, j], fmt, kahan) for j in range(5)] for i in range(6)], np.float32)
  ref.assert_same_bits(got, want)
  got0 = np.asarray(fn(x, fmt=fmt))
  want0 = np.array([[python_fold(x[:, i, j], fmt, kahan) for j in range(5)] for i in range(12)], np.float32)
  ref.assert_same_bits(got0, want0)


def test_stochastic_sum_needs_key_and_is_reproducible():
  fmt = FloatFormat(5, 2, rounding="stochastic")
  x = jnp.full((16, 3), 0.1, jnp.float32)
  with pytest.raises(ValueError, match="key=None"):
    jlp.sequential_sum(x, fmt=fmt)
  a = jlp.kahan_sum(x, fmt=fmt, key=jax.random.key(0))
  b = jlp.kahan_sum(x, fmt=fmt, key=jax.random.key(0))
  ref.assert_same_bits(a, b)


def test_errors():
  with pytest.raises(ValueError, match="axis=2"):
    jlp.sequential_sum(jnp.ones((3, 3)), axis=2)
  with pytest.raises(ValueError, match="x.dtype=int32"):
    jlp.kahan_sum(jnp.ones((3,), jnp.int32))
  with pytest.raises(ValueError, match="fmt=BFPFormat"):
    jlp.kahan_sum(jnp.ones((3,)), fmt=jlp.BFPFormat(4, (3,)))
