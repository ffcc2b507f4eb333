"""Bit-exact emulations of two peer systems' float casts (FloatFormat.compat).

* `cpd_cast_bits`: CPD's `float_quantize(x, exp, man)` (github.com/drcut/CPD,
  `CPDtorch/quant/quant_cuda/float_kernel.cu`, device function `cast_precision`).
* `qtorch_cast_bits`: QPyTorch 0.3.0's `float_quantize(x, exp, man, rounding)` on
  the CPU (github.com/Tiiiger/QPyTorch, `qtorch/quant/quant_cpu/quant_cpu.cpp` and
  `bit_helper.cpp`).

Both take and return uint32 float32 bit patterns and use only element-wise
integer ops (plus float adds/subtracts whose operands and results are float32
normals or zeros, so that flushing subnormals cannot change them), so that they
give the same bits in XLA on any backend and inside Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jlp.formats import FloatFormat
from jlp.numerics.f32_bits import (ABS, FRAC, HIDDEN, INF, QNAN, SIGN, float_bits, from_bits,
                                   to_bits, u32)


def _cpd_round(m: jax.Array, s: int) -> jax.Array:
  """CPD's round to nearest even of integer `m` at bit `s` (low `s` bits cleared).

  guard = bit s-1, sticky = bits 0..s-2, lsb = bit s: round up iff guard and
  (sticky or lsb). The result may carry into bit s + 1 of m's top.
  """
  if s == 0:
    return m
  one = u32(1)
  guard = (m >> u32(s - 1)) & one
  sticky = m & u32((1 << (s - 1)) - 1)
  lsb = (m >> u32(s)) & one
  up = (guard != 0) & ((sticky != 0) | (lsb != 0))
  return (m & u32(~((1 << s) - 1) & 0xFFFFFFFF)) + jnp.where(up, u32(1 << s), u32(0))


def _int_times_pow2_bits(n: jax.Array, scale_exp: int) -> jax.Array:
  """Bits of the float32 n * 2^scale_exp, for integers 0 <= n <= 2^23.

  Valid when every nonzero result is a float32 normal. float(n) is an exact
  int32 -> float32 conversion (n < 2^24), and the scaling an integer add to the
  exponent field, so no backend's subnormal flushing can touch it.
  """
  n_float_bits = to_bits(lax.bitcast_convert_type(n, jnp.int32).astype(jnp.float32))
  scaled = n_float_bits + u32((scale_exp << 23) & 0xFFFFFFFF)  # mod 2^32: scale_exp < 0 works
  return jnp.where(n == 0, u32(0), scaled)


def cpd_cast_bits(u: jax.Array, fmt: FloatFormat) -> jax.Array:
  """CPD's `float_quantize(x, fmt.exp, fmt.man)`, bit for bit, on float32 bits.

  Round to nearest even with an IEEE-style grid (bias 2^(exp-1) - 1, top exponent
  reserved, gradual underflow) and CPD's quirks:

  * A: overflow is tested on the exponent before rounding, so |x| in
    [max + half an ulp, 2^(emax+1)) becomes ±2^(emax+1), a value outside the
    format; only |x| >= 2^(emax+1) gives ±inf. For exp = 8 the carry reaches
    float32's inf exponent and gives ±inf, as IEEE does.
  * B: in the format's subnormal range the significand is shifted right first
    and the shifted-out bits are dropped, not used as sticky bits (a value just
    above a tie rounds as the tie).
  * C: float32 subnormal inputs give +0.0 (for every exp, 8 included).

  ±0, ±inf and NaN (payload included) pass through unchanged; a negative value
  that underflows gives -0.0. FloatFormat restricts compat="cpd" to round to
  nearest, and to man <= 22 unless exp = 8 (CPD's man = 23 path then is the
  identity on normal inputs).

  Args:
    u: uint32 float32 bit patterns.
    fmt: a FloatFormat with compat="cpd".

  Returns:
    uint32 bit patterns of the float32 results.
  """
  man, bias = fmt.man, fmt.bias
  s = 23 - man
  sign = u & SIGN
  a = u & ABS
  e8 = a >> 23
  sig = (a & FRAC) | HIDDEN
  # Normal in the format: round the 24-bit significand; a carry to 2^24 moves into
  # the exponent field by itself (exp = 8: 254 -> 255, i.e. inf).
  mag = (e8 << 23) + _cpd_round(sig, s) - HIDDEN
  if fmt.exp < 8:
    # CPD's new_e = e8 - 127 + bias <= 0: shift right by 1 - new_e first (quirk B);
    # shifts of 24 or more leave nothing of a 24-bit significand, as CPD's >= 32.
    last_subnormal_e8 = 127 - bias
    shift = u32(last_subnormal_e8 + 1) - jnp.minimum(e8, u32(last_subnormal_e8))
    rounded = _cpd_round(sig >> jnp.minimum(shift, u32(24)), s)  # <= 2^23
    # value = rounded * 2^(emin - 23) >= 2^(emin - man) >= 2^-84: a float32 normal.
    sub_mag = _int_times_pow2_bits(rounded, fmt.emin - 23)
    mag = jnp.where(e8 <= last_subnormal_e8, sub_mag, mag)
    mag = jnp.where(e8 > u32(127 + bias), INF, mag)  # before rounding (quirk A)
  out = jnp.where(e8 == 0, u32(0), sign | mag)  # quirk C
  return jnp.where((a == 0) | (e8 == 255), u, out)


def qtorch_cast_bits(u: jax.Array, fmt: FloatFormat, rbits: jax.Array | None = None) -> jax.Array:
  """QPyTorch 0.3.0's CPU `float_quantize(x, fmt.exp, fmt.man, rounding)`, bit for bit.

  QPyTorch rounds the raw float32 bits: it adds `r` to the bit pattern (sign
  included, wrapping modulo 2^32) and clears the low 23 - man bits, with
  r = 2^(22 - man) for "nearest" (ties away from zero) and, for "stochastic",
  r = rbits & (2^(23 - man) - 1): the low 23 - man bits of `rbits` stand in for
  QPyTorch's `dis(gen) & mask`; the higher bits of `rbits` are ignored.

  * No exponent is reserved: emax = bias + 1 and fmt.max = 2^emax (2 - 2^-man).
  * A rounded exponent above emax saturates to ±fmt.max (the sign of x). This
    is what ±inf becomes, and NaN too, except that the add wraps a NaN whose
    fraction is within r of all ones: +NaN then gives -0.0 and -NaN +0.0 (with
    man = 0 the default NaN 0x7FC00000 is one of them).
  * exp = 8 never saturates (the clip compares the exponent field with 255):
    the rounding carries past float32's max into ±inf (for e8m7 from
    |x| >= 0x7F7F8000 on), and ±inf stays ±inf.
  * |x| < 2^emin goes through float32: round(x + s) - s with s = ±2^emin of x's
    sign, the float32 addition rounding to nearest even first (double rounding),
    and every zero result is +0.0 (-0.0 and negative underflow included).

  One deviation: for exp = 8 QPyTorch turns NaN inputs into payload-dependent
  garbage (inf, NaN or -0.0); here they give a quiet NaN of the input's sign.

  Args:
    u: uint32 float32 bit patterns.
    fmt: a FloatFormat with compat="qtorch" (rounding "nearest" or "stochastic").
    rbits: uint32 random bits of u's shape, for rounding="stochastic".

  Returns:
    uint32 bit patterns of the float32 results.
  """
  man = fmt.man
  s = 23 - man
  mask = u32((1 << s) - 1)
  if fmt.rounding == "stochastic":
    if rbits is None:
      raise ValueError("stochastic rounding needs rbits (uint32, x.shape)")
    increment = rbits & mask
  else:
    increment = u32(1 << (s - 1))

  def round_bitwise(bits: jax.Array) -> jax.Array:
    return (bits + increment) & ~mask

  sign = u & SIGN
  a = u & ABS
  e8 = a >> 23
  emin_e8 = fmt.emin + 127
  shift_bits = sign | u32(emin_e8 << 23)  # ±2^emin, the sign of x

  rounded = round_bitwise(u)
  if fmt.exp < 8:
    over = ((rounded & ABS) >> 23) > u32(fmt.emax + 127)
    rounded = jnp.where(over, sign | float_bits(fmt.max), rounded)
    # |x| < 2^emin: float ops, every operand and result a float32 normal or zero.
    # float32 subnormal x are zeroed first, which changes nothing: |x| < 2^-126 is
    # below half an ulp of 2^emin (2^(emin-24) >= 2^-86), so RN(2^emin + |x|) =
    # 2^emin. x + s is normal, so is its rounding, and round(x + s) - s is exact
    # (Sterbenz) and normal or +0: no backend's subnormal flushing can touch them.
    x = from_bits(jnp.where(e8 == 0, sign, u))
    shift = from_bits(shift_bits)
    shifted = round_bitwise(to_bits(x + shift))
    small = to_bits(from_bits(shifted) - shift)
  else:
    # Only zeros and float32 subnormals are below 2^emin = 2^-126. There
    # x + s = ±(2^-126 + |x|) is exact: bits HIDDEN + fraction. The difference
    # round(x + s) - s is a multiple of 2^-149 below 2^-126 or equal to it, whose
    # bits are that multiple: integer ops, as float ops would be flushed.
    shifted = round_bitwise(shift_bits + a)
    steps = (shifted & ABS) - HIDDEN
    small = jnp.where(steps == 0, u32(0), sign | steps)
    rounded = jnp.where(a > INF, sign | QNAN, rounded)
  return jnp.where(e8 < u32(emin_e8), small, rounded)
