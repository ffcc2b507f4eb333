"""float32 bit patterns: the field masks and the conversions between values and their uint32 bits.

The bottom of `jlp.numerics`: the casts (`float_cast`, `compat`) and the block formats build on
these and this module imports nothing of jlp. `jlp.numerics.float_cast` re-exports every name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SIGN = np.uint32(0x80000000)
ABS = np.uint32(0x7FFFFFFF)
INF = np.uint32(0x7F800000)
QNAN = np.uint32(0x7FC00000)
FRAC = np.uint32(0x007FFFFF)
HIDDEN = np.uint32(0x00800000)


def u32(v) -> np.uint32:
  return np.uint32(v)


def float_bits(v: float) -> np.uint32:
  """The float32 bit pattern of a Python float (exact for float32 values)."""
  return np.array(v, np.float32).view(np.uint32)[()]


def to_bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, jnp.uint32)


def from_bits(u: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(u, jnp.float32)
