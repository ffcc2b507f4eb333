"""Quantize throughput against the memory-bandwidth reference, timed alternately.

Run: make bench   (or: python -m benchmarks.quantize_bench [--elements=134217728] [--repeats=7])

For each format: the XLA path of `jlp.quantize` on a donated float32 buffer of
--elements (default 128M = 512 MB, larger than the last-level cache, so memory
bandwidth is what is measured) shaped (N, 1024), or NHWC (N, 32, 32, 1024) for 4-D
BFP blocks, next to the in-place bandwidth reference (a jitted, donated `x * 2`
on the same buffer) and, where ml_dtypes has the type, the `astype` round trip
through it, each timed alternately with the reference in the same run.
GB/s counts one read and one write of the buffer (medians). Two rows after
"e4m3 stochastic" split its cost: "(cast, no hash)" is the same cast with
stand-in draws (a Weyl sequence of the element index, not random; a floor for the
cast alone) and "(hash only)" writes the Threefry draws without the cast. Ratios are the median
over the alternating pairs of reference_time / time (1.0 = as fast as the
reference). `--impl=pallas` times the Pallas kernels instead (meant for a GPU: interpret mode
is a correctness tool).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from jax import lax

from jlp import BFPFormat, BlockScaledFormat, FloatFormat, MXFormat, NVFP4Format
from jlp.numerics import random_bits
from jlp.numerics.float_cast import float_cast, from_bits
from jlp.quantize import quantize

_ELEMENTS = flags.DEFINE_integer("elements", 128 * 2 ** 20, "float32 elements per buffer (multiple of 1024).")
_REPEATS = flags.DEFINE_integer("repeats", 11, "timed (reference, candidate) pairs per format.")
_ONLY = flags.DEFINE_string("only", "", "comma-separated substrings: run only matching formats.")
_IMPL = flags.DEFINE_enum("impl", "xla", ["xla", "pallas"],
                          "The XLA path, or the Pallas kernels (compiled on a GPU; interpreted, "
                          "and slow, elsewhere).")

FLOAT_NAMES = ["float16", "bfloat16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e3m4",
               "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "e3m0", "e6m9"]


def formats():
  fmts = [(n, FloatFormat.from_name(n)) for n in FLOAT_NAMES]
  fmts += [("e4m3 saturate", FloatFormat(4, 3, overflow="saturate")),
           ("e4m3 truncate", FloatFormat(4, 3, rounding="truncate")),
           ("e4m3 stochastic", FloatFormat(4, 3, rounding="stochastic")),
           ("e4m3 cpd", FloatFormat(4, 3, compat="cpd")),
           ("e5m2 qtorch", FloatFormat(5, 2, compat="qtorch")),
           ("BFP m8 (1,16)", BFPFormat(8, (1, 16))),
           ("BFP m4 (1,24)", BFPFormat(4, (1, 24))),
           ("BFP m8 (1,16) nearest", BFPFormat(8, (1, 16), rounding="nearest")),
           ("BFP FB12 NHWC (1,3,3,24)", BFPFormat(4, (1, 3, 3, 24))),
           ("MX e4m3fn /32", MXFormat("float8_e4m3fn")),
           ("MX e2m1fn /32", MXFormat("float4_e2m1fn")),
           ("MX e4m3fn /32 rceil", MXFormat("float8_e4m3fn", scale_mode="rceil")),
           ("NVFP4 1x16", NVFP4Format()),
           ("NVFP4 16x16", NVFP4Format(block=(16, 16))),
           ("NVFP4 1x16 torchao", NVFP4Format(compat="torchao")),
           ("block FP8 1x128", BlockScaledFormat()),
           ("block FP8 128x128", BlockScaledFormat(block=(128, 128)))]
  only = [s for s in _ONLY.value.split(",") if s]
  return [(n, f) for n, f in fmts if not only or any(s in n for s in only)]


def stochastic_parts(fmt: FloatFormat, key: jax.Array) -> list[tuple[str, object]]:
  """The "(cast, no hash)" and "(hash only)" rows (module docstring), as jittable functions."""
  def cast_without_hash(v):
    m = v.size // 2  # the "pairs" layout of random_bits.map_with_bits
    index = lax.iota(jnp.uint32, m).reshape(m, 1) * 2 + lax.broadcasted_iota(jnp.uint32, (m, 2), 1)
    rows = lax.optimization_barrier(v.reshape(m, 2))
    out = lax.optimization_barrier(float_cast(rows, fmt, index * np.uint32(0x9E3779B9)))
    return out.reshape(v.shape)

  def hash_only(v):  # reads v (so the donated buffer is reused) and writes finite values
    in_one_two = lambda bits: from_bits((bits >> np.uint32(9)) | np.uint32(0x3F800000))
    return random_bits.map_with_bits(lambda u, bits: jnp.where(bits == 0, u, in_one_two(bits)), v,
                                     key)
  return [("  (cast, no hash)", cast_without_hash), ("  (hash only)", hash_only)]


def timed(fn, x):
  """Runs fn on x (donated) and returns (seconds, new buffer)."""
  t0 = time.perf_counter()
  y = fn(x)
  y.block_until_ready()
  return time.perf_counter() - t0, y


def compare(candidate, reference, x, r, repeats):
  """Alternating timings; returns (median candidate s, median reference s, median of the
  per-pair ratios reference/candidate, x, r)."""
  x = candidate(x).block_until_ready()  # compile + warm
  r = reference(r).block_until_ready()
  tc, tr = [], []
  for _ in range(repeats):
    t, r = timed(reference, r)
    tr.append(t)
    t, x = timed(candidate, x)
    tc.append(t)
  ratio = statistics.median(b / a for a, b in zip(tc, tr))
  return statistics.median(tc), statistics.median(tr), ratio, x, r


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  n = _ELEMENTS.value
  if n <= 0 or n % 1024:
    raise app.UsageError(f"--elements={n} is not allowed; expected a positive multiple of 1024.")
  gb = 2 * 4 * n / 1e9
  shape = (n // 1024, 1024)
  reference = jax.jit(lambda v: v * 2.0, donate_argnums=0)
  key = jax.random.key(0)
  x = jax.random.normal(key, shape, jnp.float32)
  r = jnp.ones(shape, jnp.float32)
  print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device), "
        f"impl={_IMPL.value}; {n} float32 ({4 * n / 2 ** 20:.0f} MiB), median of {_REPEATS.value}, reference = donated x*2\n")
  header = f"{'format':26s} {'jlp GB/s':>9s} {'ref GB/s':>9s} {'jlp/ref':>8s}   {'astype GB/s':>11s} {'astype/ref':>10s}"
  print(header)
  print("-" * len(header))
  for name, fmt in formats():
    k = key if getattr(fmt, "rounding", None) == "stochastic" else None
    # 4-D blocks quantize an NHWC buffer (N, 32, 32, 1024); reshaping inside the jitted function
    # instead would keep XLA from writing the donated buffer in place.
    view = (-1, 32, 32, 1024) if isinstance(fmt, BFPFormat) and len(fmt.block) == 4 else shape
    cand = jax.jit(lambda v, fmt=fmt, k=k: quantize(v, fmt, key=k, impl=_IMPL.value),
                   donate_argnums=0)
    tc, tr, ratio, x, r = compare(cand, reference, x.reshape(view), r.reshape(view), _REPEATS.value)
    x, r = x.reshape(shape), r.reshape(shape)
    line = f"{name:26s} {gb / tc:9.2f} {gb / tr:9.2f} {ratio:8.2f}"
    dtype = fmt.ml_dtype if isinstance(fmt, FloatFormat) else None
    if dtype is not None and fmt.bits == 6 and jax.default_backend() == "cpu":
      line += f"   {'n/a':>11s} {'n/a':>10s}  (XLA:CPU crashes on float6 astype)"
    elif dtype is not None:
      ast = jax.jit(lambda v, d=dtype: v.astype(d).astype(jnp.float32), donate_argnums=0)
      ta, _, ratio, x, r = compare(ast, reference, x, r, _REPEATS.value)
      line += f"   {gb / ta:11.2f} {ratio:10.2f}"
    print(line, flush=True)
    if name == "e4m3 stochastic":
      for part, fn in stochastic_parts(fmt, key):
        part_fn = jax.jit(fn, donate_argnums=0)
        tc, tr, ratio, x, r = compare(part_fn, reference, x, r, _REPEATS.value)
        print(f"{part:26s} {gb / tc:9.2f} {gb / tr:9.2f} {ratio:8.2f}", flush=True)
      x = jax.random.normal(key, shape, jnp.float32)  # the next formats see the usual data


if __name__ == "__main__":
  app.run(main)
