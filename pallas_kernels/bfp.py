"""Pallas kernel for block floating point (BFPFormat) quantization.

Semantics: `bfp_quantize(x, fmt, rbits)` equals
`jlp.numerics.bfp.bfp_quantize(x, fmt, rbits)` (the XLA path of `jlp.quantize`
for a BFPFormat) bit for bit, for every rounding, ragged last groups included:
both lay the groups out as rows with `jlp.numerics.bfp.group_rows` and quantize
each row with `jlp.numerics.bfp.bfp_rows_bits`, here one tile of whole rows per
grid step. Stochastic rounding consumes `rbits[i]` for element `x[i]` as the
XLA path does; `rbits` is ignored for the other roundings.

Layout: the (G, P) row array (P, the group size rounded up to a power of two,
is fixed by `group_rows`) is cut into tiles of `rows_per_tile` whole rows (a
power of two; G is zero-padded to a multiple of it, and zero rows quantize to
zero rows, sliced off again), so a group's max-exponent reduction never spans
two grid steps (`pallas_kernels.tiling.quantize_groups`, shared with the MX
kernel). A group is therefore limited to one tile: very large blocks (P of many
thousands) make large Triton tiles, and Triton refuses tiles of more than 2^20
elements. `interpret=True` runs the kernel with the Pallas interpreter (any
backend); `interpret=False` needs a GPU (Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlp.formats import BFPFormat
from jlp.numerics.bfp import bfp_rows_bits
from pallas_kernels.tiling import check_rows_per_tile, checked_rbits, quantize_groups


def bfp_quantize(x: jax.Array, fmt: BFPFormat, rbits: jax.Array | None = None, *,
                 interpret: bool = False, rows_per_tile: int | None = None) -> jax.Array:
  """float32 `x` quantized to `fmt`, as float32, by a Pallas kernel.

  Args:
    x: float32 array with ndim == len(fmt.block).
    fmt: the BFP format.
    rbits: uint32 array of x's shape, required for fmt.rounding == "stochastic".
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    rows_per_tile: groups per tile (grid step), a power of two; None picks
      max(1, tiling.TILE_ELEMENTS // P), capped at the number of groups rounded up to a
      power of two.

  Returns:
    float32 array of x's shape, bit-identical to
    `jlp.numerics.bfp.bfp_quantize(x, fmt, rbits)`.
  """
  if not isinstance(fmt, BFPFormat):
    raise TypeError(f"fmt={fmt!r} is not a BFPFormat.")
  check_rows_per_tile(rows_per_tile)
  x = jnp.asarray(x, jnp.float32)
  fmt.check_rank(x.ndim)
  rbits = checked_rbits(x, rbits, fmt.rounding)
  if x.size == 0:
    return x
  return quantize_groups(x, fmt.block, lambda u, r: bfp_rows_bits(u, fmt, r), rbits,
                         rows_per_tile=rows_per_tile, interpret=interpret,
                         name=f"bfp_m{fmt.man}_{fmt.rounding}")
