"""The random bits of stochastic rounding: a counter-based hash of (key, element index).

Every element of an array gets one uint32 draw that is a pure function of the PRNG key and the
element's global flat index g (C order, plus `index_offset`), computed with element-wise uint32
adds, rotations and xors. So the draws are generated inside the cast's own fusion or kernel tile
(one pass reads x and writes q(x); no array of draws in memory), they depend neither on how the
array is tiled nor on how it is sharded, and the XLA path and the Pallas kernels agree bit for
bit.

The hash is Threefry-2x32-20 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
1, 2, 3", SC'11, §3.2; Random123's `threefry2x32` with 20 rounds, the generator behind
`jax.random`): a 2x32-bit counter and a 2x32-bit key give two uint32 words that pass TestU01's
BigCrush (ibid.). It needs only 32-bit adds, rotations and xors. Philox-4x32-10 needs
32x32->64-bit products, which jax expresses only with 64-bit types enabled; with them (four
draws per hash) it measured no faster than this in the XLA:CPU cast, and built from 16-bit
partial products about 1.4x slower. The key's two words are `jax.random.key_data(key)` of a
threefry2x32 key (the default key type; a raw uint32[2] key works too).

Streams (`rng`):
  "pairs" (default): the two output words of one hash serve two neighbouring elements. Element g
    takes word (g mod 2) of Threefry-2x32-20(key, (hi | 2^31, lo)), (hi, lo) the 32-bit halves
    of floor(g / 2). The tag bit 2^31 keeps these counters apart from the "jax" stream's.
  "jax": element g takes word0 xor word1 of Threefry-2x32-20(key, (hi, lo)), (hi, lo) the halves
    of g: with index_offset=0 exactly `jax.random.bits(key, x.shape, jnp.uint32)` (jax's
    default `jax_threefry_partitionable=True` layout), at twice the hashing cost per element.

Sharding: `index_offset` is the global flat index of the array's first element (0 for a whole
array). A block of a leading-axis split (`jax.shard_map` with P(axis) on axis 0) of an array
whose other dimensions are unsplit starts at `lax.axis_index(axis) * x.size`; with that offset
every element gets the draw it gets unsharded. A Python int offset is static; a traced integer
scalar (int32 / uint32) works too. The "pairs" stream computes each hash once for two elements
when the offset is a static even int and x.size is even, otherwise once per element (same bits).
An array holds at most 2^32 - 1 elements; g must stay below 2^64.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

RNGS = ("pairs", "jax")

_PARITY = np.uint32(0x1BD11BDA)  # Threefish's key-schedule constant C240, 32-bit
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # R_{2x32}, rounds 4i..4i+3 alternate
_PAIRS_TAG = np.uint32(0x80000000)
_MAX_SIZE = 2 ** 32 - 1


def check_rng(rng: str) -> None:
  if rng not in RNGS:
    raise ValueError(f"rng={rng!r} is not allowed; expected one of {RNGS}.")


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, c0: jax.Array, c1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32-20 of counter (c0, c1) under key (k0, k1), element-wise on uint32 arrays.

  Five groups of four rounds (x0 += x1; x1 = rotl(x1, R) ^ x0), each group followed by a key
  injection from the schedule (k0, k1, k0 ^ k1 ^ C240) with the group number added to x1.
  """
  ks = (k0, k1, k0 ^ k1 ^ _PARITY)
  x0, x1 = c0 + ks[0], c1 + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + ks[(group + 2) % 3] + np.uint32(group + 1)
  return x0, x1


