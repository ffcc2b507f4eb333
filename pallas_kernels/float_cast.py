"""Pallas kernel for the float32 -> FloatFormat -> float32 cast.

Semantics: `float_cast(x, fmt, rbits)` equals
`jlp.numerics.float_cast.float_cast(x, fmt, rbits)` (the XLA path of
`jlp.quantize` for a FloatFormat) bit for bit, for every FloatFormat option and
compat mode, NaN payloads and signed zeros included: the kernel body is that
path's `cast_bits` applied to one tile of float32 bit patterns. Stochastic
rounding consumes `rbits[i]` for element `x[i]` exactly as the XLA path does,
so the same draws give the same result; `rbits` is ignored for the other
roundings, as there.

Layout: x is flattened and zero-padded to a multiple of `block_size` (a power
of two, as Triton requires), each grid step casting one contiguous 1-D tile;
the padding is sliced off again. Arrays smaller than one tile use a single tile
of the next power of two. `interpret=True` runs the kernel with the Pallas
interpreter (any backend); `interpret=False` needs a GPU (Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlp.formats import FloatFormat
from jlp.numerics.float_cast import cast_bits
from pallas_kernels.tiling import checked_rbits, is_power_of_two, next_power_of_two, num_warps

# 4096 float32 = 16 KiB in + 16 KiB out per tile: with 8 warps, 16 elements
# (four 128-bit loads) per thread, enough in flight to saturate H100 HBM while
# the integer work per element stays in registers.
DEFAULT_BLOCK_SIZE = 4096



def float_cast(x: jax.Array, fmt: FloatFormat, rbits: jax.Array | None = None, *,
               interpret: bool = False, block_size: int = DEFAULT_BLOCK_SIZE) -> jax.Array:
  """float32 `x` rounded to `fmt`, as float32, by a Pallas kernel.

  Args:
    x: float32 array of any shape.
    fmt: the target format.
    rbits: uint32 array of x's shape, required for fmt.rounding == "stochastic".
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    block_size: elements per tile (grid step), a power of two.

  Returns:
    float32 array of x's shape, bit-identical to
    `jlp.numerics.float_cast.float_cast(x, fmt, rbits)`.
  """
  if not isinstance(fmt, FloatFormat):
    raise TypeError(f"fmt={fmt!r} is not a FloatFormat.")
  if not is_power_of_two(block_size):
    raise ValueError(f"block_size={block_size!r} is not allowed; expected a power of two >= 1.")
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise ValueError(f"x has dtype {x.dtype}; expected float32.")
  rbits = checked_rbits(x, rbits, fmt.rounding)
  stochastic = rbits is not None
  n = x.size
  if n == 0:
    return x

  block = min(block_size, next_power_of_two(n))
  num_blocks = -(-n // block)
  padded = num_blocks * block

  def flat(a: jax.Array) -> jax.Array:
    a = a.reshape(-1)
    return a if padded == n else jnp.pad(a, (0, padded - n))

  def kernel(*refs):
    u = lax.bitcast_convert_type(refs[0][...], jnp.uint32)
    r = refs[1][...] if stochastic else None
    refs[-1][...] = lax.bitcast_convert_type(cast_bits(u, fmt, r), jnp.float32)

  operands = [flat(x)] + ([flat(rbits)] if stochastic else [])
  spec = pl.BlockSpec((block,), lambda i: (i,))
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((padded,), jnp.float32),
      grid=(num_blocks,),
      in_specs=[spec] * len(operands),
      out_specs=spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(block)),
      name=f"float_cast_{fmt.name}_{fmt.rounding}" + (f"_{fmt.compat}" if fmt.compat else ""),
  )(*operands)
  return (out if padded == n else out[:n]).reshape(x.shape)
