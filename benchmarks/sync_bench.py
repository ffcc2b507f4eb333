"""Compressed synchronisation (CaSync PS and ring) against lax.psum on 8 emulated CPU devices.

Run: python -m benchmarks.sync_bench [--size=16M] [--repeats=7] [--compressors=tbq,onebit,...]
     [--topologies=ps,ring] [--stages]

For every compressor x topology, `jlp.compression.sync` of one float32 leaf of --size elements
per device (compressed in K = 8 partitions: min_size=0) is timed alternately with `lax.psum` of
the same sharded data in the same run (each a jitted shard_map). The compression state is
donated and returned first (XLA pairs a donated buffer with the first output of its size), so
that it is updated in place, as in a train step that donates its state. Ratios are the median
over the alternating pairs of time / psum time (target, issue 11: <= 1.5x psum for onebit and
tbq), of wall time and of CPU time (this process's, all threads: steadier than wall time when
other jobs share the 2 cores).

Floor rows, timed the same way:

* (x * 2): one elementwise pass over the leaf, which any reduction that reads every element and
  writes a result pays;
* (floor) per compressor and topology: the sync's collectives moving payload-sized byte buffers,
  with no encode or decode: PS one all_to_all of the 8 worker payloads and one all_gather of the
  server payload; ring 7 ppermute hops of one chunk's worker payload and one all_gather of the
  last server payload.

--stages adds, per compressor, the worker encode alone (every partition encoded with its slot,
in place, as sync does) and the decode alone (8 payloads into the float32 result).

The 8 devices are emulated on this machine's CPU cores: the numbers measure the arithmetic, the
memory traffic and the emulated transfers (each collective a rendezvous of 8 threads), not a
network. The payloads are 16-32x smaller than the float32 data, so the floor rows are a few
percent of psum: what a network would reward costs almost nothing here, and what psum does in
one pass (read, add, write) the compressed sync does in several (encode: read the gradient and
the residual, write the residual and the codes; merge; decode: write the result).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jlp.compression as jc  # noqa: E402
from benchmarks.sizes import parse_size, size_label  # noqa: E402

_SIZE = flags.DEFINE_string("size", "16M", "float32 elements per device (K/M suffixes).")
_REPEATS = flags.DEFINE_integer("repeats", 7, "timed (psum, candidate) pairs per case.")
_COMPRESSORS = flags.DEFINE_list("compressors", ["onebit", "tbq", "terngrad", "efsignsgd", "qsgd",
                                                 "dgc", "graddrop"], "registered compressors.")
_TOPOLOGIES = flags.DEFINE_list("topologies", ["ps", "ring"], "CaSync topologies.")
_STAGES = flags.DEFINE_bool("stages", False, "also time the encode and the decode alone.")

W = 8


def timed(fn, *args):
  """((wall s, CPU s of this process: all its threads), fn's output)."""
  t0, c0 = time.perf_counter(), time.process_time()
  out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0, time.process_time() - c0), out


class Case:
  """A jitted shard_map step `fn(x, carry) -> (carry, out)` whose carry is donated."""

  def __init__(self, mesh, body, carry):
    self.fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                    check_vma=False), donate_argnums=1)
    self.carry = carry

  def __call__(self, x):
    t, (self.carry, _) = timed(self.fn, x, self.carry)
    return t


def compare(case, psum, x, repeats):
  """Median case wall s, median psum wall s, and the medians of the per-pair ratios case / psum
  of wall time and of CPU time."""
  case(x)  # compile + warm
  timed(psum, x)
  tc, tr = [], []
  for _ in range(repeats):
    tr.append(timed(psum, x)[0])
    tc.append(case(x))
  return (statistics.median(c[0] for c in tc), statistics.median(r[0] for r in tr),
          statistics.median(c[0] / r[0] for c, r in zip(tc, tr)),
          statistics.median(c[1] / r[1] for c, r in zip(tc, tr)))


def keyed(comp):
  return jax.random.key(0) if comp.needs_key else None


def sync_case(mesh, sharding, comp, topology, n):
  """The sync of one leaf; the state travels as its shard_map block (no squeeze, no copy)."""
  state = jc.init_state(jax.ShapeDtypeStruct((n,), jnp.float32), comp, W, topology=topology,
                        min_size=0)
  stacked = jax.device_put(jax.tree.map(lambda s: jnp.stack([s] * W), state), sharding)

  def body(x, block):
    out, block = jc.sync(x[0], "d", comp, block, topology=topology, min_size=0, key=keyed(comp))
    return block, out[None]
  return Case(mesh, body, stacked)


def payload_bytes(comp, width):
  return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize
             for s in comp.payload_spec(width).values())


