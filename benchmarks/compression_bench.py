"""Compressor throughput in bytes moved against the memory-bandwidth reference, timed
alternately, and the compression ratios of the payloads against theory
(docs/hipress.md#compressors).

Run: python -m benchmarks.compression_bench [--elements=134217728] [--repeats=9] [--only=dgc,tbq]

For each registered compressor with its default parameters (HiPress's five, then the contrib
ones), on a float32 gradient of --elements (default 128M = 512 MiB, larger than the last-level
cache, so memory bandwidth is what a streaming kernel meets):
  encode     the jitted `encode(x, state, key)` with the state donated (updated in place, as the
             train step does); x is the same buffer every round, the key changes per round;
  decode     the jitted `decode_add(payload, acc)` with acc donated: CaSync's merge
             (decode add_to), the decode on the aggregation path;
  reference  a jitted, donated `x * 2`: one read and one write of the buffer, 8n bytes, timed in
             each round right before the compressor.

The headline is in bytes: **bytes ratio** = (the bytes the codec must move at least, encode +
decode_add) / (encode + decode time), over the reference's 8n bytes / its time; 1.0 = the
codec streams its minimum traffic at the reference's bandwidth. Each ratio is the median over
rounds. Targets (issue 19): >= 0.5 for onebit, tbq and terngrad, >= 0.3 for dgc and graddrop.
The time ratio (reference time / (encode + decode)) of the earlier tables stays beside it.

The minimum bytes (one function per codec below): a streaming implementation of the codec's
algorithm and state, with n floats too many for any cache, reads each input once per pass the
algorithm needs and writes each output once. A statistic of the whole tensor (TernGrad's min and
max, QSGD's norm, EF-signSGD's scale) must be known before the first element it scales is
written: a second read of what it is computed from. Per codec (n float32 elements, P the payload
bytes `wire_bytes(n)`, sparse at capacity k; decode_add of a dense payload reads P and reads and
writes acc, 8n; a sparse one scatters in place: P and acc's k touched elements, 8k):
  onebit     encode 12n + P: read x and the last v, write v (its state) and the payload in one
             pass (the residual v - decode is applied at the next encode). The code makes three:
             v; the scales' sums over v (a sequential float32 reduce: its rounding is fixed); the
             packed signs from v (XLA:CPU does not write outputs of different shapes from one
             loop): 20n + P.
  tbq        encode 12n + P: read x and r, write r and the codes. The code keeps v (as onebit)
             and makes two passes: v from x and the last v, written in place, then the packed
             codes from v (XLA:CPU does not write outputs of different shapes from one loop):
             16n + P.
  terngrad   encode 8n + P: x read twice (min and max, then the codes), what the code does.
  dgc        encode 20n + P: read x, u and v, write u and v, and compare |v| with the threshold
             in that pass (the threshold comes from a sample of v, a gather); zeroing k entries
             of u and v is sparse. The code writes u and v in one pass and counts and compacts
             the selection in further passes over v.
  graddrop   encode 12n + P: read x and r, write r (as DGC, one state array); the code adds
             further passes for the selection.
  efsignsgd  encode 20n + P: read x and r for the scale, then read them again and write r (its
             state is r: the residual needs the scale).
  qsgd       encode 8n + P: x read twice (the norm, then the codes).
"xla B/elt" is what XLA's cost analysis counts for the compiled encode + decode_add (the bytes of
every operand and result of every fused op; a scatter counts its whole operand): what the code
does, as XLA models it, next to the minimum.
Compression: 4n / len(to_bytes(payload)) for the last round's payload (sparse: its actual
count), 4n / wire_bytes(n) (sparse: at capacity), and the theory (`theory`).
The Pallas path (impl="auto" picks it on GPU) is not timed here: on CPU "auto" is XLA.

PowerSGD (`jlp.compression.PowerSGD`, topology "allreduce"; --powersgd_ranks, "" to skip) has no
encode / decode pair: its step is `jlp.compression.sync` itself, timed on a one-device mesh (its
two psums move nothing, so what is timed is the arithmetic: the error feedback M + E, P = MQ and
Q = M^T P, two orthonormalizations, the approximation P Q^T and the new error M - A) on the
gradient as one (rows, n / rows) matrix (rows the power of two nearest sqrt(n)), start_iter=0,
state donated. Beside it, in the same rounds, the float32 all-reduce floor: the reference above
(x * 2, one read and one write of the gradient: what any all-reduce of float32 values pays on
each device). "vs floor" = step time / floor time (the median over rounds); "GFLOP/s" counts
the two matmuls and the approximation (3 * 2 * n * r); "4n/payload" is the compression of the
two all-reduced payloads, n / (r * (rows + n / rows)).
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from jlp import compression
from jlp.compression import DGC, QSGD, TBQ, EFSignSGD, GradDrop, OneBit, TernGrad

_ELEMENTS = flags.DEFINE_integer("elements", 128 * 2 ** 20, "float32 elements of the gradient.")
_REPEATS = flags.DEFINE_integer("repeats", 9, "timed rounds (reference, encode, decode) each.")
_ONLY = flags.DEFINE_string("only", "", "comma-separated compressor names: run only these.")
_POWERSGD_RANKS = flags.DEFINE_list("powersgd_ranks", ["1", "2", "4"],
                                    "PowerSGD ranks to time against the float32 floor ('' skips).")

HIPRESS = ("onebit", "tbq", "terngrad", "dgc", "graddrop")
TARGETS = {"onebit": 0.5, "tbq": 0.5, "terngrad": 0.5, "dgc": 0.3, "graddrop": 0.3}


# -- the minimum bytes of each codec (encode, decode_add), see the module docstring ------------
def _dense_decode(payload: int, n: int) -> int:
  return payload + 8 * n  # read the payload, read and write acc


def _sparse_decode(c, n: int) -> int:
  k = c.payload_spec(n)["indices"].shape[0]
  return c.wire_bytes(n) + 8 * k  # read the payload, read and write acc at the k indices


def onebit_bytes(c: OneBit, n: int) -> tuple[int, int]:
  p = c.wire_bytes(n)
  return 4 * n + 4 * n + 4 * n + p, _dense_decode(p, n)  # x, v read; v, payload written


def tbq_bytes(c: TBQ, n: int) -> tuple[int, int]:
  p = c.wire_bytes(n)
  return 4 * n + 4 * n + 4 * n + p, _dense_decode(p, n)  # x, r read; r, codes written


def terngrad_bytes(c: TernGrad, n: int) -> tuple[int, int]:
  p = c.wire_bytes(n)
  return 4 * n + 4 * n + p, _dense_decode(p, n)  # x read for min/max, again for the codes


def dgc_bytes(c: DGC, n: int) -> tuple[int, int]:
  return 4 * n + 2 * (4 * n + 4 * n) + c.wire_bytes(n), _sparse_decode(c, n)  # x; u, v read+write


def graddrop_bytes(c: GradDrop, n: int) -> tuple[int, int]:
  return 4 * n + 4 * n + 4 * n + c.wire_bytes(n), _sparse_decode(c, n)  # x, r read; r written


def efsignsgd_bytes(c: EFSignSGD, n: int) -> tuple[int, int]:
  p = c.wire_bytes(n)
  return 8 * n + 12 * n + p, _dense_decode(p, n)  # x, r for the scale; x, r read, r written


def qsgd_bytes(c: QSGD, n: int) -> tuple[int, int]:
  p = c.wire_bytes(n)
  return 4 * n + 4 * n + p, _dense_decode(p, n)  # x read for the norm, again for the codes


MIN_BYTES = {OneBit: onebit_bytes, TBQ: tbq_bytes, TernGrad: terngrad_bytes, DGC: dgc_bytes,
             GradDrop: graddrop_bytes, EFSignSGD: efsignsgd_bytes, QSGD: qsgd_bytes}


def min_bytes(c, n: int) -> tuple[int, int]:
  """(encode, decode_add) bytes the codec must move at least (module docstring)."""
  if type(c) not in MIN_BYTES:
    raise ValueError(f"compressor {type(c).__name__} has no byte count; expected one of "
                     f"{sorted(t.__name__ for t in MIN_BYTES)} (add a function here).")
  return MIN_BYTES[type(c)](c, n)


def theory(c, n: int) -> float:
  """4n / the payload bytes of the compressor's wire format in theory (sparse: at capacity)."""
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


