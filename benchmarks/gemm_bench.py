"""Custom-precision accumulation matmul against a float32 matmul, timed alternately.

Run: python -m benchmarks.gemm_bench [--size=256 | --shape=M,K,N] [--repeats=11] [--impl=xla]

`jlp.gemm.accum.matmul` (M = K = N = --size, or --shape) with an e5m2
accumulator in the exact per-add mode (chunk = 1, CPD's quant_gemm, docs/cpd.md#accumulating-gemm)
and with chunk = 32, plain and Kahan, each timed alternately with a jitted float32
`jnp.matmul(precision=HIGHEST)` in the same run. Ratios are the median over the
alternating pairs of time / float32 time (targets, issue 3: <= 30x exact,
<= 3x chunk = 32). The Pallas path is only meaningful on a GPU (interpret mode
is a correctness tool). The K-scaling case of issue 14 is a convolution's
weight gradient, K = N*H*W: --shape=64,147456,64 and --shape=64,802816,128.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from jlp.formats import FloatFormat
from jlp.gemm.accum import matmul

_SIZE = flags.DEFINE_integer("size", 256, "M = K = N.")
_SHAPE = flags.DEFINE_list("shape", None, "M,K,N (instead of --size), e.g. 64,147456,64.")
_REPEATS = flags.DEFINE_integer("repeats", 11, "timed (float32, candidate) pairs per case.")
_IMPL = flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas"], "matmul implementation.")


def timed(fn, a, b):
  t0 = time.perf_counter()
  fn(a, b).block_until_ready()
  return time.perf_counter() - t0


def compare(candidate, reference, a, b, repeats):
  """Median candidate s, median reference s, median per-pair ratio candidate / reference."""
  candidate(a, b).block_until_ready()  # compile + warm
  reference(a, b).block_until_ready()
  tc, tr = [], []
  for _ in range(repeats):
    tr.append(timed(reference, a, b))
    tc.append(timed(candidate, a, b))
  ratio = statistics.median(c / r for c, r in zip(tc, tr))
  return statistics.median(tc), statistics.median(tr), ratio


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if _SHAPE.value is None:
    m = k = n = _SIZE.value
  else:
    try:
      m, k, n = (int(v) for v in _SHAPE.value)
    except ValueError:
      raise app.UsageError(f"--shape={','.join(_SHAPE.value)} is not allowed; expected M,K,N.")
  if min(m, k, n) <= 0:
    raise app.UsageError(f"M, K, N = {m}, {k}, {n} is not allowed; expected positive ints.")
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (m, k), jnp.float32)
  b = jax.random.normal(kb, (k, n), jnp.float32)
  fmt = FloatFormat.from_name("e5m2")
  reference = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
  impl = _IMPL.value + (" (interpreted)" if _IMPL.value == "pallas"
                        and jax.default_backend() != "gpu" else "")
  print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device); "
        f"(M, K, N) = ({m}, {k}, {n}), e5m2 accumulator, impl={impl}, "
        f"median of {_REPEATS.value}, "
        f"reference = float32 jnp.matmul (HIGHEST); load average before: "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
  header = f"{'case':22s} {'ms':>9s} {'f32 ms':>9s} {'ratio':>8s}"
  print(header)
  print("-" * len(header))
  for chunk in (1, 32):
    for kahan in (False, True):
      cand = jax.jit(lambda x, y, chunk=chunk, kahan=kahan: matmul(
          x, y, accum=fmt, kahan=kahan, chunk=chunk, impl=_IMPL.value))
      tc, tr, ratio = compare(cand, reference, a, b, _REPEATS.value)
      name = f"chunk={chunk} " + ("kahan" if kahan else "plain")
      print(f"{name:22s} {tc * 1e3:9.2f} {tr * 1e3:9.3f} {ratio:7.1f}x", flush=True)
  print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
  app.run(main)