def floor_case(mesh, comp, topology, n):
  """The collectives of the sync with payload-sized uint8 buffers and no arithmetic."""
  width = -(-n // W)
  worker = payload_bytes(comp, width)
  server = payload_bytes(comp.server(W), width)
  to_next = [(i, (i + 1) % W) for i in range(W)]

  def body(x, carry):
    del x
    if topology == "ps":
      got = lax.all_to_all(carry[0], "d", 0, 0)
      out = lax.all_gather(got[0, :server] if server <= worker else
                           jnp.pad(got[0], (0, server - worker)), "d")
    else:
      wire = carry[0, 0]
      for _ in range(W - 1):
        wire = lax.ppermute(wire, "d", to_next)
      out = lax.all_gather(jnp.pad(wire, (0, max(server - worker, 0))), "d")
    return carry, out[None]
  carry = jax.device_put(np.zeros((W, W, worker), np.uint8), NamedSharding(mesh, P("d")))
  return Case(mesh, body, carry)


def stage_cases(mesh, sharding, comp, n):
  """(encode alone, decode alone), each as sync runs them: the 8 partitions of the leaf encoded
  as one vmap with their slots (in place), and 8 payloads decoded into the float32 result."""
  k, width = W, -(-n // W)
  slots = jax.tree.map(lambda s: jnp.zeros((W, k) + s.shape, s.dtype), comp.init_flat(width))
  key = keyed(comp)
  keys = None if key is None else jax.random.split(key, k)

  def encode(x, slots):
    rows = x[0].reshape(k, width)
    slots = jax.tree.map(lambda s: s[0], slots)
    if keys is None:
      payloads, slots = jax.vmap(lambda r, s: comp.encode(r, s, None))(rows, slots)
    else:
      payloads, slots = jax.vmap(comp.encode)(rows, slots, keys)
    return jax.tree.map(lambda s: s[None], slots), jax.tree.map(lambda p: p[None], payloads)

  def decode(x, payloads):
    del x
    rows = jax.tree.map(lambda p: p[0], payloads)
    return payloads, jax.vmap(lambda p: comp.decode(p, width))(rows).reshape(1, -1)
  one = comp.init_flat(width)
  sample = jax.vmap(lambda r: comp.encode(r, one, key)[0])(jnp.ones((k, width), jnp.float32))
  payloads = jax.device_put(jax.tree.map(lambda p: jnp.stack([p] * W), sample), sharding)
  return (Case(mesh, encode, jax.device_put(slots, sharding)),
          Case(mesh, decode, payloads))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  n = parse_size(_SIZE.value, "--size=")
  for name in _COMPRESSORS.value:
    if name not in jc.COMPRESSORS:
      raise app.UsageError(f"--compressors entry {name!r} is not allowed; expected one of "
                           f"{sorted(jc.COMPRESSORS)}.")
  for topology in _TOPOLOGIES.value:
    if topology not in jc.TOPOLOGIES:
      raise app.UsageError(f"--topologies entry {topology!r} is not allowed; expected one of "
                           f"{jc.TOPOLOGIES}.")
  devices = jax.devices()
  if len(devices) != W:
    raise app.UsageError(f"expected {W} devices, found {len(devices)} (XLA_FLAGS set too late?)")
  mesh = Mesh(np.array(devices), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  psum = jax.jit(jax.shard_map(lambda v: lax.psum(v, "d"), mesh=mesh, in_specs=P("d"),
                               out_specs=P("d"), check_vma=False))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (W, n), jnp.float32), sharding)
  print(f"jax {jax.__version__}, {W} emulated {jax.default_backend()} devices on "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {size_label(n)} float32 "
        f"per device; median of {_REPEATS.value} alternating pairs; reference = lax.psum\n")
  header = (f"{'compressor':10s} {'topology':8s} {'case':8s} {'ms':>9s} {'psum ms':>9s} "
            f"{'ratio':>7s} {'CPU ratio':>9s}")
  print(header)
  print("-" * len(header))

  def row(name, topology, label, case):
    tc, tr, ratio, cpu = compare(case, psum, x, _REPEATS.value)
    print(f"{name:10s} {topology:8s} {label:8s} {tc * 1e3:9.1f} {tr * 1e3:9.1f} {ratio:6.2f}x "
          f"{cpu:8.2f}x", flush=True)

  double = Case(mesh, lambda v, c: (c, v * 2.0), jax.device_put(np.zeros((W, 1), np.float32),
                                                              sharding))
  row("-", "-", "(x * 2)", double)
  for name in _COMPRESSORS.value:
    comp = jc.get(name)
    for topology in _TOPOLOGIES.value:
      row(name, topology, "(floor)", floor_case(mesh, comp, topology, n))
      row(name, topology, "sync", sync_case(mesh, sharding, comp, topology, n))
    if _STAGES.value:
      encode, decode = stage_cases(mesh, sharding, comp, n)
      row(name, "-", "(encode)", encode)
      row(name, "-", "(decode)", decode)
  print(f"\nload average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  app.run(main)
