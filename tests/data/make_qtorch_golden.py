"""Generates qtorch_0_3_0_nearest.npz: golden outputs of the REAL QPyTorch 0.3.0.

This script is a standalone tool, NOT part of the test suite (no test imports it;
it needs torch and qtorch, which the jlp venv does not have). The test that uses
its output is tests/numerics/qtorch_golden_test.py.

Re-creating the oracle venv (outside the repo; see /work/shared/specs/toolchain.md §5):

    /root/.pyenv/versions/3.11.7/bin/python3.11 -m venv /tmp/qtvenv
    /tmp/qtvenv/bin/pip install torch==2.13.0      # the local CPU wheel, not a CUDA build
    /tmp/qtvenv/bin/pip install ninja qtorch numpy # qtorch 0.3.0; numpy is undeclared

Running it (the first `import qtorch.quant` JIT-builds the C++ extension with g++
and ninja, ~20-40 s; it is cached in the torch_extensions directory afterwards):

    cd /work/main && /tmp/qtvenv/bin/python tests/data/make_qtorch_golden.py

What it writes: for each (exp, man) in FORMATS, `x_e{exp}m{man}` (uint32 float32
bit patterns of the inputs, sorted, unique) and `y_e{exp}m{man}` (uint32 bit
patterns of `qtorch.quant.float_quantize(x, exp, man, rounding="nearest")` on a
contiguous CPU float32 tensor), plus `formats` (int32, (n, 2): exp, man) and
`versions` (strings: qtorch, torch, numpy versions, the platform). The inputs are
deterministic (fixed seeds; they depend only on numpy's PCG64 generator).

Only rounding="nearest": QPyTorch's "stochastic" draws its random bits from a
global std::mt19937 seeded by std::random_device (quant_cpu.cpp), so its outputs
cannot be reproduced bit for bit.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import numpy as np

U32 = np.uint32
FORMATS = [(4, 3), (5, 2), (5, 10), (3, 4), (2, 1), (6, 9), (8, 7), (3, 0), (2, 3), (7, 5)]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qtorch_0_3_0_nearest.npz")

N_RANDOM_BITS = 3000      # uniform uint32 patterns (NaN, inf, subnormals included)
N_LOG_UNIFORM = 2000      # values log-uniform over the format's whole range
MAX_NORMAL_MIDPOINTS = 1000
MAX_SUBNORMAL_MIDPOINTS = 500
MIN_MAGNITUDES = 11000    # small formats: log-uniform values fill up to this many

SPECIALS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
    0xFF800001, 0x7FBFFFFF, 0xFFBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFA00000, 0x7FFFF000,
    0x7FC00001, 0x00000001, 0x80000001, 0x00000002, 0x007FFFFF, 0x807FFFFF, 0x00400000,
    0x80400000, 0x00800000, 0x80800000, 0x00800001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,
    0x7F7F7FFF, 0x7F7F0000, 0x00000100, 0x3F800000, 0xBF800000, 0x3F800001, 0x3F7FFFFF,
]


def _both_signs(u: np.ndarray) -> np.ndarray:
  u = np.asarray(u, np.uint64).astype(U32)
  return np.concatenate([u & U32(0x7FFFFFFF), u | U32(0x80000000)])


def _around(u, radius: int) -> np.ndarray:
  """Bit patterns u + d for |d| <= radius (magnitudes, kept within [0, 0x7FFFFFFF])."""
  u = np.asarray(u, np.int64).reshape(-1, 1)
  d = np.arange(-radius, radius + 1, dtype=np.int64).reshape(1, -1)
  return np.clip(u + d, 0, 0x7FFFFFFF).ravel()


def _f32_bits(values) -> np.ndarray:
  """Bits of float64 values that are exactly float32 (asserted)."""
  v = np.asarray(values, np.float64)
  f = v.astype(np.float32)
  assert np.all(f.astype(np.float64) == v), "not exactly representable in float32"
  return f.view(U32).astype(np.int64)


def _pick(rng, n_total: int, n_max: int, must=()) -> np.ndarray:
  """All of range(n_total) if small enough, else `must` plus a random subset."""
  if n_total <= n_max:
    return np.arange(n_total)
  idx = rng.choice(n_total, size=n_max, replace=False)
  must = np.asarray([m for m in must if 0 <= m < n_total], np.int64)
  return np.unique(np.concatenate([idx, must]))


def make_inputs(exp: int, man: int) -> np.ndarray:
  """Deterministic uint32 input bit patterns for one format (sorted, unique).

  Every magnitude below is taken with both signs (so the counts double).
  """
  rng = np.random.default_rng(1000 * exp + man)
  s = 23 - man
  half = 1 << (s - 1)
  bias = 2 ** (exp - 1) - 1
  emin, emax = 1 - bias, bias + 1        # QPyTorch: no exponent reserved
  emin_e8 = emin + 127
  top_e8 = min(emax + 127 + 1, 254)      # one binade past the saturation edge
  parts = [np.asarray(SPECIALS, np.int64)]

  # Random bit patterns: everything, NaN payloads / inf / float32 subnormals included.
  parts.append(rng.integers(0, 1 << 32, N_RANDOM_BITS, dtype=np.uint64).astype(np.int64))

  # NaNs: random payloads, and those whose fraction is within a few units of the
  # wrap-around of the rounding add (fraction + 2^(s-1) >= 2^23), and near 0x7F800001.
  nan_frac = rng.integers(1, 1 << 23, 200, dtype=np.int64)
  wrap = (1 << 23) - half
  near = np.concatenate([np.arange(1, 9), np.arange(wrap - 8, wrap + 9), np.arange((1 << 23) - 9, 1 << 23)])
  near = near[(near >= 1) & (near < (1 << 23))]
  parts.append(0x7F800000 + np.concatenate([nan_frac, near]))

  # float32 subnormals: random, and the edges.
  parts.append(rng.integers(1, 1 << 23, 400, dtype=np.int64))
  parts.append(np.concatenate([np.arange(1, 33), np.arange((1 << 23) - 32, (1 << 23) + 33)]))

  # Normal range: midpoints (ties) between neighbouring grid values, and the grid
  # values, with +-1 float32 ulp, for every binade from 2^emin to one past the top.
  n_frac = 1 << man
  n_bin = top_e8 - emin_e8 + 1
  must = sorted({0, 1, n_frac - 1})  # the ends of every binade
  must = [b * n_frac + k for b in range(n_bin) for k in must]
  idx = _pick(rng, n_bin * n_frac, MAX_NORMAL_MIDPOINTS, must)
  e8, k = emin_e8 + idx // n_frac, idx % n_frac
  grid = (e8 << 23) + (k << s)
  parts.append(_around(grid + half, 1))
  parts.append(_around(grid, 1))
  # A few larger offsets around a subset of the ties (the half-ulp add's carry range).
  sub = grid[rng.choice(grid.size, size=min(grid.size, 300), replace=False)]
  parts.append(_around(sub + half, 4))

  # Format subnormal range |x| < 2^emin: grid step 2^(emin - man); its midpoints
  # (2j + 1) 2^(emin - man - 1) and grid values, +-2 float32 ulps.
  j = _pick(rng, n_frac, MAX_SUBNORMAL_MIDPOINTS, list(range(8)) + list(range(n_frac - 8, n_frac)))
  sub_mid = _f32_bits(np.ldexp(2.0 * j + 1, emin - man - 1))
  sub_grid = _f32_bits(np.ldexp(j.astype(np.float64), emin - man))
  parts.append(_around(sub_mid, 2))
  parts.append(_around(sub_grid[sub_grid > 0], 1))

  # Just below 2^emin: the double-rounding region of x + 2^emin. The top 200
  # float32 values below 2^emin, 2^emin and a few above, random values in the binade
  # below, and log-uniform values from 2^(emin - man - 3) up to 2^emin.
  edge = emin_e8 << 23
  parts.append(np.arange(max(edge - 200, 0), edge + 9))
  parts.append(((emin_e8 - 1) << 23) + rng.integers(0, 1 << 23, 800, dtype=np.int64)
               if emin_e8 > 1 else rng.integers(1, 1 << 23, 800, dtype=np.int64))
  lo = max(emin - man - 3, -149)
  v = np.exp2(rng.uniform(lo, emin, 800)).astype(np.float32)
  parts.append(v.view(U32).astype(np.int64))

  # Overflow edges: QPyTorch's max and max + half an ulp (the saturation tie), the
  # exponent-field edges 2^emax and 2^(emax + 1), and the IEEE-style max (emax - 1)
  # with its 2^(emax) tie; +-8 float32 ulps each. For exp = 8 the same expressions
  # land on float32's max and its inf edge.
  frac_max = ((1 << 23) - 1) >> s << s
  for e in {min(emax + 127, 254), min(bias + 127, 254)}:
    top = (e << 23) | frac_max
    parts.append(_around([top, top + half, e << 23, (e + 1) << 23], 8))

  # Log-uniform random values over the whole range, past both ends.
  lo = max(emin - man - 4, -149)
  hi = min(emax + 3, 127)
  v = np.exp2(rng.uniform(lo, hi, N_LOG_UNIFORM)).astype(np.float32)
  parts.append(v.view(U32).astype(np.int64))

  u = np.concatenate([np.asarray(p, np.int64).ravel() for p in parts])
  u = np.unique(u[(u >= 0) & (u < (1 << 32))].astype(np.uint64).astype(U32) & U32(0x7FFFFFFF))
  # Small formats have few ties: fill up with more log-uniform values.
  if u.size < MIN_MAGNITUDES:
    v = np.exp2(rng.uniform(lo, hi, MIN_MAGNITUDES - u.size)).astype(np.float32)
    u = np.concatenate([u, v.view(U32)])
  return np.unique(_both_signs(u))


def main() -> None:
  import torch
  from qtorch.quant import float_quantize  # JIT-builds the C++ extension the first time

  out = {}
  for exp, man in FORMATS:
    x = make_inputs(exp, man)
    t = torch.from_numpy(x.view(np.float32).copy())
    assert t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
    y = float_quantize(t, exp, man, rounding="nearest").numpy().view(U32).copy()
    # The input must come back untouched (no payload canonicalisation on the way in).
    assert np.array_equal(t.numpy().view(U32), x)
    out[f"x_e{exp}m{man}"] = x
    out[f"y_e{exp}m{man}"] = y
    print(f"e{exp}m{man}: {x.size} inputs, {int(np.isnan(y.view(np.float32)).sum())} NaN outputs")
  out["formats"] = np.asarray(FORMATS, np.int32)
  out["versions"] = np.asarray([
      f"qtorch=={importlib.metadata.version('qtorch')}",
      f"torch=={torch.__version__}",
      f"numpy=={np.__version__}",
      f"python=={platform.python_version()}",
      f"platform={platform.platform()}",
      f"torch.get_num_threads()={torch.get_num_threads()}",
      "rounding=nearest",
  ])
  np.savez_compressed(OUT, **out)
  print(f"wrote {OUT}: {os.path.getsize(OUT)} bytes; versions: {list(out['versions'])}")


if __name__ == "__main__":
  sys.exit(main())
