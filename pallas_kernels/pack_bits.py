"""Pallas kernels packing b-bit codes into bytes and unpacking them (b in 1, 2, 4, 8).

Semantics: `pack_bits(codes, bits, pad)` equals `jlp.compression.ops.pack_bits_xla(codes, bits,
pad)` and `unpack_bits(packed, bits, n)` equals `jlp.compression.ops.unpack_bits_xla(packed,
bits, n)` bit for bit: code i (its low `bits` bits; higher bits are dropped) sits at bit offset
bits*(i mod 8/bits) of byte i // (8/bits), LSB-first (the layout of
`jlp.compression.layout.Packed` and `jlp.compression.ops.pack_bits`); packing n codes gives
ceil(n*bits/8) bytes whose slots past n hold `pad` (a `bits`-bit code); unpacking returns the
first n codes.

Layout: Triton has little uint8 arithmetic, so the kernels work on uint32 words of 32/bits codes
(four packed bytes, little-endian: byte j of a word is its bits 8j..8j+7, as XLA's bitcast
between uint32 and uint8[4] gives on every JAX platform). pack_bits reads a (words, 32/bits)
uint8 tile of codes and writes the tile's words, code j of a word shifted left by bits*j;
unpack_bits reads a tile of words and writes the (words, 32/bits) uint8 codes, code j shifted
right by bits*j. Every shift is by less than 32 (Triton shifts by >= the width are poison). The
codes, or the bytes, are padded on the XLA side to whole tiles of `block_codes` codes (a power of
two; a tile holds at least one word, and arrays smaller than one tile use a single tile of the
next power of two words) and the padding is sliced off again. `interpret=True` runs the kernels
with the Pallas interpreter (any backend); `interpret=False` needs a GPU (Triton).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlp.numerics.packing import BITS, packed_size
from pallas_kernels.tiling import is_power_of_two, next_power_of_two, num_warps

# 8192 codes (8 KiB of uint8 codes, 1 to 8 KiB packed) per tile: with 8 warps, 32 codes per
# thread, which the kernels widen to uint32 in registers (as many as the float cast kernel's
# 16 float32 and their temporaries).
DEFAULT_BLOCK_CODES = 8192


def _check(bits: int, block_codes: int) -> None:
  if bits not in BITS:
    raise ValueError(f"bits={bits!r} is not allowed; expected one of {BITS}.")
  if not is_power_of_two(block_codes):
    raise ValueError(f"block_codes={block_codes!r} is not allowed; expected a power of two >= 1.")


def _tiles(words: int, bits: int, block_codes: int) -> tuple[int, int]:
  """(words per tile, number of tiles) for `words` words of 32/bits codes."""
  block = min(max(1, block_codes * bits // 32), next_power_of_two(words))
  return block, -(-words // block)


def _shifts(shape: tuple[int, int], bits: int) -> jax.Array:
  """uint32 bits*j for column j: code j's bit offset in its word (at most 32 - bits)."""
  return lax.broadcasted_iota(jnp.uint32, shape, 1) * jnp.uint32(bits)


def pack_words(codes: jax.Array, bits: int) -> jax.Array:
  """The pack kernel's body: uint32[w] words from uint8[w, 32/bits] codes, code j of a word
  (its low `bits` bits) at bit offset bits*j."""
  c = codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
  # The shifted codes occupy disjoint bits, so their sum is their bitwise or.
  return jnp.sum(c << _shifts(c.shape, bits), axis=1, dtype=jnp.uint32)


def unpack_words(words: jax.Array, bits: int) -> jax.Array:
  """The unpack kernel's body: uint8[w, 32/bits] codes of uint32[w] words."""
  shape = (words.shape[0], 32 // bits)
  codes = (words[:, None] >> _shifts(shape, bits)) & jnp.uint32((1 << bits) - 1)
  return codes.astype(jnp.uint8)


def pack_bits(codes: jax.Array, bits: int, pad: int = 0, *, interpret: bool = False,
              block_codes: int = DEFAULT_BLOCK_CODES) -> jax.Array:
  """uint8[ceil(n*bits/8)]: the n uint8 `codes` packed `bits` bits each, by a Pallas kernel.

  Args:
    codes: uint8 array (flattened; n = codes.size).
    bits: bits per code, one of 1, 2, 4, 8.
    pad: the code in the last byte's slots past n, 0 <= pad < 2**bits.
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    block_codes: codes per tile (grid step), a power of two (at least one word: 32/bits).

  Returns:
    uint8[ceil(n*bits/8)], equal to `jlp.compression.ops.pack_bits_xla(codes, bits, pad)`.
  """
  _check(bits, block_codes)
  if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < (1 << bits):
    raise ValueError(f"pad={pad!r} is not allowed; expected a {bits}-bit code (an int).")
  codes = jnp.asarray(codes)
  if codes.dtype != jnp.uint8:
    raise ValueError(f"codes has dtype {codes.dtype}; expected uint8.")
  codes = codes.reshape(-1)
  n = codes.shape[0]
  if n == 0:
    return codes
  per_word = 32 // bits
  block, num_blocks = _tiles(-(-n // per_word), bits, block_codes)
  padded = num_blocks * block * per_word
  if padded != n:
    codes = jnp.concatenate([codes, jnp.full((padded - n,), pad, jnp.uint8)])

  def kernel(codes_ref, words_ref):
    words_ref[...] = pack_words(codes_ref[...], bits)

  words = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_blocks * block,), jnp.uint32),
      grid=(num_blocks,),
      in_specs=[pl.BlockSpec((block, per_word), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(block * per_word)),
      name=f"pack_bits_{bits}",
  )(codes.reshape(-1, per_word))
  return lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:packed_size(n, bits)]


def unpack_bits(packed: jax.Array, bits: int, n: int, *, interpret: bool = False,
                block_codes: int = DEFAULT_BLOCK_CODES) -> jax.Array:
  """uint8[n]: the first n `bits`-bit codes of `packed`, by a Pallas kernel.

  Args:
    packed: uint8[ceil(n*bits/8)], as `pack_bits` returns.
    bits: bits per code, one of 1, 2, 4, 8.
    n: number of codes.
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    block_codes: codes per tile (grid step), a power of two (at least one word: 32/bits).

  Returns:
    uint8[n], equal to `jlp.compression.ops.unpack_bits_xla(packed, bits, n)`.
  """
  _check(bits, block_codes)
  packed = jnp.asarray(packed)
  if packed.dtype != jnp.uint8:
    raise ValueError(f"packed has dtype {packed.dtype}; expected uint8.")
  packed = packed.reshape(-1)
  if packed.shape[0] != packed_size(n, bits):
    raise ValueError(f"packed has {packed.shape[0]} bytes; expected ceil({n}*{bits}/8) = "
                     f"{packed_size(n, bits)}.")
  if n == 0:
    return packed
  per_word = 32 // bits
  block, num_blocks = _tiles(-(-packed.shape[0] // 4), bits, block_codes)
  padded = num_blocks * block * 4
  if padded != packed.shape[0]:
    packed = jnp.pad(packed, (0, padded - packed.shape[0]))
  words = lax.bitcast_convert_type(packed.reshape(-1, 4), jnp.uint32)

  def kernel(words_ref, codes_ref):
    codes_ref[...] = unpack_words(words_ref[...], bits)

  codes = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_blocks * block, per_word), jnp.uint8),
      grid=(num_blocks,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block, per_word), lambda i: (i, 0)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(block * per_word)),
      name=f"unpack_bits_{bits}",
  )(words)
  return codes.reshape(-1)[:n]
