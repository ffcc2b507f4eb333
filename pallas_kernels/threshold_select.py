"""Pallas kernels selecting the indices of the values above a threshold (DGC's and GradDrop's
selection: idx = [i : |v_i| > thr], ascending, thrust::copy_if).

Semantics: `threshold_select(values, threshold, capacity)` returns `(indices, total)`:
  indices  int32[capacity]: the first min(total, capacity) indices i (ascending) with
           |values[i]| > threshold, the remaining slots n = values.size;
  total    int32[]: the number of i with |values[i]| > threshold (not capped).
(indices, min(total, capacity)) is exactly `jlp.compression.ops.capacity_filter(
jnp.abs(values) > threshold, capacity)`. The comparison is float32's: NaN values are never
selected, nor values equal to the threshold.

Layout: values (flattened float32) are cut into tiles of `block_size` elements (a power of two;
arrays smaller than one tile use a single tile of the next power of two), the last one padded
with NaN (never selected). Two kernels and a prefix sum over tiles, the usual GPU stream
compaction:
  1. `tile_counts`: per tile, the number of selected elements (int32[tiles]);
  2. on the XLA side, offset[t] = sum of counts before tile t (an exclusive cumsum over the few
     tiles) and total = the sum of all counts;
  3. `compact`: per tile, each selected element's rank within the tile (a cumsum of the mask),
     its index stored at slot offset[t] + rank when that is below `capacity`, into an output
     that XLA fills with n beforehand (aliased in place). Tiles starting at or past `capacity`
     store nothing, so a small capacity costs the second kernel little.
Slots are written by exactly one element, so the grid steps are independent. `interpret=True`
runs the kernels with the Pallas interpreter (any backend); `interpret=False` needs a GPU
(Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import is_power_of_two, next_power_of_two, num_warps

# As the float cast kernel: 4096 float32 (16 KiB) per tile, 16 elements per thread with 8 warps.
DEFAULT_BLOCK_SIZE = 4096


def _selected(values_ref, threshold_ref) -> jax.Array:
  return jnp.abs(values_ref[...]) > threshold_ref[...]


def tile_counts(values: jax.Array, threshold: jax.Array, block: int, *,
                interpret: bool = False) -> jax.Array:
  """int32[tiles]: per tile of `block` values, how many have |v| > threshold.

  `values` is float32[tiles * block] (padded with NaN), `threshold` float32[1].
  """

  def kernel(values_ref, threshold_ref, count_ref):
    count_ref[...] = jnp.sum(_selected(values_ref, threshold_ref), dtype=jnp.int32, keepdims=True)

  num_blocks = values.shape[0] // block
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_blocks,), jnp.int32),
      grid=(num_blocks,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,)), pl.BlockSpec((1,), lambda i: (0,))],
      out_specs=pl.BlockSpec((1,), lambda i: (i,)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(block)),
      name="threshold_tile_counts",
  )(values, threshold)


def compact(values: jax.Array, threshold: jax.Array, offsets: jax.Array, capacity: int,
            fill: int, block: int, *, interpret: bool = False) -> jax.Array:
  """int32[capacity]: slot offsets[t] + r holds the index of tile t's r-th selected value (when
  below capacity); every other slot holds `fill`.

  `values` is float32[tiles * block] (padded with NaN), `threshold` float32[1], `offsets`
  int32[tiles] the exclusive prefix sum of `tile_counts`.
  """

  def kernel(values_ref, threshold_ref, offset_ref, _, indices_ref):
    offset = offset_ref[0]
    start = pl.program_id(0) * block  # outside pl.when: the interpreter cannot see it in there

    @pl.when(offset < capacity)
    def _():
      selected = _selected(values_ref, threshold_ref)
      slot = offset + jnp.cumsum(selected.astype(jnp.int32)) - 1
      lane = lax.broadcasted_iota(jnp.int32, (block,), 0)
      stored = selected & (slot < capacity)
      # Lanes that store nothing get distinct slots past `capacity`: the GPU masks them out, and
      # the interpreter, which writes masked-out lanes back with their old values, writes them
      # where they cannot overwrite a stored index.
      slot = jnp.where(stored, slot, capacity + lane)
      pltriton.store(indices_ref.at[slot], start + lane, mask=stored)

  num_blocks = values.shape[0] // block
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((capacity + block,), jnp.int32),
      grid=(num_blocks,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,)), pl.BlockSpec((1,), lambda i: (0,)),
                pl.BlockSpec((1,), lambda i: (i,)), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      input_output_aliases={3: 0},
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(block)),
      name="threshold_compact",
  )(values, threshold, offsets, jnp.full((capacity + block,), fill, jnp.int32))[:capacity]


def threshold_select(values: jax.Array, threshold: jax.Array | float, capacity: int, *,
                     interpret: bool = False, block_size: int = DEFAULT_BLOCK_SIZE
                     ) -> tuple[jax.Array, jax.Array]:
  """(indices int32[capacity], total int32[]) of the values with |v| > threshold, by Pallas
  kernels (see the module docstring).

  Args:
    values: float32 array of any shape (flattened; n = values.size).
    threshold: float32 scalar (an array or a Python number).
    capacity: slots of `indices`, an int >= 0.
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    block_size: values per tile (grid step), a power of two.

  Returns:
    indices: the first min(total, capacity) selected indices, ascending, then n.
    total: the number of selected values.
  """
  if not is_power_of_two(block_size):
    raise ValueError(f"block_size={block_size!r} is not allowed; expected a power of two >= 1.")
  if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
    raise ValueError(f"capacity={capacity!r} is not allowed; expected an int >= 0.")
  values = jnp.asarray(values)
  if values.dtype != jnp.float32:
    raise ValueError(f"values has dtype {values.dtype}; expected float32.")
  threshold = jnp.asarray(threshold, jnp.float32)
  if threshold.shape != ():
    raise ValueError(f"threshold has shape {threshold.shape}; expected a scalar.")
  values = values.reshape(-1)
  n = values.shape[0]
  if n == 0:
    return jnp.zeros((capacity,), jnp.int32), jnp.int32(0)

  block = min(block_size, next_power_of_two(n))
  padded = -(-n // block) * block
  if padded != n:
    values = jnp.concatenate([values, jnp.full((padded - n,), jnp.nan, jnp.float32)])
  threshold = threshold.reshape(1)
  counts = tile_counts(values, threshold, block, interpret=interpret)
  total = jnp.sum(counts)
  if capacity == 0:
    return jnp.zeros((0,), jnp.int32), total
  offsets = jnp.cumsum(counts) - counts
  return compact(values, threshold, offsets, capacity, n, block, interpret=interpret), total
