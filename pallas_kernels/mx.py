"""Pallas kernel for OCP Microscaling (MXFormat) quantization.

Semantics: `mx_quantize(x, fmt, rbits)` equals `jlp.numerics.mx.mx_quantize(x,
fmt, rbits)` (the XLA path of `jlp.quantize` for an MXFormat) bit for bit, for
every element format (float8_e4m3fn, float8_e5m2, float6_e2m3fn, float6_e3m2fn,
float4_e2m1fn, int8 and any other FloatFormat with compat=None), any `axis`, any
`block` (<= 2^20, see Layout), ragged last blocks included, every rounding
of the element format (stochastic rounding consumes `rbits[i]` for element
`x[i]` as the XLA path does; `rbits` is ignored otherwise). That is, per block of
`fmt.block` consecutive elements along `fmt.axis` (the last one zero-padded):

  shared_exp = floor(log2(max |x| in block)) - emax(elem), clamped below at -127;
  element = round(x / 2^shared_exp) in the element format, saturating at
    ±max(elem) (MXINT8: k / 64, k = round-half-even(v · 64) clamped to ±127),
    times 2^shared_exp;
  a block holding inf or NaN, or with shared_exp > 127, is all NaN (0x7FC00000);
  all-zero blocks and elements rounding to zero keep their signs; with `fmt.prescale` = p != 1
  the elements are multiplied by p before the cast and divided by p after it (IEEE float32),

with the power-of-two scalings done on bit patterns, so float32 subnormal inputs
and results are exact on any backend (OCP MX v1.0 §5-§6; `jlp.numerics.mx`).
The kernel body is the XLA path's own `jlp.numerics.mx.mx_rows_bits` (which calls
`jlp.numerics.float_cast.cast_bits` for the elements) applied to tiles of blocks.

Layout: the blocks are laid out as the rows of a (G, P) array by
`jlp.numerics.bfp.group_rows` with the block shape (1, ..., fmt.block, ..., 1)
(P = min(fmt.block, the axis length) rounded up to a power of two; zero padding
never changes a block's scale), cut into tiles of `rows_per_tile` whole rows, one
tile per grid step (`pallas_kernels.tiling.quantize_groups`, the BFP kernel's
tiling), so a block's max-reduction never spans two grid steps. Every MXFormat
block fits one tile (fmt.block <= 2^20, the largest tile Triton accepts; the
(1, 2^20) tile lowers), but blocks of many thousands make large tiles.
`interpret=True` runs the kernel with the Pallas interpreter (any backend);
`interpret=False` needs a GPU (Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlp.formats import INT8, MXFormat
from jlp.numerics.mx import mx_rows_bits
from pallas_kernels.tiling import check_rows_per_tile, checked_rbits, quantize_groups


def mx_quantize(x: jax.Array, fmt: MXFormat, rbits: jax.Array | None = None, *,
                interpret: bool = False, rows_per_tile: int | None = None) -> jax.Array:
  """float32 `x` quantized to `fmt` (OCP MX), as float32, by a Pallas kernel.

  Args:
    x: float32 array; `fmt.axis` must be one of its axes.
    fmt: the MX format.
    rbits: uint32 array of x's shape, required when the element format rounds
      stochastically.
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    rows_per_tile: blocks per tile (grid step), a power of two; None picks
      max(1, tiling.TILE_ELEMENTS // P), capped at the number of blocks rounded up
      to a power of two.

  Returns:
    float32 array of x's shape, bit-identical to
    `jlp.numerics.mx.mx_quantize(x, fmt, rbits)`.
  """
  if not isinstance(fmt, MXFormat):
    raise TypeError(f"fmt={fmt!r} is not an MXFormat.")
  check_rows_per_tile(rows_per_tile)
  x = jnp.asarray(x, jnp.float32)
  fmt.check_rank(x.ndim)
  rbits = checked_rbits(x, rbits, fmt.rounding)
  if x.size == 0:
    return x
  block = [1] * x.ndim
  block[fmt.axis] = fmt.block
  elem = "int8" if fmt.elem == INT8 else fmt.elem.name
  return quantize_groups(x, tuple(block), lambda u, r: mx_rows_bits(u, fmt, r), rbits,
                         rows_per_tile=rows_per_tile, interpret=interpret,
                         name=f"mx_{elem}_{fmt.rounding}")
