"""Compressor throughput against the memory-bandwidth reference, timed alternately, and the
compression ratios of the payloads against theory (hipress.md §1.6).

Run: python -m benchmarks.compression_bench [--elements=134217728] [--repeats=5] [--only=dgc,tbq]

For each registered compressor with its default parameters (HiPress's five, then the contrib
ones), on a float32 gradient of --elements (default 128M = 512 MiB, larger than the last-level
cache, so memory bandwidth is what a streaming kernel meets):
  encode     the jitted `encode(x, state, key)` with the state donated (updated in place, as the
             train step does); x is the same buffer every round, the key changes per round;
  decode     the jitted `decode_add(payload, acc)` with acc donated: CaSync's merge
             (decode add_to), the decode on the aggregation path;
  reference  a jitted, donated `x * 2` (one read and one write of the buffer), timed in each
             round right before the compressor.
GB/s counts one read and one write of the n float32 values (8n bytes) for the reference and for
the compressor alike, so ratio = reference time / compressor time (1.0 = as fast as the
reference); each ratio is the median over the rounds; "enc+dec" is reference / (encode + decode).
Targets (issue 11): enc+dec >= 0.5x for onebit, tbq, terngrad; >= 0.2x for dgc, graddrop, on
that time ratio (the headline). "bw" is the effective bandwidth ratio of enc+dec: the bytes the
codec must move at least (encode: read x, read and write each state array, write the payload;
decode_add: read the payload, read and write acc) over encode + decode time, against the
reference's 8n bytes over its time.
Compression: 4n / len(to_bytes(payload)) for the last round's payload (sparse: its actual
count), 4n / wire_bytes(n) (sparse: at capacity), and the theory of hipress.md §1.6.
The Pallas path is not timed: interpret mode is a correctness tool, and there is no GPU here.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from jlp import compression
from jlp.compression import DGC, QSGD, TBQ, GradDrop, OneBit, TernGrad

_ELEMENTS = flags.DEFINE_integer("elements", 128 * 2 ** 20, "float32 elements of the gradient.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed rounds (reference, encode, decode) each.")
_ONLY = flags.DEFINE_string("only", "", "comma-separated compressor names: run only these.")

HIPRESS = ("onebit", "tbq", "terngrad", "dgc", "graddrop")
TARGETS = {"onebit": 0.5, "tbq": 0.5, "terngrad": 0.5, "dgc": 0.2, "graddrop": 0.2}


def theory(c, n: int) -> float:
  """4n / the payload bytes hipress.md §1.6 gives (sparse: at capacity)."""
  if isinstance(c, OneBit):
    return 4 * n / (n / 8 + (8 if c.scale_mode == "two_means" else 4))
  if isinstance(c, TBQ):
    return 16.0
  if isinstance(c, TernGrad):
    return 4 * n / (10 + n * c.bitwidth / 8)
  if isinstance(c, (DGC, GradDrop)):
    return 4 * n / (4 + 8 * n * float(c.density))
  if isinstance(c, QSGD):
    return 32 / c.layout[-1].bits
  return 32.0  # efsignsgd: one bit per element


def timed(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0, out


def run(name: str, x: jax.Array, r: jax.Array, repeats: int):
  """(row of the table, r): the reference buffer comes back so that it stays donated."""
  c = compression.get(name)
  n = x.shape[0]
  encode = jax.jit(lambda x, state, key: c.encode(x, state, key), donate_argnums=1)
  decode_add = jax.jit(lambda payload, acc: c.decode_add(payload, acc), donate_argnums=1)
  reference = jax.jit(lambda v: v * 2.0, donate_argnums=0)
  keys = [jax.random.fold_in(jax.random.key(1), i) if c.needs_key else None
          for i in range(repeats + 1)]
  state = c.init_flat(n)
  t0 = time.perf_counter()
  payload, state = jax.block_until_ready(encode(x, state, keys[0]))
  compile_s = time.perf_counter() - t0
  acc = jax.block_until_ready(decode_add(payload, jnp.zeros((n,), jnp.float32)))
  r = jax.block_until_ready(reference(r))
  t_ref, t_enc, t_dec = [], [], []
  for i in range(repeats):
    t, r = timed(reference, r)
    t_ref.append(t)
    t, (payload, state) = timed(encode, x, state, keys[i + 1])
    t_enc.append(t)
    t, acc = timed(decode_add, payload, acc)
    t_dec.append(t)
  gb = 8 * n / 1e9
  wire = len(c.to_bytes(payload))
  payload_bytes = sum(a.nbytes for a in jax.tree.leaves(payload))
  moved = 4 * n + 2 * sum(a.nbytes for a in jax.tree.leaves(state)) + payload_bytes + (
      payload_bytes + 8 * n)
  row = dict(
      name=name, enc_ms=1e3 * statistics.median(t_enc), dec_ms=1e3 * statistics.median(t_dec),
      ref_gbs=gb / statistics.median(t_ref),
      enc=statistics.median(a / b for a, b in zip(t_ref, t_enc)),
      dec=statistics.median(a / b for a, b in zip(t_ref, t_dec)),
      both=statistics.median(a / (b + d) for a, b, d in zip(t_ref, t_enc, t_dec)),
      bw=statistics.median(moved / (8 * n) * a / (b + d) for a, b, d in zip(t_ref, t_enc, t_dec)),
      target=TARGETS.get(name), payload_ratio=4 * n / wire,
      capacity_ratio=4 * n / c.wire_bytes(n), theory=theory(c, n), compile_s=compile_s)
  del payload, state, acc
  return row, r


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  n = _ELEMENTS.value
  if n <= 0:
    raise app.UsageError(f"--elements={n} is not allowed; expected a positive int.")
  names = list(HIPRESS) + sorted(set(compression.COMPRESSORS) - set(HIPRESS))
  only = [s for s in _ONLY.value.split(",") if s]
  unknown = sorted(set(only) - set(names))
  if unknown:
    raise app.UsageError(f"--only={_ONLY.value!r}: {unknown} not registered; expected {names}.")
  names = [m for m in names if not only or m in only]
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  r = jnp.ones((n,), jnp.float32)
  print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device); "
        f"{n} float32 ({4 * n / 2 ** 20:.0f} MiB), median of {_REPEATS.value} rounds, "
        "reference = donated x*2; GB/s = 8n bytes / time\n")
  header = (f"{'compressor':10s} {'enc ms':>8s} {'dec ms':>7s} {'ref GB/s':>8s} {'enc/ref':>7s} "
            f"{'dec/ref':>7s} {'enc+dec':>7s} {'bw':>6s} {'target':>6s}   {'4n/payload':>10s} "
            f"{'4n/capacity':>11s} {'theory':>7s}")
  print(header)
  print("-" * len(header))
  for name in names:
    row, r = run(name, x, r, _REPEATS.value)
    target = "-" if row["target"] is None else f"{row['target']:.1f}"
    met = "" if row["target"] is None else ("  met" if row["both"] >= row["target"] else "  MISSED")
    print(f"{name:10s} {row['enc_ms']:8.1f} {row['dec_ms']:7.1f} {row['ref_gbs']:8.1f} "
          f"{row['enc']:7.3f} {row['dec']:7.3f} {row['both']:7.3f} {row['bw']:6.3f} {target:>6s}   "
          f"{row['payload_ratio']:10.2f} {row['capacity_ratio']:11.2f} {row['theory']:7.2f}"
          f"{met}", flush=True)
    if not math.isclose(row["capacity_ratio"], row["theory"], rel_tol=1e-3):
      print(f"  ! {name}: 4n/wire_bytes {row['capacity_ratio']:.3f} differs from theory "
            f"{row['theory']:.3f}")


if __name__ == "__main__":
  app.run(main)
