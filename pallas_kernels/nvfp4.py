"""Pallas kernel for NVFP4 quantization (`NVFP4Format`).

Semantics: `nvfp4_quantize(x, fmt, rbits)` equals `jlp.numerics.nvfp4.nvfp4_quantize(x, fmt,
rbits)` (the XLA path of `jlp.quantize` for an NVFP4Format) bit for bit, for every NVFP4Format:
1 x 16 and 16 x 16 tiles, any `axis`, ragged tiles (zero-padded), tensor_scale, nearest and
stochastic rounding (element x[i] consumes rbits[i]; rbits is ignored otherwise), rht, and both
compat modes. That is, with amax = max |x| over the tensor (of the transformed tensor with rht)
and the exact float32 operations of `jlp.numerics.nvfp4` (done with integer operations, so
float32 subnormals are exact on any backend):

  compat=None (TransformerEngine's NVFP4QuantizerRef): ges = min(2688 / amax, FLT_MAX), 1 if 0;
    per tile s = e4m3(clamp(min(vmax * (ges * float32(1/6)), FLT_MAX), -448, 448)),
    es = min(1 / (s * (1 / ges)), FLT_MAX); per element code = e2m1(clamp(x * es, -6, 6));
    value = (e2m1 * s) * (amax / 2688);
  compat="torchao": s = e4m3(clamp(vmax / 6, 2^-6, 448)), value = e2m1 * s (single level), or with
    pts = amax / 2688: s = e4m3(clamp((vmax / 6) / pts, 2^-6, 448)), code from x * ((1 / pts) / s),
    value = e2m1 * (pts * s) (two levels);
  rht: each 16-element block along the axis is transformed by T = D H16 / 4 before, and the
    decoded values by T^T after (TE's signs D, butterflies with strides 8, 4, 2, 1).

Layout: the tiles are laid out as the rows of a (G, P) array by `jlp.numerics.nvfp4.prepare`
(`jlp.numerics.bfp.group_rows` on the matrix view: the axis moved last, the other axes flattened
into rows; P = 16 for 1 x 16 tiles, 256 for 16 x 16, fewer for short axes), cut into tiles of
`rows_per_tile` whole rows, one per grid step. The per-tensor values (from amax, a reduction over
the whole tensor) are computed by XLA before the kernel, as the XLA path computes them, and enter
as (1, 1) uint32 blocks. The kernel body is the XLA path's own `jlp.numerics.nvfp4.quantize_rows`
(Hadamard butterflies with split / stack / reshape, row maxima, integer multiplication and
division). `interpret=True` runs the kernel with the Pallas interpreter (any backend);
`interpret=False` needs a GPU (Triton).

References: arXiv:2509.25149; TransformerEngine custom_recipes/quantization_nvfp4.py; torchao 0.18
prototype/mx_formats/nvfp4_tensor.py (see `jlp.numerics.nvfp4`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlp.formats import NVFP4Format
from jlp.numerics import nvfp4
from jlp.numerics.float_cast import from_bits
from pallas_kernels.tiling import TILE_ELEMENTS, check_rows_per_tile, next_power_of_two, num_warps


def nvfp4_quantize(x: jax.Array, fmt: NVFP4Format, rbits: jax.Array | None = None, *,
                   interpret: bool = False, rows_per_tile: int | None = None) -> jax.Array:
  """float32 x quantized to NVFP4 and decoded, as float32, by a Pallas kernel.

  Args:
    x: float32 array; fmt.axis must be one of its axes (a multiple of 16 long with rht).
    fmt: the NVFP4 format.
    rbits: uint32 array of x's shape, required with rounding="stochastic".
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    rows_per_tile: tiles (rows) per grid step, a power of two; None picks
      max(1, tiling.TILE_ELEMENTS // P), capped at the number of tiles rounded up to a power of
      two.

  Returns:
    float32 array of x's shape, bit-identical to `jlp.numerics.nvfp4.nvfp4_quantize(x, fmt,
    rbits)`.
  """
  check_rows_per_tile(rows_per_tile)
  nvfp4.check_args(x, fmt, rbits)
  x = jnp.asarray(x, jnp.float32)
  if x.size == 0:
    return x
  rows, r, scalars, restore = nvfp4.prepare(x, fmt, rbits)
  operands = [rows] if r is None else [rows, r]
  num_rows, width = rows.shape
  tile_rows = min(rows_per_tile or max(1, TILE_ELEMENTS // width), next_power_of_two(num_rows))
  num_tiles = -(-num_rows // tile_rows)
  padded = num_tiles * tile_rows
  if padded != num_rows:
    operands = [jnp.pad(a, ((0, padded - num_rows), (0, 0))) for a in operands]
  k = len(scalars)

  def kernel(*refs):
    values = tuple(ref[...] for ref in refs[:k])
    draws = refs[k + 1][...] if r is not None else None
    refs[-1][...] = nvfp4.quantize_rows(refs[k][...], values, fmt, draws)

  tile = pl.BlockSpec((tile_rows, width), lambda i: (i, 0))
  scalar = pl.BlockSpec((1, 1), lambda i: (0, 0))
  name = "nvfp4_" + ("te" if fmt.compat is None else fmt.compat) + f"_{fmt.block[0]}x16"
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((padded, width), jnp.uint32),
      grid=(num_tiles,),
      in_specs=[scalar] * k + [tile] * len(operands),
      out_specs=tile,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(tile_rows * width)),
      name=name + ("_rht" if fmt.rht else "") + f"_{fmt.rounding}",
  )(*scalars, *operands)
  return from_bits(restore(out[:num_rows]))
