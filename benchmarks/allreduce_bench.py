"""Custom-precision all-reduce against lax.psum on 8 emulated CPU devices, timed alternately.

Run: python -m benchmarks.allreduce_bench [--sizes=1M,16M] [--repeats=15] [--kahan]
     [--tree]

For every algorithm (sequential, ring) x format (float32, e5m2, e4m3) x APS
(off, on; APS needs a low-precision format), `jlp.collectives.allreduce` of one
float32 leaf of --sizes elements per device is timed alternately with
`lax.psum` of the same sharded data in the same run (each a jitted shard_map).
Ratios are the median over the alternating pairs of time / psum time. Three floor
rows come first, timed the same way:

* (x * 2): one elementwise pass over the same data, which any reduction that
  reads and writes every element pays;
* (ring floor): the collectives the ring issues, with no arithmetic: W - 1 = 7
  `ppermute` hops of a 1/W chunk, then an `all_gather` of the chunks;
* (APS floor): the same plus what APS adds before the first hop can start: the
  max|g| pass over the leaf and the `pmax` of the exponents.

Each ring row also gives "vs floor": its ratio over the ratio of its own floor row
of the same run ((ring floor) without APS, (APS floor) with it). Targets (issue 13,
restating issue 4's ring <= 2x psum for emulated devices): at 16M floats per device
the ring <= 1.5x psum in every format, APS included; at 1M, vs floor <= 1.3x.

--tree adds a case whose data is a gradient tree shaped like CIFAR ResNet18's parameters
(62 leaves, 11.2M floats per device; reference: one `lax.psum` per leaf), where the
ring's hops carry every leaf at once.

The 8 devices are emulated on this machine's CPU cores, so the numbers measure
the arithmetic and the emulated transfers (each collective a rendezvous of 8
threads), not a network.
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

from benchmarks.sizes import parse_size, size_label  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jlp.collectives import allreduce  # noqa: E402

_SIZES = flags.DEFINE_list("sizes", ["1M", "16M"], "float32 elements per device (K/M suffixes).")
_REPEATS = flags.DEFINE_integer("repeats", 15, "timed (psum, candidate) pairs per case.")
_KAHAN = flags.DEFINE_bool("kahan", False, "also time kahan=True for every case.")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["sequential", "ring"], "algorithms to time.")
_TREE = flags.DEFINE_bool("tree", False, "also time a ResNet18-shaped gradient tree (62 leaves).")


def resnet18_shapes() -> list[tuple[int, ...]]:
  """The parameter shapes of kuangliu's CIFAR ResNet18 (CPD's, docs/cpd.md#recipes): conv kernels
  (HWIO), two BatchNorm vectors per conv, 1x1 projection shortcuts, the classifier (62 leaves,
  11.2M)."""
  shapes = [(3, 3, 3, 64), (64,), (64,)]
  for cin, cout in ((64, 64), (64, 128), (128, 256), (256, 512)):
    for block in range(2):
      first = cin if block == 0 else cout
      shapes += [(3, 3, first, cout), (cout,), (cout,), (3, 3, cout, cout), (cout,), (cout,)]
      if first != cout:
        shapes += [(1, 1, first, cout), (cout,), (cout,)]
  return shapes + [(512, 10), (10,)]


def sharded_fn(mesh, body):
  """jit(shard_map) of body(list of per-device leaves) -> list of leaves."""
  return jax.jit(jax.shard_map(lambda xs: [y[None] for y in body([x[0] for x in xs])], mesh=mesh,
                               in_specs=P("d"), out_specs=P("d"), check_vma=False))


def ring_floor(v, aps: bool, n: int = 8):
  """The ring's collectives without its arithmetic (see the module docstring)."""
  chunk = v[:-(-v.shape[0] // n)]
  if aps:
    e = jnp.max(jnp.abs(v))[None]
    chunk = chunk * lax.pmax(e, "d")[0]
  to_next = [(i, (i + 1) % n) for i in range(n)]
  for _ in range(n - 1):
    chunk = lax.ppermute(chunk, "d", to_next)
  return lax.all_gather(chunk, "d").reshape(-1)


def timed(fn, x):
  t0 = time.perf_counter()
  jax.block_until_ready(fn(x))
  return time.perf_counter() - t0


def compare(candidate, reference, x, repeats):
  """Median candidate s, median reference s, median per-pair ratio candidate / reference."""
  jax.block_until_ready(candidate(x))  # compile + warm
  jax.block_until_ready(reference(x))
  tc, tr = [], []
  for _ in range(repeats):
    tr.append(timed(reference, x))
    tc.append(timed(candidate, x))
  return statistics.median(tc), statistics.median(tr), statistics.median(
      c / r for c, r in zip(tc, tr))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  sizes = [parse_size(s) for s in _SIZES.value]
  for a in _ALGORITHMS.value:
    if a not in ("sequential", "ring"):
      raise app.UsageError(f"--algorithms entry {a!r} is not allowed; expected sequential or ring.")
  devices = jax.devices()
  if len(devices) != 8:
    raise app.UsageError(f"expected 8 devices, found {len(devices)} (XLA_FLAGS set too late?)")
  mesh = Mesh(np.array(devices), ("d",))
  psum = sharded_fn(mesh, lambda vs: [lax.psum(v, "d") for v in vs])
  print(f"jax {jax.__version__}, 8 emulated {jax.default_backend()} devices on {os.cpu_count()} "
        f"cores; median of {_REPEATS.value} alternating pairs; reference = lax.psum, same data\n")
  header = f"{'per device':>10s} {'algorithm':12s} {'fmt':7s} {'aps':3s} {'kahan':5s} " \
           f"{'ms':>9s} {'psum ms':>9s} {'ratio':>7s} {'vs floor':>8s}"
  print(header)
  print("-" * len(header))
  cases = [(size_label(n), [(n,)]) for n in sizes]
  if _TREE.value:
    cases.append(("RN18 tree", resnet18_shapes()))
  sharding = NamedSharding(mesh, P("d"))
  for label, shapes in cases:
    keys = jax.random.split(jax.random.key(0), len(shapes))
    x = [jax.device_put(jax.random.normal(k, (8,) + s, jnp.float32), sharding)
         for k, s in zip(keys, shapes)]
    floors = {"(x * 2)": lambda v: v * 2.0,
              "(ring floor)": lambda v: ring_floor(v, aps=False),
              "(APS floor)": lambda v: ring_floor(v, aps=True)}
    floor_ratios = {}
    for name, body in floors.items() if len(shapes) == 1 else ():
      tc, tr, ratio = compare(sharded_fn(mesh, lambda vs, b=body: [b(vs[0])]), psum, x,
                              _REPEATS.value)
      floor_ratios[name] = ratio
      print(f"{label:>10s} {name:12s} {'-':7s} {'-':3s} {'-':5s} {tc * 1e3:9.1f} {tr * 1e3:9.1f} "
            f"{ratio:6.2f}x", flush=True)
    for algorithm in _ALGORITHMS.value:
      for fmt in (None, "e5m2", "e4m3"):
        for aps in (False, True):
          if aps and fmt is None:
            continue
          for kahan in (False, True) if _KAHAN.value else (False,):
            cand = sharded_fn(mesh, lambda vs, f=fmt, a=algorithm, s=aps, k=kahan: allreduce(
                vs, "d", fmt=f, algorithm=a, aps=s, kahan=k))
            tc, tr, ratio = compare(cand, psum, x, _REPEATS.value)
            floor = floor_ratios.get("(APS floor)" if aps else "(ring floor)")
            vs_floor = f"{ratio / floor:7.2f}x" if algorithm == "ring" and floor else f"{'-':>8s}"
            print(f"{label:>10s} {algorithm:12s} {fmt or 'float32':7s} {'on' if aps else 'off':3s} "
                  f"{'on' if kahan else 'off':5s} {tc * 1e3:9.1f} {tr * 1e3:9.1f} {ratio:6.2f}x "
                  f"{vs_floor}", flush=True)
    del x


if __name__ == "__main__":
  app.run(main)
