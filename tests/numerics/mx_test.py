"""OCP MX quantization against a float64 + ml_dtypes reference written from the spec.

`mx_reference` follows OCP MX v1.0 §6.3 (bfp.md §6.1): per block of `block`
elements along `axis` (last block zero-padded), shared_exp = floor(log2 amax) -
emax(elem) clamped to [-127, 127] (NaN scale above), elements = the ml_dtypes
cast of clip(x / 2^shared_exp, ±max(elem)), or k/64 with k = round-half-even
clamped to ±127 for MXINT8; blocks holding inf/NaN are NaN. The element table
below is copied from the spec, not from jlp. The other scale modes ("ceil",
"even", "rceil") choose shared_exp as torchao 0.18's `to_mx` does
(`shared_exponent`, transcribed from torchao/prototype/mx_formats/mx_tensor.py
in float64 arithmetic, with the exact ceiling of cuBLAS's RCEIL rule); the
elements are then made the same way.
"""

import functools
import os

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
MANTISSA_BITS = {"float8_e5m2": 2, "float8_e4m3fn": 3, "float6_e3m2fn": 2, "float6_e2m3fn": 3,
                 "float4_e2m1fn": 1, "int8": 6}  # int8: the grid k / 64 below 2
SCALE_MODES = ("floor", "ceil", "even", "rceil")


def shared_exponent(amax, elem, mode):
  """The unclamped shared exponent of blocks with the largest magnitude `amax` (float64 of a
  finite float32), transcribed from torchao's `to_mx`: it reads amax's float32 exponent field,
  so a subnormal amax counts as 2^-127 ("floor") or, having a nonzero fraction, 2^-126
  ("ceil"); "even" first rounds amax half up to the element's mantissa bits; "rceil" takes
  ceil(log2(fl32(amax / max))) exactly."""
  _, emax, largest = ELEMENTS[elem]
  normal = amax >= 2.0 ** -126
  m, e = np.frexp(amax)  # amax = m · 2^e, m in [0.5, 1)
  floor_log2 = np.where(normal, e - 1, -127)
  if mode == "floor":
    return floor_log2 - emax
  if mode == "ceil":
    return np.where(normal, np.where(m == 0.5, e - 1, e), np.where(amax > 0, -126, -127)) - emax
  if mode == "even":
    half_up = 2.0 ** -(MANTISSA_BITS[elem] + 1)  # rounds the significand 2m up to 2
    carry = np.where(normal, 2 * m >= 2 - half_up, amax >= 2.0 ** -126 * (1 - half_up))
    return floor_log2 + carry - emax
  assert mode == "rceil"
  with np.errstate(under="ignore"):
    d = (amax.astype(np.float32) / np.float32(largest)).astype(np.float64)  # IEEE, subnormals
  md, ed = np.frexp(d)
  return np.where(d == 0, -127, np.where(md == 0.5, ed - 1, ed))


def round_elements(scaled, elem, rbits=None):
  dtype, _, largest = ELEMENTS[elem]
  if elem == "int8":
    return np.clip(np.round(scaled * 64), -127, 127) / 64  # np.round: half to even
  clipped = np.clip(scaled, -largest, largest)
  if rbits is None:
    return clipped.astype(dtype).astype(np.float64)
  stochastic = FloatFormat.from_name(elem, rounding="stochastic", overflow="saturate")
  return ref.round_to_format(clipped.astype(np.float32), stochastic, rbits).astype(np.float64)


