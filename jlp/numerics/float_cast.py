"""Bit-exact float32 -> FloatFormat -> float32 casts with integer operations.

Everything here is written with `jnp`/`lax` element-wise integer ops on the
float32 bit pattern, so that

* the result never depends on the backend flushing float32 subnormals (XLA:CPU
  flushes subnormal results of float arithmetic to zero), and
* the same functions run inside Pallas kernels (`pallas_kernels/float_cast.py`)
  and in plain XLA: the kernel and the XLA path agree bit for bit.

Default semantics (compat=None) are those of ml_dtypes casts (IEEE 754 round to
nearest even, gradual underflow, the overflow rules of each ml_dtypes type);
see `jlp.FloatFormat` for the options.

Stochastic rounding takes one uint32 draw `rbits` per element: with the exact
value lying a fraction `p` of the way from the grid point below to the one above
(in magnitude), the result rounds away from zero iff `rbits < floor(p * 2^32)`
(exact integer arithmetic; p is resolved to 2^-32). `float_cast` takes the draws
either as an array or as a PRNG key, from which they are generated inside the
cast's fusion (`jlp.numerics.random_bits`: a counter-based hash of the key and
each element's global index).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.formats import FloatFormat
from jlp.numerics import compat
from jlp.numerics import random_bits as rb
# The bit helpers live below this module and `compat` (both use them); re-exported here.
from jlp.numerics.f32_bits import (ABS, FRAC, HIDDEN, INF, QNAN, SIGN, float_bits, from_bits,
                                   to_bits, u32)


def round_up_decision(rem: jax.Array, half: jax.Array, lsb: jax.Array, rounding: str,
                      stochastic_threshold=None, rbits=None) -> jax.Array:
  """Whether to step one grid point away from zero (a bool array).

  rem: dropped magnitude (integer units); half: rem of an exact tie; lsb: parity of
  the kept count. For stochastic rounding, `stochastic_threshold` is
  p * 2^32 (uint32) and `rbits` the uniform uint32 draws.
  """
  if rounding == "nearest":
    return (rem > half) | ((rem == half) & (lsb != 0) & (half != 0))
  if rounding == "truncate":
    return jnp.zeros(rem.shape, jnp.bool_)
  if rounding == "stochastic":
    return rbits < stochastic_threshold
  raise ValueError(f"rounding={rounding!r}")


def _round_deterministic(a: jax.Array, fmt: FloatFormat) -> jax.Array:
  """Magnitude bits `a` rounded to `fmt`'s grid by "nearest" or "truncate" (before overflow).

  The lean path (a handful of ops an element): in fmt's normal range the grid is
  float32's with the low 23 - man bits dropped, so the bits are rounded directly
  (a carry moves into the exponent, which is right). Below 2^emin (exp < 8) the
  grid step is Q = 2^(emin - man): nearest uses the float addition |x| + C with
  C = 2^(emin - man + 23), whose sum has ulp Q and is rounded to nearest even by
  the FPU, so its bits minus C's bits count the steps (an integer subtraction:
  XLA would simplify the float (|x| + C) - C to |x|); truncate uses
  floor(|x| / Q). The count times Q is the result. Every operand and result is
  a float32 normal or zero (|x| < 2^-126 would round to 0 and flushing it gives
  0), so subnormal flushing by the backend cannot change the result.
  """
  man = fmt.man
  s = 23 - man
  mask = u32((1 << s) - 1)
  if s == 0:
    q = a
  elif fmt.rounding == "truncate":
    q = a & ~mask
  else:
    # Parity of the kept count: bit s, or for man = 0 the hidden bit (1 for normals).
    lsb = jnp.where(a >= HIDDEN, u32(1), u32(0)) if man == 0 else (a >> u32(s)) & u32(1)
    q = (a + u32((1 << (s - 1)) - 1) + lsb) & ~mask
  if fmt.exp == 8:  # fmt's subnormals are float32's, on the same bit grid
    return q
  abs_x = from_bits(a)
  if fmt.rounding == "truncate":
    steps = jnp.floor(abs_x * np.float32(2.0 ** (man - fmt.emin)))
  else:
    c = np.float32(2.0 ** (fmt.emin - man + 23))
    steps = lax.bitcast_convert_type(to_bits(abs_x + c) - float_bits(c), jnp.int32).astype(jnp.float32)
  below = steps * np.float32(2.0 ** (fmt.emin - man))
  return jnp.where(a < u32((fmt.emin + 127) << 23), to_bits(below), q)


def _round_stochastic(a: jax.Array, fmt: FloatFormat, rbits: jax.Array) -> jax.Array:
  """Magnitude bits `a` rounded stochastically to `fmt`'s grid (before overflow): one step away
  from zero iff rbits < floor(p * 2^32), p the fraction of a grid step that is dropped.

  In fmt's normal range the grid is float32's with the low s = 23 - man bits dropped. With
  r = rbits >> (32 - s), rbits < rem * 2^(32 - s) iff r < rem iff rem + (2^s - 1 - r) carries
  into bit s, so the result is (a + (~rbits >> (32 - s))) with the low s bits cleared (a carry
  into the exponent is right). Below 2^emin (exp < 8) the grid step is Q = 2^(emin - man):
  y = |x| / Q and p = y - floor(y) are exact float32 operations (a power-of-two scale; Sterbenz),
  p * 2^32 < 2^32 is exact, so its floor converted to uint32 is the threshold, and
  (floor(y) + up) * Q is a float32 normal. A float32-subnormal |x|, which XLA:CPU flushes to 0,
  has p < 2^-32 there (exp < 8 means Q >= 2^-85), so its threshold is 0 either way.
  """
  man = fmt.man
  s = 23 - man
  if s == 0:
    q = a
  else:
    q = (a + ((~rbits) >> u32(32 - s))) & ~u32((1 << s) - 1)
  if fmt.exp == 8:  # fmt's subnormals are float32's, on the same bit grid
    return q
  y = from_bits(a) * np.float32(2.0 ** (man - fmt.emin))
  steps = jnp.floor(y)
  threshold = jnp.floor((y - steps) * np.float32(2.0 ** 32)).astype(jnp.uint32)
  steps = steps + jnp.where(rbits < threshold, np.float32(1), np.float32(0))
  below = to_bits(steps * np.float32(2.0 ** (fmt.emin - man)))
  return jnp.where(a < u32((fmt.emin + 127) << 23), below, q)


def ieee_cast_bits(u: jax.Array, fmt: FloatFormat, rbits: jax.Array | None = None) -> jax.Array:
  """float32 bits -> bits of the float32 value rounded to `fmt` (compat=None)."""
  sign = u & SIGN
  a = u & ABS
  emin_field = fmt.emin + 127  # float32 exponent field of fmt's smallest normal
  if fmt.rounding != "stochastic":
    q = _round_deterministic(a, fmt)
  else:
    q = _round_stochastic(a, fmt, rbits)

  if fmt.exp == 8 and fmt.overflow == "inf":
    # float32's own exponent range and overflow rule: a finite input rounds to at most INF's
    # bits (the carry out of max finite is exactly ±inf, and truncation stays at or below max),
    # ±inf keeps its bits, and only a NaN input needs replacing.
    q = jnp.where(a > INF, QNAN, q)
  else:
    q = _overflow(a, q, fmt)
  if not fmt.subnormals:
    q = jnp.where(q < u32(emin_field << 23), u32(0), q)
  out = sign | q
  if fmt.specials == "none":  # ml_dtypes: NaN -> a zero of the opposite sign
    return jnp.where(a > INF, sign ^ SIGN, out)
  return out


def _overflow(a: jax.Array, q: jax.Array, fmt: FloatFormat) -> jax.Array:
  """Rounded magnitude bits q of input magnitude bits a past fmt's max finite replaced by fmt's
  overflow value (±inf, max finite or NaN, by fmt's rules)."""
  max_bits = float_bits(fmt.max)
  if fmt.specials == "none" or fmt.overflow == "saturate":
    on_over = max_bits
  elif fmt.specials == "ieee":
    on_over = INF
  else:  # nan_only
    on_over = QNAN
  if fmt.rounding == "truncate" and on_over != max_bits:
    # IEEE 754 roundTowardZero: a finite overflow gives max finite; ±inf inputs don't.
    on_over = jnp.where(a < INF, max_bits, on_over)
  # A NaN input's rounded bits stay above every finite value, so it takes this branch.
  if fmt.specials != "none" and not (isinstance(on_over, np.uint32) and on_over == QNAN):
    on_over = jnp.where(a > INF, QNAN, on_over)
  return jnp.where(q > max_bits, on_over, q)


def cast_bits(u: jax.Array, fmt: FloatFormat, rbits: jax.Array | None = None) -> jax.Array:
  """float32 bits -> bits of the value in `fmt`, for every compat mode."""
  if fmt.compat is None:
    return ieee_cast_bits(u, fmt, rbits)
  if fmt.compat == "cpd":
    return compat.cpd_cast_bits(u, fmt)
  return compat.qtorch_cast_bits(u, fmt, rbits)


def float_cast(x: jax.Array, fmt: FloatFormat, rbits: jax.Array | None = None, *,
               key: jax.Array | None = None, index_offset=0, rng: str = "pairs") -> jax.Array:
  """float32 `x` rounded to `fmt`, as float32 (the XLA path of `jlp.quantize`).

  Stochastic rounding takes its draws from `rbits` (uint32, x's shape) or, when rbits is None,
  from `key`: `jlp.numerics.random_bits` stream `rng` at global index `index_offset` + the
  element's flat index, generated in the same fusion as the cast. Other roundings ignore both.
  """
  if fmt.rounding != "stochastic":
    return from_bits(cast_bits(to_bits(x), fmt))
  if rbits is not None:
    return from_bits(cast_bits(to_bits(x), fmt, rbits))
  if key is None:
    raise ValueError("stochastic rounding needs rbits (uint32, x.shape) or a key")
  return rb.map_with_bits(lambda v, r: from_bits(cast_bits(to_bits(v), fmt, r)), x, key,
                          index_offset=index_offset, rng=rng)
