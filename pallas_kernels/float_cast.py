"""Pallas kernel for the float32 -> FloatFormat -> float32 cast.

Semantics: `float_cast(x, fmt, rbits)` equals
`jlp.numerics.float_cast.float_cast(x, fmt, rbits)` (the XLA path of
`jlp.quantize` for a FloatFormat) bit for bit, for every FloatFormat option and
compat mode, NaN payloads and signed zeros included: the kernel body is that
path's `cast_bits` applied to one tile of float32 bit patterns. Stochastic
rounding consumes `rbits[i]` for element `x[i]` exactly as the XLA path does,
so the same draws give the same result; `rbits` is ignored for the other
roundings, as there. Given a `key` instead of `rbits`, each tile generates its
draws from the key and the elements' global indices
(`jlp.numerics.random_bits`, the same functions as the XLA path), so no array
of draws is read: one pass reads x and writes q(x).

Layout: x is flattened and zero-padded to a multiple of `block_size` (a power
of two, as Triton requires), each grid step casting one contiguous 1-D tile;
the padding is sliced off again. Arrays smaller than one tile use a single tile
of the next power of two. With a key and the "pairs" stream at a static even
offset (and an even size), a tile is a (block_size / 2, 2) array whose rows share
one hash. `interpret=True` runs the kernel with the Pallas interpreter (any
backend); `interpret=False` needs a GPU (Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlp.formats import FloatFormat
from jlp.numerics import random_bits as rb
from jlp.numerics.float_cast import cast_bits
from pallas_kernels.tiling import checked_rbits, is_power_of_two, next_power_of_two, num_warps

# 4096 float32 = 16 KiB in + 16 KiB out per tile: with 8 warps, 16 elements
# (four 128-bit loads) per thread, enough in flight to saturate H100 HBM while
# the integer work per element stays in registers.
DEFAULT_BLOCK_SIZE = 4096



def float_cast(x: jax.Array, fmt: FloatFormat, rbits: jax.Array | None = None, *,
               key: jax.Array | None = None, index_offset=0, rng: str = "pairs",
               interpret: bool = False, block_size: int = DEFAULT_BLOCK_SIZE) -> jax.Array:
  """float32 `x` rounded to `fmt`, as float32, by a Pallas kernel.

  Args:
    x: float32 array of any shape.
    fmt: the target format.
    rbits: uint32 array of x's shape: the draws of stochastic rounding.
    key: PRNG key from which the kernel generates the draws when rbits is None
      (`jlp.numerics.random_bits`); one of rbits and key is required for
      fmt.rounding == "stochastic", both are ignored otherwise.
    index_offset: the global flat index of x's first element (int or int32 / uint32 scalar).
    rng: the stream of the draws, "pairs" or "jax".
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    block_size: elements per tile (grid step), a power of two.

  Returns:
    float32 array of x's shape, bit-identical to
    `jlp.numerics.float_cast.float_cast(x, fmt, rbits, key=key, index_offset=index_offset,
    rng=rng)`.
  """
  if not isinstance(fmt, FloatFormat):
    raise TypeError(f"fmt={fmt!r} is not a FloatFormat.")
  if not is_power_of_two(block_size):
    raise ValueError(f"block_size={block_size!r} is not allowed; expected a power of two >= 1.")
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise ValueError(f"x has dtype {x.dtype}; expected float32.")
  keyed = fmt.rounding == "stochastic" and rbits is None and key is not None
  if keyed:
    rb.check_rng(rng)
    rb.check_offset(index_offset, x.size)
  else:
    rbits = checked_rbits(x, rbits, fmt.rounding)
  n = x.size
  if n == 0:
    return x
  name = f"float_cast_{fmt.name}_{fmt.rounding}" + (f"_{fmt.compat}" if fmt.compat else "")
  if keyed:
    return _keyed_float_cast(x, fmt, key, index_offset, rng, interpret, block_size, name)

  block = min(block_size, next_power_of_two(n))
  num_blocks = -(-n // block)
  padded = num_blocks * block

  def flat(a: jax.Array) -> jax.Array:
    a = a.reshape(-1)
    return a if padded == n else jnp.pad(a, (0, padded - n))

  stochastic = rbits is not None

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
      name=name,
  )(*operands)
  return (out if padded == n else out[:n]).reshape(x.shape)


def _keyed_float_cast(x, fmt, key, index_offset, rng, interpret, block_size, name):
  """The stochastic cast with the draws generated in the kernel from `key` (see float_cast).

  The kernel's second operand holds (k0, k1, hi, lo): the key's words and the 64-bit index
  of the tile grid's first hash counter (pairs layout: the first row's counter, offset / 2)
  or first element (otherwise).
  """
  n = x.size
  k0, k1 = rb.key_words(key)
  pairs = rb.pairs_aligned(rng, index_offset, n)
  if pairs:
    base = int(index_offset) // 2
    hi, lo = np.uint32(base >> 32), np.uint32(base & 0xFFFFFFFF)
  else:
    hi, lo = rb.offset_words(index_offset)
  params = jnp.stack([k0, k1, jnp.asarray(hi, jnp.uint32), jnp.asarray(lo, jnp.uint32)])

  block = max(2, min(block_size, next_power_of_two(n))) if pairs else min(block_size,
                                                                           next_power_of_two(n))
  num_blocks = -(-n // block)
  padded = num_blocks * block
  flat = x.reshape(-1)
  if padded != n:
    flat = jnp.pad(flat, (0, padded - n))
  tile = (block // 2, 2) if pairs else (block,)
  operand = flat.reshape(padded // 2, 2) if pairs else flat

  def kernel(x_ref, p_ref, o_ref):
    kw0, kw1, base_hi, base_lo = p_ref[0], p_ref[1], p_ref[2], p_ref[3]
    first = lax.convert_element_type(pl.program_id(0), jnp.uint32) * np.uint32(tile[0])
    local = first + lax.broadcasted_iota(jnp.uint32, (tile[0], 1) if pairs else tile, 0)
    c_hi, c_lo = rb.add_with_carry(base_hi, base_lo, local)
    r = rb.pair_bits(kw0, kw1, c_hi, c_lo) if pairs else rb.bits_at(kw0, kw1, c_hi, c_lo, rng)
    u = lax.bitcast_convert_type(x_ref[...], jnp.uint32)
    o_ref[...] = lax.bitcast_convert_type(cast_bits(u, fmt, r), jnp.float32)

  spec = pl.BlockSpec(tile, (lambda i: (i, 0)) if pairs else (lambda i: (i,)))
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(operand.shape, jnp.float32),
      grid=(num_blocks,),
      in_specs=[spec, pl.BlockSpec((4,), lambda i: (0,))],
      out_specs=spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(block)),
      name=name + "_" + rng,
  )(operand, params)
  out = out.reshape(-1)
  return (out if padded == n else out[:n]).reshape(x.shape)
