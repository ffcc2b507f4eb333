"""A plain-Python simulation of CaSync over W ranks (hipress.md §2.2, §2.3), the reference of
casync_test.py, written from the protocol of the task (not from jlp.compression.sync).

The simulation loops over ranks, partitions, owners, chunks and hops in Python, holding every
rank's data and state as numpy arrays. It calls a compressor's own encode / decode / decode_add
on one partition at a time (the codecs are tested against their spec elsewhere), except that a
rank's K worker encodes in PS are one vmapped call, as the protocol makes them (batched, a
codec's float32 reductions may sum in another order than alone). Everything else is done here:
routing, the flattening and zero-padding into K partitions, which rank encodes which partition
with which state slot and which key, the all_to_all / all_gather / ring hops as index
arithmetic, the owner's merge order, the server re-encode and its state, the ring's hop order,
and the wire bytes, counted from HiPress's wire bytes of each message (`Compressor.to_bytes`,
its length) for every message a rank sends to another rank.

Protocol (per compressed leaf i of n elements, K partitions of c = ceil(n/K)):
  keys: fold_in(fold_in(fold_in(fold_in(key, i), partition), rank), step)
  PS: every rank r encodes partition j < K with slot j (step 0) and sends it to rank j (not to
      itself); owner j: if server(W) is the compressor or has state, acc = its raw partition j, acc =
      decode_add(payload of r, acc) for r ascending, r != j, then encodes acc with server(W)
      (step 1) and slot j; another, stateless server(W) (DGC's union): acc = 0, decode_add of every rank's payload
      (its own included) in rank order, encoded fresh, every slot keeping its step-0 state;
      sends it to the W-1 others; all decode with server(W).
  ring: chunk k (< K) starts at rank k+1, encoded with the compressor and slot k (step 0);
      hop t = 0..W-2: rank k+2+t decodes it (with what encoded it) onto its raw chunk k (another,
      stateless server(t+2): onto the decode of its chunk k encoded with the compressor, slot k,
      step W + t) and encodes with server(t+2) (step t+1), slot k if that has state; the last one (rank k)
      forwards it to the W-1 others around the ring (ranks k, k+1, ..., k+W-2 send it); all
      decode with server(W).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

F32 = np.float32


@functools.lru_cache(maxsize=None)
def _encoder(comp):
  return jax.jit(comp.encode)


@functools.lru_cache(maxsize=None)
def _decoder(comp, n):
  return jax.jit(lambda p: comp.decode(p, n))


@functools.lru_cache(maxsize=None)
def _decode_adder(comp):
  return jax.jit(comp.decode_add)


def encode(comp, x, state, key):
  payload, state = _encoder(comp)(jnp.asarray(x), state, key)
  return jax.tree.map(np.asarray, payload), jax.tree.map(np.asarray, state)


@functools.lru_cache(maxsize=None)
def _batch_encoder(comp, keyed):
  if keyed:
    return jax.jit(jax.vmap(comp.encode))
  return jax.jit(jax.vmap(lambda x, s: comp.encode(x, s, None)))


def encode_batch(comp, rows, states, keys):
  """The encodes of a rank's K partitions, made as one vmapped call (as sync makes them: batched,
  a codec's float32 reductions may sum in another order than alone). Returns per-row payloads
  and states."""
  rows = jnp.asarray(np.stack(rows))
  states = jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *states) if states else states
  if keys[0] is None:
    payloads, new = _batch_encoder(comp, False)(rows, states)
  else:
    payloads, new = _batch_encoder(comp, True)(rows, states, jnp.stack(keys))
  k = rows.shape[0]
  payloads, new = jax.tree.map(np.asarray, (payloads, new))  # rows cut in numpy: no compiles
  return ([jax.tree.map(lambda a, j=j: a[j], payloads) for j in range(k)],
          [jax.tree.map(lambda a, j=j: a[j], new) for j in range(k)])


def decode(comp, payload, n):
  return np.asarray(_decoder(comp, n)(payload))


def decode_add(comp, payload, acc):
  return np.asarray(_decode_adder(comp)(payload, jnp.asarray(acc)))


def message_bytes(comp, payload):
  """HiPress's wire bytes of one message (sparse payloads at their real count)."""
  return len(comp.to_bytes(payload))