def _xla_bytes(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float((cost or {}).get("bytes accessed", math.nan))


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
  xla_bytes = (_xla_bytes(encode.lower(x, state, keys[0]).compile())
               + _xla_bytes(decode_add.lower(payload, acc).compile()))
  r = jax.block_until_ready(reference(r))
  t_ref, t_enc, t_dec = [], [], []
  for i in range(repeats):
    t, r = timed(reference, r)
    t_ref.append(t)
    t, (payload, state) = timed(encode, x, state, keys[i + 1])
    t_enc.append(t)
    t, acc = timed(decode_add, payload, acc)
    t_dec.append(t)
  enc_bytes, dec_bytes = min_bytes(c, n)
  moved = enc_bytes + dec_bytes
  wire = len(c.to_bytes(payload))
  row = dict(
      name=name, enc_ms=1e3 * statistics.median(t_enc), dec_ms=1e3 * statistics.median(t_dec),
      ref_gbs=8 * n / 1e9 / statistics.median(t_ref),
      both=statistics.median(a / (b + d) for a, b, d in zip(t_ref, t_enc, t_dec)),
      bytes=statistics.median(moved / (8 * n) * a / (b + d)
                              for a, b, d in zip(t_ref, t_enc, t_dec)),
      min_elt=moved / n, xla_elt=xla_bytes / n, target=TARGETS.get(name),
      payload_ratio=4 * n / wire, capacity_ratio=4 * n / c.wire_bytes(n), theory=theory(c, n),
      compile_s=compile_s)
  del payload, state, acc
  return row, r


def powersgd_run(rank: int, x: jax.Array, r: jax.Array, repeats: int):
  """(row, r): PowerSGD's step against the float32 all-reduce floor (module docstring)."""
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  n = x.shape[0]
  rows = 2 ** round(math.log2(n) / 2)
  while n % rows:
    rows //= 2
  m = x.reshape(rows, n // rows)
  c = compression.PowerSGD(rank=rank, start_iter=0)
  mesh = Mesh(jax.devices()[:1], ("data",))
  state = compression.init_state({"g": m}, c, 1, topology="allreduce", seed=0)

  def body(state, g):
    summed, state = compression.sync({"g": g}, "data", c, state, topology="allreduce")
    return state, summed["g"]
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()),
                               check_vma=False), donate_argnums=0)
  reference = jax.jit(lambda v: v * 2.0, donate_argnums=0)
  t0 = time.perf_counter()
  state, out = jax.block_until_ready(step(state, m))
  compile_s = time.perf_counter() - t0
  r = jax.block_until_ready(reference(r))
  t_ref, t_step = [], []
  for _ in range(repeats):
    t, r = timed(reference, r)
    t_ref.append(t)
    t, (state, out) = timed(step, state, m)
    t_step.append(t)
  k = min(rank, rows, n // rows)
  row = dict(rank=rank, shape=(rows, n // rows), step_ms=1e3 * statistics.median(t_step),
             ref_ms=1e3 * statistics.median(t_ref),
             vs_floor=statistics.median(b / a for a, b in zip(t_ref, t_step)),
             gflops=3 * 2 * n * k / 1e9 / statistics.median(t_step),
             payload_ratio=n / (k * (rows + n // rows)), compile_s=compile_s)
  del state, out
  return row, r


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  n = _ELEMENTS.value
  if n <= 0:
    raise app.UsageError(f"--elements={n} is not allowed; expected a positive int.")
  codecs = {n for n, c in compression.COMPRESSORS.items() if "ps" in c.topologies}  # not PowerSGD
  names = list(HIPRESS) + sorted(codecs - set(HIPRESS))
  only = [s for s in _ONLY.value.split(",") if s]
  unknown = sorted(set(only) - set(names) - {"powersgd"})
  if unknown:
    raise app.UsageError(f"--only={_ONLY.value!r}: {unknown} not registered; expected "
                         f"{names + ['powersgd']}.")
  names = [m for m in names if not only or m in only]
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  r = jnp.ones((n,), jnp.float32)
  print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device); "
        f"{n} float32 ({4 * n / 2 ** 20:.0f} MiB), median of {_REPEATS.value} rounds, "
        "reference = donated x*2 (8n bytes)\n")
  header = (f"{'compressor':10s} {'enc ms':>8s} {'dec ms':>7s} {'ref GB/s':>8s} {'min B/elt':>9s} "
            f"{'xla B/elt':>9s} {'bytes':>6s} {'target':>6s} {'time':>6s}   {'4n/payload':>10s} "
            f"{'4n/capacity':>11s} {'theory':>7s}")
  print(header)
  print("-" * len(header))
  for name in names:
    row, r = run(name, x, r, _REPEATS.value)
    target = "-" if row["target"] is None else f"{row['target']:.1f}"
    met = "" if row["target"] is None else (
        "  met" if row["bytes"] >= row["target"] else "  MISSED")
    print(f"{name:10s} {row['enc_ms']:8.1f} {row['dec_ms']:7.1f} {row['ref_gbs']:8.1f} "
          f"{row['min_elt']:9.2f} {row['xla_elt']:9.2f} {row['bytes']:6.3f} {target:>6s} "
          f"{row['both']:6.3f}   {row['payload_ratio']:10.2f} {row['capacity_ratio']:11.2f} "
          f"{row['theory']:7.2f}{met}", flush=True)
    if not math.isclose(row["capacity_ratio"], row["theory"], rel_tol=1e-3):
      print(f"  ! {name}: 4n/wire_bytes {row['capacity_ratio']:.3f} differs from theory "
            f"{row['theory']:.3f}")
  ranks = [int(v) for v in _POWERSGD_RANKS.value if v]
  if ranks and (not only or "powersgd" in only):
    header = (f"\n{'powersgd':10s} {'matrix':>13s} {'step ms':>8s} {'floor ms':>8s} "
              f"{'vs floor':>8s} {'GFLOP/s':>8s} {'4n/payload':>10s}")
    print(header)
    print("-" * (len(header) - 1))
    for rank in ranks:
      row, r = powersgd_run(rank, x, r, _REPEATS.value)
      shape = f"{row['shape'][0]}x{row['shape'][1]}"
      print(f"{'rank ' + str(rank):10s} {shape:>13s} {row['step_ms']:8.1f} {row['ref_ms']:8.1f} "
            f"{row['vs_floor']:7.2f}x {row['gflops']:8.2f} {row['payload_ratio']:10.1f}",
            flush=True)


if __name__ == "__main__":
  app.run(main)
