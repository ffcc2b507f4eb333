"""The combinators compressors are written with (CompLL's vocabulary; docs/hipress.md).

  pack_bits(codes, bits, pad)        uint8 codes (one per element) -> packed bytes, LSB-first
  unpack_bits(packed, bits, n)       the inverse
  capacity_filter(mask, capacity)    the first `capacity` indices where mask holds (ascending)
  threshold_select(values, thr, capacity)
                                     capacity_filter(|values| > thr, capacity)
  top_k(scores, k)                   indices of the k largest scores (ascending index order)
  capped_select(mask, scores, k)     indices where mask holds, capped at k by the largest scores
  capped_threshold_select(values, thr, k)
                                     capped_select(|values| > thr, |values|, k): DGC's and
                                     GradDrop's selection
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

from jlp.compression.layout import decimal
from jlp.numerics.packing import BITS, packed_size
from pallas_kernels import pack_bits as pack_bits_kernel
from pallas_kernels import threshold_select as threshold_select_kernel

__all__ = ["IMPLS", "block_sums", "capacity_filter", "capped_select", "capped_threshold_select", "fold",
           "pack_bits", "sampled_threshold", "threshold_select", "top_k", "uniform",
           "unpack_bits"]

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
  slots past n hold `pad`, a `bits`-bit code. Codes must fit in `bits` bits (higher bits are
  dropped)."""
  _check_bits(bits)
  if not 0 <= pad < (1 << bits):
    raise ValueError(f"pad={pad!r} is not allowed; expected a {bits}-bit code.")
  pad = int(pad)
  codes = jnp.asarray(codes).reshape(-1).astype(jnp.uint8)
  if use_pallas(impl):
    return pack_bits_kernel.pack_bits(codes, bits, pad, interpret=jax.default_backend() != "gpu")
  return pack_bits_xla(codes, bits, pad)


def pack_bits_xla(codes: jax.Array, bits: int, pad: int = 0) -> jax.Array:
  n = codes.shape[0]
  per = 8 // bits
  m = packed_size(n, bits)
  mask = jnp.uint8((1 << bits) - 1)
  codes = codes & mask
  if m * per != n:
    codes = jnp.concatenate([codes, jnp.full((m * per - n,), pad, jnp.uint8)])
  if bits == 1:
    # Eight codes as two little-endian uint32 words (XLA:CPU vectorises word shifts; per-byte
    # slices gather): the word lo | hi << 4 holds code j at bit 8j (j < 4) or 8(j-4) + 4.
    words = lax.bitcast_convert_type(codes.reshape(m, 2, 4), jnp.uint32)
    w = words[:, 0] | (words[:, 1] << jnp.uint32(4))
    return (w | (w >> jnp.uint32(7)) | (w >> jnp.uint32(14)) | (w >> jnp.uint32(21))
            ).astype(jnp.uint8)
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
    return pack_bits_kernel.unpack_bits(packed, bits, n, interpret=jax.default_backend() != "gpu")
  return unpack_bits_xla(packed, bits, n)


def unpack_bits_xla(packed: jax.Array, bits: int, n: int) -> jax.Array:
  per = 8 // bits
  shifts = jnp.arange(per, dtype=jnp.uint8) * jnp.uint8(bits)
  codes = (packed[:, None] >> shifts[None, :]) & jnp.uint8((1 << bits) - 1)
  return codes.reshape(-1)[:n]


