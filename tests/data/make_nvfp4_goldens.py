"""Writes tests/data/nvfp4_torchao.npz: torchao 0.18's NVFP4 on CPU (tests/numerics/nvfp4_test.py).

Run in an environment with torch (CPU) and torchao 0.18 (not jlp's):
  python tests/data/make_nvfp4_goldens.py

For each deterministic input `x_<name>` (float32) and each level (`single`: no per-tensor scale;
`two`: per_tensor_scale = per_tensor_amax_to_scale(max |x|), torchao's dynamic per-tensor scale),
the file holds `nvfp4_quantize(x, 16, per_tensor_scale)` as torchao returns it (`<level>_<name>_
qdata`: packed uint8, element 2i in the low nibble; `<level>_<name>_scale`: the float8_e4m3fn
scales' bytes) and `NVFP4Tensor.to_nvfp4(x, per_tensor_scale=...).dequantize(torch.float32)`
(`<level>_<name>_dequant`), plus the versions in `versions`.
"""

import pathlib

import numpy as np
import torch
import torchao
from torchao.prototype.mx_formats.nvfp4_tensor import (NVFP4Tensor, nvfp4_quantize,
                                                       per_tensor_amax_to_scale)

F32_MAX = np.finfo(np.float32).max


def inputs() -> dict:
  """Deterministic (16, 128) inputs (one compiled shape in the test) and a 3-D one."""
  rng = np.random.default_rng(2509)
  boundary = np.empty(128, np.float32)
  base = np.linspace(-12.0, 12.0, 64, dtype=np.float32)  # TE's boundary-value test row
  boundary[0::2], boundary[1::2] = base - np.float32(1e-3), base + np.float32(1e-3)
  shape = (16, 128)
  tiny = rng.standard_normal(shape) * 2.0 ** rng.integers(-150, -100, shape)
  wide = rng.standard_normal(shape) * 2.0 ** rng.integers(-60, 60, shape)
  specials = rng.standard_normal(shape).astype(np.float32)
  specials[0, 3], specials[2, 17], specials[5, 5] = np.nan, -np.inf, -np.nan
  specials[7, :16] = 0.0
  return {
      "randn": rng.standard_normal(shape).astype(np.float32),
      "boundary": np.tile(boundary, (16, 1)),
      "zeros": np.zeros(shape, np.float32),
      "maxima": np.full(shape, F32_MAX, np.float32),
      "tiny": tiny.astype(np.float32),
      "wide": wide.astype(np.float32),
      "specials": specials,
      "batched": rng.standard_normal((2, 8, 128)).astype(np.float32),
  }


def main() -> None:
  out = {"versions": np.array([f"torch {torch.__version__}", f"torchao {torchao.__version__}"])}
  for name, x in inputs().items():
    out[f"x_{name}"] = x
    t = torch.from_numpy(x)
    for level in ("single", "two"):
      pts = per_tensor_amax_to_scale(torch.max(torch.abs(t))) if level == "two" else None
      scale, qdata = nvfp4_quantize(t, 16, pts)
      deq = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=pts).dequantize(torch.float32)
      out[f"{level}_{name}_qdata"] = qdata.numpy()
      out[f"{level}_{name}_scale"] = scale.view(torch.uint8).numpy()
      out[f"{level}_{name}_dequant"] = deq.numpy()
  path = pathlib.Path(__file__).with_name("nvfp4_torchao.npz")
  np.savez_compressed(path, **out)
  print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
  main()
