"""Generates mx_scale_modes_torchao.npz: golden outputs of the REAL torchao 0.18.0 `to_mx`.

This script is a standalone tool, NOT part of the test suite (no test imports it; it needs torch
and torchao, which the jlp venv does not have). The test that uses its output is
`test_torchao_goldens` in tests/numerics/mx_test.py.

Re-creating the oracle venv (outside the repo; toolchain.md §5):

    /root/.pyenv/versions/3.11.7/bin/python3.11 -m venv /tmp/torchao_venv
    /tmp/torchao_venv/bin/pip install torch==2.13.0 torchao==0.18.0 numpy ml_dtypes

Running it (torchao logs that it cannot load its CUDA extensions; harmless on CPU):

    cd <repo> && /tmp/torchao_venv/bin/python tests/data/make_mx_scale_mode_goldens.py

What it writes, for each element dtype E in ELEMS: `x_E` (uint32 float32 bit patterns, (64, 32):
one MX block of 32 per row) and, for each mode M of torchao's ScaleCalculationMode, `y_E_M` (uint32
bit patterns of torchao's dequantized float32 values: `to_mx(x, dtype, 32, scaling_mode=M)` then
`to_dtype(..., torch.float32)`, i.e. element · 2^(scale - 127) in float32), plus `versions`.

The inputs are deterministic (numpy's PCG64, fixed seeds) and, by construction, avoid the corners
where jlp deliberately differs from torchao 0.18 (documented in `jlp.numerics.mx`): every block is
all zero, holds a NaN, or has its largest magnitude A in [2^-100, 2^100] (no clamped 2^-127
scale, no inf), and "rceil"'s quotient fl32(A / max) is a power of two or at least 2^-14 above one
in relative terms (torchao's float32 ceil(log2(.)) is exact there). Random blocks (normal values
with outliers, scales 2^-90..2^90, signed zeros) and boundary blocks: A a power of two, A at and
below "even"'s carry threshold (2 - 2^-(m+1)) · 2^k, A = max · 2^k and just below, saturating
tops, grid ties.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

import ml_dtypes
import numpy as np
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mx_scale_modes_torchao.npz")
ELEMS = {  # jlp element name: (torchao dtype, max, mantissa bits)
    "float8_e4m3fn": (torch.float8_e4m3fn, 448.0, 3),
    "float8_e5m2": (torch.float8_e5m2, 57344.0, 2),
    "float6_e2m3fn": ("fp6_e2m3", 7.5, 3),
    "float6_e3m2fn": ("fp6_e3m2", 28.0, 2),
    "float4_e2m1fn": (torch.float4_e2m1fn_x2, 6.0, 1),
}
MODES = ("floor", "ceil", "even", "rceil")
ROWS, BLOCK = 64, 32


def _grid(name: str) -> np.ndarray:
  dtype = getattr(ml_dtypes, name)
  v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
  return np.unique(v[np.isfinite(v) & (v >= 0)])


def make_inputs(name: str, seed: int) -> np.ndarray:
  _, largest, man = ELEMS[name]
  rng = np.random.default_rng(seed)
  f32 = np.float32
  x = rng.standard_normal((ROWS, BLOCK)) * 2.0 ** rng.integers(-90, 90, (ROWS, 1))
  x[rng.random((ROWS, BLOCK)) < 0.03] *= 64.0  # outliers
  x = x.astype(f32)
  x[rng.random((ROWS, BLOCK)) < 0.05] = 0.0
  x[rng.random((ROWS, BLOCK)) < 0.03] = -0.0
  grid = _grid(name)
  mids = (grid[:-1] + grid[1:]) / 2
  tops = []
  for k in (-60, -7, 0, 5, 70):
    tops += [2.0 ** k, 2.0 ** k * (2 - 2.0 ** -(man + 1)), largest * 2.0 ** k]
  for r, top in enumerate(tops):  # boundary rows, each also with its float32 neighbour below
    row = 2 * r
    t = f32(top)
    for i, amax in enumerate((t, np.nextafter(t, f32(0)))):
      scale = 2.0 ** (np.floor(np.log2(float(amax))) - np.floor(np.log2(largest)))
      ties = rng.choice(mids, BLOCK - 1) * scale * rng.choice([-1, 1], BLOCK - 1)
      x[row + i, 1:] = np.clip(ties, -float(amax), float(amax)).astype(f32)
      x[row + i, 0] = amax * rng.choice(np.array([-1, 1], f32))
  x[ROWS - 4] = 0.0
  x[ROWS - 4, ::2] = -0.0                                       # all-zero block, signed
  x[ROWS - 3, 7] = np.nan                                       # NaN block
  x[ROWS - 2] = f32(957.0 / 448 * largest) * rng.random(BLOCK).astype(f32)  # saturating tops
  x[ROWS - 2, 0] = f32(957.0 / 448 * largest)
  x[ROWS - 1] = np.linspace(-12, 12, BLOCK, dtype=f32)
  _check_corners(x, largest)
  return x


def _check_corners(x: np.ndarray, largest: float) -> None:
  """Asserts that no block is in a documented jlp-vs-torchao corner (module docstring)."""
  with np.errstate(invalid="ignore"):
    amax = np.abs(x.astype(np.float64)).max(axis=1)
  for a in amax[np.isfinite(amax) & (amax > 0)]:
    assert 2.0 ** -100 <= a <= 2.0 ** 100, a
    d = np.float32(a) / np.float32(largest)
    fraction = int(np.array(d).view(np.uint32)) & 0x7FFFFF
    assert fraction == 0 or fraction >= 1 << 9, (a, d)


def torchao_values(x: np.ndarray, name: str, mode: str) -> np.ndarray:
  dtype = ELEMS[name][0]
  t = torch.from_numpy(x.copy())
  scale, data = to_mx(t, dtype, BLOCK, scaling_mode=ScaleCalculationMode(mode))
  return to_dtype(data, scale, dtype, BLOCK, torch.float32).numpy()


def main() -> None:
  arrays = {}
  for seed, name in enumerate(ELEMS):
    x = make_inputs(name, seed)
    arrays[f"x_{name}"] = x.view(np.uint32)
    for mode in MODES:
      y = torchao_values(x, name, mode)
      assert y.shape == x.shape and y.dtype == np.float32
      arrays[f"y_{name}_{mode}"] = y.view(np.uint32)
  versions = {p: importlib.metadata.version(p) for p in ("torch", "torchao", "numpy", "ml_dtypes")}
  arrays["versions"] = np.array([f"{k}=={v}" for k, v in versions.items()] +
                                [platform.platform()])
  np.savez_compressed(OUT, **arrays)
  print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes): {sorted(arrays)}")


if __name__ == "__main__":
  main()
