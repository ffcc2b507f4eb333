"""Pallas kernel for block-scaled quantization (BlockScaledFormat: DeepSeek-V3's fine-grained FP8,
TransformerEngine's Float8BlockScaling).

Semantics: `block_scaled_quantize(x, fmt)` equals `jlp.numerics.block_scaled.block_scaled_quantize(
x, fmt)` (the XLA path of `jlp.quantize` for a BlockScaledFormat) bit for bit, for any element
format, block shape, axis and pow2_scale, partial edge blocks included. That is, with x viewed as
a matrix (`fmt.axis` moved last, the other axes flattened into rows) and, per block of
(r, c) = fmt.block elements (each entry capped at the matrix's extent), A = max |x| over the
block and M = elem.max:

  s = fl32(A / M) (1 for an all-zero block, 2^-149 where the quotient rounds to zero), or with
    pow2_scale the smallest power of two >= that s (read from its bits, at most 2^127);
  value = fl32(elem(fl32(x / s)) · s), elem rounding to nearest even and saturating to ±M;
  a block holding inf or NaN is all NaN (0x7FC00000),

every float32 operation IEEE-exact with gradual underflow (integer ops, `jlp.numerics.ieee_f32`),
so blocks with float32-subnormal scales or results give the same bits on every backend. The
kernel body is the XLA path's own `jlp.numerics.block_scaled.block_scaled_rows_bits`.

Layout: the matrix's blocks are laid out as the rows of a (G, P) uint32 array by
`jlp.numerics.bfp.group_rows` (P = r · c rounded up to a power of two; the zero padding of
partial blocks and of P leaves each block's amax unchanged), cut into tiles of `rows_per_tile`
whole blocks, one tile per grid step (`pallas_kernels.tiling.quantize_groups`, shared with the
BFP and MX kernels), so a block's amax never spans two grid steps. A (128, 128) block is one
(1, 16384) tile; a block is limited to 2^20 elements (Triton's largest tile). `interpret=True`
runs the kernel with the Pallas interpreter (any backend); `interpret=False` needs a GPU
(Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlp.formats import BlockScaledFormat
from jlp.numerics.block_scaled import (as_matrix, block_scaled_rows_bits, check_arguments,
                                       from_matrix)
from pallas_kernels.tiling import check_rows_per_tile, quantize_groups

MAX_BLOCK_ELEMENTS = 2 ** 20


def block_scaled_quantize(x: jax.Array, fmt: BlockScaledFormat, *, interpret: bool = False,
                          rows_per_tile: int | None = None) -> jax.Array:
  """float32 `x` quantized to `fmt`, as float32, by a Pallas kernel.

  Args:
    x: float32 array with at least one axis; `fmt.axis` must be one of them.
    fmt: the block-scaled format.
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    rows_per_tile: blocks per tile (grid step), a power of two; None picks
      max(1, tiling.TILE_ELEMENTS // P), capped at the number of blocks rounded up to a power of
      two.

  Returns:
    float32 array of x's shape, bit-identical to
    `jlp.numerics.block_scaled.block_scaled_quantize(x, fmt)`.

  Raises:
    TypeError: fmt is not a BlockScaledFormat.
    ValueError: x is not float32, fmt.axis is out of range, rows_per_tile is not a power of two
      or a block (capped at the matrix) has more than 2^20 elements, before any computation.
  """
  check_arguments(x, fmt)
  check_rows_per_tile(rows_per_tile)
  x = jnp.asarray(x)
  if x.size == 0:
    return x
  m, moved_shape = as_matrix(x, fmt.axis)
  block = (min(fmt.block[0], m.shape[0]), min(fmt.block[1], m.shape[1]))
  if block[0] * block[1] > MAX_BLOCK_ELEMENTS:
    raise ValueError(f"block={fmt.block!r} is not allowed for a {m.shape[0]} x {m.shape[1]} "
                     f"matrix; expected at most {MAX_BLOCK_ELEMENTS} elements per block (one "
                     "Triton tile).")
  elem = fmt.elem.name.replace(".", "_")
  out = quantize_groups(m, block, lambda u, _: block_scaled_rows_bits(u, fmt), None,
                        rows_per_tile=rows_per_tile, interpret=interpret,
                        name=f"block_scaled_{elem}_{block[0]}x{block[1]}")
  return from_matrix(out, moved_shape, fmt.axis)
