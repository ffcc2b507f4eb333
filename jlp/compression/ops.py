"""The combinators compressors are written with (CompLL's vocabulary, hipress.md §3.3).

  pack_bits(codes, bits, pad)        uint8 codes (one per element) -> packed bytes, LSB-first
  unpack_bits(packed, bits, n)       the inverse
  capacity_filter(mask, capacity)    the first `capacity` indices where mask holds (ascending)
  top_k(scores, k)                   indices of the k largest scores (ascending index order)
  capped_select(mask, scores, k)     indices where mask holds, capped at k by the largest scores
  sampled_threshold(mag, key, sample_rate, density)
                                     HiPress's sampled threshold: the sample's element at rank
                                     floor(S * density) of its descending order
  uniform(key, shape)                per-key random numbers in [0, 1)
  fold(key, *ids)                    a key per (leaf, partition, rank, ...)

Each takes fixed shapes (jit, vmap and shard_map carry them). `impl` chooses the XLA path or the
Pallas kernel of `pallas_kernels/` ("auto": Pallas on GPU); both give the same bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jlp.compression.layout import BITS, decimal, packed_size

__all__ = ["IMPLS", "capacity_filter", "capped_select", "fold", "pack_bits", "sampled_threshold",
           "top_k", "uniform", "unpack_bits"]

IMPLS = ("auto", "xla", "pallas")


def use_pallas(impl: str) -> bool:
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not allowed; expected one of {IMPLS}.")
  return impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu")


def _check_bits(bits: int) -> None:
  if bits not in BITS:
    raise ValueError(f"bits={bits!r} is not allowed; expected one of {BITS}.")


def pack_bits(codes: jax.Array, bits: int, pad: int = 0, impl: str = "xla") -> jax.Array:
  """uint8[ceil(n*bits/8)]: code i at bit offset bits*(i mod 8/bits) of byte i // (8/bits);
  slots past n hold `pad`. Codes must fit in `bits` bits (higher bits are dropped)."""
  _check_bits(bits)
  codes = jnp.asarray(codes).reshape(-1).astype(jnp.uint8)
  if use_pallas(impl):
    from pallas_kernels import pack_bits as kernel  # pylint: disable=g-import-not-at-top
    return kernel.pack_bits(codes, bits, pad, interpret=jax.default_backend() != "gpu")
  return pack_bits_xla(codes, bits, pad)


def pack_bits_xla(codes: jax.Array, bits: int, pad: int = 0) -> jax.Array:
  n = codes.shape[0]
  per = 8 // bits
  m = packed_size(n, bits)
  mask = jnp.uint8((1 << bits) - 1)
  codes = codes & mask
  if m * per != n:
    codes = jnp.concatenate([codes, jnp.full((m * per - n,), pad, jnp.uint8)])
  rows = codes.reshape(m, per)
  out = rows[:, 0]
  for j in range(1, per):
    out = out | (rows[:, j] << jnp.uint8(bits * j))
  return out


def unpack_bits(packed: jax.Array, bits: int, n: int, impl: str = "xla") -> jax.Array:
  """uint8[n]: the codes of `pack_bits` (tail slots dropped)."""
  _check_bits(bits)
  packed = jnp.asarray(packed, jnp.uint8).reshape(-1)
  if packed.shape[0] != packed_size(n, bits):
    raise ValueError(f"packed has {packed.shape[0]} bytes; expected ceil({n}*{bits}/8) = "
                     f"{packed_size(n, bits)}.")
  if use_pallas(impl):
    from pallas_kernels import pack_bits as kernel  # pylint: disable=g-import-not-at-top
    return kernel.unpack_bits(packed, bits, n, interpret=jax.default_backend() != "gpu")
  return unpack_bits_xla(packed, bits, n)


def unpack_bits_xla(packed: jax.Array, bits: int, n: int) -> jax.Array:
  per = 8 // bits
  shifts = jnp.arange(per, dtype=jnp.uint8) * jnp.uint8(bits)
  codes = (packed[:, None] >> shifts[None, :]) & jnp.uint8((1 << bits) - 1)
  return codes.reshape(-1)[:n]


def capacity_filter(mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """(indices int32[capacity], count int32): the first `capacity` positions where `mask` holds,
  ascending; unused slots hold n (out of range: scatters with mode="drop" skip them)."""
  mask = jnp.asarray(mask).reshape(-1)
  n = mask.shape[0]
  (idx,) = jnp.nonzero(mask, size=capacity, fill_value=n)
  count = jnp.minimum(jnp.sum(mask, dtype=jnp.int32), capacity)
  return idx.astype(jnp.int32), count


def top_k(scores: jax.Array, k: int) -> jax.Array:
  """int32[k]: indices of the k largest scores (ties: the lower index), in ascending order."""
  scores = jnp.asarray(scores).reshape(-1)
  _, idx = lax.top_k(scores, k)
  return jnp.sort(idx.astype(jnp.int32))


def capped_select(mask: jax.Array, scores: jax.Array, capacity: int
                  ) -> tuple[jax.Array, jax.Array]:
  """(indices int32[capacity] ascending, count): every position where mask holds if there are at
  most `capacity`, else the `capacity` of them with the largest scores (ties: lower index).
  Unused slots hold n. This is HiPress's select-then-truncate of DGC and GradDrop (§1.3, §1.4),
  truncating by the true magnitudes (HiPress's dgc_new compares already-zeroed values)."""
  mask = jnp.asarray(mask).reshape(-1)
  scores = jnp.asarray(scores, jnp.float32).reshape(-1)
  n = mask.shape[0]
  capacity = min(capacity, n)
  total = jnp.sum(mask, dtype=jnp.int32)

  def truncate(_):
    masked = jnp.where(mask, scores, -jnp.inf)
    return top_k(masked, capacity), jnp.int32(capacity)

  def keep_all(_):
    return capacity_filter(mask, capacity)

  return lax.cond(total > capacity, truncate, keep_all, None)


def sampled_threshold(magnitude: jax.Array, key: jax.Array, sample_rate: float,
                      density: float) -> jax.Array:
  """HiPress's threshold (§1.3): S = ceil(n * sample_rate) indices drawn uniformly with
  replacement, the sampled magnitudes sorted in descending order, the one at position
  floor(S * density)."""
  magnitude = jnp.asarray(magnitude).reshape(-1)
  n = magnitude.shape[0]
  s = max(1, math.ceil(n * decimal(sample_rate)))
  pos = min(s - 1, math.floor(s * decimal(density)))
  idx = jax.random.randint(key, (s,), 0, n)
  sample = -jnp.sort(-magnitude[idx])
  return sample[pos]


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """float32 numbers uniform in [0, 1), one per element, from `key` alone."""
  return jax.random.uniform(key, shape, jnp.float32)


def fold(key: jax.Array, *ids: int | jax.Array) -> jax.Array:
  """`key` folded with each id in turn: one independent stream per (leaf, partition, ...)."""
  for i in ids:
    key = jax.random.fold_in(key, i)
  return key
