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
two grid steps. A group is therefore limited to one tile: very large blocks
(P of many thousands) make large Triton tiles, and Triton refuses tiles of more
than 2^20 elements. `interpret=True` runs the kernel
with the Pallas interpreter (any backend); `interpret=False` needs a GPU
(Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlp.formats import BFPFormat
from jlp.numerics.bfp import bfp_rows_bits, group_rows
from pallas_kernels.tiling import checked_rbits, is_power_of_two, next_power_of_two, num_warps

# Elements per tile when rows_per_tile is not given: as the float cast kernel,
# 4096 float32 (16 KiB) per tile, which Triton keeps in registers with 8 warps.
TILE_ELEMENTS = 4096



def bfp_quantize(x: jax.Array, fmt: BFPFormat, rbits: jax.Array | None = None, *,
                 interpret: bool = False, rows_per_tile: int | None = None) -> jax.Array:
  """float32 `x` quantized to `fmt`, as float32, by a Pallas kernel.

  Args:
    x: float32 array with ndim == len(fmt.block).
    fmt: the BFP format.
    rbits: uint32 array of x's shape, required for fmt.rounding == "stochastic".
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    rows_per_tile: groups per tile (grid step), a power of two; None picks
      max(1, TILE_ELEMENTS // P), capped at the number of groups rounded up to a
      power of two.

  Returns:
    float32 array of x's shape, bit-identical to
    `jlp.numerics.bfp.bfp_quantize(x, fmt, rbits)`.
  """
  if not isinstance(fmt, BFPFormat):
    raise TypeError(f"fmt={fmt!r} is not a BFPFormat.")
  if rows_per_tile is not None and not is_power_of_two(rows_per_tile):
    raise ValueError(f"rows_per_tile={rows_per_tile!r} is not allowed; "
                     "expected None or a power of two >= 1.")
  x = jnp.asarray(x, jnp.float32)
  fmt.check_rank(x.ndim)
  rbits = checked_rbits(x, rbits, fmt.rounding)
  stochastic = rbits is not None
  if x.size == 0:
    return x

  rows, ungroup = group_rows(lax.bitcast_convert_type(x, jnp.uint32), fmt.block)
  operands = [rows]
  if stochastic:
    operands.append(group_rows(rbits, fmt.block)[0])
  num_groups, width = rows.shape
  tile_rows = rows_per_tile or max(1, TILE_ELEMENTS // width)
  tile_rows = min(tile_rows, next_power_of_two(num_groups))
  num_tiles = -(-num_groups // tile_rows)
  padded = num_tiles * tile_rows
  if padded != num_groups:
    operands = [jnp.pad(a, ((0, padded - num_groups), (0, 0))) for a in operands]

  def kernel(*refs):
    r = refs[1][...] if stochastic else None
    refs[-1][...] = bfp_rows_bits(refs[0][...], fmt, r)

  spec = pl.BlockSpec((tile_rows, width), lambda i: (i, 0))
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((padded, width), jnp.uint32),
      grid=(num_tiles,),
      in_specs=[spec] * len(operands),
      out_specs=spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(tile_rows * width)),
      name=f"bfp_m{fmt.man}_{fmt.rounding}",
  )(*operands)
  if padded != num_groups:
    out = out[:num_groups]
  return lax.bitcast_convert_type(ungroup(out), jnp.float32)
