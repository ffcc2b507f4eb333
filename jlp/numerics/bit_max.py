"""Maxima of uint32 arrays (float32 magnitude bits) in the shapes XLA:CPU vectorizes.

XLA:CPU compiles some max reductions to scalar loops, about a tenth of the memory bandwidth on
this project's machines (a sum of the same shape runs at full speed): over a minor axis of 32
or more elements, over a whole large array, and into outputs whose minor axis has 8 elements.
Reductions over a leading axis (16 rows at a time, or the 16-element columns of a
row) vectorize; the optimization barriers keep XLA from fusing the steps back into one slow
loop. Integer maxima are exact in any order, so the results are `jnp.max`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def max_rows(a: jax.Array) -> jax.Array:
  """max over axis 1 of the 2-D uint32 `a`, keepdims: while the rows are a multiple of 16 and
  longer, the maxima of their 16-element columns (a reduction over a leading axis), then one
  reduction of each row."""
  while a.shape[1] > 16 and a.shape[1] % 16 == 0:
    a = lax.optimization_barrier(jnp.max(a.reshape(a.shape[0], -1, 16), axis=1))
  return jnp.max(a, axis=1, keepdims=True)


def fold_rows(a: jax.Array) -> jax.Array:
  """The 3-D uint32 `a` (n, rows, cols) with its rows folded by maxima 16 at a time while their
  count is a multiple of 16 and above 16 (same maxima over axis 1)."""
  n, _, cols = a.shape
  while a.shape[1] > 16 and a.shape[1] % 16 == 0:
    a = lax.optimization_barrier(jnp.max(a.reshape(n, -1, 16, cols), axis=2))
  return a


def max_all(a: jax.Array) -> jax.Array:
  """max over all elements of the 2-D uint32 `a`, as a (1, 1) array: `fold_rows`, then
  `max_rows` and one reduction of the rest."""
  return jnp.max(max_rows(fold_rows(a[None])[0]), axis=0, keepdims=True)
