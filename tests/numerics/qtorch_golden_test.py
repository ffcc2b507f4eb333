"""compat="qtorch" against golden outputs of the REAL QPyTorch 0.3.0, bit for bit.

Reference: tests/data/qtorch_0_3_0_nearest.npz, written by
tests/data/make_qtorch_golden.py, which runs the actual library (qtorch 0.3.0 from
PyPI, its C++ CPU extension, on torch 2.13.0+cpu; versions stored in the file)
`qtorch.quant.float_quantize(x, exp, man, rounding="nearest")` on ~22k-42k float32
inputs per format: random bit patterns (NaN, inf, +-0 and float32 subnormals
included), every tie of the small formats (sampled for the large ones) and the
values one float32 ulp either side, the grid and ties of the formats' subnormal
ranges, the values just below 2^emin (the double rounding of x + 2^emin), and the
overflow / saturation edges.

Every output must match bit for bit (uint32 compare) with one exception, jlp's
documented deviation (`jlp.numerics.compat.qtorch_cast_bits`): for exp = 8 QPyTorch
turns NaN inputs into payload-dependent garbage (inf, NaN or -0.0), where jlp
gives a quiet NaN of the input's sign; there the test asserts jlp's documented
output instead.

Stochastic rounding is not covered: QPyTorch draws its bits from an internal,
randomly seeded std::mt19937, so its outputs cannot be reproduced.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp import FloatFormat
from jlp.numerics.float_cast import float_cast

U32 = np.uint32
GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "data", "qtorch_0_3_0_nearest.npz")
FORMATS = [(4, 3), (5, 2), (5, 10), (3, 4), (2, 1), (6, 9), (8, 7), (3, 0), (2, 3), (7, 5)]


@pytest.fixture(scope="module")
def golden():
  with np.load(GOLDEN) as data:
    return {k: data[k] for k in data.files}


def _jlp_bits(x_bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
  cast = jax.jit(lambda u: jax.lax.bitcast_convert_type(
      float_cast(jax.lax.bitcast_convert_type(u, jnp.float32), fmt), jnp.uint32))
  return np.asarray(cast(jnp.asarray(x_bits, jnp.uint32)))


def _classify(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
  a = x & U32(0x7FFFFFFF)
  e8 = (a >> U32(23)).astype(np.int64)
  out = np.full(x.shape, "normal range", dtype=object)
  out[e8 < fmt.emin + 127] = "below 2^emin"
  out[(e8 == 0) & (a != 0)] = "f32 subnormal"
  out[a == 0] = "zero"
  out[a == U32(0x7F800000)] = "inf"
  out[a > U32(0x7F800000)] = "nan"
  return out


def test_golden_file_metadata(golden):
  versions = list(golden["versions"])
  assert "qtorch==0.3.0" in versions
  assert any(v.startswith("torch==") for v in versions)
  assert [tuple(f) for f in golden["formats"]] == FORMATS


@pytest.mark.parametrize("exp,man", FORMATS, ids=[f"e{e}m{m}" for e, m in FORMATS])
def test_matches_real_qtorch_nearest(golden, exp, man):
  fmt = FloatFormat(exp, man, compat="qtorch")
  x = golden[f"x_e{exp}m{man}"]
  want = golden[f"y_e{exp}m{man}"]
  got = _jlp_bits(x, fmt)

  is_nan_in = (x & U32(0x7FFFFFFF)) > U32(0x7F800000)
  deviation = is_nan_in if exp == 8 else np.zeros_like(is_nan_in)
  if deviation.any():
    # jlp's documented deviation: a quiet NaN of the input's sign.
    dev_got = got[deviation]
    assert np.all((dev_got & U32(0x7FC00000)) == U32(0x7FC00000)), "not a quiet NaN"
    assert np.all((dev_got >> U32(31)) == (x[deviation] >> U32(31))), "NaN sign differs"

  bad = (got != want) & ~deviation
  if bad.any():
    classes = _classify(x, fmt)
    idx = np.flatnonzero(bad)
    summary = {c: int((classes[idx] == c).sum()) for c in sorted(set(classes[idx]))}
    detail = [(f"{x[i]:#010x}", f"{want[i]:#010x}", f"{got[i]:#010x}") for i in idx[:12]]
    raise AssertionError(
        f"e{exp}m{man}: {bad.sum()} of {x.size} differ from QPyTorch 0.3.0, by input class "
        f"{summary}; (x, qtorch, jlp): {detail}")