def reference_blocks(blocks, elem, rbits=None, mode="floor", prescale=1.0):
  """Each row of `blocks` (float32) quantized as one MX block, in float64; with a prescale p the
  shared exponent comes from the block, the elements from float32(x * p), and the result is
  divided by p in float32 (numpy's IEEE float32, gradual underflow)."""
  v = blocks.astype(np.float64)
  amax = np.abs(v).max(axis=1, keepdims=True)
  if mode == "floor":
    _, exp2 = np.frexp(amax)  # amax = m · 2^exp2, m in [0.5, 1): floor(log2 amax) = exp2 - 1
    shared = np.maximum(exp2 - 1 - ELEMENTS[elem][1], -127).astype(np.float64)
  else:
    finite_amax = np.where(np.isfinite(amax), amax, 0.0)
    shared = np.maximum(shared_exponent(finite_amax, elem, mode), -127).astype(np.float64)
  with np.errstate(invalid="ignore", over="ignore", under="ignore"):
    elements = (blocks.astype(np.float32) * np.float32(prescale)).astype(np.float64)
    scaled = elements / 2.0 ** shared
    out = round_elements(np.where(np.isfinite(scaled), scaled, 0.0), elem, rbits) * 2.0 ** shared
  out = np.where(amax == 0, v, out)  # all-zero block: signed zeros kept
  nan_block = ~np.isfinite(v).all(axis=1, keepdims=True) | (shared > 127)
  with np.errstate(over="ignore", under="ignore"):  # 2^128 -> inf ("ceil", "even", "rceil")
    out = np.where(nan_block, np.nan, out).astype(np.float32)
    return out if prescale == 1.0 else out / np.float32(prescale)


