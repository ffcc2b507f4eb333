"""IEEE 754 binary32 division, multiplication and addition that do not depend on the backend's
handling of subnormals.

`div_bits(a, b)` and `mul_bits(a, b)` return the bits of fl32(a / b) and fl32(a · b), rounded to
nearest even with gradual underflow (subnormal operands and results are exact) and overflow to
±inf, as IEEE 754 specifies. They exist because the float ops cannot be trusted for that here:
XLA:CPU flushes subnormal float32 results to zero and compiles `x / s` with a scalar `s` as
x · (1/s), and a GPU kernel's float division may be approximate or flush
subnormals. Built from uint32 shifts, masks, multiplies and divisions (every shift amount below
32), they give the same bits in plain XLA, in a Pallas kernel and under the Pallas interpreter.

Method: a finite nonzero operand is unpacked to a significand m in [2^23, 2^24) and an unbiased
exponent e (value m · 2^(e - 23); subnormals are normalized with a count of leading zeros).
Division takes the 25-bit quotient floor(n · 2^24 / m_b) (n = m_a or 2 m_a, so that the quotient
lies in [1, 2)) by long division, eight bits a step (the remainder stays below 2^24, so a shifted
remainder fits 32 bits), and a sticky bit from the final remainder. Multiplication forms the
48-bit product of the significands from 12-bit limbs and keeps its top 25 bits and a sticky bit.
`_round_pack` then rounds (25 bits + sticky) once, to nearest even, at float32's normal or
subnormal position.

Operands must be finite; the divisor must be nonzero. A zero operand (or dividend) gives a zero
whose sign is the XOR of the operands' signs.

`ieee_add(x, y)` takes and returns float32 (any operands, inf and NaN included): the backend's
addition where it is exact, a rescaled addition where subnormals could be flushed (see the
comment above it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.numerics.float_cast import ABS, FRAC, HIDDEN, INF, SIGN, u32
from jlp.numerics.shared import shared_jit

__all__ = ["div_bits", "div_float", "ieee_add", "mul_bits"]

_LOW12 = u32(0xFFF)
_LOW24 = u32(0xFFFFFF)


def _unpack(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(significand in [2^23, 2^24), unbiased exponent) of the nonzero finite magnitude bits `a`.

  The value is significand · 2^(exponent - 23). For a = 0 the significand is 0 (callers mask).
  """
  field = (a >> 23).astype(jnp.int32)
  significand = (a & FRAC) | jnp.where(field > 0, HIDDEN, u32(0))
  shift = jnp.clip(lax.clz(significand.astype(jnp.int32)) - 8, 0, 23)
  return significand << shift.astype(jnp.uint32), jnp.maximum(field, 1) - 127 - shift


def _round_pack(sign: jax.Array, sig: jax.Array, exponent: jax.Array,
                sticky: jax.Array) -> jax.Array:
  """Bits of sign · (sig + ε) · 2^(exponent - 24) rounded to float32 (nearest even).

  `sig` is in [2^24, 2^25); `sticky` says whether ε (a fraction of the last bit, below one) is
  nonzero. Results past float32's range are ±inf; below 2^-126 they are rounded at the subnormal
  position (a carry into bit 23 gives the smallest normal's bits, which is the right value).
  """
  one = u32(1)
  biased = exponent + 127
  base = (jnp.clip(biased, 0, 254).astype(jnp.uint32) << 23) | ((sig >> 1) & FRAC)
  up = ((sig & one) != 0) & (sticky | ((base & one) != 0))
  normal = base + up.astype(jnp.uint32)  # a carry out of 254 gives exactly inf's bits
  normal = jnp.where(biased >= 255, INF, normal)
  # Subnormal: the value in units of 2^-149 is sig · 2^(exponent + 125), a right shift by
  # t = -(exponent + 125) >= 2; t >= 26 leaves sig below half a unit (rounds to zero).
  t = jnp.clip(-(exponent + 125), 2, 26).astype(jnp.uint32)
  kept = sig >> t
  rem = sig & ((one << t) - one)
  half = one << (t - one)
  up = (rem > half) | ((rem == half) & (sticky | ((kept & one) != 0)))
  subnormal = kept + up.astype(jnp.uint32)
  return sign | jnp.where(biased >= 1, normal, subnormal)


