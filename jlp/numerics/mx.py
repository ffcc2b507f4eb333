"""OCP Microscaling (MX v1.0) quantization on float32 bit patterns.

Each block of `fmt.block` consecutive elements along `fmt.axis` (the last block
zero-padded) shares one E8M0 scale 2^shared_exp. With A = max |x| in the block (a
float32), field(v) and frac(v) the exponent field and fraction bits of a float32 v,
emax = emax(elem) and m = the element's mantissa bits (6 for MXINT8, its grid being
k / 64), `fmt.scale_mode` picks shared_exp as torchao's `ScaleCalculationMode` of the
same name does (torchao/prototype/mx_formats/mx_tensor.py, `to_mx`):

  "floor" (OCP §6.3): shared_exp = field(A) - 127 - emax, i.e. floor(log2 A) - emax
    (a float32-subnormal A counts as 2^-127);
  "ceil":  shared_exp = field(A) - 127 + [frac(A) != 0] - emax, i.e. ceil(log2 A) - emax
    for a normal A (a subnormal A counts as 2^-126);
  "even":  A is first rounded to m mantissa bits, half away from zero, on its bits:
    A' = (bits(A) + 2^(22 - m)) & 0x7F800000, then shared_exp = field(A') - 127 - emax
    (A' may be 2^128 for a finite A near float32's max);
  "rceil" (cuBLAS / `cvt.rp.satfinite.ue8m0x2.f32`): D = fl32(A / max(elem)), one IEEE
    division (subnormal D included), and shared_exp = ceil(log2 D) exactly from D's bits:
    field(D) - 127 + [frac(D) != 0] for a normal D, -126 for a subnormal D above 2^-127,
    and -127 (after the clamp) for D <= 2^-127 and D = 0,

each then clamped below at -127; a shared_exp above 127 (an E8M0 NaN scale) makes the
block NaN in every mode. Elements are x / 2^shared_exp rounded by the element format
with overflow saturating to ±max(elem) (OCP §6.3), then multiplied back by 2^shared_exp
-- the same for every mode ("ceil" and "rceil" never saturate: A / 2^shared_exp <= max).
The product is a float32 in "floor" mode (shared_exp <= 127 - emax); the other modes
reach shared_exp = 128 - emax for A above 2^127, where an element rounding up to 2^emax
gives 2^128: that product is ±inf, as torchao's float32 dequantization gives.

Where torchao 0.18's `to_mx` differs (on CPU, eager), jlp keeps the OCP rules above:
a block whose shared_exp is -127 is divided by 2^-126 in "floor"/"ceil"/"even" (torchao
clamps the float scale to the smallest normal) and multiplied by 1.0 instead of 2^127 in
"rceil"; a block holding inf gets a finite scale there (2^(128 - emax), "rceil" 2^127)
instead of NaN; and its "rceil" fallback takes ceil(torch.log2(D)) in float32, which is
one too low when D lies a few ulps above a power of two (torchao's later
`_f32_to_e8m0_rceil` and the hardware instruction take the exact ceiling, as here).

With `fmt.prescale` = p != 1 (Tseng et al.'s 3/4, arXiv:2502.20586) the shared exponent is
chosen as above from the block as given; each finite element is then multiplied by p (one IEEE
float32 multiply, `jlp.numerics.ieee_f32.mul_bits`), scaled down, cast and scaled back as above,
and divided by p (one IEEE float32 division, `div_bits`; an infinite product stays infinite):
value = fl32(fl32(elem(fl32(x · p) / 2^shared_exp) · 2^shared_exp) / p). It always takes the
scale-down-cast-scale-back path.

Special cases: a block holding inf or NaN, or one whose shared_exp would exceed
127 (an E8M0 NaN scale), becomes all NaN; an all-zero block keeps its signed
zeros; elements keep their sign when they round to zero.

MXINT8 elements are k / 64 with k = round-half-even(v · 64) clamped to
[-127, 127] (-128 unused, as microxcaling reads the spec).

The power-of-two scalings are integer ops on the bit patterns, so float32
subnormal inputs and outputs are exact whatever the backend does with subnormal
float arithmetic: adding ±shared_exp to the exponent field where the element grid
allows it (`_exponent_scaling_is_exact`: every OCP element format, nearest or
truncating rounding), else the general `ldexp_bits`. Both give the same bits.

Each block's scale is carried as an int32 code: -1 for an all-zero block,
shared_exp + 127 (0..254, the E8M0 byte) otherwise, 255 for a NaN block
(`_scale_codes`). The XLA path reads x twice: once for each block's scale code (a
reshape of the zero-padded axis into (blocks, block); in "floor" mode only the
largest exponent field decides the shared exponent, and a max of 8-bit fields
vectorizes on XLA:CPU where a max of whole bit patterns, which the other modes
need, runs as a scalar compare-and-branch loop), once to quantize x in its own
shape, so a donated buffer is written in place. With nearest rounding,
when every block is all zero, non-finite, or has its largest field in the range
`_nearest_fields(fmt)` (for E4M3 blocks, max |x| from 2^-108 to 2^122), the elements are
rounded directly on the block's grid, the element grid times 2^shared_exp
(`_nearest_on_scaled_grid`); otherwise, and for the other roundings, they are
scaled down, cast and scaled back. Both give the same bits.

References:
  OCP Microscaling Formats (MX) Specification v1.0, 2023, §5–§6.
  pytorch/ao 0.18.0, torchao/prototype/mx_formats/mx_tensor.py (`to_mx`, `_to_mx_rceil`) and
    config.py (`ScaleCalculationMode`); NVIDIA cuBLAS documentation, "1D block quantization"
    (the RCEIL scale: UE8M0 of amax / max rounded toward +inf).
  Rouhani et al., "Microscaling Data Formats for Deep Learning", arXiv:2310.10537;
    github.com/microsoft/microxcaling (`mx/mx_ops.py`, issue #4 on saturation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import INT8, FloatFormat, MXFormat
from jlp.numerics.float_cast import (ABS, FRAC, HIDDEN, INF, QNAN, SIGN, cast_bits, float_bits,
                                     from_bits, to_bits, u32)
from jlp.numerics.ieee_f32 import div_bits, mul_bits
from jlp.numerics.shared import shared_jit

E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
# MXINT8's grid k/64 for |v| < 2 is the grid of an e2m6 float (emin 0, step 2^-6 below 2).
_INT8_GRID = FloatFormat(2, 6)
_INT8_MAX_BITS = float_bits(127 / 64)
ZERO_BLOCK = -1  # the scale code of an all-zero block
NAN_SCALE = 255  # the scale code of a NaN block (E8M0's NaN byte)


def ldexp_bits(u: jax.Array, k: jax.Array) -> jax.Array:
  """Bits of the float32 `u` times 2^k, rounded to nearest even (IEEE, no flushing).

  Integer ops only: normal <-> subnormal transitions are exact, results past the
  float32 range are ±inf. `u` must be finite; `k` is int32, broadcast against u.
  """
  sign = u & SIGN
  a = u & ABS
  field = (a >> 23).astype(jnp.int32)
  significand = (a & FRAC) | jnp.where(field > 0, HIDDEN, u32(0))
  # Normalize: leading one to bit 23 (clz of a nonzero significand is 8..31).
  lead_shift = jnp.clip(lax.clz(significand.astype(jnp.int32)) - 8, 0, 23)
  normalized = significand << lead_shift.astype(jnp.uint32)
  out_field = jnp.maximum(field, 1) - lead_shift + k

  normal = (jnp.clip(out_field, 1, 254).astype(jnp.uint32) << 23) | (normalized & FRAC)
  normal = jnp.where(out_field >= 255, INF, normal)
  # Subnormal result: normalized · 2^(out_field - 1) in units of 2^-149; a rounding
  # carry into bit 23 gives the smallest normal's bits, which is the right value.
  right = jnp.clip(1 - out_field, 1, 25).astype(jnp.uint32)
  one = u32(1)
  kept = normalized >> right
  rem = normalized & ((one << right) - one)
  half = one << (right - one)
  up = (rem > half) | ((rem == half) & ((kept & one) != 0))
  subnormal = kept + jnp.where(up, one, u32(0))

  magnitude = jnp.where(out_field >= 1, normal, subnormal)
  return sign | jnp.where(significand == 0, u32(0), magnitude)


def _exponent_scaling_is_exact(fmt: MXFormat) -> bool:
  """Whether `_scale_down_bits` / `_scale_up_bits` give the same result as `ldexp_bits`.

  True when the element grid's smallest step 2^low has low >= -22 (every q · 2^shared_exp,
  shared_exp >= -127, is a float32, so scaling back is exact) and low - 1 >= -126 (a scaled
  element below 2^-126, the only case where the scaling down rounds, rounds to a zero of
  its sign by nearest or truncating rounding, as it does by the element cast; stochastic
  rounding keeps `ldexp_bits`).
  """
  grid = _INT8_GRID if fmt.elem == INT8 else fmt.elem
  low = grid.emin - grid.man
  return fmt.rounding != "stochastic" and low >= -22


def _scale_down_bits(u: jax.Array, shared_exp: jax.Array) -> jax.Array:
  """Bits of the finite float32 `u` times 2^-shared_exp where that is a float32 normal, else ±0.

  Exponent-field arithmetic only: a float32 subnormal input is its fraction (an int below
  2^23, exactly a float32) times 2^-149. Requires |u| < 2^(shared_exp + 128).
  """
  sign = u & SIGN
  a = u & ABS
  subnormal_in = a < HIDDEN
  base = jnp.where(subnormal_in, to_bits(a.astype(jnp.float32)), a)
  shift = jnp.where(subnormal_in, -149 - shared_exp, -shared_exp)
  out_field = (base >> 23).astype(jnp.int32) + shift
  shifted = (base.astype(jnp.int32) + (shift << 23)).astype(jnp.uint32)
  return sign | jnp.where(out_field >= 1, shifted, u32(0))


def _scale_up_bits(q: jax.Array, shared_exp: jax.Array) -> jax.Array:
  """Bits of q · 2^shared_exp for a zero or float32-normal `q` whose product is exact.

  A product below 2^-126 is the significand shifted right, exactly (no bits are lost when
  `_exponent_scaling_is_exact`). Products of 2^128 or more are ±inf for shared_exp <= 128 (an
  element of a "ceil" / "even" / "rceil" block near float32's max), garbage above (NaN scales).
  """
  sign = q & SIGN
  a = q & ABS
  out_field = (a >> 23).astype(jnp.int32) + shared_exp
  normal = (a.astype(jnp.int32) + (shared_exp << 23)).astype(jnp.uint32)
  right = jnp.clip(1 - out_field, 0, 31).astype(jnp.uint32)
  subnormal = ((a & FRAC) | HIDDEN) >> right
  magnitude = jnp.where(out_field >= 1, normal, subnormal)
  magnitude = jnp.where(out_field >= 255, INF, magnitude)
  return sign | jnp.where(a == 0, u32(0), magnitude)


def _saturating(elem: FloatFormat) -> FloatFormat:
  return dataclasses.replace(elem, overflow="saturate")


def _int8_bits(v: jax.Array) -> jax.Array:
  q = cast_bits(v, _INT8_GRID)  # |v| < 2, so no overflow
  return (q & SIGN) | jnp.minimum(q & ABS, _INT8_MAX_BITS)


def mx_rows_bits(u: jax.Array, fmt: MXFormat, rbits: jax.Array | None = None) -> jax.Array:
  """Quantizes each row of float32 bit patterns as one MX block.

  Element-wise ops and one max-reduction along axis 1; zero padding in a row
  does not change the other elements.

  Args:
    u: uint32 (R, B) float32 bit patterns, one block per row.
    fmt: the MX format (its `elem`; `block` and `axis` are already applied).
    rbits: uint32 (R, B) draws, required when the element format rounds stochastically.

  Returns:
    uint32 (R, B) bit patterns of the quantized values.
  """
  if fmt.rounding == "stochastic" and rbits is None:
    raise ValueError("stochastic rounding needs rbits (uint32, one per element)")
  largest = jnp.max(u & ABS, axis=1, keepdims=True)
  return _mx_bits_given_scale(u, _scale_codes(largest, fmt), fmt, rbits)


def _elem_man(fmt: MXFormat) -> int:
  return _INT8_GRID.man if fmt.elem == INT8 else fmt.elem.man


def _unclamped_shared_exp(largest: jax.Array, fmt: MXFormat) -> jax.Array:
  """int32 shared exponent of blocks whose max |x| has the finite bits `largest`, by
  `fmt.scale_mode` (module docstring), before the clamp to [-127, 127]."""
  mode = fmt.scale_mode
  emax = fmt.elem_emax
  if mode == "rceil":
    max_bits = _INT8_MAX_BITS if fmt.elem == INT8 else float_bits(fmt.elem.max)
    largest = div_bits(largest, jnp.full_like(largest, max_bits))
    emax = 0
  if mode == "even":
    largest = largest + u32(1 << (22 - _elem_man(fmt)))  # the carry is all that matters
  field = (largest >> 23).astype(jnp.int32)
  fraction = largest & FRAC
  if mode == "floor" or mode == "even":
    return field - 127 - emax
  ceil = field - 127 + (fraction != 0).astype(jnp.int32) - emax
  if mode == "ceil":
    return ceil
  # rceil: D = m · 2^-149 subnormal: ceil(log2 D) <= -127 for m <= 2^22, else -126.
  return jnp.where(field > 0, ceil, jnp.where(fraction > u32(1 << 22), -126, -127))


def _scale_codes(largest: jax.Array, fmt: MXFormat) -> jax.Array:
  """int32 scale codes (module docstring) of blocks whose max |x| has the bits `largest`
  (>= INF: the block holds inf or NaN)."""
  finite = largest < INF
  shared_exp = _unclamped_shared_exp(jnp.where(finite, largest, u32(0)), fmt)
  code = jnp.maximum(shared_exp, E8M0_MIN_EXP) + 127
  code = jnp.where(finite & (shared_exp <= E8M0_MAX_EXP), code, NAN_SCALE)
  return jnp.where(largest == 0, ZERO_BLOCK, code)


def _field_codes_to_scale_codes(codes: jax.Array, fmt: MXFormat) -> jax.Array:
  """"floor" scale codes from `_block_field_codes` (0, or 1 + the largest exponent field)."""
  shared_exp = codes.astype(jnp.int32) - 128 - fmt.elem_emax
  code = jnp.where((codes >= 256) | (shared_exp > E8M0_MAX_EXP), NAN_SCALE,
                   jnp.maximum(shared_exp, E8M0_MIN_EXP) + 127)
  return jnp.where(codes == 0, ZERO_BLOCK, code)


def _mx_bits_given_scale(u: jax.Array, code: jax.Array, fmt: MXFormat,
                         rbits: jax.Array | None) -> jax.Array:
  """Element-wise MX quantization of bit patterns `u` whose blocks have the scale codes `code`."""
  a = u & ABS
  shared_exp = jnp.maximum(code, 0) - 127
  nan_scale = code >= NAN_SCALE

  finite = jnp.where(a >= INF, u32(0), u)
  if fmt.prescale != 1.0:
    finite = mul_bits(finite, jnp.full_like(finite, float_bits(fmt.prescale)))
  exact = _exponent_scaling_is_exact(fmt)
  scaled = _scale_down_bits(finite, shared_exp) if exact else ldexp_bits(finite, -shared_exp)
  if fmt.elem == INT8:
    q = _int8_bits(scaled)
  else:
    q = cast_bits(scaled, _saturating(fmt.elem), rbits)
  out = _scale_up_bits(q, shared_exp) if exact else ldexp_bits(q, shared_exp)
  if fmt.prescale != 1.0:
    infinite = (out & ABS) >= INF  # an element of a "ceil" / "even" / "rceil" block near 2^128
    out = jnp.where(infinite, out, div_bits(jnp.where(infinite, u32(0), out),
                                            jnp.full_like(out, float_bits(fmt.prescale))))
  return jnp.where(nan_scale, QNAN, out)


def _nearest_fields(fmt: MXFormat) -> tuple[int, int]:
  """The range of a block's largest exponent field F in which `_nearest_on_scaled_grid` is exact.

  With shared_exp = F - 127 - emax and the block grid's subnormal step Q = 2^(emin + shared_exp
  - man): from below, Q >= 2^-125, so float32-subnormal elements (which the backend may read as
  0) lie below Q / 2 and round to 0, and every result k · Q is a float32 normal; from above,
  2^23 · Q (the constant C of the rounding) is a finite float32.
  """
  grid = _INT8_GRID if fmt.elem == INT8 else fmt.elem
  low = grid.emin - grid.man
  return 2 + fmt.elem_emax - low, 231 + fmt.elem_emax - low


def _nearest_scale_codes(fmt: MXFormat) -> tuple[int, int]:
  """`_nearest_fields(fmt)` as scale codes: shared_exp + 127 = field - emax there."""
  low, high = _nearest_fields(fmt)
  return low - fmt.elem_emax, min(high - fmt.elem_emax, 254)


def _nearest_on_scaled_grid(u: jax.Array, code: jax.Array, fmt: MXFormat) -> jax.Array:
  """MX with nearest rounding, on the grid of the element format scaled by 2^shared_exp.

  `code` is the block's scale code, in `_nearest_scale_codes(fmt)` or 255 (a NaN block); an
  all-zero block may pass any code of that range. In the block grid's normal range
  (|x| >= 2^(emin + shared_exp)) the grid is float32's with the low 23 - man bits dropped, so
  the bits are rounded directly (a carry into the exponent is right). Below it the step is
  Q = 2^(emin + shared_exp - man): |x| + C with C = 2^23 · Q is rounded to nearest even by the
  float addition, its bits minus C's count the steps k (as in `float_cast`), and k · Q is
  exact. Results above the block's largest value max(elem) · 2^shared_exp saturate to it.
  """
  grid = _INT8_GRID if fmt.elem == INT8 else fmt.elem
  s = 23 - grid.man
  max_bits = _INT8_MAX_BITS if fmt.elem == INT8 else float_bits(fmt.elem.max)
  shared_exp = code - 127

  def power_bits(exponent: jax.Array) -> jax.Array:
    return ((exponent + 127) << 23).astype(jnp.uint32)

  a = u & ABS
  normal = (a + u32((1 << (s - 1)) - 1) + ((a >> u32(s)) & u32(1))) & ~u32((1 << s) - 1)
  step = shared_exp + (grid.emin - grid.man)
  c = power_bits(step + 23)
  steps = lax.bitcast_convert_type(to_bits(from_bits(a) + from_bits(c)) - c, jnp.int32)
  below = to_bits(steps.astype(jnp.float32) * from_bits(power_bits(step)))
  q = jnp.where(a < power_bits(shared_exp + grid.emin), below, normal)
  q = jnp.minimum(q, (max_bits.astype(jnp.int32) + (shared_exp << 23)).astype(jnp.uint32))
  return jnp.where(code >= NAN_SCALE, QNAN, (u & SIGN) | q)


def _scale_codes_on_scaled_grid(code: jax.Array, fmt: MXFormat) -> jax.Array:
  """Whether every block (scale codes) is all zero, NaN or has its code in
  `_nearest_scale_codes(fmt)`: then `_nearest_on_scaled_grid` quantizes x."""
  low, high = _nearest_scale_codes(fmt)
  return jnp.all(((code >= low) & (code <= high)) | (code == ZERO_BLOCK) | (code == NAN_SCALE))


def _rounds_on_scaled_grid(codes: jax.Array, fmt: MXFormat) -> jax.Array:
  """`_scale_codes_on_scaled_grid` for "floor" blocks given by `_block_field_codes`: every
  block is all zero, non-finite or has its largest field in `_nearest_fields(fmt)`."""
  return _scale_codes_on_scaled_grid(_field_codes_to_scale_codes(codes, fmt), fmt)


def _block_field_codes(u: jax.Array, axis: int, block: int) -> jax.Array:
  """Per MX block along `axis`: 0 for an all-zero block, else 1 + the largest exponent field.

  The axis is zero-padded to whole blocks, split into (blocks, block) by a reshape and reduced;
  the result has a size-1 axis after the blocks axis (`_broadcast_blocks` undoes the split).
  A float32 subnormal's field is 0, so a nonzero block's code is at least 1.
  """
  length = u.shape[axis]
  count = -(-length // block)
  a = u & ABS
  codes = (a >> 23) + (a != 0).astype(jnp.uint32)
  pad = [(0, 0)] * u.ndim
  pad[axis] = (0, count * block - length)
  split = u.shape[:axis] + (count, block) + u.shape[axis + 1:]
  return jnp.max(jnp.pad(codes, pad).reshape(split), axis=axis + 1, keepdims=True)


def _block_largest(u: jax.Array, axis: int, block: int) -> jax.Array:
  """Per MX block along `axis`: the bits of max |x| (split as `_block_field_codes`)."""
  length = u.shape[axis]
  count = -(-length // block)
  pad = [(0, 0)] * u.ndim
  pad[axis] = (0, count * block - length)
  split = u.shape[:axis] + (count, block) + u.shape[axis + 1:]
  return jnp.max(jnp.pad(u & ABS, pad).reshape(split), axis=axis + 1, keepdims=True)


def _broadcast_blocks(per_block: jax.Array, shape: tuple[int, ...], axis: int,
                      block: int) -> jax.Array:
  """Per-block values (from `_block_field_codes`) broadcast back to every element of `shape`."""
  count = per_block.shape[axis]
  split = shape[:axis] + (count, block) + shape[axis + 1:]
  padded = shape[:axis] + (count * block,) + shape[axis + 1:]
  full = jnp.broadcast_to(per_block, split).reshape(padded)
  return lax.slice_in_dim(full, 0, shape[axis], axis=axis)


def mx_quantize(x: jax.Array, fmt: MXFormat, rbits: jax.Array | None = None) -> jax.Array:
  """float32 `x` quantized to `fmt` (OCP MX), as float32 (the XLA path of `jlp.quantize`).

  Args:
    x: float32 array; `fmt.axis` must be one of its axes.
    fmt: the MX format.
    rbits: uint32 draws of x's shape, required when the element format rounds
      stochastically.

  Returns:
    float32 array of x's shape.
  """
  fmt.check_rank(x.ndim)
  if fmt.rounding == "stochastic" and rbits is None:
    raise ValueError("stochastic rounding needs rbits (uint32, x.shape)")
  x = jnp.asarray(x, jnp.float32)
  if x.size == 0:
    return x
  u = to_bits(x)
  axis = fmt.axis % u.ndim
  block = min(fmt.block, u.shape[axis])
  if fmt.scale_mode == "floor":
    codes = _field_codes_to_scale_codes(_block_field_codes(u, axis, block), fmt)
  else:
    codes = _scale_codes(_block_largest(u, axis, block), fmt)

  # The branches take x, not u: a bitcast outside lax.cond made XLA:CPU copy a donated buffer.
  def general(x: jax.Array, codes: jax.Array) -> jax.Array:
    code = _broadcast_blocks(codes, x.shape, axis, block)
    r = jnp.asarray(rbits, jnp.uint32) if fmt.rounding == "stochastic" else None
    return from_bits(_mx_bits_given_scale(to_bits(x), code, fmt, r))

  if fmt.rounding != "nearest" or fmt.prescale != 1.0:
    return general(x, codes)

  def nearest(x: jax.Array, codes: jax.Array) -> jax.Array:
    code = _broadcast_blocks(codes, x.shape, axis, block)
    code = jnp.where(code == ZERO_BLOCK, _nearest_scale_codes(fmt)[0], code)
    return from_bits(_nearest_on_scaled_grid(to_bits(x), code, fmt))

  general_call = lambda x, codes: _general_call(x, codes, fmt=fmt, axis=axis, block=block)
  return lax.cond(_scale_codes_on_scaled_grid(codes, fmt), nearest, general_call, x, codes)


@shared_jit(static_argnames=("fmt", "axis", "block"))
def _general_call(x: jax.Array, codes: jax.Array, *, fmt: MXFormat, axis: int,
                  block: int) -> jax.Array:
  """`mx_quantize`'s general element operations (round to nearest, no draws) where the nearest
  scale's grid does not hold: a call that XLA compiles on its own (`shared_jit`), inside the
  `lax.cond`, whose boundary it already is."""
  code = _broadcast_blocks(codes, x.shape, axis, block)
  return from_bits(_mx_bits_given_scale(to_bits(x), code, fmt, None))