def mx_reference(x, elem, block, axis, rbits=None, mode="floor", prescale=1.0):
  x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
  n = x.shape[-1]
  padded = np.zeros(x.shape[:-1] + (-(-n // block) * block,), np.float32)
  padded[..., :n] = x
  r = None
  if rbits is not None:
    r = np.zeros(padded.shape, np.uint32)
    r[..., :n] = np.moveaxis(rbits, axis, -1)
    r = r.reshape(-1, block)
  out = reference_blocks(padded.reshape(-1, block), elem, r, mode, prescale)
  out = out.reshape(padded.shape)[..., :n]
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


def cast(request, key, x, fmt, rbits=None):
  """quantize(x, fmt, rbits); a cast of the default tier's parametrized cases (`default_casts`,
  looked up by `key`) comes from the one program that casts them all (each program apart
  compiles the cast again)."""
  if key not in _default_keys():
    return quantize(x, fmt, rbits)
  bx, bfmt, brbits, got, _ = request.getfixturevalue("default_casts")[key]
  assert bfmt == fmt
  assert np.array_equal(bx.view(np.uint32), np.asarray(x, np.float32).view(np.uint32))
  assert (rbits is None and brbits is None) or np.array_equal(brbits, rbits)
  return got


LAYOUTS = [((40, 64), 32, -1), ((50, 24), 20, 0)]  # (shape, block, axis): full and ragged blocks


def _slow_unless(default, *names):
  """pytest.param(*names) in the slow tier unless `names` is in `default` (one default case per
  branch of the code: the element classes e5m2 (inf and NaN), e4m3fn (NaN only), float6 / float4
  (neither; the same branches, other constants) and int8 (its own grid and clamp), each scale
  mode, each layout, stochastic and prescale)."""
  return pytest.param(*names, marks=() if names in default else pytest.mark.slow)


# Every element in a layout; int8 (its own branch) in both.
_LAYOUT_DEFAULT = {("float8_e5m2", 0), ("float6_e3m2fn", 0), ("float4_e2m1fn", 0), ("int8", 0),
                   ("float8_e4m3fn", 1), ("float6_e2m3fn", 1), ("int8", 1)}


@pytest.mark.parametrize("elem,layout", [
    pytest.param(e, LAYOUTS[i], id=f"{e}-{LAYOUTS[i]}",
                 marks=() if (e, i) in _LAYOUT_DEFAULT else pytest.mark.slow)
    for i in range(len(LAYOUTS)) for e in ELEMENTS])
def test_matches_reference(elem, layout, request):
  shape, block, axis = layout
  x, fmt = layout_input(elem, layout)
  ref.assert_same_bits(cast(request, ("layout", elem, LAYOUTS.index(layout)), x, fmt),
                       mx_reference(x, elem, block, axis), x, repr(fmt))


def layout_input(elem, layout):
  shape, block, axis = layout
  rng = np.random.default_rng(len(elem) * 7 + block)
  x = random_blocks(rng, shape[0] if axis == -1 else shape[1], shape[1] if axis == -1 else shape[0])
  x = x if axis == -1 else x.T.copy()
  return x, MXFormat(elem, block=block, axis=axis)


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
  """Whether `mx_quantize` rounds x (blocks of 32 along its rows) directly on the scaled grid."""
  codes = mx_numerics._block_field_codes(jnp.asarray(x).view(jnp.uint32), 1, 32)
  return mx_numerics._rounds_on_scaled_grid(codes, fmt)


def scale_codes_on_grid(x, fmt):
  """Whether the scale codes of x's rows (one block each) are on the scaled grid."""
  codes = mx_numerics._scale_codes(jnp.max(jnp.asarray(x).view(jnp.uint32) & 0x7FFFFFFF, axis=1),
                                   fmt)
  return mx_numerics._scale_codes_on_scaled_grid(codes, fmt)


def on_grid(request, key, x, fmt, predicate):
  """bool(predicate(x, fmt)), from the `default_casts` program for a default-tier key."""
  if key not in _default_keys():
    return bool(jax.jit(predicate, static_argnums=1)(jnp.asarray(x), fmt))
  return request.getfixturevalue("default_casts")[key][4]


# Slow: float6_e3m2fn (the branches of float6_e2m3fn and float4_e2m1fn, no inf or NaN).
@pytest.mark.parametrize("elem", [pytest.param(e, marks=pytest.mark.slow)
                                  if e == "float6_e3m2fn" else e for e in ELEMENTS])
def test_rounding_on_the_scaled_grid_matches_reference(elem, request):
  """Nearest rounding of arrays whose blocks all lie in `_nearest_fields`, quantized directly on
  the scaled grid (asserted), at shared exponents from the lowest to the highest of that range,
  with an all-zero block and a NaN block beside them."""
  x, fmt = scaled_grid_input(elem)
  assert on_grid(request, ("grid", elem), x, fmt, scaled_grid_codes)
  ref.assert_same_bits(cast(request, ("grid", elem), x, fmt), mx_reference(x, elem, 32, -1), x,
                       repr(fmt))


def scaled_grid_input(elem):
  fmt = MXFormat(elem)
  low, high = mx_numerics._nearest_fields(fmt)
  emax = ELEMENTS[elem][1]
  high = min(high, 254)  # the largest finite field
  exps = sorted({low - 127 - emax, low - 126 - emax, -40, -3, 0, 5, 60, high - 128 - emax,
                 high - 127 - emax})
  x = scaled_grid_blocks(elem, exps, np.random.default_rng(len(elem)))
  x = np.concatenate([x, np.zeros((1, 32), np.float32), np.ones((1, 32), np.float32)])
  x[-1, 9] = np.nan
  return x, fmt


@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int8"])
def test_blocks_outside_the_scaled_grid_range_match_reference(elem, request):
  """One block just below or just above `_nearest_fields` (if that is below float32's largest
  field) sends the array through the general path (asserted), which gives the reference's bits
  too."""
  for e, x, fmt in outside_inputs(elem):
    assert not on_grid(request, ("outside", elem, e), x, fmt, scaled_grid_codes)
    ref.assert_same_bits(cast(request, ("outside", elem, e), x, fmt),
                         mx_reference(x, elem, 32, -1), x, f"{fmt!r} at 2^{e}")


def outside_inputs(elem):
  fmt = MXFormat(elem)
  low, high = mx_numerics._nearest_fields(fmt)
  emax = ELEMENTS[elem][1]
  return [(e, scaled_grid_blocks(elem, [e, 0], np.random.default_rng(3)), fmt)
          for e in [low - 128 - emax] + ([high - 126 - emax] if high < 254 else [])]


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


# -- scale modes ("ceil", "even", "rceil"; "floor" is the default above) ---------------------------

def scale_mode_blocks(elem, rng):
  """(rows, 32) blocks whose largest magnitude (the first element, signed) sits on or beside each
  mode's rounding boundary: powers of two and their neighbours, the "even" carry threshold
  (2 - 2^-(m+1)) · 2^k, max(elem) · 2^k (where "rceil"'s quotient is a power of two), subnormal
  maxima around 2^-127 and 2^-126, float32's largest values (products of 2^128 -> inf), and a
  maximum whose quotient by max(elem) underflows to 0; the other elements are random fractions
  of the maximum, its float32 neighbour below, zeros and float32 subnormals."""
  _, _, largest = ELEMENTS[elem]
  half_up = 2.0 ** -(MANTISSA_BITS[elem] + 1)
  f32 = np.float32
  tops = []
  for k in (-140, -127, -126, -125, -100, -9, -1, 0, 3, 60, 113, 125, 127):
    for t in (2.0 ** k, 2.0 ** k * (2 - half_up), largest * 2.0 ** k):
      if t < 2.0 ** 128 and t >= 2.0 ** -149:
        v = f32(t)
        tops += [v, np.nextafter(v, f32(np.inf)), np.nextafter(v, f32(0))]
  tops += [np.uint32(b).view(f32) for b in (1, 0x400000, 0x400001, 0x7FFFFF, 0x7F7FFFFF)]
  tops += [f32(2.0 ** -126 * (1 - half_up)), f32(1.9 * 2.0 ** 127), f32(1.96875 * 2.0 ** 127)]
  tops = np.array([t for t in tops if np.isfinite(t) and t > 0], f32)
  rows = tops.size
  x = (rng.random((rows, 32)) * rng.choice([-1.0, 1.0], (rows, 32))).astype(f32) * tops[:, None]
  x[:, 0] = tops * rng.choice(np.array([-1, 1], f32), rows)
  x[:, 1] = np.nextafter(tops, f32(0))
  x[::3, 2:5] = 0.0
  x[1::3, 5] = np.uint32(0x3FF).view(f32)
  return x


# Each mode with two or three element classes, int8 (its own mantissa and max in "even" and
# "rceil") in both modes that branch on it; every element once.
_MODES_DEFAULT = {("float8_e4m3fn", "ceil"), ("float6_e3m2fn", "ceil"), ("float8_e5m2", "even"),
                  ("int8", "even"), ("float4_e2m1fn", "even"), ("float6_e2m3fn", "rceil"),
                  ("int8", "rceil")}


@pytest.mark.parametrize("elem,mode", [_slow_unless(_MODES_DEFAULT, e, m)
                                       for e in ELEMENTS for m in SCALE_MODES[1:]])
def test_scale_modes_match_reference(elem, mode, request):
  """Boundary blocks (general path) and random wide blocks incl. specials, along the last axis
  and, ragged, along axis 0."""
  for i, (x, fmt) in enumerate(scale_modes_inputs(elem, mode)):
    ref.assert_same_bits(cast(request, ("modes", elem, mode, i), x, fmt),
                         mx_reference(x, elem, fmt.block, fmt.axis, mode=mode), x, repr(fmt))


def scale_modes_inputs(elem, mode):
  rng = np.random.default_rng(len(elem) + len(mode))
  x = scale_mode_blocks(elem, rng)
  return [(x, MXFormat(elem, scale_mode=mode)),
          (random_blocks(rng, 24, 50).T.copy(), MXFormat(elem, block=20, axis=0, scale_mode=mode))]


# E5M2 (inf outside "floor") in every mode but "floor", each other element class in one mode
# ("floor" on the scaled grid for all elements: test_rounding_on_the_scaled_grid_matches_reference).
_GRID_DEFAULT = {("float8_e5m2", m) for m in SCALE_MODES[1:]} | {
    ("float8_e4m3fn", "ceil"), ("float4_e2m1fn", "even"), ("int8", "rceil")}


@pytest.mark.parametrize("elem,mode", [
    _slow_unless(_GRID_DEFAULT, e, m)
    for e in ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int8"] for m in SCALE_MODES])
def test_scale_modes_on_the_scaled_grid_match_reference(elem, mode, request):
  """Blocks within `_nearest_fields` take the direct rounding on the scaled grid (asserted) in
  every mode, with ties, saturating tops, an all-zero and a NaN block; for E5M2 also blocks
  near float32's max, whose elements round up to 2^128 = inf outside "floor" mode."""
  x, fmt = grid_modes_input(elem, mode)
  assert on_grid(request, ("grid modes", elem, mode), x, fmt, scale_codes_on_grid)
  want = mx_reference(x, elem, 32, -1, mode=mode)
  ref.assert_same_bits(cast(request, ("grid modes", elem, mode), x, fmt), want, x, repr(fmt))
  assert np.isinf(want).any() == (elem == "float8_e5m2" and mode != "floor")


def grid_modes_input(elem, mode):
  exps = [-40, -3, 0, 5, 60] + ([112] if elem == "float8_e5m2" else [])
  x = scaled_grid_blocks(elem, exps, np.random.default_rng(11))
  x = np.concatenate([x, np.zeros((1, 32), np.float32), np.ones((1, 32), np.float32)])
  x[-1, 9] = np.nan
  return x, MXFormat(elem, scale_mode=mode)


def test_scale_modes_by_hand():
  """E4M3 (max 448 = 1.75 · 2^8, 3 mantissa bits): amax 1.96875 = 1.11111b · 2^0 gives
  shared_exp 0 - 8 ("floor": 504 saturates to 448), "ceil" 1 - 8, "even" 1 - 8 (1.11111b
  rounds up to 2 at 3 bits) and "rceil" ceil(log2(1.96875 / 448)) = -7; 252 then ties to 256.
  amax 1.5: "even" stays at -8 (1.1b), "rceil" ceil(log2(1.5 / 448)) = -8, "ceil" -7, where
  2^-17 (a tie at 2^-10 · 2^-7) rounds to even 0."""
  x = np.zeros((2, 32), np.float32)
  x[0, :3] = [1.96875, -1.875, 0.5]
  x[1, :2] = [1.5, 2.0 ** -17]
  want = {"floor": [[1.75, -1.75, 0.5], [1.5, 2.0 ** -17]],
          "ceil": [[2.0, -1.875, 0.5], [1.5, 0.0]],
          "even": [[2.0, -1.875, 0.5], [1.5, 2.0 ** -17]],
          "rceil": [[2.0, -1.875, 0.5], [1.5, 2.0 ** -17]]}
  fmts = [MXFormat("float8_e4m3fn", scale_mode=mode) for mode in want]
  every_mode = jax.jit(lambda x: [mx_quantize(x, f) for f in fmts])(jnp.asarray(x))
  for (mode, (first, second)), got in zip(want.items(), every_mode, strict=True):
    got = np.asarray(got)
    np.testing.assert_array_equal(got[0, :3], first, err_msg=mode)
    np.testing.assert_array_equal(got[1, :2], second, err_msg=mode)


def test_ceil_modes_overflow_to_inf_near_float32_max():
  """float32's max in a "ceil" block: shared_exp 128 - 8, 2^128 (1 - 2^-24) / 2^120 rounds to
  256 = 2^8, and 256 · 2^120 is past float32: inf (torchao's float32 product too)."""
  x = np.zeros(32, np.float32)
  x[:2] = [np.finfo(np.float32).max, -1.0]
  got = quantize(x, MXFormat("float8_e4m3fn", scale_mode="ceil"))
  assert got[0] == np.inf and got[1] == 0.0 and np.signbit(got[1])


def test_scale_mode_validation():
  with pytest.raises(ValueError, match="scale_mode='round'"):
    MXFormat("float8_e4m3fn", scale_mode="round")


GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "mx_scale_modes_torchao.npz")


# Slow: the float6 goldens (float4_e2m1fn's element class: no inf or NaN, other constants).
@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2",
                                  *[pytest.param(e, marks=pytest.mark.slow)
                                    for e in ("float6_e2m3fn", "float6_e3m2fn")],
                                  "float4_e2m1fn"])
def test_torchao_goldens(elem, request):
  """Every scale mode against the real torchao 0.18.0 `to_mx` + `to_dtype` on CPU
  (tests/data/make_mx_scale_mode_goldens.py; 64 blocks of 32 per element type: random blocks
  with outliers and signed zeros, each mode's boundary maxima, grid ties, saturating tops, an
  all-zero and a NaN block, none in the documented corners), bit for bit; NaNs of any sign
  count as equal (torchao's NaN signs come from its float ops)."""
  with np.load(GOLDEN) as data:
    x = data[f"x_{elem}"].view(np.float32)
    goldens = {mode: data[f"y_{elem}_{mode}"].view(np.float32) for mode in SCALE_MODES}
  differ = 0
  for mode, want in goldens.items():
    got = cast(request, ("golden", elem, mode), x, MXFormat(elem, scale_mode=mode))
    want = np.where(np.isnan(want), np.float32(np.nan), want)
    ref.assert_same_bits(got, want, x, f"{elem} {mode}")
    differ += int((~ref.same_bits(want, goldens["floor"])).sum())
  assert differ > 0  # the modes are told apart by these inputs


# -- prescale (Tseng et al.'s 3/4 before stochastic rounding) -------------------------------------

# Each float element stochastic (the ldexp scaling), nearest (the exponent-field scaling) with
# float4_e2m1fn and int8, "floor" and "rceil" each nearest and stochastic.
_PRESCALE_DEFAULT = {("float4_e2m1fn", "floor", False), ("float4_e2m1fn", "rceil", True),
                     ("float8_e4m3fn", "floor", True), ("int8", "rceil", False)}


@pytest.mark.parametrize("elem, mode, stochastic", [
    _slow_unless(_PRESCALE_DEFAULT, e, m, s)
    for e in ("float4_e2m1fn", "float8_e4m3fn", "int8") for m in ("floor", "rceil")
    for s in (False, True) if not (s and e == "int8")])  # MXINT8 rounds to nearest only
def test_prescale_matches_reference(elem, mode, stochastic, request):
  """Random wide blocks with zeros, float32 subnormals and specials, along the last axis and,
  ragged, along axis 0."""
  for i, (x, fmt, rbits) in enumerate(prescale_inputs(elem, mode, stochastic)):
    want = mx_reference(x, elem, fmt.block, fmt.axis, rbits, mode, prescale=0.75)
    ref.assert_same_bits(cast(request, ("prescale", elem, mode, stochastic, i), x, fmt, rbits),
                         want, x, repr(fmt))


def prescale_inputs(elem, mode, stochastic):
  rng = np.random.default_rng(len(elem) + len(mode) + stochastic)
  rounding = "stochastic" if stochastic else "nearest"
  e = elem if elem == "int8" else FloatFormat.from_name(elem, rounding=rounding)
  out = []
  for shape, block, axis in LAYOUTS:
    rows, cols = shape if axis == -1 else shape[::-1]
    x = random_blocks(rng, rows, cols)
    x = x if axis == -1 else x.T.copy()
    rbits = rng.integers(0, 2 ** 32, x.shape, dtype=np.uint64).astype(np.uint32)
    rbits = rbits if stochastic else None
    out.append((x, MXFormat(e, block=block, axis=axis, scale_mode=mode, prescale=0.75), rbits))
  return out


# -- one program for the default tier's parametrized casts ------------------------------------

_GOLDEN_DEFAULT = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
_OUTSIDE_ELEMS = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int8")


def _default_casts():
  """(key, x, fmt, rbits) of the casts of the default tier's parametrized cases above."""
  out = []
  for elem, i in sorted(_LAYOUT_DEFAULT):
    out.append((("layout", elem, i), *layout_input(elem, LAYOUTS[i]), None))
  for elem in ELEMENTS:
    if elem != "float6_e3m2fn":
      out.append((("grid", elem), *scaled_grid_input(elem), None))
  for elem in _OUTSIDE_ELEMS:
    out += [(("outside", elem, e), x, fmt, None) for e, x, fmt in outside_inputs(elem)]
  for elem, mode in sorted(_MODES_DEFAULT):
    out += [(("modes", elem, mode, i), x, fmt, None)
            for i, (x, fmt) in enumerate(scale_modes_inputs(elem, mode))]
  for elem, mode in sorted(_GRID_DEFAULT):
    out.append((("grid modes", elem, mode), *grid_modes_input(elem, mode), None))
  with np.load(GOLDEN) as data:
    for elem in _GOLDEN_DEFAULT:
      x = data[f"x_{elem}"].view(np.float32)
      out += [(("golden", elem, mode), x, MXFormat(elem, scale_mode=mode), None)
              for mode in SCALE_MODES]
  for elem, mode, stochastic in sorted(_PRESCALE_DEFAULT):
    out += [(("prescale", elem, mode, stochastic, i), *c)
            for i, c in enumerate(prescale_inputs(elem, mode, stochastic))]
  return out


@functools.lru_cache(maxsize=None)
def _default_keys():
  keys = {("layout", e, i) for e, i in _LAYOUT_DEFAULT}
  keys |= {("grid", e) for e in ELEMENTS if e != "float6_e3m2fn"}
  for elem in _OUTSIDE_ELEMS:  # the exponents of `outside_inputs`
    low, high = mx_numerics._nearest_fields(MXFormat(elem))
    emax = ELEMENTS[elem][1]
    keys |= {("outside", elem, e)
             for e in [low - 128 - emax] + ([high - 126 - emax] if high < 254 else [])}
  keys |= {("modes", e, m, i) for e, m in _MODES_DEFAULT for i in (0, 1)}
  keys |= {("grid modes", e, m) for e, m in _GRID_DEFAULT}
  keys |= {("golden", e, m) for e in _GOLDEN_DEFAULT for m in SCALE_MODES}
  return keys | {("prescale", e, m, s, i) for e, m, s in _PRESCALE_DEFAULT for i in (0, 1)}


@pytest.fixture(scope="module")
def default_casts():
  """{key: (x, fmt, rbits, mx_quantize(x, fmt, rbits), predicate)} of `_default_casts`, all cast
  by one jitted program (the cases differ in shape and format: a program each would compile each
  apart), with the path predicate the key's test asserts (`scaled_grid_codes` or
  `scale_codes_on_grid`; None for the others)."""
  cases = _default_casts()
  assert {c[0] for c in cases} == _default_keys()
  fmts = tuple(c[2] for c in cases)
  predicates = tuple({"grid": scaled_grid_codes, "outside": scaled_grid_codes,
                      "grid modes": scale_codes_on_grid}.get(c[0][0]) for c in cases)

  @jax.jit
  def run(xs, rs):
    return [(mx_quantize(x, f, r), None if p is None else p(x, f))
            for x, f, r, p in zip(xs, fmts, rs, predicates)]

  outs = run([jnp.asarray(c[1], jnp.float32) for c in cases],
             [None if c[3] is None else jnp.asarray(c[3], jnp.uint32) for c in cases])
  return {c[0]: (c[1], c[2], c[3], np.asarray(q), None if p is None else bool(p))
          for c, (q, p) in zip(cases, outs, strict=True)}


def test_prescale_is_tseng_et_al_s_dither_scale():
  """amazon-science/mxfp4-llm's microxcaling patch (round='dither_scale'), transcribed in float32:
  shared_exp = floor(log2 amax) - 2 (OCP, E2M1), A = 3 * x / 2^(shared_exp + 2), stochastic
  rounding onto E2M1 (saturating), then A * 2^(shared_exp + 2) / 3. With the same draws it gives
  jlp's bits on normal-range blocks, and no element reaches the saturation bound."""
  rng = np.random.default_rng(11)
  f32 = np.float32
  x = (rng.standard_normal((64, 32)) * 2.0 ** rng.integers(-20, 20, (64, 1))).astype(f32)
  x[:, 0] = np.float32(7.99) * 2.0 ** rng.integers(-20, 20, 64)  # maxima where OCP would clip
  rbits = rng.integers(0, 2 ** 32, x.shape, dtype=np.uint64).astype(np.uint32)
  _, e = np.frexp(np.abs(x).max(axis=1, keepdims=True).astype(np.float64))
  shared = (e - 1 - 2).astype(np.float64)
  a = ((f32(3) * x).astype(np.float64) / 2.0 ** (shared + 2)).astype(f32)
  assert np.abs(a).max() < 6  # no clipping
  sr = FloatFormat.from_name("float4_e2m1fn", rounding="stochastic", overflow="saturate")
  q = ref.round_to_format(a, sr, rbits).astype(np.float64)
  want = ((q * 2.0 ** (shared + 2)).astype(f32) / f32(3)).astype(f32)
  fmt = MXFormat(FloatFormat.from_name("float4_e2m1fn", rounding="stochastic"), prescale=0.75)
  ref.assert_same_bits(quantize(x, fmt, rbits), want, x)


def test_prescale_keeps_stochastic_rounding_unbiased():
  """Blocks whose maximum lies in (6, 8) x 2^shared_exp: plain OCP scaling clips it to 6 x
  2^shared_exp, a bias stochastic rounding cannot undo; with the 3/4 prescale the mean of many
  roundings converges to x."""
  f32 = np.float32
  row = np.linspace(-7.9, 7.9, 32).astype(f32)
  x = np.tile(row, (4096, 1))
  rbits = np.random.default_rng(2).integers(0, 2 ** 32, x.shape, dtype=np.uint64).astype(np.uint32)
  sr = FloatFormat.from_name("float4_e2m1fn", rounding="stochastic")
  unbiased = quantize(x, MXFormat(sr, prescale=0.75), rbits).mean(axis=0)
  clipped = quantize(x, MXFormat(sr), rbits).mean(axis=0)
  np.testing.assert_allclose(unbiased, row, atol=0.05)
  assert abs(clipped[0] - row[0]) > 1.5 and abs(clipped[-1] - row[-1]) > 1.5  # clipped to ±6


def test_prescale_validation_and_repr():
  for bad in (0.0, -0.75, 1.5, 0.1, True, "0.75"):  # 0.1 is not a float32
    with pytest.raises(ValueError, match=r"prescale=.* is not allowed; expected a float32 in"):
      MXFormat("float4_e2m1fn", prescale=bad)
  fmt = MXFormat("float4_e2m1fn", prescale=0.75)
  assert repr(fmt) == "MXFormat(elem=float4_e2m1fn, block=32, axis=-1, prescale=0.75)"
  assert MXFormat("float4_e2m1fn", prescale=1) == MXFormat("float4_e2m1fn")
  assert MXFormat("float4_e2m1fn").representable_in(ml_dtypes.bfloat16)
  assert fmt.representable_in(np.float32)  # values q * 2^e / p: float32 only
  assert not fmt.representable_in(ml_dtypes.bfloat16)
