"""OCP MX quantization against a float64 + ml_dtypes reference written from the spec.

`mx_reference` follows OCP MX v1.0 §6.3 (bfp.md §6.1): per block of `block`
elements along `axis` (last block zero-padded), shared_exp = floor(log2 amax) -
emax(elem) clamped to [-127, 127] (NaN scale above), elements = the ml_dtypes
cast of clip(x / 2^shared_exp, ±max(elem)), or k/64 with k = round-half-even
clamped to ±127 for MXINT8; blocks holding inf/NaN are NaN. The element table
below is copied from the spec, not from jlp.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jlp import FloatFormat, MXFormat
from jlp.numerics import mx as mx_numerics
from jlp.numerics.mx import ldexp_bits, mx_quantize
import references as ref

ELEMENTS = {  # name: (ml_dtypes type, emax, largest magnitude)
    "float8_e5m2": (ml_dtypes.float8_e5m2, 15, 57344.0),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 8, 448.0),
    "float6_e3m2fn": (ml_dtypes.float6_e3m2fn, 4, 28.0),
    "float6_e2m3fn": (ml_dtypes.float6_e2m3fn, 2, 7.5),
    "float4_e2m1fn": (ml_dtypes.float4_e2m1fn, 2, 6.0),
    "int8": (None, 0, 127 / 64),
}


def round_elements(scaled, elem, rbits=None):
  dtype, _, largest = ELEMENTS[elem]
  if elem == "int8":
    return np.clip(np.round(scaled * 64), -127, 127) / 64  # np.round: half to even
  clipped = np.clip(scaled, -largest, largest)
  if rbits is None:
    return clipped.astype(dtype).astype(np.float64)
  stochastic = FloatFormat.from_name(elem, rounding="stochastic", overflow="saturate")
  return ref.round_to_format(clipped.astype(np.float32), stochastic, rbits).astype(np.float64)


def reference_blocks(blocks, elem, rbits=None):
  """Each row of `blocks` (float32) quantized as one MX block, in float64."""
  v = blocks.astype(np.float64)
  amax = np.abs(v).max(axis=1, keepdims=True)
  _, exp2 = np.frexp(amax)  # amax = m · 2^exp2, m in [0.5, 1): floor(log2 amax) = exp2 - 1
  shared = np.maximum(exp2 - 1 - ELEMENTS[elem][1], -127).astype(np.float64)
  with np.errstate(invalid="ignore"):
    scaled = v / 2.0 ** shared
    out = round_elements(np.where(np.isfinite(scaled), scaled, 0.0), elem, rbits) * 2.0 ** shared
  out = np.where(amax == 0, v, out)  # all-zero block: signed zeros kept
  nan_block = ~np.isfinite(v).all(axis=1, keepdims=True) | (shared > 127)
  return np.where(nan_block, np.nan, out).astype(np.float32)


def mx_reference(x, elem, block, axis, rbits=None):
  x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
  n = x.shape[-1]
  padded = np.zeros(x.shape[:-1] + (-(-n // block) * block,), np.float32)
  padded[..., :n] = x
  r = None
  if rbits is not None:
    r = np.zeros(padded.shape, np.uint32)
    r[..., :n] = np.moveaxis(rbits, axis, -1)
    r = r.reshape(-1, block)
  out = reference_blocks(padded.reshape(-1, block), elem, r).reshape(padded.shape)[..., :n]
  return np.moveaxis(out, -1, axis)


def random_blocks(rng, rows, cols):
  """Rows with scales from 2^-150 to 2^126, wide spreads, zeros, subnormals and a few specials."""
  scale = 2.0 ** rng.integers(-150, 127, (rows, 1))
  spread = 2.0 ** -rng.integers(0, 30, (rows, cols))
  x = rng.standard_normal((rows, cols)) * spread * scale
  x = x.astype(np.float32)
  kind = rng.random((rows, cols))
  x[kind < 0.05] = 0.0
  x[(kind >= 0.05) & (kind < 0.08)] = -0.0
  subnormals = rng.integers(1, 2 ** 23, (rows, cols), dtype=np.uint32).view(np.float32)
  x[(kind >= 0.08) & (kind < 0.1)] = subnormals[(kind >= 0.08) & (kind < 0.1)]
  x[0] = np.where(rng.random(cols) < 0.5, 0.0, -0.0)          # an all-zero row
  x[1] = subnormals[1] * rng.choice([-1, 1], cols)             # a float32-subnormal row
  x[2, 3], x[3, 5], x[4, 0] = np.inf, -np.inf, np.nan
  x[5] = np.float32(957.0) * rng.random(cols).astype(np.float32)  # saturating E4M3 tops
  x[5, 7] = 957.0
  return x


@functools.lru_cache(maxsize=None)
def _jitted(fmt):
  return jax.jit(lambda x, r: mx_quantize(x, fmt, r))


def quantize(x, fmt, rbits=None):
  rbits = None if rbits is None else jnp.asarray(rbits, jnp.uint32)
  return np.asarray(_jitted(fmt)(jnp.asarray(x, jnp.float32), rbits))


LAYOUTS = [((40, 64), 32, -1), ((50, 24), 20, 0)]  # (shape, block, axis): full and ragged blocks


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("elem", list(ELEMENTS))
def test_matches_reference(elem, layout):
  shape, block, axis = layout
  rng = np.random.default_rng(len(elem) * 7 + block)
  x = random_blocks(rng, shape[0] if axis == -1 else shape[1], shape[1] if axis == -1 else shape[0])
  x = x if axis == -1 else x.T.copy()
  fmt = MXFormat(elem, block=block, axis=axis)
  ref.assert_same_bits(quantize(x, fmt), mx_reference(x, elem, block, axis), x, repr(fmt))


def element_grid(elem):
  """The non-negative finite values of the element format, from ml_dtypes (k / 64 for int8)."""
  dtype, _, largest = ELEMENTS[elem]
  if dtype is None:
    return np.arange(128) / 64
  values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
  return np.unique(values[np.isfinite(values) & (values >= 0) & (values <= largest)])


def scaled_grid_blocks(elem, shared_exps, rng):
  """Blocks of 32 whose first element is max(elem) * 2^e (so the shared exponent is e) and the
  rest are hard cases on that block's grid: grid points, midpoints (ties), their float32
  neighbours, values past the saturation bound, float32 subnormals and signed zeros."""
  _, emax, largest = ELEMENTS[elem]
  grid = element_grid(elem)
  mids = (grid[:-1] + grid[1:]) / 2
  top = 2.0 ** (emax + 1)  # saturating values stay below it, so the block's exponent stays e
  cases = np.concatenate([grid, mids, [(largest + top) / 2, top * (1 - 2.0 ** -24)]])
  blocks = []
  for e in shared_exps:
    with np.errstate(over="ignore"):  # e5m2's top * 2^e may pass float32's range
      v = (cases * 2.0 ** e).astype(np.float32)
      v = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))])
      v = v[v < np.float32(top * 2.0 ** e)]
    specials = np.array([2.0 ** -149, 3 * 2.0 ** -140, 2.0 ** -127, 0.0, -0.0], np.float32)
    v = np.concatenate([v, specials])
    v = v * rng.choice(np.array([-1, 1], np.float32), v.size)
    v = np.concatenate([v, np.zeros(-v.size % 31, np.float32)]).reshape(-1, 31)
    first = np.full((v.shape[0], 1), np.float32(largest * 2.0 ** e))
    blocks.append(np.concatenate([first, v], axis=1))
  return np.concatenate(blocks)


def scaled_grid_codes(x, fmt):
  codes = mx_numerics._block_field_codes(jnp.asarray(x).view(jnp.uint32), 1, 32)
  return bool(mx_numerics._rounds_on_scaled_grid(codes, fmt))


@pytest.mark.parametrize("elem", list(ELEMENTS))
def test_rounding_on_the_scaled_grid_matches_reference(elem):
  """Nearest rounding of arrays whose blocks all lie in `_nearest_fields`, quantized directly on
  the scaled grid (asserted), at shared exponents from the lowest to the highest of that range,
  with an all-zero block and a NaN block beside them."""
  fmt = MXFormat(elem)
  low, high = mx_numerics._nearest_fields(fmt)
  emax = ELEMENTS[elem][1]
  high = min(high, 254)  # the largest finite field
  exps = sorted({low - 127 - emax, low - 126 - emax, -40, -3, 0, 5, 60, high - 128 - emax,
                 high - 127 - emax})
  x = scaled_grid_blocks(elem, exps, np.random.default_rng(len(elem)))
  x = np.concatenate([x, np.zeros((1, 32), np.float32), np.ones((1, 32), np.float32)])
  x[-1, 9] = np.nan
  assert scaled_grid_codes(x, fmt)
  ref.assert_same_bits(quantize(x, fmt), mx_reference(x, elem, 32, -1), x, repr(fmt))


@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int8"])
def test_blocks_outside_the_scaled_grid_range_match_reference(elem):
  """One block just below or just above `_nearest_fields` (if that is below float32's largest
  field) sends the array through the general path (asserted), which gives the reference's bits
  too."""
  fmt = MXFormat(elem)
  low, high = mx_numerics._nearest_fields(fmt)
  emax = ELEMENTS[elem][1]
  for e in [low - 128 - emax] + ([high - 126 - emax] if high < 254 else []):
    x = scaled_grid_blocks(elem, [e, 0], np.random.default_rng(3))
    assert not scaled_grid_codes(x, fmt)
    ref.assert_same_bits(quantize(x, fmt), mx_reference(x, elem, 32, -1), x, f"{fmt!r} at 2^{e}")


def test_stochastic_elements_match_reference():
  rng = np.random.default_rng(5)
  x = random_blocks(rng, 24, 64)
  rbits = rng.integers(0, 2 ** 32, x.shape, dtype=np.uint64).astype(np.uint32)
  fmt = MXFormat(FloatFormat.from_name("float8_e4m3fn", rounding="stochastic"))
  ref.assert_same_bits(quantize(x, fmt, rbits), mx_reference(x, "float8_e4m3fn", 32, -1, rbits), x)


def test_microxcaling_issue_4_saturates():
  x = np.zeros(32, np.float32)
  x[:3] = [957.0, 96.0, -3.0]
  got = quantize(x, MXFormat("float8_e4m3fn"))  # scale 2^(9 - 8): 957 / 2 = 478.5 > 448
  np.testing.assert_array_equal(got[:3], [896.0, 96.0, -3.0])


def test_inf_or_nan_makes_the_block_nan():
  x = np.ones((4, 32), np.float32)
  x[0, 4], x[1, 31], x[2, 0] = np.inf, -np.inf, np.nan
  for elem in ("float8_e5m2", "float4_e2m1fn", "int8"):
    got = quantize(x, MXFormat(elem))
    assert np.isnan(got[:3]).all() and (got[3] == 1.0).all()


def test_all_zero_block_keeps_signed_zeros():
  x = np.array([0.0, -0.0] * 16 + [1.0] * 32, np.float32)
  got = quantize(x, MXFormat("float6_e2m3fn"))
  np.testing.assert_array_equal(got.view(np.uint32), x.view(np.uint32))


def test_subnormal_blocks_use_the_smallest_scale():
  tiny = np.array([1.5 * 2.0 ** -130, 2.0 ** -149, -3 * 2.0 ** -140, 2.0 ** -126, -(2.0 ** -136)], np.float32)
  x = np.zeros(32, np.float32)
  x[:5] = tiny  # E4M3 elements at scale 2^-127: steps of 2^-136 below 2^-133
  want = np.array([1.5 * 2.0 ** -130, 0.0, -0.0, 2.0 ** -126, -(2.0 ** -136)], np.float32)
  ref.assert_same_bits(quantize(x, MXFormat("float8_e4m3fn"))[:5], want)
  # MXINT8 (emax 0): scale 2^-126, not clamped; grid 2^-132
  got = quantize(x, MXFormat("int8"))[:5]
  ref.assert_same_bits(got, mx_reference(x, "int8", 32, -1)[:5])
  assert got[0] == tiny[0] and got[1] == 0 and got[3] == 2.0 ** -126


def test_ldexp_bits_matches_numpy():
  rng = np.random.default_rng(2)
  u = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
  u = np.where((u & 0x7F800000) == 0x7F800000, u & 0x807FFFFF, u)  # finite only
  u[:1000] &= 0x807FFFFF  # more subnormals
  k = rng.integers(-300, 300, u.shape).astype(np.int32)
  got = np.asarray(jax.jit(ldexp_bits)(jnp.asarray(u), jnp.asarray(k)))
  with np.errstate(over="ignore"):
    want = np.ldexp(u.view(np.float32).astype(np.float64), k).astype(np.float32)
  np.testing.assert_array_equal(got, want.view(np.uint32))


def test_jit_and_vmap():
  rng = np.random.default_rng(9)
  x = random_blocks(rng, 6, 70).reshape(3, 2, 70)
  whole = quantize(x, MXFormat("float4_e2m1fn", axis=2))
  per_matrix = jax.jit(jax.vmap(lambda m: mx_quantize(m, MXFormat("float4_e2m1fn"))))(jnp.asarray(x))
  ref.assert_same_bits(np.asarray(per_matrix), whole)
  ref.assert_same_bits(whole.reshape(6, 70), mx_reference(x.reshape(6, 70), "float4_e2m1fn", 32, -1))


def test_validation():
  with pytest.raises(ValueError, match="axis"):
    mx_quantize(jnp.ones((4, 4)), MXFormat("int8", axis=2))
  with pytest.raises(ValueError, match="rbits"):
    mx_quantize(jnp.ones((4,)), MXFormat(FloatFormat(4, 3, rounding="stochastic")))
