"""How CaSync's payloads travel inside `jax.shard_map`: payloads as bytes, and the two exchanges of
K partitions over the W ranks of an axis, with the bytes each one moves.

A payload (a dict of fixed-shape arrays, `Compressor.payload_spec`) travels as its fields bitcast
to uint8 side by side (`to_bytes` / `from_bytes`), so that every leaf of a sync shares one
collective per exchange. Partition j (0 <= j < K) is owned by rank j.

  gather_to_owners(rows [K, B])  -> [W, B]  owner j gets row j of every rank (row r: rank r's)
  broadcast_from_owners(row [B]) -> [K, B]  every rank gets every owner's row

K == W: one `all_to_all` / one `all_gather`. K < W: W-1 `ppermute`s, shift d = 1..W-1, whose
source-target pairs are only the real messages (rank r -> owner (r+d) mod W < K, and owner
j < K -> rank (j+d) mod W), so the ranks that own nothing neither receive dummy rows nor send
any: K < W moves K(W-1) rows in each exchange, never W(W-1).

Bytes moved, per device averaged over the W devices (`moved_bytes`; the conventions that
`tests/compression/hlo_bytes.py` reads off a compiled program): an all_to_all of [W, B] sends
(W-1) B per device, an all_gather of [B] (W-1) B, a ppermute of [B] B per source-target pair
with source != target (summed over pairs, over W), a psum of B bytes 2 (W-1)/W B (a ring
all-reduce).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jlp.compression.base import Compressor, is_sparse

__all__ = ["Codec", "broadcast_from_owners", "from_bytes", "gather_to_owners", "psum_bytes",
           "ring_allreduce_bytes", "to_bytes"]


def _field_bytes(spec: jax.ShapeDtypeStruct) -> int:
  return math.prod(spec.shape) * jnp.dtype(spec.dtype).itemsize


def to_bytes(payload: dict[str, jax.Array], spec: dict[str, jax.ShapeDtypeStruct]) -> jax.Array:
  """uint8[..., B]: the payload's fields bitcast to bytes side by side (leading batch axes kept)."""
  parts = []
  for name, s in spec.items():
    a = payload[name]
    lead = a.shape[:a.ndim - len(s.shape)]
    if a.dtype != jnp.uint8:
      a = lax.bitcast_convert_type(a, jnp.uint8)
    parts.append(a.reshape(lead + (-1,)))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def from_bytes(data: jax.Array, spec: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
  """The payload that `to_bytes` wrote as data (uint8[..., B], leading batch axes kept)."""
  out, pos = {}, 0
  lead = data.shape[:-1]
  for name, s in spec.items():
    size = _field_bytes(s)
    chunk = data[..., pos:pos + size]
    pos += size
    dtype = jnp.dtype(s.dtype)
    if dtype == jnp.uint8:
      out[name] = chunk.reshape(lead + s.shape)
    else:
      out[name] = lax.bitcast_convert_type(chunk.reshape(lead + s.shape + (dtype.itemsize,)),
                                           dtype)
  return out


class Codec(NamedTuple):
  """A compressor at one partition width: its payload spec, the bytes the payload moves (its
  in-jit size: HiPress's wire size with sparse pairs at capacity) and the HiPress wire bytes
  without the sparse pairs (those, 8 * count, are counted from the payload)."""
  comp: Compressor
  spec: dict[str, jax.ShapeDtypeStruct]
  nbytes: int
  fixed_wire: int
  sparse: bool

  @classmethod
  def of(cls, comp: Compressor, width: int) -> "Codec":
    spec = comp.payload_spec(width)
    sparse = is_sparse(comp)
    fixed = comp.wire_bytes(width) - (8 * spec["indices"].shape[0] if sparse else 0)
    return cls(comp, spec, sum(_field_bytes(s) for s in spec.values()), fixed, sparse)

  def sparse_wire(self, payload: dict[str, jax.Array]) -> jax.Array:
    """int32 (batched like payload): the bytes of the (index, value) pairs, 8 * count."""
    if not self.sparse:
      return jnp.zeros(payload[next(iter(self.spec))].shape[:-1], jnp.int32)
    return 8 * payload["count"].astype(jnp.int32)


def psum_bytes(nbytes: int, w: int) -> float:
  """Bytes per device of a psum of nbytes (ring all-reduce: 2 (W-1)/W of them)."""
  return 2 * (w - 1) / w * nbytes


def ring_allreduce_bytes(n: int, w: int) -> float:
  """Bytes per device of `jlp.collectives.allreduce(algorithm="ring")` of one float32 vector of n
  elements: W-1 hops of a chunk of C = ceil(n/W) floats, then an all_gather of the chunks."""
  return 2 * (w - 1) * 4 * -(-n // w) if n else 0.0


def _shift_recv(send: jax.Array, own: jax.Array, w: int, pairs_of, axis_name) -> jax.Array:
  """[W, B]: row 0 `own`, row d what arrived by the ppermute of shift d (pairs_of(d))."""
  rows = [own]
  for d in range(1, w):
    rows.append(lax.ppermute(send(d), axis_name, pairs_of(d)))
  return jnp.stack(rows)


def gather_to_owners(rows: jax.Array, k: int, w: int, axis_name) -> jax.Array:
  """uint8[W, B] on owner j: row r is rank r's row j (rows: this rank's uint8[K, B]); on a rank
  that owns nothing (j >= K), zeros. Bytes moved per device: K (W-1) B / W."""
  if k == w:
    return lax.all_to_all(rows, axis_name, 0, 0)
  rank = lax.axis_index(axis_name)

  def send(d):  # this rank's row for owner (rank + d) mod W (not sent unless that is < K)
    return lax.dynamic_index_in_dim(rows, jnp.minimum((rank + d) % w, k - 1), keepdims=False)
  own = lax.dynamic_index_in_dim(rows, jnp.minimum(rank, k - 1), keepdims=False)
  by_shift = _shift_recv(send, own, w,
                         lambda d: [(r, (r + d) % w) for r in range(w) if (r + d) % w < k],
                         axis_name)
  # The row of rank r arrived by shift (rank - r) mod W.
  return jnp.take(by_shift, (rank - jnp.arange(w)) % w, axis=0)


def broadcast_from_owners(row: jax.Array, k: int, w: int, axis_name) -> jax.Array:
  """uint8[K, B] on every rank: row j is owner j's `row` (ranks >= K send nothing). Bytes moved
  per device: K (W-1) B / W."""
  if k == w:
    return lax.all_gather(row, axis_name)
  rank = lax.axis_index(axis_name)
  by_shift = _shift_recv(lambda d: row, row, w,
                         lambda d: [(j, (j + d) % w) for j in range(k)], axis_name)
  # Owner j's row arrived by shift (rank - j) mod W (shift 0: this rank's own).
  return jnp.take(by_shift, (rank - jnp.arange(k)) % w, axis=0)