def div_float(a: jax.Array, b: jax.Array) -> jax.Array:
  """a / b in float32 by the backend's one float32 division (XLA:CPU: IEEE, subnormal operands
  read as 0 and subnormal results flushed; a GPU divides approximately): the barrier keeps XLA
  from rewriting a division by a constant or by a quotient as a product with a reciprocal (two
  roundings). `div_bits` is the exact division on every backend."""
  return a / lax.optimization_barrier(b)


@shared_jit
def div_bits(a: jax.Array, b: jax.Array) -> jax.Array:
  """Bits of fl32(a / b) for float32 bit patterns `a` (finite) and `b` (finite, nonzero).

  Correctly rounded to nearest even, subnormals included; uint32 in, uint32 out (broadcast).
  """
  sign = (a ^ b) & SIGN
  ma, ea = _unpack(a & ABS)
  mb, eb = _unpack(b & ABS)
  below = ma < mb
  n = jnp.where(below, ma << u32(1), ma)  # n / mb in [1, 2)
  exponent = ea - eb - below.astype(jnp.int32)
  q = jnp.ones_like(n)
  r = n - mb
  for _ in range(3):  # r < mb < 2^24, so r << 8 fits
    r = r << u32(8)
    d = r // mb
    r = r - d * mb
    q = (q << u32(8)) | d
  out = _round_pack(sign, q, exponent, r != 0)
  return jnp.where((a & ABS) == 0, sign, out)


@shared_jit
def mul_bits(a: jax.Array, b: jax.Array) -> jax.Array:
  """Bits of fl32(a · b) for finite float32 bit patterns `a` and `b`.

  Correctly rounded to nearest even, subnormals included, ±inf past float32's range; uint32 in,
  uint32 out (broadcast).
  """
  sign = (a ^ b) & SIGN
  ma, ea = _unpack(a & ABS)
  mb, eb = _unpack(b & ABS)
  ah, al = ma >> u32(12), ma & _LOW12
  bh, bl = mb >> u32(12), mb & _LOW12
  mid = ah * bl + al * bh  # < 2^25
  low = al * bl + ((mid & _LOW12) << u32(12))  # < 2^25
  high = ah * bh + (mid >> u32(12)) + (low >> u32(24))  # product = high · 2^24 + low24
  low = low & _LOW24
  top = high >= u32(1 << 23)  # product in [2^47, 2^48)
  sig = jnp.where(top, (high << u32(1)) | (low >> u32(23)), (high << u32(2)) | (low >> u32(22)))
  sticky = jnp.where(top, low & u32(0x7FFFFF), low & u32(0x3FFFFF)) != 0
  out = _round_pack(sign, sig, ea + eb + top.astype(jnp.int32), sticky)
  return jnp.where(((a & ABS) == 0) | ((b & ABS) == 0), sign, out)


# -- addition --------------------------------------------------------------------------------------

_ADD_SIGN = np.uint32(0x80000000)
_ADD_ABS = np.uint32(0x7FFFFFFF)
_ADD_FRAC = np.uint32(0x007FFFFF)
_ADD_HIDDEN = np.uint32(0x00800000)
_ADD_SCALE = 64                                  # operands below 2^-60 are scaled by 2^64
_ADD_SMALL = np.uint32((127 - 60) << 23)         # bits of 2^-60
_ADD_SHIFT = np.uint32(_ADD_SCALE << 23)             # 2^64 as an exponent-field increment
_ADD_SUB_UNIT = np.float32(2.0 ** (-149 + _ADD_SCALE))  # a float32 subnormal unit 2^-149, scaled


def _as_bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, jnp.uint32)