def block_sums(values: tuple[jax.Array, ...], block: int = 1024) -> tuple[jax.Array, ...]:
  """The sums of 1-D arrays of one length, each over its elements, in blocks: zero-padded to
  rows of `block`, each row summed, then the row sums the same way until one value is left.
  One pass for all of them (a variadic reduce). A single float32 accumulator over n elements
  drifts by O(n) roundings: at 128M elements XLA:CPU's one-loop sum of N(0,1) negatives came out
  31% low; blocked, the error grows with log(n) (within 1e-5 here)."""
  values = tuple(jnp.asarray(v).reshape(-1) for v in values)
  inits = tuple(jnp.zeros((), v.dtype) for v in values)

  def add(a, b):
    return tuple(x + y for x, y in zip(a, b))

  while values[0].shape[0] > block:
    n = values[0].shape[0]
    rows = -(-n // block)
    padded = tuple(jnp.pad(v, (0, rows * block - n)).reshape(rows, block) for v in values)
    values = lax.reduce(padded, inits, add, (1,))
  return lax.reduce(values, inits, add, (0,))


def capacity_filter(mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """(indices int32[capacity], count int32): the first `capacity` positions where `mask` holds,
  ascending; unused slots hold n (out of range: scatters with mode="drop" skip them)."""
  mask = jnp.asarray(mask).reshape(-1)
  idx, total = _compact_xla(mask, lambda m: m, capacity, False)
  return idx, jnp.minimum(total, capacity)


_COMPACT_BLOCK = 16


def _compact_xla(values: jax.Array, selected, capacity: int, pad) -> tuple[jax.Array, jax.Array]:
  """(the first `capacity` i with selected(values)[i], ascending, unused slots n; how many i
  are selected), for flat `values` and an elementwise predicate. By blocks of 16 (as the Pallas
  kernel by tiles): the selected count of every block, the first `capacity` blocks with any
  (recursively), and a cumsum within those blocks only. jnp.nonzero's cumsum over all n costs
  XLA:CPU ~10 passes over the mask; this costs about one."""
  n = values.shape[0]
  if n <= 4096 or capacity == 0:
    mask = selected(values)
    (idx,) = jnp.nonzero(mask, size=capacity, fill_value=n)
    return idx.astype(jnp.int32), jnp.sum(mask, dtype=jnp.int32)
  size = _COMPACT_BLOCK
  blocks = -(-n // size)
  if blocks * size != n:
    values = jnp.pad(values, (0, blocks * size - n), constant_values=pad)
  rows = values.reshape(blocks, size)
  # The barrier materialises the counts once (XLA would otherwise fuse this pass over all n into
  # each of the counts' three consumers).
  counts = lax.optimization_barrier(jnp.sum(selected(rows), axis=1, dtype=jnp.int32))
  active, _ = _compact_xla(counts > 0, lambda m: m, min(capacity, blocks), False)
  chosen = selected(jnp.take(rows, active, axis=0, mode="fill", fill_value=pad))
  before = jnp.take(counts, active, mode="fill", fill_value=0)
  slot = (jnp.cumsum(before, dtype=jnp.int32) - before)[:, None] + (
      jnp.cumsum(chosen, axis=1, dtype=jnp.int32) - chosen)
  slot = jnp.where(chosen & (slot < capacity), slot, capacity)
  position = active[:, None] * size + jnp.arange(size, dtype=jnp.int32)
  idx = jnp.full((capacity,), n, jnp.int32).at[slot.reshape(-1)].set(position.reshape(-1),
                                                                     mode="drop")
  return idx, jnp.sum(counts)


def top_k(scores: jax.Array, k: int) -> jax.Array:
  """int32[k]: indices of the k largest scores (ties: the lower index), in ascending order."""
  scores = jnp.asarray(scores).reshape(-1)
  _, idx = lax.top_k(scores, k)
  return jnp.sort(idx.astype(jnp.int32))


def capped_select(mask: jax.Array, scores: jax.Array, capacity: int
                  ) -> tuple[jax.Array, jax.Array]:
  """(indices int32[capacity] ascending, count): every position where mask holds if there are at
  most `capacity`, else the `capacity` of them with the largest scores (ties: lower index).
  Unused slots hold n. This is HiPress's select-then-truncate of DGC and GradDrop,
  truncating by the true magnitudes (HiPress's dgc_new compares already-zeroed values)."""
  mask = jnp.asarray(mask).reshape(-1)
  scores = jnp.asarray(scores, jnp.float32).reshape(-1)
  n = mask.shape[0]
  capacity = min(capacity, n)
  total = jnp.sum(mask, dtype=jnp.int32)

  def truncate(_):
    masked = jnp.where(mask, scores, -jnp.inf)
    return top_k(masked, capacity), jnp.minimum(total, capacity)  # typed like total (vma)

  def keep_all(_):
    return capacity_filter(mask, capacity)

  return lax.cond(total > capacity, truncate, keep_all, None)


def _threshold_select(values: jax.Array, threshold: jax.Array, capacity: int, impl: str
                      ) -> tuple[jax.Array, jax.Array]:
  """(capacity_filter(|values| > threshold, capacity)'s indices, the uncapped count)."""
  if use_pallas(impl):
    return threshold_select_kernel.threshold_select(values, threshold, capacity,
                                   interpret=jax.default_backend() != "gpu")
  return _compact_xla(values, lambda v: jnp.abs(v) > threshold, capacity, jnp.nan)


def _float32_values(values: jax.Array, threshold: jax.Array | float
                    ) -> tuple[jax.Array, jax.Array]:
  values = jnp.asarray(values)
  if values.dtype != jnp.float32:
    raise ValueError(f"values has dtype {values.dtype}; expected float32.")
  threshold = jnp.asarray(threshold, jnp.float32)
  if threshold.shape != ():
    raise ValueError(f"threshold has shape {threshold.shape}; expected a scalar.")
  return values.reshape(-1), threshold


def threshold_select(values: jax.Array, threshold: jax.Array | float, capacity: int,
                     impl: str = "xla") -> tuple[jax.Array, jax.Array]:
  """(indices int32[capacity], count int32): `capacity_filter(|values| > threshold, capacity)`
  for float32 `values` (any shape, flattened) and a float32 scalar threshold: the first
  `capacity` indices i with |values[i]| > threshold, ascending, unused slots n; count =
  min(number selected, capacity). NaN values and values equal to the threshold are not selected.
  impl="pallas" runs `pallas_kernels.threshold_select` (per-tile counts, a prefix sum over tiles,
  per-tile compaction), with the same result."""
  values, threshold = _float32_values(values, threshold)
  idx, total = _threshold_select(values, threshold, capacity, impl)
  return idx, jnp.minimum(total, capacity)


def capped_threshold_select(values: jax.Array, threshold: jax.Array | float, capacity: int,
                            impl: str = "xla") -> tuple[jax.Array, jax.Array]:
  """(indices int32[min(capacity, n)] ascending, count): `capped_select(|values| > threshold,
  |values|, capacity)` for float32 `values` (any shape, flattened): every index with
  |values[i]| > threshold if there are at most `capacity`, else the `capacity` largest
  |values[i]| (ties: lower index); unused slots n. DGC's and GradDrop's selection.
  impl="pallas" selects with `pallas_kernels.threshold_select`; the truncation, when
  over capacity, stays XLA's top_k (over the first 2*capacity selected when that is all of them,
  else over all n)."""
  values, threshold = _float32_values(values, threshold)
  # The threshold typed like the values (its value unchanged): under vmap inside shard_map, jax's
  # varying-axes typing rejects the switch below when its branches close over axis-varying values
  # and a constant threshold.
  threshold = jnp.where(values[0] != values[0], threshold, threshold)
  n = values.shape[0]
  capacity = min(capacity, n)
  # Up to 2*capacity candidates: a sampled threshold over-selects a little more often than not,
  # and then top_k runs over the candidates only (HiPress sorts the selected, not all n).
  candidates = min(n, 2 * capacity)
  idx, total = _threshold_select(values, threshold, candidates, impl)

  def keep_all(_):
    return idx[:capacity], total

  def truncate_candidates(_):
    magnitude = jnp.take(jnp.abs(values), idx, mode="fill", fill_value=-jnp.inf)
    _, best = lax.top_k(magnitude, capacity)
    # idx is ascending, so idx[sort(best)]: the chosen candidates in order, by a mask over the
    # candidates (a cumsum over 2*capacity) instead of a sort of capacity indices.
    chosen = jnp.zeros(idx.shape, jnp.bool_).at[best].set(True)
    (order,) = jnp.nonzero(chosen, size=capacity, fill_value=0)
    return idx[order], jnp.minimum(total, capacity)  # typed like total (vma)

  def truncate(_):
    magnitude = jnp.abs(values)
    masked = jnp.where(magnitude > threshold, magnitude, -jnp.inf)
    return top_k(masked, capacity), jnp.minimum(total, capacity)

  branch = (total > capacity).astype(jnp.int32) + (total > candidates).astype(jnp.int32)
  return lax.switch(branch, (keep_all, truncate_candidates, truncate), None)


def sampled_threshold(magnitude: jax.Array, key: jax.Array, sample_rate: float,
                      density: float) -> jax.Array:
  """HiPress's threshold (DGC, GradDrop): S = ceil(n * sample_rate) indices drawn uniformly with
  replacement, the sampled magnitudes sorted in descending order, the one at position
  floor(S * density)."""
  magnitude = jnp.asarray(magnitude).reshape(-1)
  n = magnitude.shape[0]
  s = max(1, math.ceil(n * decimal(sample_rate)))
  pos = min(s - 1, math.floor(s * decimal(density)))
  idx = jax.random.randint(key, (s,), 0, n)
  sample = magnitude[idx]
  # -sort(-sample)[pos] (a stable sort: NaNs last, values that compare equal, such as -0, +0 and
  # the denormals XLA:CPU flushes, in index order), found by top_k (ties: lower index first) over
  # int32 keys in that order: XLA:CPU's top_k is ~100x faster than its sort here, and its own
  # float order differs on NaN and zeros.
  bits = lax.bitcast_convert_type(sample, jnp.int32)
  keys = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
  keys = jnp.where(sample == 0, 0, keys)
  keys = jnp.where(jnp.isnan(sample), jnp.iinfo(jnp.int32).min, keys)
  _, order = lax.top_k(keys, pos + 1)
  return sample[order[pos]]


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """float32 numbers uniform in [0, 1), one per element, from `key` alone."""
  return jax.random.uniform(key, shape, jnp.float32)


def fold(key: jax.Array, *ids: int | jax.Array) -> jax.Array:
  """`key` folded with each id in turn: one independent stream per (leaf, partition, ...)."""
  for i in ids:
    key = jax.random.fold_in(key, i)
  return key