def key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two uint32 words of a threefry2x32 key (typed, or a raw uint32[2] key)."""
  key = key if isinstance(key, jax.Array) else jnp.asarray(key)
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  if data.shape != (2,) or data.dtype != jnp.uint32:
    raise ValueError(f"key with data of shape {data.shape} and dtype {data.dtype} is not allowed; "
                     "expected a threefry2x32 key (jax.random.key(seed), the default) "
                     "or a raw uint32[2] key.")
  return data[0], data[1]


def check_offset(index_offset, size: int) -> None:
  """ValueError unless `index_offset` is a valid offset for an array of `size` elements."""
  if size > _MAX_SIZE:
    raise ValueError(f"x.size={size} is not allowed with stochastic rounding; expected at most "
                     f"{_MAX_SIZE} elements (split the array).")
  if isinstance(index_offset, (int, np.integer)) and not isinstance(index_offset, bool):
    if not 0 <= int(index_offset) <= 2 ** 64 - max(size, 1):
      raise ValueError(f"index_offset={int(index_offset)} is not allowed; expected an int in "
                       f"[0, 2**64 - x.size].")
    return
  dtype = jnp.result_type(index_offset)
  if jnp.shape(index_offset) != () or dtype not in (jnp.int32, jnp.uint32):
    raise ValueError(f"index_offset of shape {jnp.shape(index_offset)} and dtype {dtype} is not "
                     "allowed; expected a non-negative int or an int32 / uint32 scalar.")


def offset_words(index_offset) -> tuple:
  """(hi, lo) uint32 halves of the offset: numpy constants for an int, else jax scalars."""
  if isinstance(index_offset, (int, np.integer)):
    g = int(index_offset)
    return np.uint32(g >> 32), np.uint32(g & 0xFFFFFFFF)
  return np.uint32(0), lax.convert_element_type(index_offset, jnp.uint32)


def pairs_aligned(rng: str, index_offset, size: int) -> bool:
  """Whether the "pairs" stream can hash once per two elements: a static even offset, even size."""
  return (rng == "pairs" and isinstance(index_offset, (int, np.integer))
          and int(index_offset) % 2 == 0 and size % 2 == 0)


def add_with_carry(hi, lo, local: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(hi, lo) + local as 64-bit halves (local uint32)."""
  new_lo = lo + local
  return hi + jnp.where(new_lo < local, np.uint32(1), np.uint32(0)), new_lo


def bits_at(k0, k1, hi: jax.Array, lo: jax.Array, rng: str) -> jax.Array:
  """The draws of the elements whose global indices have 64-bit halves (hi, lo)."""
  if rng == "jax":
    y0, y1 = threefry2x32(k0, k1, hi, lo)
    return y0 ^ y1
  c_hi = (hi >> np.uint32(1)) | _PAIRS_TAG
  c_lo = (lo >> np.uint32(1)) | (hi << np.uint32(31))
  y0, y1 = threefry2x32(k0, k1, c_hi, c_lo)
  return jnp.where((lo & np.uint32(1)) == 0, y0, y1)


def pair_bits(k0, k1, c_hi: jax.Array, c_lo: jax.Array) -> jax.Array:
  """The "pairs" draws of the elements 2c and 2c + 1 as an (m, 2) array, c of shape (m, 1)
  given by its halves (c_hi, c_lo): one hash per row, its two words side by side."""
  y0, y1 = threefry2x32(k0, k1, c_hi | _PAIRS_TAG, c_lo)
  column = lax.broadcasted_iota(jnp.uint32, (c_lo.shape[0], 2), 1)
  return jnp.where(column == 0, y0, y1)


def map_with_bits(fn: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, key: jax.Array,
                  *, index_offset=0, rng: str = "pairs") -> jax.Array:
  """fn(x, bits) for an element-wise `fn`, the draws generated inside the same XLA fusion.

  `bits` are the uint32 draws of x's elements (module docstring). When the "pairs" stream is
  aligned, fn runs on x viewed as (size / 2, 2), each hash computed once for its row. The
  optimization barriers around that view keep XLA from folding the reshapes into the fusion,
  which would then loop over x's shape (each hash computed twice) or, with a donated x, write a
  fresh buffer and copy it (measured on XLA:CPU).
  """
  check_rng(rng)
  check_offset(index_offset, x.size)
  k0, k1 = key_words(key)
  off_hi, off_lo = offset_words(index_offset)
  if x.size == 0:
    return fn(x, jnp.zeros(x.shape, jnp.uint32))
  if pairs_aligned(rng, index_offset, x.size):
    m = x.size // 2
    base = int(index_offset) // 2
    local = lax.iota(jnp.uint32, m).reshape(m, 1)
    c_hi, c_lo = add_with_carry(np.uint32(base >> 32), np.uint32(base & 0xFFFFFFFF), local)
    rows = lax.optimization_barrier(x.reshape(m, 2))
    out = lax.optimization_barrier(fn(rows, pair_bits(k0, k1, c_hi, c_lo)))
    return out.reshape(x.shape)
  local = lax.iota(jnp.uint32, x.size).reshape(x.shape)
  hi, lo = add_with_carry(off_hi, off_lo, local)
  return fn(x, bits_at(k0, k1, hi, lo, rng))


def random_bits(key: jax.Array, shape: tuple[int, ...], *, index_offset=0,
                rng: str = "pairs") -> jax.Array:
  """The uint32 draws of an array of `shape` (module docstring), as an array."""
  shape = tuple(shape)
  return map_with_bits(lambda u, bits: bits, jnp.zeros(shape, jnp.uint32), key,
                       index_offset=index_offset, rng=rng)
