"""Relative error of an FP8 GEMM with a Hopper-like accumulator, with and without promotion.

Run: python -m benchmarks.promotion_error [--m=64 --n=64 --ks=256,1024,4096,16384
       --mean=1.0 --std=1.0 --promote_every=128 --seed=0]

DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, §3.3.2,
"Increasing Accumulation Precision") reports that the FP8 GEMMs of NVIDIA H800 tensor cores
keep only about 14 bits of their accumulation, which gives "a maximum relative error of nearly
2%" for two random matrices at K = 4096, and fixes it by adding the tensor cores' partial sums
into float32 registers every N_C = 128 products. Here `jlp.gemm.accum.matmul` models that
accumulator as FloatFormat(8, 13, rounding="truncate") (8 exponent bits as float32, 13 stored
mantissa bits, round toward zero), every addition rounded (chunk = 1), without promotion and
with promote_every=128.

Inputs (for each K, drawn afresh): a (M, K) and b (K, N), every element an N(mean, std)
float32 sample (numpy default_rng(seed + K), a first, then b) rounded to OCP FP8 E4M3
(`ml_dtypes.float8_e4m3fn`, round to nearest even), i.e. the FP8 operands of a Hopper GEMM;
a positive mean makes the partial sums grow with k, as in DeepSeek-V3's test. Reference:
the float64 product of those FP8 values (their products are exact in float64). For each of
the M x N outputs, the relative error |c - ref| / |ref|; the table gives its maximum and
median. The float32 column is the same sequential k-order sum in float32 (accum =
FloatFormat(8, 23): every product and addition rounded to nearest float32), for scale.
"""

from __future__ import annotations

import time

import jax
import ml_dtypes
import numpy as np
from absl import app, flags, logging

from jlp.formats import FloatFormat
from jlp.gemm.accum import matmul

_M = flags.DEFINE_integer("m", 64, "rows of a (outputs per K: m x n).")
_N = flags.DEFINE_integer("n", 64, "columns of b.")
_KS = flags.DEFINE_list("ks", ["256", "1024", "4096", "16384"], "inner dimensions K.")
_MEAN = flags.DEFINE_float("mean", 1.0, "mean of the normal samples before the FP8 rounding.")
_STD = flags.DEFINE_float("std", 1.0, "standard deviation of the normal samples.")
_PROMOTE = flags.DEFINE_integer("promote_every", 128, "products per run before promotion (N_C).")
_SEED = flags.DEFINE_integer("seed", 0, "base seed (K is added).")

HOPPER = FloatFormat(8, 13, rounding="truncate")
FLOAT32 = FloatFormat(8, 23)


def fp8_operands(m: int, k: int, n: int, seed: int, mean: float, std: float):
  rng = np.random.default_rng(seed)
  e4m3 = lambda x: x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  a = e4m3(rng.normal(mean, std, (m, k)).astype(np.float32))
  b = e4m3(rng.normal(mean, std, (k, n)).astype(np.float32))
  return a, b


def relative_errors(c, exact: np.ndarray) -> np.ndarray:
  return np.abs(np.asarray(c, np.float64) - exact) / np.abs(exact)


def pct(x: float) -> str:
  return f"{100 * x:.3g} %"


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  m, n, promote = _M.value, _N.value, _PROMOTE.value
  try:
    ks = [int(k) for k in _KS.value]
  except ValueError:
    raise app.UsageError(f"--ks={','.join(_KS.value)} is not allowed; expected positive ints.")
  if min([m, n, promote] + ks) <= 0:
    raise app.UsageError(f"m, n, promote_every, ks = {m}, {n}, {promote}, {ks} is not allowed; "
                         "expected positive ints.")
  run = jax.jit(matmul, static_argnames=("accum", "promote_every", "impl"))
  t0 = time.perf_counter()
  print(f"jax {jax.__version__} on {jax.default_backend()}; M = {m}, N = {n}; inputs "
        f"e4m3fn(N({_MEAN.value:g}, {_STD.value:g}^2)), seed {_SEED.value} + K; accum = "
        f"FloatFormat(8, 13, rounding='truncate'), chunk = 1, impl = xla\n")
  print(f"| K | no promotion: max rel. error | median | promote_every={promote}: max | median "
        f"| float32 sequential: max |")
  print("|---:|---:|---:|---:|---:|---:|")
  for k in ks:
    a, b = fp8_operands(m, k, n, _SEED.value + k, _MEAN.value, _STD.value)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    plain = relative_errors(run(a, b, accum=HOPPER, impl="xla"), exact)
    promoted = relative_errors(run(a, b, accum=HOPPER, promote_every=promote, impl="xla"), exact)
    wide = relative_errors(run(a, b, accum=FLOAT32, impl="xla"), exact)
    print(f"| {k} | {pct(plain.max())} | {pct(np.median(plain))} | {pct(promoted.max())} "
          f"| {pct(np.median(promoted))} | {pct(wide.max())} |", flush=True)
  print(f"\nDeepSeek-V3 (arXiv:2412.19437 §3.3.2): max relative error nearly 2% at K = 4096 "
        f"without promotion (H800, their random inputs). Wall time {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
  app.run(main)
