"""Properties of quantize over random formats and inputs (hypothesis).

Independent checks: grid membership is tested from the definition (significand
bits and exponent range in float64), not with jlp code.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import jlp
from jlp import BFPFormat, FloatFormat

formats = st.builds(
    FloatFormat,
    exp=st.integers(2, 8), man=st.integers(0, 23),
    rounding=st.sampled_from(["nearest", "truncate"]),
    overflow=st.sampled_from(["inf", "saturate"]),
    subnormals=st.booleans(),
)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
arrays = st.lists(finite_f32, min_size=1, max_size=64).map(lambda v: np.array(v, np.float32))

SETTINGS = settings(max_examples=40, deadline=None)
PAD = 64  # arrays hold 1..64 values


def quantize(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
  """jlp.quantize of x padded with zeros to PAD values (the cast is elementwise), so that every
  example has one shape: each new shape would compile every op of the cast again."""
  padded = np.zeros(PAD, np.float32)
  padded[:x.size] = x
  return np.asarray(jlp.quantize(jnp.asarray(padded), fmt, impl="xla"))[:x.size]


def on_grid(v: np.ndarray, fmt: FloatFormat) -> np.ndarray:
  v = v.astype(np.float64)
  a = np.abs(v)
  finite = np.isfinite(v)
  m, e = np.frexp(np.where(finite & (a > 0), a, 1.0))
  exponent = np.maximum(e - 1, fmt.emin)
  scaled = np.where(finite, a / np.ldexp(1.0, exponent - fmt.man), 0.0)
  ok = (scaled == np.floor(scaled)) & (a <= fmt.max)
  if not fmt.subnormals:
    ok &= (a == 0) | (a >= fmt.smallest_normal)
  return ok | ~finite


@SETTINGS
@given(formats, arrays)
def test_output_on_grid_and_idempotent(fmt, x):
  q = quantize(x, fmt)
  assert on_grid(q, fmt).all()
  qq = quantize(q, fmt)
  np.testing.assert_array_equal(q.view(np.uint32), qq.view(np.uint32))


@SETTINGS
@given(formats, arrays)
def test_monotone_and_sign_symmetric(fmt, x):
  xs = np.sort(x)
  q = quantize(xs, fmt).astype(np.float64)
  assert np.all(q[1:] >= q[:-1])
  qn = quantize(-xs, fmt)
  np.testing.assert_array_equal(qn.view(np.uint32), (-q.astype(np.float32)).view(np.uint32))


@SETTINGS
@given(st.integers(1, 24), st.lists(st.integers(1, 5), min_size=2, max_size=2),
       st.lists(finite_f32, min_size=12, max_size=12), st.sampled_from(["truncate", "nearest"]))
def test_bfp_idempotent_monotone_in_magnitude_within_a_group(man, block, values, rounding):
  fmt = BFPFormat(man, tuple(block), rounding=rounding)
  x = np.array(values, np.float32).reshape(3, 4)
  q = np.asarray(jlp.quantize(jnp.asarray(x), fmt, impl="xla"))
  qq = np.asarray(jlp.quantize(jnp.asarray(q), fmt, impl="xla"))
  np.testing.assert_array_equal(q.view(np.uint32), qq.view(np.uint32))
  if rounding == "truncate":
    assert np.all(np.abs(q) <= np.abs(x))