def capacity_bytes(comp, n):
  """The bytes one message of n elements moves: its wire size with sparse payloads at capacity
  (the in-jit payload travels whole)."""
  return comp.wire_bytes(n)


def fold(key, *ids):
  if key is None:
    return None
  for i in ids:
    key = jax.random.fold_in(key, i)
  return key


def has_state(comp, width):
  return bool(jax.tree.leaves(comp.init(jnp.zeros((width,), jnp.float32))))


def slot(state, j):
  return jax.tree.map(lambda a: np.array(a[j]), state)


def set_slot(state, j, value):
  def put(a, v):
    a = np.array(a)
    a[j] = v
    return a
  return jax.tree.map(put, state, value)


def partitions(x, k):
  flat = np.ravel(np.asarray(x, F32))
  c = -(-flat.size // k)
  return [np.concatenate([flat, np.zeros(k * c - flat.size, F32)])[j * c:(j + 1) * c]
          for j in range(k)], c


def ps_leaf(xs, comp, states, key, leaf, k):
  """xs[r]: rank r's leaf; states[r]: its K state slots (leading axis). Returns (every rank's
  flat result, every rank's new slots, the bytes each rank sent)."""
  w = len(xs)
  parts = [partitions(x, k)[0] for x in xs]
  c = parts[0][0].size
  server = comp.server(w)
  sent, moved = [0] * w, [0] * w
  new = list(states)
  payloads = [[None] * k for _ in range(w)]
  for r in range(w):
    payloads[r], slots = encode_batch(comp, parts[r], [slot(states[r], j) for j in range(k)],
                                      [fold(key, leaf, j, r, 0) for j in range(k)])
    for j in range(k):
      new[r] = set_slot(new[r], j, slots[j])
      if r != j:
        sent[r] += message_bytes(comp, payloads[r][j])
        moved[r] += capacity_bytes(comp, c)
  merged = []
  for j in range(k):
    if server == comp or has_state(server, c):
      acc = parts[j][j]
      for r in range(w):
        if r != j:
          acc = decode_add(comp, payloads[r][j], acc)
      payload, st = encode(server, acc, slot(states[j], j), fold(key, leaf, j, j, 1))
      new[j] = set_slot(new[j], j, st)
    else:  # another, stateless server (DGC's union) merges every rank's payload, the owner's included
      acc = np.zeros(c, F32)
      for r in range(w):
        acc = decode_add(comp, payloads[r][j], acc)
      payload, _ = encode(server, acc, None, fold(key, leaf, j, j, 1))
    sent[j] += (w - 1) * message_bytes(server, payload)
    moved[j] += (w - 1) * capacity_bytes(server, c)
    merged.append(payload)
  result = [np.concatenate([decode(server, merged[j], c) for j in range(k)]) for _ in range(w)]
  return result, new, sent, moved


def ring_leaf(xs, comp, states, key, leaf, k):
  """As ps_leaf, for the ring."""
  w = len(xs)
  parts = [partitions(x, k)[0] for x in xs]
  c = parts[0][0].size
  coder = [comp] + [comp.server(m) for m in range(2, w + 1)]
  sent, moved = [0] * w, [0] * w
  new = list(states)
  finals = []
  for chunk in range(k):
    r = (chunk + 1) % w
    payload, st = encode(comp, parts[r][chunk], slot(new[r], chunk), fold(key, leaf, chunk, r, 0))
    new[r] = set_slot(new[r], chunk, st)
    for t in range(w - 1):
      sent[r] += message_bytes(coder[t], payload)
      moved[r] += capacity_bytes(coder[t], c)
      r = (chunk + 2 + t) % w
      own = parts[r][chunk]
      if coder[t + 1] != comp and not has_state(coder[t + 1], c):  # DGC's union: own chunk encoded
        mine, st = encode(comp, own, slot(new[r], chunk), fold(key, leaf, chunk, r, w + t))
        new[r] = set_slot(new[r], chunk, st)
        own = decode_add(comp, mine, np.zeros(c, F32))
      acc = decode_add(coder[t], payload, own)
      if has_state(coder[t + 1], c):
        payload, st = encode(coder[t + 1], acc, slot(new[r], chunk),
                             fold(key, leaf, chunk, r, t + 1))
        new[r] = set_slot(new[r], chunk, st)
      else:
        payload, _ = encode(coder[t + 1], acc, None, fold(key, leaf, chunk, r, t + 1))
    assert r == chunk
    for t in range(w - 1):  # forwarding: rank chunk, chunk+1, ..., chunk+W-2 send it on
      sent[(chunk + t) % w] += message_bytes(coder[w - 1], payload)
      moved[(chunk + t) % w] += capacity_bytes(coder[w - 1], c)
    finals.append(payload)
  result = [np.concatenate([decode(coder[w - 1], finals[j], c) for j in range(k)])
            for _ in range(w)]
  return result, new, sent, moved


def ring_sum(vectors):
  """The float32 ring all-reduce of one vector per rank (jlp.collectives, algorithm="ring"), from
  its definition: chunk k of C = ceil(n/W) elements is summed in float32 as s = 0, s = s + x_r
  for r = k+1, k+2, ..., k+W (mod W). Returns the sum (every rank gets the same)."""
  w, n = len(vectors), vectors[0].size
  c = -(-n // w)
  out = np.zeros(n, F32)
  for k in range(w):
    part = slice(k * c, min((k + 1) * c, n))
    s = np.zeros(out[part].shape, F32)
    for j in range(1, w + 1):
      s = (s + np.asarray(vectors[(k + j) % w], F32)[part]).astype(F32)
    out[part] = s
  return out


def simulate(ranks, comp, states, key, routes, topology):
  """ranks[r]: rank r's leaves (list, flattening order); states[r]: {path: slots};
  routes: [(path, size, compress, K)]. Returns (per leaf the [W, ...] results, per rank new
  states, the bytes of HiPress's wire (sparse messages at their real count) and the bytes moved
  (at capacity, plus the sync's bookkeeping psum of one int32 per compressed leaf and two more),
  each averaged over the ranks). The non-empty uncompressed leaves are packed into one vector
  (flattening order) and summed by `ring_sum`, which moves W-1 hops and an all_gather of a chunk
  of ceil(n/W) float32 per rank."""
  w = len(ranks)
  results = [None] * len(routes)
  new_states = [dict(s) for s in states]
  sent = np.zeros(w, np.float64)
  moved = np.zeros(w, np.float64)
  compressed = 0
  plain = [i for i, (_, size, compress, _) in enumerate(routes) if size and not compress]
  if plain:
    total = ring_sum([np.concatenate([np.ravel(r[i]) for i in plain]) for r in ranks])
    sent += 2 * (w - 1) * 4 * -(-total.size // w)
    moved += 2 * (w - 1) * 4 * -(-total.size // w)
    offset = 0
    for i in plain:
      size, shape = routes[i][1], np.shape(ranks[0][i])
      results[i] = np.stack([total[offset:offset + size].reshape(shape)] * w)
      offset += size
  for i, (path, size, compress, k) in enumerate(routes):
    if not compress:
      continue
    compressed += 1
    fn = ps_leaf if topology == "ps" else ring_leaf
    out, new, bytes_, moved_ = fn([r[i] for r in ranks], comp, [s[path] for s in states], key,
                                  i, k)
    shape = np.shape(ranks[0][i])
    results[i] = np.stack([o[:size].reshape(shape) for o in out])
    for r in range(w):
      new_states[r][path] = new[r]
    sent += bytes_
    moved += moved_
  if any(size for _, size, _, _ in routes):
    moved += 2 * (w - 1) / w * 4 * (compressed + 2)
  return results, new_states, float(np.mean(sent)), float(np.mean(moved))
