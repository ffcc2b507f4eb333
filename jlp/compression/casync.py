"""Compression-aware synchronisation (HiPress's CaSync, docs/hipress.md#casync) in shard_map.

`sync(tree, axis_name, compressor, state)` sums a pytree of float32 leaves over the W ranks of
`axis_name` inside `jax.shard_map`; every rank gets the same bits, and its own new state.
(topology="allreduce", for compressors whose payloads are summed by all-reduces, is PowerSGD's:
jlp.compression.powersgd documents its routing, state and bytes; the rest of this docstring is
CaSync's "ps" and "ring".)

Routing (static, `leaf_routes`). A leaf is compressed iff it has more than `min_size`
elements (HiPress's --comp-threshold, "minimal (excluded) number of floats to compress"), in
K = min(W, n) partitions. A SeCoPa `plan` {jax.tree_util.keystr(path): (compress, K)} overrides
the leaves it names (1 <= K <= min(W, n)). The other leaves are summed in float32 by one ring
all-reduce of all of them, packed into one vector (`jlp.collectives.allreduce`, algorithm="ring",
fmt=None: a fixed order of float32 adds, so the same bits on any number of processes, where
lax.psum's order is the backend's; HiPress sends them through NCCL's ring); empty leaves pass
through unchanged and reach no collective.

Partitions and state. A compressed leaf of n elements is flattened (C order), zero-padded to K*c
elements and cut into K partitions of c = ceil(n/K); partition j is owned by rank j. Each rank
keeps, per compressed leaf, K state slots of c elements: the compressor's state (EF residual,
DGC's u and v, ...) with a leading slot axis, keyed by leaf and partition.
S = compressor.server(W) is what re-encodes a sum of W contributions (the compressor itself,
except DGC: the union of the non-zeros).

topology="ps" (CaSync-PS with co-located servers; DeepSpeed's compressed_allreduce shape):
  1. rank r encodes each of its K partitions j with slot j (the K encodes as one vmap);
  2. partition j's payloads travel to their owner, rank j (`transport.gather_to_owners`);
  3. owner j merges, starting from its own RAW partition j (its contribution enters
     uncompressed, as in HiPress): acc = decode_add(payload of rank r, acc) for
     r = 0, 1, ..., W-1 ascending, r != j;
  4. owner j re-encodes acc with S and its slot j as it was before step 1 (HiPress GradDrop's
     root reuses the same residual buffer): slot j takes S's new state. The owner's own step-1
     payload and state for partition j are discarded.
     A stateless S (state {}: DGC's union of the non-zeros, capacity W*k) keeps no residual, so
     it must only see sparse contributions (a raw partition would lose everything beyond W*k
     entries for good): then steps 3-4 are acc = 0, acc = decode_add(payload of rank r, acc) for
     r = 0..W-1 ascending, the owner's own step-1 payload included, and S encodes acc from a
     fresh state; every slot keeps its step-1 state;
  5. the K server payloads travel to every rank (`transport.broadcast_from_owners`); every rank
     decodes partitions 0..K-1 with S.
topology="ring" (CaSync-Ring), the chunk order of `jlp.collectives.allreduce`'s ring over
  the K chunks: chunk k starts at rank k+1, which encodes its raw chunk with the compressor and
  its slot k; at reduce hop t = 0..W-2 the chunk moves from rank k+1+t to rank k+2+t, which
  decodes it onto its own raw chunk k (acc = raw + decode, with the compressor that encoded it)
  and re-encodes acc with server(t+2) (the number of contributions it now holds; the compressor
  itself except for DGC: then this is "encode with its own state for that chunk") and its slot
  k. A stateless server (DGC's union, capacity (t+2)*k) merges encoded contributions only: the
  rank's own chunk enters as its worker encode (the compressor, slot k, key step W + t) instead
  of raw, and the server encodes from a fresh state.
  After W-1 hops rank k holds chunk k (W encodes and W-1 decodes per chunk). The gather phase
  does no arithmetic: the reduced payloads travel from their holders to every rank
  (`transport.broadcast_from_owners`: the bits of W-1 forwarding hops), and every rank decodes
  each of the K chunks once, with server(W). Each hop is one `ppermute` of every leaf's payload
  (bitcast to bytes side by side, as in the bucketed ring of `jlp.collectives.allreduce`) whose
  source-target pairs are the K ranks that hold a chunk at that hop.
Leaves with different K are exchanged group by group (largest K first), each group's collectives
ordered after the previous group's: only real partitions travel.

Random draws (`needs_key`, then `key` is required): the encode of partition / chunk p of leaf i
(its index in the flattened tree) by rank r at step s uses `ops.fold(key, i, p, r, s)`: PS s = 0
worker, 1 server; ring s = 0 first encode, t+1 at reduce hop t (W + t: the worker encode of
the rank's own chunk at hop t under a stateless server). Callers fold in what else must differ
(the train step its step number, a pipeline its stage index), so every (stage, pipeline, leaf,
partition, rank, step) draws its own numbers; the result is the same run to run for a key.

Non-finite gradients. If any rank's leaf holds a NaN or an infinity, that leaf's sum is NaN on
every rank (a decode would otherwise turn it into finite numbers), and every rank's state comes
back exactly as it went in, for every leaf (the call leaves no trace: a following call with
finite gradients gives the bits it would have given without this one). `nonfinite` counts the
non-finite gradient elements over all ranks and leaves.

Bits. Every encode and decode is the compressor's own, on one partition (or, for a rank's K
worker encodes in PS, one vmapped call: batched, a codec's float32 reductions such as onebit's
means may sum in another order than alone, so the reference batches them too), and XLA may not
change their bits by fusing them with each other: the leaves enter behind an optimization
barrier, a dense merge adds the decode rounded to float32 (XLA:CPU would otherwise contract the
decode's multiply and the add into one FMA in some programs and not in others), a sparse merge
(scatter-add) and every merged partition or chunk pass barriers, and so do the final decodes.

State. `init_state(tree, compressor, W, ...)` is ONE rank's fresh state: {keystr(path): the
compressor's state with a leading axis of K slots} for the compressed leaves (zeros for the
built-in compressors); `sync` returns the same structure. Every rank's state is its own: a train
step carries it stacked on a leading [W] axis sharded over the axis,
    stacked = jax.tree.map(lambda s: jnp.stack([s] * W), init_state(grads, c, W))
with in_specs / out_specs P(axis). Inside the shard_map body pass the block as it comes (every
leaf with a leading axis of 1; the new state is returned in the same form) or without its
leading axis (`s[0]`, then return `s[None]`). Donate it.

Bytes (`sync_with_bytes`'s report, float32 scalars averaged over the devices, the same on every
rank):
  wire_bytes     the bytes the call's collectives move per device (the conventions of
                 `jlp.compression.transport`): every payload at its in-jit size, which is
                 HiPress's wire size with sparse payloads at capacity (4 + 8 * capacity), K(W-1)
                 worker and K(W-1) server messages in PS, K per reduce hop and K(W-1) forwarded
                 in the ring; 2(W-1) * 4 * ceil(n/W) for the float32 ring all-reduce of the n
                 uncompressed elements; and
                 the sync's bookkeeping psum of (number of compressed leaves + 2) int32 counters
                 (non-finite counts and sparse sizes). Static: it is what the compiled program
                 moves, whatever the data.
  payload_bytes  what HiPress's wire format would carry for the same messages: sparse payloads
                 at their real count (4 + 8 * count), the uncompressed leaves as above, no
                 bookkeeping. Exact while the totals stay below 2^24 bytes; float32 beyond.
  nonfinite      int32: the number of non-finite gradient elements, summed over the ranks.

The results of compressed leaves are identical on every rank but typed as varying over
`axis_name` (they come from a collective): return them with out_specs naming the axis, or use
`check_vma=False` for out_specs=P().
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp._checks import invalid, is_int
from jlp.collectives.allreduce import allreduce, axis_size
from jlp.compression import ops
from jlp.compression import transport
from jlp.compression import powersgd
from jlp.compression.base import Compressor, is_sparse
from jlp.compression.leaves import leaf_specs, nonfinite_count, state_form
from jlp.compression.transport import Codec
from jlp.numerics.opaque import opaque_zero

__all__ = ["DEFAULT_MIN_SIZE", "SYNC_TOPOLOGIES", "TOPOLOGIES", "Route", "check_pairing",
           "init_state", "leaf_routes", "sync", "sync_with_bytes"]

TOPOLOGIES = ("ps", "ring")
#: Every topology of `sync`: CaSync's, and "allreduce" for compressors whose payloads can be
#: summed (PowerSGD: jlp.compression.powersgd, which documents it).
SYNC_TOPOLOGIES = TOPOLOGIES + ("allreduce",)
#: HiPress's --comp-threshold: compress iff a leaf has more than this many floats.
DEFAULT_MIN_SIZE = 262144


class Route(NamedTuple):
  """How `sync` moves one leaf: compressed in K partitions, or by the float32 ring all-reduce (K
  is then only what a plan said, or min(W, n))."""
  path: str
  size: int
  compress: bool
  K: int


# -- validation and routing (static) ---------------------------------------------------------------

def _check_topology(topology: Any) -> None:
  if not isinstance(topology, str) or topology not in SYNC_TOPOLOGIES:
    raise invalid("topology", topology, f"one of {SYNC_TOPOLOGIES}")


def check_pairing(compressor: Compressor, topology: str) -> None:
  """One-line ValueError unless `compressor` runs with `topology` (`Compressor.topologies`)."""
  allowed = type(compressor).topologies
  if topology not in allowed:
    raise invalid("topology", topology,
                  f"one of {allowed} for {type(compressor).__name__}"
                  + (" (its payloads cannot be summed)" if topology == "allreduce" else ""))


def _check_min_size(min_size: Any) -> None:
  if not is_int(min_size) or min_size < 0:
    raise invalid("min_size", min_size, "an int >= 0 (elements; 0 compresses every non-empty leaf)")


def _check_compressor(compressor: Any) -> None:
  if not isinstance(compressor, Compressor):
    raise invalid("compressor", compressor,
                  "a jlp.compression.Compressor (e.g. jlp.compression.get('tbq'))")


def _routes(specs: list[tuple[str, tuple[int, ...]]], num_ranks: int, min_size: Any,
            plan: Any) -> list[Route]:
  _check_min_size(min_size)
  if plan is None:
    plan = {}
  if not isinstance(plan, dict):
    raise invalid("plan", plan, "None or a dict {keystr(path): (compress: bool, K: int)}")
  paths = {p for p, _ in specs}
  unknown = sorted(set(plan) - paths)
  if unknown:
    raise invalid("plan path", unknown[0], f"a leaf path of the tree, one of {sorted(paths)}")
  routes = []
  for path, shape in specs:
    size = math.prod(shape)
    compress, k = size > min_size, min(num_ranks, max(size, 1))
    if path in plan:
      entry = plan[path]
      if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
        raise invalid(f"plan[{path!r}]", entry, "a pair (compress: bool, K: int)")
      compress, k = entry
      if not isinstance(compress, (bool, np.bool_)):
        raise invalid(f"plan[{path!r}] compress", compress, "True or False")
      if not is_int(k) or not 1 <= k <= num_ranks:
        raise invalid(f"plan[{path!r}] K", k, f"an int in [1, {num_ranks}] (the number of ranks)")
      if compress and size == 0:
        raise invalid(f"plan[{path!r}] compress", compress, "False for an empty leaf")
      if compress and k > size:
        raise invalid(f"plan[{path!r}] K", k,
                      f"an int in [1, {size}] (a partition per element at most: the leaf has "
                      f"{size})")
    routes.append(Route(path, size, bool(compress), int(k)))
  return routes


def leaf_routes(tree: Any, num_ranks: int, *, min_size: int = DEFAULT_MIN_SIZE,
                plan: dict[str, tuple[bool, int]] | None = None) -> list[Route]:
  """How `sync` routes each leaf of `tree` over `num_ranks` ranks: [Route(path, size, compress,
  K)] in flattening order (K = min(num_ranks, size) unless the plan says otherwise)."""
  if not is_int(num_ranks) or num_ranks < 1:
    raise invalid("num_ranks", num_ranks, "an int >= 1")
  return _routes(leaf_specs(tree), int(num_ranks), min_size, plan)


def _shapes(tree: Any) -> Any:
  return jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)


def _server_stateful(compressor: Compressor, server: Compressor, width: int) -> bool:
  """Whether `server` re-encodes with the aggregator's slot (its state has the compressor's
  structure) rather than a fresh state (stateless: {})."""
  if server is compressor:
    return True
  own = jax.eval_shape(lambda: compressor.init_flat(width))
  theirs = jax.eval_shape(lambda: server.init_flat(width))
  if not jax.tree.leaves(theirs):
    return False
  if _shapes(own) != _shapes(theirs):
    raise invalid(f"{type(server).__name__} (the server of {type(compressor).__name__}) state",
                  jax.tree.map(lambda a: a.shape, theirs),
                  "the compressor's state structure or no state")
  return True


class _Leaf(NamedTuple):
  index: int
  route: Route
  shape: tuple[int, ...]
  width: int  # c = ceil(n / K)


def _leaves(specs: list[tuple[str, tuple[int, ...]]], routes: list[Route]) -> list[_Leaf]:
  return [_Leaf(i, r, shape, -(-r.size // r.K)) for i, ((_, shape), r)
          in enumerate(zip(specs, routes)) if r.compress]


def _slot_state(compressor: Compressor, leaf: _Leaf) -> Any:
  one = compressor.init_flat(leaf.width)
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (leaf.route.K,) + a.shape), one)


def init_state(tree: Any, compressor: Compressor, num_ranks: int, *, topology: str = "ps",
               min_size: int = DEFAULT_MIN_SIZE,
               plan: dict[str, tuple[bool, int]] | None = None, seed: int = 0) -> dict[str, Any]:
  """ONE rank's fresh state for leaves shaped like `tree` (arrays or ShapeDtypeStructs) over
  `num_ranks` ranks: {keystr(path): compressor state with a leading axis of K slots} for the
  compressed leaves. Callable outside shard_map; stack it on a leading [W] axis for a train
  state (module docstring). topology "allreduce": PowerSGD's state, its Q drawn from `seed`
  (jlp.compression.powersgd)."""
  _check_topology(topology)
  _check_compressor(compressor)
  check_pairing(compressor, topology)
  if topology == "allreduce":
    if plan is not None:
      raise invalid("plan", plan, "None with topology='allreduce'")
    return powersgd.init_state(tree, compressor, seed=seed)
  specs = leaf_specs(tree)
  routes = leaf_routes(tree, num_ranks, min_size=min_size, plan=plan)
  return {leaf.route.path: _slot_state(compressor, leaf) for leaf in _leaves(specs, routes)}


# -- the synchronisation ---------------------------------------------------------------------------

def _keys(key: jax.Array | None, leaf: int, parts: jax.Array | int, rank: jax.Array, step: Any):
  if key is None:
    return None
  if jnp.ndim(parts) == 0:
    return ops.fold(key, leaf, parts, rank, step)
  return jax.vmap(lambda p: ops.fold(key, leaf, p, rank, step))(parts)


def _dense_merge(comp: Compressor) -> bool:
  """Whether comp's decode_add is the base class's acc + decode (not sparse, not overridden)."""
  return not is_sparse(comp) and type(comp).decompress_add is Compressor.decompress_add


def _decode_add(comp: Compressor, payload: dict[str, jax.Array], acc: jax.Array,
                zero: jax.Array) -> jax.Array:
  """comp.decode_add(payload, acc), computed so that its bits do not depend on what XLA fuses it
  with: a dense decode is rounded to float32 before the add (its bits OR-ed with `zero`, an
  opaque zero: XLA:CPU would otherwise contract a decode's multiply and the add into one FMA in
  some programs and not in others); any other decode_add (a scatter-add) is computed behind an
  optimization barrier (XLA would otherwise, e.g., re-associate a merge's scatter-add with the
  next encode's residual add)."""
  if _dense_merge(comp):
    decoded = lax.bitcast_convert_type(comp.decode(payload, acc.shape[0]), jnp.uint32) | zero
    return acc + lax.bitcast_convert_type(decoded, jnp.float32)
  return lax.optimization_barrier(comp.decode_add(payload, acc))


def _encode_rows(comp: Compressor, rows: jax.Array, states: Any, keys: jax.Array | None
                 ) -> tuple[dict[str, jax.Array], Any]:
  """comp.encode of every row (partition) j with slot j (states: [1, K, ...]) and keys[j], as
  one batched call (vmap). Batched, a codec's float32 reductions may round differently from a
  lone encode of the row (module docstring); a loop of lone encodes is 4-10x slower on XLA:CPU."""
  slots = jax.tree.map(lambda a: a[0], states)
  if keys is None:
    payloads, slots = jax.vmap(lambda r, s: comp.encode(r, s, None))(rows, slots)
  else:
    payloads, slots = jax.vmap(comp.encode)(rows, slots, keys)
  return payloads, jax.tree.map(lambda a: a[None], slots)


def _decode_rows(comp: Compressor, payloads: dict[str, jax.Array], width: int) -> jax.Array:
  """float32[K, width]: the decode of every payload row, batched (decodes are elementwise, or a
  scatter for sparse payloads: batching changes no bit; one pass writes the result)."""
  payloads = lax.optimization_barrier(payloads)
  return lax.optimization_barrier(jax.vmap(lambda p: comp.decode(p, width))(payloads))


def _slot(states: Any, j: jax.Array | int) -> Any:
  """Slot j of states held as [1, K, ...] arrays (the form of a shard_map block, which the state
  keeps inside `sync_with_bytes`)."""
  def take(a):
    start = (0, j) + (0,) * (a.ndim - 2)
    return lax.dynamic_slice(a, start, (1, 1) + a.shape[2:]).reshape(a.shape[2:])
  return jax.tree.map(take, states)


def _set_slot(states: Any, value: Any, j: jax.Array | int) -> Any:
  def put(a, v):
    start = (0, j) + (0,) * (a.ndim - 2)
    return lax.dynamic_update_slice(a, v.astype(a.dtype).reshape((1, 1) + v.shape), start)
  return jax.tree.map(put, states, value)


def _take(tree: Any, i: jax.Array | int) -> Any:
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _select(pred: jax.Array | bool, a: Any, b: Any) -> Any:
  if pred is True:
    return a
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _partitions(x: jax.Array, rows: int, width: int) -> jax.Array:
  flat = x.reshape(-1)
  return jnp.pad(flat, (0, rows * width - flat.shape[0])).reshape(rows, width)


def _unpartition(rows: jax.Array, leaf: _Leaf) -> jax.Array:
  return rows.reshape(-1)[:leaf.route.size].reshape(leaf.shape)


def _real_and_slot(index: jax.Array, k: int, w: int) -> tuple[jax.Array | bool, jax.Array]:
  """Whether partition / chunk `index` (0 <= index < W, traced) is one of the K real ones, and the
  state slot its encode uses (clamped into [0, K) for the ranks that have none)."""
  if k == w:
    return True, index
  return index < k, jnp.minimum(index, k - 1)


class _Exchange(NamedTuple):
  """What `_ps` / `_ring` return for one group of leaves: the sums, the new states, this device's
  sparse wire bytes (int32, 8*count of the messages it sent) and, static and averaged per
  device, the bytes the group's collectives move and the HiPress wire bytes without the sparse
  pairs."""
  sums: list[jax.Array]
  states: list[Any]
  sparse_bytes: jax.Array
  moved_bytes: float
  fixed_bytes: float


def _ps(xs: list[jax.Array], leaves: list[_Leaf], k: int, compressor: Compressor,
        server: Compressor, states: list[Any], key: jax.Array | None, w: int,
        axis_name: Any) -> _Exchange:
  """CaSync-PS of leaves of K partitions each (module docstring): one exchange to the owners and
  one back for all of them."""
  rank = lax.axis_index(axis_name)
  owns, slot = _real_and_slot(rank, k, w)  # rank j owns partition j
  sends, work = [], []
  for x, leaf, state in zip(xs, leaves, states, strict=True):
    c = leaf.width
    worker, agg = Codec.of(compressor, c), Codec.of(server, c)
    parts = _partitions(x, k, c)
    # The owner's slot, copied out before the worker encodes overwrite the state in place.
    old = lax.optimization_barrier(_slot(state, slot))
    payloads, encoded = _encode_rows(compressor, parts, state,
                                     _keys(key, leaf.index, jnp.arange(k), rank, 0))
    sends.append(transport.to_bytes(payloads, worker.spec))
    work.append((leaf, worker, agg, parts, payloads, encoded, old))
  recv = transport.gather_to_owners(jnp.concatenate(sends, axis=1), k, w, axis_name)
  zero = opaque_zero()

  offset, server_data, new_states = 0, [], []
  sparse = jnp.zeros((), jnp.int32)
  moved = fixed = 0.0
  for leaf, worker, agg, parts, payloads, encoded, old in work:
    c = leaf.width
    got = transport.from_bytes(recv[:, offset:offset + worker.nbytes], worker.spec)
    offset += worker.nbytes
    server_key = _keys(key, leaf.index, rank, rank, 1)
    if _server_stateful(compressor, server, c):
      acc = lax.dynamic_index_in_dim(parts, slot, keepdims=False)
      for i in range(w - 1):  # ranks 0..W-1 in ascending order, skipping this rank
        acc = _decode_add(compressor, _take(got, i + (i >= rank).astype(jnp.int32)), acc, zero)
      acc = lax.optimization_barrier(acc)  # the server encodes the merged partition on its own
      payload, served = server.encode(acc, old, server_key)
      # The owner's worker encode of its own partition is discarded, payload and state.
      new_states.append(_set_slot(encoded, _select(owns, served, _slot(encoded, slot)), slot))
    else:  # a stateless server merges every rank's payload, the owner's own one included
      acc = jnp.zeros((c,), jnp.float32)
      for i in range(w):
        acc = _decode_add(compressor, _take(got, i), acc, zero)
      acc = lax.optimization_barrier(acc)
      payload = server.encode(acc, None, server_key)[0]
      new_states.append(encoded)
    server_data.append(transport.to_bytes(payload, agg.spec))
    own_sends = jnp.where(jnp.arange(k) != rank, worker.sparse_wire(payloads), 0)
    sparse += jnp.sum(own_sends) + jnp.where(owns, (w - 1) * agg.sparse_wire(payload), 0)
    moved += k * (w - 1) * (worker.nbytes + agg.nbytes) / w
    fixed += k * (w - 1) * (worker.fixed_wire + agg.fixed_wire) / w

  gathered = transport.broadcast_from_owners(jnp.concatenate(server_data), k, w, axis_name)
  sums, offset = [], 0
  for leaf, _, agg, *_ in work:
    rows = transport.from_bytes(gathered[:, offset:offset + agg.nbytes], agg.spec)
    offset += agg.nbytes
    sums.append(_unpartition(_decode_rows(server, rows, leaf.width), leaf))
  return _Exchange(sums, new_states, sparse, moved, fixed)


def _ring(xs: list[jax.Array], leaves: list[_Leaf], k: int, compressor: Compressor,
          states: list[Any], key: jax.Array | None, w: int, axis_name: Any) -> _Exchange:
  """CaSync-Ring of leaves of K chunks each (module docstring): every hop one ppermute of all of
  them, then one exchange from the chunks' holders to every rank."""
  rank = lax.axis_index(axis_name)
  zero = opaque_zero()
  # coders[s]: what encodes at step s (0: the compressor, t+1: server(t+2) at reduce hop t).
  coders = _coders(compressor, "ring", w)
  chunks = [_partitions(x, k, leaf.width) for x, leaf in zip(xs, leaves, strict=True)]
  codecs = [[Codec.of(comp, leaf.width) for comp in coders] for leaf in leaves]
  stateful = [[_server_stateful(compressor, comp, leaf.width) for comp in coders]
              for leaf in leaves]

  def own_chunk(i, chunk):
    return lax.dynamic_index_in_dim(chunks[i], _real_and_slot(chunk, k, w)[1], keepdims=False)

  def encode_step(s, step, chunk, accs, states):
    """Every leaf's chunk (accs) encoded by coders[s] at `step` (the key's step id: s, traced
    inside the loop) with this rank's slot; the bytes to send and their sparse wire bytes."""
    real, slot = _real_and_slot(chunk, k, w)
    datas, new_states, sparse = [], [], jnp.zeros((), jnp.int32)
    for leaf, acc, state, codec, full in zip(leaves, accs, states, codecs, stateful, strict=True):
      keys = _keys(key, leaf.index, chunk, rank, step)
      if full[s]:
        old = _slot(state, slot)
        payload, new = coders[s].encode(acc, old, keys)
        state = _set_slot(state, _select(real, new, old), slot)
      else:
        payload, _ = coders[s].encode(acc, None, keys)
      datas.append(transport.to_bytes(payload, codec[s].spec))
      new_states.append(state)
      sparse += jnp.where(real, codec[s].sparse_wire(payload), 0)
    return jnp.concatenate(datas), new_states, sparse

  def pairs(t):
    """The source-target pairs of reduce hop t: chunk c moves from rank c+1+t to rank c+2+t."""
    return [((c + 1 + t) % w, (c + 2 + t) % w) for c in range(k)]

  def hop(s, t, wire, states, sparse):
    """Reduce hop t (coders[s], s = t + 1, encodes; t may be traced when K = W): receive chunk
    r-2-t from rank r-1, decode it onto this rank's raw chunk, re-encode."""
    got = lax.ppermute(wire, axis_name, pairs(0 if k == w else t))
    chunk = (rank - 2 - t) % w
    accs, offset, states = [], 0, list(states)
    for i, (leaf, codec) in enumerate(zip(leaves, codecs, strict=True)):
      sent = codec[s - 1]
      payload = transport.from_bytes(got[offset:offset + sent.nbytes], sent.spec)
      offset += sent.nbytes
      own = own_chunk(i, chunk)
      if not stateful[i][s]:
        # A stateless server (DGC's union) merges encoded contributions only: this rank's chunk
        # enters as its worker encode (slot k, key step W + t), not raw.
        real, slot = _real_and_slot(chunk, k, w)
        old = _slot(states[i], slot)
        mine, new = compressor.encode(own, old, _keys(key, leaf.index, chunk, rank, w + t))
        states[i] = _set_slot(states[i], _select(real, new, old), slot)
        own = _decode_add(compressor, mine, jnp.zeros_like(own), zero)
      # Materialised once: fused into the encode, the decode would run in each of its passes.
      accs.append(lax.optimization_barrier(_decode_add(sent.comp, payload, own, zero)))
    wire, states, more = encode_step(s, t + 1, chunk, accs, states)
    sent_on = t + 1 < w - 1  # the last encode travels in the gather phase, counted there
    return wire, states, sparse + jnp.where(sent_on, more, 0)

  first_chunk = (rank - 1) % w
  first = [own_chunk(i, first_chunk) for i in range(len(leaves))]
  carry = encode_step(0, 0, first_chunk, first, list(states))
  if w > 1:
    carry = hop(1, 0, *carry)
  if k == w and w > 2 and all(comp == coders[1] for comp in coders[1:]):
    # Hops 1..W-2 send over the whole ring and encode with the same codec: one loop body.
    carry = lax.fori_loop(1, w - 1, lambda t, c: hop(2, t, *c), carry)
  else:
    for t in range(1, w - 1):
      carry = hop(t + 1, t, *carry)
  wire, states, sparse = carry

  # Gather phase: rank j holds chunk j. It does no arithmetic, so one exchange from the holders
  # gives the bits of the W-1 forwarding hops.
  gathered = transport.broadcast_from_owners(wire, k, w, axis_name)
  holds, _ = _real_and_slot(rank, k, w)
  sums, offset, moved, fixed = [], 0, 0.0, 0.0
  for i, (leaf, codec) in enumerate(zip(leaves, codecs, strict=True)):
    last = codec[w - 1]
    rows = transport.from_bytes(gathered[:, offset:offset + last.nbytes], last.spec)
    own = transport.from_bytes(wire[offset:offset + last.nbytes], last.spec)
    offset += last.nbytes
    sparse += jnp.where(holds, (w - 1) * last.sparse_wire(own), 0)
    moved += k * (sum(c.nbytes for c in codec[:-1]) + (w - 1) * last.nbytes) / w
    fixed += k * (sum(c.fixed_wire for c in codec[:-1]) + (w - 1) * last.fixed_wire) / w
    sums.append(_unpartition(_decode_rows(last.comp, rows, leaf.width), leaf))
  return _Exchange(sums, states, sparse, moved, fixed)


# -- the public functions --------------------------------------------------------------------------

def _coders(compressor: Compressor, topology: str, w: int) -> list[Compressor]:
  """Every compressor that encodes in a sync: the compressor and its server(s)."""
  if topology == "ps":
    return [compressor, compressor.server(w)]
  return [compressor] + [compressor.server(m) for m in range(2, w + 1)]


def sync_with_bytes(tree: Any, axis_name: Any, compressor: Compressor, state: Any = None, *,
                    topology: str = "ps", min_size: int = DEFAULT_MIN_SIZE,
                    plan: dict[str, tuple[bool, int]] | None = None,
                    key: jax.Array | None = None) -> tuple[Any, Any, dict[str, jax.Array]]:
  """`sync`, plus its report {"wire_bytes", "payload_bytes", "nonfinite"} (module docstring),
  identical on every rank."""
  _check_topology(topology)
  _check_compressor(compressor)
  check_pairing(compressor, topology)
  if topology == "allreduce":
    return powersgd.sync_with_bytes(tree, axis_name, compressor, state, axis_size(axis_name),
                                    plan=plan, key=key)
  specs = leaf_specs(tree)
  w = axis_size(axis_name)
  routes = _routes(specs, w, min_size, plan)
  leaves = _leaves(specs, routes)
  coders = _coders(compressor, topology, w)
  if leaves and key is None and any(c.needs_key for c in coders):
    raise invalid("key", key, f"a jax.random key ({type(compressor).__name__} draws random "
                  "numbers)")

  def fresh():
    return init_state(tree, compressor, w, topology=topology, min_size=min_size, plan=plan)
  block = False if state is None else state_form(state, jax.eval_shape(fresh))
  if not block:  # inside, every leaf of the state has the block's leading axis of 1
    state = jax.tree.map(lambda a: jnp.asarray(a)[None], fresh() if state is None else state)

  flat, treedef = jax.tree.flatten(tree)
  out = [jnp.asarray(x, jnp.float32) for x in flat]
  plain = [i for i, r in enumerate(routes) if not r.compress and r.size > 0]
  counts = [nonfinite_count(out[leaf.index]) for leaf in leaves]
  counts.append(sum((nonfinite_count(out[i]) for i in plain), jnp.zeros((), jnp.int32)))
  plain_size = sum(routes[i].size for i in plain)
  moved = fixed = transport.ring_allreduce_bytes(plain_size, w)
  if plain:
    # One float32 ring all-reduce of all of them, packed (a fixed order of the float32 adds:
    # the same bits on any number of processes, where lax.psum's order is the backend's).
    total = allreduce(jnp.concatenate([out[i].reshape(-1) for i in plain]), axis_name,
                      algorithm="ring")
    offset = 0
    for i in plain:
      out[i] = total[offset:offset + routes[i].size].reshape(out[i].shape)
      offset += routes[i].size
  new_state = dict(state)
  sparse = jnp.zeros((), jnp.int32)
  done_before = [out[i] for i in plain]
  groups = defaultdict(list)
  for leaf in leaves:
    groups[leaf.route.K].append(leaf)
  for k in sorted(groups, reverse=True):
    group = groups[k]
    # The barrier keeps the leaves from fusing into the encodes, and orders this group's
    # exchange after the collectives before it: XLA:CPU runs independent collectives of one
    # program in any order on each device, and two devices waiting in different collectives
    # deadlock.
    xs, _ = lax.optimization_barrier(([out[leaf.index] for leaf in group], done_before))
    olds = [state[leaf.route.path] for leaf in group]
    if topology == "ps":
      done = _ps(xs, group, k, compressor, coders[1], olds, key, w, axis_name)
    else:
      done = _ring(xs, group, k, compressor, olds, key, w, axis_name)
    for leaf, total, leaf_state in zip(group, done.sums, done.states, strict=True):
      out[leaf.index] = total
      new_state[leaf.route.path] = leaf_state
    sparse += done.sparse_bytes
    moved += done.moved_bytes
    fixed += done.fixed_bytes
    done_before = done.sums

  report = {"wire_bytes": jnp.float32(0), "payload_bytes": jnp.float32(0),
            "nonfinite": jnp.zeros((), jnp.int32)}
  if plain or leaves:
    # One psum of the bookkeeping after every exchange (the barrier orders it last): the
    # non-finite counts of each compressed leaf and of the others, and the sparse wire bytes.
    stats, _ = lax.optimization_barrier((jnp.stack(counts + [sparse]), done_before))
    stats = lax.psum(stats, axis_name)
    moved += transport.psum_bytes(4 * stats.shape[0], w)
    bad = jnp.sum(stats[:-1]) > 0
    for j, leaf in enumerate(leaves):
      out[leaf.index] = jnp.where(stats[j] > 0, jnp.float32(jnp.nan), out[leaf.index])
      old = state[leaf.route.path]
      new_state[leaf.route.path] = jax.tree.map(lambda o, n: jnp.where(bad, o, n), old,
                                                new_state[leaf.route.path])
    report = {"wire_bytes": jnp.float32(moved),
              "payload_bytes": jnp.float32(fixed) + stats[-1].astype(jnp.float32) / jnp.float32(w),
              "nonfinite": jnp.sum(stats[:-1])}
  if not block:
    new_state = jax.tree.map(lambda a: a[0], new_state)
  return jax.tree.unflatten(treedef, out), new_state, report


def sync(tree: Any, axis_name: Any, compressor: Compressor, state: Any = None, *,
         topology: str = "ps", min_size: int = DEFAULT_MIN_SIZE,
         plan: dict[str, tuple[bool, int]] | None = None,
         key: jax.Array | None = None) -> tuple[Any, Any]:
  """Sum of a pytree of float32 leaves over the W ranks of `axis_name` (inside jax.shard_map),
  compressing the leaves of more than `min_size` elements (or as `plan` says) with `compressor`.

  Args:
    tree: this rank's float32 leaves (e.g. gradients), any shapes.
    axis_name: a mesh axis of the enclosing shard_map.
    compressor: a jlp.compression.Compressor.
    state: this rank's state from `init_state` or the previous call; None: fresh (zeros).
    topology: "ps" (CaSync-PS) or "ring" (CaSync-Ring), see the module docstring; "allreduce"
      for compressors whose payloads are summed by all-reduces (PowerSGD,
      jlp.compression.powersgd; min_size does not apply there).
    min_size: compress a leaf iff it has more than this many elements.
    plan: {keystr(path): (compress, K)} overriding the leaves it names (SeCoPa).
    key: a jax.random key, required when the compressor draws random numbers.

  Returns:
    (the summed tree, identical on every rank; this rank's new state).
  """
  summed, new_state, _ = sync_with_bytes(tree, axis_name, compressor, state, topology=topology,
                                         min_size=min_size, plan=plan, key=key)
  return summed, new_state
