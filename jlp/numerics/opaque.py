"""Values XLA cannot see through, to keep the bits of a float32 expression the same in every
program: XLA:CPU contracts a multiply and a following add into one fused multiply-add (rounded
once) in some fusions and not in others."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["opaque_zero", "rounded_product"]


def opaque_zero() -> jax.Array:
  """A uint32 zero that the compiler cannot constant-fold (blocks FMA contraction)."""
  return lax.optimization_barrier(jnp.zeros((), jnp.uint32))


def rounded_product(x: jax.Array, y: jax.Array, zero: jax.Array) -> jax.Array:
  """fl32(x * y), forced to be rounded to float32 before any later addition.

  `zero` is an opaque uint32 zero (`opaque_zero()`, or one loaded from memory
  inside a kernel): OR-ing it into the product's bits keeps the compiler from
  fusing the multiply into a following add (an FMA rounds only once).
  """
  p = lax.bitcast_convert_type(x * y, jnp.uint32) | zero
  return lax.bitcast_convert_type(p, jnp.float32)