def _as_float(u: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(u, jnp.float32)


def _add_scale_up(u: jax.Array) -> jax.Array:
  """The float32 x * 2^64 of x (bits u, |x| < 2^-60), exact, never a subnormal."""
  exponent = lax.shift_right_logical(u, np.uint32(23)) & np.uint32(0xFF)
  units = lax.convert_element_type((u & _ADD_FRAC).astype(jnp.int32), jnp.float32)  # < 2^23, exact
  subnormal = _as_bits(units * _ADD_SUB_UNIT) | (u & _ADD_SIGN)  # u * 2^-149 * 2^64 = units * 2^-85
  return _as_float(jnp.where(exponent == 0, subnormal, u + _ADD_SHIFT))


def _add_scale_down(u: jax.Array) -> jax.Array:
  """The bits of r * 2^-64 for a float32 r (bits u) that is 0 or a multiple of 2^-85 below 2^5."""
  exponent = lax.shift_right_logical(u, np.uint32(23)) & np.uint32(0xFF)
  sign = u & _ADD_SIGN
  # r = sig24 * 2^(e - 150), so r * 2^-64 = (sig24 >> (65 - e)) * 2^-149 for e <= 64 (exact).
  shift = jnp.clip(65 - exponent.astype(jnp.int32), 0, 31).astype(jnp.uint32)
  subnormal = sign | lax.shift_right_logical((u & _ADD_FRAC) | _ADD_HIDDEN, shift)
  small = jnp.where(exponent == 0, sign, subnormal)
  return jnp.where(exponent > np.uint32(_ADD_SCALE), u - _ADD_SHIFT, small)


# IEEE 754 binary32 addition whose result does not depend on the backend flushing subnormals.
#
# XLA:CPU runs float32 arithmetic with flush-to-zero and denormals-are-zero: a
# float32 subnormal operand is read as 0 and a subnormal result is written as 0
# (`jit(lambda v: v * 0.5)(2**-126)` is 0.0). `ieee_add(x, y)` returns the
# correctly rounded IEEE sum (round to nearest, ties to even, gradual underflow)
# on any backend, in XLA and inside Pallas kernels, bit for bit:
#
# * max(|x|, |y|) >= 2^-60 (or either is inf / NaN): the backend's own float32
#   addition. It is exact here: the sum of two floats whose larger exponent is
#   >= -61 is a multiple of 2^-84 (never a nonzero subnormal), and a subnormal
#   addend is below half an ulp of the larger operand (>= 2^-84), so dropping it
#   gives the same rounded sum (the larger operand itself).
# * both below 2^-60: both are scaled by 2^64 (exactly, with integer operations:
#   a normal one by adding 64 to its exponent field, a subnormal one u * 2^-149
#   as float(u) * 2^-85), added in float32 (every operand and every nonzero
#   result is then a normal float32: a multiple of 2^-85 below 2^5), and the sum
#   is scaled back by 2^-64 with integer operations (a result below 2^-126 is
#   exact, since both operands are multiples of 2^-149, and becomes the
#   subnormal with that integer significand). Rounding commutes with the power
#   of two scaling outside the subnormal range, so this is the IEEE result.
#
# Signed zeros follow IEEE: x + (-x) = +0, (-0) + (-0) = -0.
def ieee_add(x: jax.Array, y: jax.Array) -> jax.Array:
  """fl32(x + y): IEEE 754 binary32 addition, round to nearest even, subnormals exact.

  Args:
    x, y: float32 arrays of the same shape (or broadcastable).

  Returns:
    float32: the IEEE sum, bit for bit, whatever the backend does with subnormals
    (see the module docstring for the method).
  """
  xb, yb = _as_bits(x), _as_bits(y)
  small = jnp.maximum(xb & _ADD_ABS, yb & _ADD_ABS) < _ADD_SMALL
  plain = _as_bits(x + y)
  scaled = _add_scale_down(_as_bits(_add_scale_up(xb) + _add_scale_up(yb)))
  return _as_float(jnp.where(small, scaled, plain))
