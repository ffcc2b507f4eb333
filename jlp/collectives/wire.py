"""A format's own bits on the wire: float32 values on a `FloatFormat`'s grid as their codes
(sign, biased exponent, mantissa: `fmt.bits` bits in one uint8 or uint16), and back, exactly.

Encoding, from the float32 bits (sign s, exponent field E32, fraction M32) of a value v of fmt:
  * zero: exponent and mantissa fields 0;
  * |v| >= 2^emin (a normal of fmt): exponent field E32 - 127 + bias, mantissa M32 >> (23 - man);
  * 0 < |v| < 2^emin (a subnormal of fmt): exponent field 0, mantissa |v| / 2^(emin - man), an
    integer below 2^man (from the float32 significand, or M32 itself for a float32 subnormal);
  * inf (specials "ieee"): exponent field all ones, mantissa 0; NaN: exponent field all ones and
    mantissa all ones (the NaN of "nan_only" and one of "ieee"'s), decoded as float32's quiet NaN
    with its sign.
Decoding is the inverse, with integer operations only (XLA:CPU flushes float32 subnormal results,
so no float arithmetic builds a value). Every float32 value a cast to fmt produces round-trips
bit for bit, except NaN payloads.

Packed wires need `packable(fmt)`: at most 16 bits, no `compat` (CPD's and QPyTorch's casts may
leave their nominal grid) and, with "ieee" specials, a mantissa to hold NaN (man >= 1).

A vector of codes of a format of at most 4 bits can travel two to a byte (`pack_nibbles`: code
2i in the low half of byte i, code 2i + 1 in the high half, a zero half after an odd count;
`unpack_nibbles` inverts it); `vector_bytes(fmt, n)` is what n codes occupy on such a wire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import FloatFormat

__all__ = ["decode", "encode", "pack_nibbles", "packable", "unpack_nibbles", "vector_bytes",
           "wire_dtype"]


def packable(fmt: FloatFormat | None) -> bool:
  """Whether fmt's values travel as their codes (module docstring)."""
  return (fmt is not None and fmt.bits <= 16 and fmt.compat is None
          and not (fmt.specials == "ieee" and fmt.man == 0))


def wire_dtype(fmt: FloatFormat):
  """uint8 for formats of at most 8 bits, else uint16."""
  return jnp.uint8 if fmt.bits <= 8 else jnp.uint16


def vector_bytes(fmt: FloatFormat, n: int) -> int:
  """Bytes of n codes of fmt as one vector: two to a byte for at most 4 bits (`pack_nibbles`),
  else one uint8 or uint16 each."""
  if fmt.bits <= 4:
    return -(-n // 2)
  return n * jnp.dtype(wire_dtype(fmt)).itemsize


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """uint8 codes [n] (each below 16) two to a byte: [ceil(n / 2)] (module docstring)."""
  codes = codes.astype(jnp.uint8)
  if codes.shape[0] % 2:
    codes = jnp.concatenate([codes, jnp.zeros((1,), jnp.uint8)])
  pairs = codes.reshape(-1, 2)
  return pairs[:, 0] | (pairs[:, 1] << jnp.uint8(4))


def unpack_nibbles(packed: jax.Array, n: int) -> jax.Array:
  """The n codes of `pack_nibbles(codes)` (leading axes of packed kept): [..., n] uint8."""
  low, high = packed & jnp.uint8(0xF), packed >> jnp.uint8(4)
  both = jnp.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (-1,))
  return both[..., :n]


def encode(x: jax.Array, fmt: FloatFormat) -> jax.Array:
  """The codes of x (float32 values of fmt) as `wire_dtype(fmt)`."""
  e, m = fmt.exp, fmt.man
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  sign = bits >> 31
  e32 = ((bits >> 23) & 0xFF).astype(jnp.int32)
  m32 = bits & 0x7FFFFF
  top = (1 << e) - 1
  emin = 1 - fmt.bias
  unbiased = e32 - 127
  normal = unbiased >= emin
  field = jnp.where(normal, unbiased + fmt.bias, 0)
  mant_normal = m32 >> (23 - m)
  # A subnormal of fmt that is a float32 normal: (2^23 + M32) * 2^(E - 23) / 2^(emin - m).
  shift = jnp.clip((23 - m) + (emin - unbiased), 0, 31).astype(jnp.uint32)
  mant_sub = jnp.where(e32 == 0, m32 >> (23 - m), ((m32 | (1 << 23)) >> shift))
  mant = jnp.where(normal, mant_normal, mant_sub)
  special = e32 == 0xFF
  nan = special & (m32 != 0)
  field = jnp.where(special, top, field)
  mant = jnp.where(special, jnp.where(nan, (1 << m) - 1, 0), mant)
  code = (sign << (e + m)) | (field.astype(jnp.uint32) << m) | mant
  return code.astype(wire_dtype(fmt))


def decode(code: jax.Array, fmt: FloatFormat) -> jax.Array:
  """The float32 values of `encode`'s codes."""
  e, m = fmt.exp, fmt.man
  code = code.astype(jnp.uint32)
  sign = (code >> (e + m)) & 1
  field = ((code >> m) & ((1 << e) - 1)).astype(jnp.int32)
  mant = code & ((1 << m) - 1)
  top = (1 << e) - 1
  emin = 1 - fmt.bias
  # Normals of fmt.
  e32 = field - fmt.bias + 127
  bits_normal = (e32.astype(jnp.uint32) << 23) | (mant << (23 - m))
  # Subnormals of fmt: mant * 2^(emin - m); a float32 subnormal only when exp = 8.
  lead = 31 - lax.clz(jnp.maximum(mant, 1)).astype(jnp.int32)  # the leading one's position
  e32_sub = (emin - m + lead + 127)
  frac = (mant ^ (jnp.uint32(1) << lead.astype(jnp.uint32))) << (23 - lead).astype(jnp.uint32)
  if e == 8:
    bits_sub = mant << (23 - m)
  else:
    bits_sub = (e32_sub.astype(jnp.uint32) << 23) | frac
  bits_sub = jnp.where(mant == 0, 0, bits_sub)
  bits = jnp.where(field == 0, bits_sub, bits_normal)
  if fmt.specials == "ieee":
    bits = jnp.where(field == top, jnp.where(mant == 0, 0x7F800000, 0x7FC00000), bits)
  elif fmt.specials == "nan_only":
    bits = jnp.where((field == top) & (mant == (1 << m) - 1), 0x7FC00000, bits)
  return lax.bitcast_convert_type(bits | (sign << 31), jnp.float32)
