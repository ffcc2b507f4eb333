"""Zero-setting error (ZSE) of block floating point: BFPsim's `get_zse` (docs/bfp.md).

For a group G of a BFP format (an axis-aligned box of the array, the last box
along an axis possibly smaller) with raw largest float32 exponent field M:

  * M == 0 (the group holds only zeros and float32 subnormals): contributes 0;
  * otherwise it contributes #{i in G : M - e_i + 1 > man}, e_i the raw exponent
    field of element i: exactly the elements BFPsim's truncating quantizer sets
    to +0.0, counting elements that were already exactly 0 and subnormals (e_i = 0).

ZSE = sum over groups / x.size. Zero padding of ragged last groups is never
counted. BFPsim only supports 4-D tensors; here any rank works (one block entry
per axis). The rounding mode of the format is ignored: ZSE is defined by the
truncation rule.

`man` may be a traced int32 scalar, so ZSE can be computed inside a jitted train
step while the dynamic precision controller (`jlp.nn.controller`) changes widths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlp.formats import BFPFormat
from jlp.numerics.float_cast import to_bits, u32

__all__ = ["zero_setting_error", "group_max_exponents"]


def group_max_exponents(x: jax.Array, block: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """Raw float32 exponent fields of `x` and their group maxima broadcast to x's shape.

  Returns:
    (e, group_max): int32 arrays of x's shape; group_max[i] is the largest raw
    exponent field of the group holding element i (padding ignored: zeros never
    raise a maximum).
  """
  shape = tuple(x.shape)
  dims = tuple(max(1, min(int(d), n)) for d, n in zip(block, shape))
  counts = tuple(-(-n // d) for n, d in zip(shape, dims))
  padded_shape = tuple(c * d for c, d in zip(counts, dims))
  split = tuple(v for cd in zip(counts, dims) for v in cd)
  ragged = padded_shape != shape

  e = ((to_bits(jnp.asarray(x, jnp.float32)) >> 23) & u32(0xFF)).astype(jnp.int32)
  padded = jnp.pad(e, [(0, p - n) for p, n in zip(padded_shape, shape)]) if ragged else e
  group_max = jnp.max(padded.reshape(split), axis=tuple(range(1, 2 * len(shape), 2)), keepdims=True)
  group_max = jnp.broadcast_to(group_max, split).reshape(padded_shape)
  if ragged:
    group_max = group_max[tuple(slice(0, n) for n in shape)]
  return e, group_max


def zero_setting_error(x: jax.Array, fmt: BFPFormat, man: jax.Array | int | None = None) -> jax.Array:
  """Fraction of x's elements that BFP truncation to `fmt` sets to zero (module docstring).

  Args:
    x: float32 array (any rank >= 1) with ndim == len(fmt.block).
    fmt: the BFP format (its block and, unless `man` is given, its man).
    man: optional mantissa width overriding fmt.man: an int or an int32 scalar
      array (may be traced).

  Returns:
    float32 scalar in [0, 1]; 0.0 for an empty array.
  """
  if not isinstance(fmt, BFPFormat):
    raise ValueError(f"fmt={fmt!r} is not a BFPFormat")
  fmt.check_rank(jnp.ndim(x))
  if man is None:
    man = fmt.man
  elif isinstance(man, int) and not isinstance(man, bool):
    man = BFPFormat(int(man), fmt.block).man  # validates 1..24
  else:
    man = jnp.asarray(man)
    if not jnp.issubdtype(man.dtype, jnp.integer):
      raise ValueError(f"man must be an integer array (int32), got dtype {man.dtype}")
    man = man.astype(jnp.int32)
  size = x.size
  if size == 0:
    return jnp.zeros((), jnp.float32)
  e, group_max = group_max_exponents(x, fmt.block)
  zeroed = (group_max > 0) & (group_max - e + 1 > man)
  # An int32 count (exact up to 2^31 elements) times a float32 1/size: the same
  # ops eagerly and under jit (XLA would rewrite a division by a constant).
  count = jnp.sum(zeroed, dtype=jnp.int32)
  return count.astype(jnp.float32) * jnp.float32(1.0 / size)
