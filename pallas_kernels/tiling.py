"""Helpers shared by the kernels: tile sizes (Triton needs power-of-two block shapes), argument
checks, and the row-tile kernel of the block formats (BFP, MX)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlp.numerics.bfp import group_rows

# Elements per tile of the block-format kernels when rows_per_tile is not given: as the float
# cast kernel, 4096 float32 (16 KiB) per tile, which Triton keeps in registers with 8 warps.
TILE_ELEMENTS = 4096


def is_power_of_two(n: int) -> bool:
  return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def num_warps(tile_elements: int) -> int:
  """1 warp per 256 elements of a tile, 1 to 8."""
  return max(1, min(8, tile_elements // 256))


def checked_rbits(x, rbits, rounding: str):
  """The stochastic-rounding draws as a uint32 array of x's shape (None unless stochastic).

  Raises:
    ValueError: stochastic rounding without rbits, or rbits of another shape or dtype.
  """
  if rounding != "stochastic":
    return None
  if rbits is None:
    raise ValueError("stochastic rounding needs rbits (uint32, x.shape)")
  rbits = jnp.asarray(rbits)
  if rbits.shape != x.shape or rbits.dtype != jnp.uint32:
    raise ValueError(f"rbits has shape {rbits.shape} and dtype {rbits.dtype}; "
                     f"expected {x.shape} and uint32.")
  return rbits


def check_rows_per_tile(rows_per_tile: int | None) -> None:
  if rows_per_tile is not None and not is_power_of_two(rows_per_tile):
    raise ValueError(f"rows_per_tile={rows_per_tile!r} is not allowed; "
                     "expected None or a power of two >= 1.")


RowsBits = Callable[[jax.Array, "jax.Array | None"], jax.Array]


def quantize_groups(x: jax.Array, block: tuple[int, ...], rows_bits: RowsBits,
                    rbits: jax.Array | None, *, rows_per_tile: int | None, interpret: bool,
                    name: str) -> jax.Array:
  """float32 `x` with every group quantized by `rows_bits`, one Pallas kernel over row tiles.

  The groups (boxes of shape `block`, ragged at the ends) are laid out as the rows of a (G, P)
  uint32 array by `jlp.numerics.bfp.group_rows` (P a power of two), which is cut into tiles of
  `rows_per_tile` whole rows (None: max(1, TILE_ELEMENTS // P), capped at G rounded up to a
  power of two; G is zero-padded to a multiple of it, the padding rows sliced off again), so a
  group's reductions never span two grid steps. Each grid step evaluates
  `rows_bits(tile, rbits_tile)` on one (rows_per_tile, P) tile of float32 bit patterns
  (`rbits_tile`, the draws laid out alike, is None when `rbits` is None). `rows_bits` must be
  row-wise and leave a row's other elements unchanged by zero padding; the result is then
  `ungroup(rows_bits(rows, rbit_rows))`, bit for bit.

  A group is limited to one tile: Triton refuses tiles of more than 2^20 elements.
  """
  rows, ungroup = group_rows(lax.bitcast_convert_type(x, jnp.uint32), block)
  operands = [rows]
  if rbits is not None:
    operands.append(group_rows(rbits, block)[0])
  num_groups, width = rows.shape
  tile_rows = rows_per_tile or max(1, TILE_ELEMENTS // width)
  tile_rows = min(tile_rows, next_power_of_two(num_groups))
  num_tiles = -(-num_groups // tile_rows)
  padded = num_tiles * tile_rows
  if padded != num_groups:
    operands = [jnp.pad(a, ((0, padded - num_groups), (0, 0))) for a in operands]

  def kernel(*refs):
    r = refs[1][...] if rbits is not None else None
    refs[-1][...] = rows_bits(refs[0][...], r)

  spec = pl.BlockSpec((tile_rows, width), lambda i: (i, 0))
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((padded, width), jnp.uint32),
      grid=(num_tiles,),
      in_specs=[spec] * len(operands),
      out_specs=spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(tile_rows * width)),
      name=name,
  )(*operands)
  if padded != num_groups:
    out = out[:num_groups]
  return lax.bitcast_convert_type(ungroup(out), jnp.float32)
