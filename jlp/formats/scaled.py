"""Formats with a float scale per block: `NVFP4Format` (NVIDIA's FP4 with E4M3 block scales and a
per-tensor scale) and `BlockScaledFormat` (DeepSeek-V3's fine-grained FP8; TransformerEngine's
Float8BlockScaling).

Both view an array as a matrix: `axis` is moved last and the other axes are flattened into rows,
as TransformerEngine's quantizers see a 2-D tensor. A block of shape (r, c) then covers r
consecutive rows and c consecutive elements along `axis`.

References:
  NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, 2025.
  DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024, §3.3.
  NVIDIA TransformerEngine (NVFP4QuantizerRef, Float8BlockQuantizer); pytorch/ao
    (torchao.prototype.mx_formats.nvfp4_tensor).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import ml_dtypes
import numpy as np

from jlp.formats.float_format import FloatFormat, _check_choice, _invalid

NVFP4_BLOCKS = ((1, 16), (16, 16))
NVFP4_ROUNDINGS = ("nearest", "stochastic")
NVFP4_COMPATS = (None, "torchao")
#: BlockScaledFormat.scale_rule values (its docstring).
SCALE_RULES = ("divide", "reciprocal")
#: A BlockScaledFormat block covering any tensor (each entry is capped at the matrix's extent):
#: one scale per tensor.
TENSOR_BLOCK = (2 ** 31 - 1, 2 ** 31 - 1)


def _check_axis(axis) -> None:
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise _invalid("axis", axis, "an int")


def _check_block(block, allowed: str) -> tuple[int, int]:
  if (not isinstance(block, (tuple, list)) or len(block) != 2 or
      any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in block)):
    raise _invalid("block", block, allowed)
  return tuple(int(b) for b in block)


def _check_rank(axis: int, ndim: int) -> None:
  if ndim < 1 or not -ndim <= axis < ndim:
    raise ValueError(f"axis={axis!r} is out of range for an array with ndim={ndim}.")


@dataclasses.dataclass(frozen=True)
class NVFP4Format:
  """NVFP4: E2M1 elements, an E4M3 scale per block of 16 and an optional float32 per-tensor scale.

  Attributes:
    block: (1, 16) (one scale per 16 elements along `axis`) or (16, 16) (one per 16 x 16 tile,
      TransformerEngine's 2-D weight quantization). Partial blocks are zero-padded.
    axis: the axis the 16 elements run along (moved last; the other axes are the rows).
    tensor_scale: two-level scaling: a float32 per-tensor scale from the tensor's amax
      (False: single level, the E4M3 scale alone; compat="torchao" only).
    rounding: "nearest" (ties to even) or "stochastic" (unbiased on the E2M1 grid; needs a key).
    rht: TransformerEngine's 16-point random Hadamard transform along `axis` before the amax
      and the quantization; `quantize` maps the decoded values back (compat=None, block (1, 16)).
    compat: None (TransformerEngine's `NVFP4QuantizerRef`) or "torchao" (torchao's
      `nvfp4_quantize` / `NVFP4Tensor.dequantize`; block (1, 16), nearest, no RHT).

  The exact operation order of each variant is in `jlp.numerics.nvfp4`.
  """

  block: tuple[int, int] = (1, 16)
  axis: int = -1
  tensor_scale: bool = True
  rounding: str = "nearest"
  rht: bool = False
  compat: Optional[str] = None

  def __post_init__(self):
    block = _check_block(self.block, "(1, 16) or (16, 16)")
    if block not in NVFP4_BLOCKS:
      raise _invalid("block", self.block, "(1, 16) or (16, 16)")
    object.__setattr__(self, "block", block)
    _check_axis(self.axis)
    for name in ("tensor_scale", "rht"):
      if not isinstance(getattr(self, name), bool):
        raise _invalid(name, getattr(self, name), "True or False")
    _check_choice("rounding", self.rounding, NVFP4_ROUNDINGS)
    _check_choice("compat", self.compat, NVFP4_COMPATS)
    if self.compat is None and not self.tensor_scale:
      raise _invalid("tensor_scale", self.tensor_scale,
                     "True with compat=None (TransformerEngine always scales per tensor; "
                     "single-level NVFP4 is compat='torchao')")
    if self.compat == "torchao":
      for name, value, default in (("block", self.block, (1, 16)), ("rht", self.rht, False),
                                   ("rounding", self.rounding, "nearest")):
        if value != default:
          raise _invalid(name, value, f"{default!r} with compat='torchao' (torchao's NVFP4 has "
                         "1x16 blocks, round-to-nearest and no Hadamard transform)")
    if self.rht and self.block != (1, 16):
      raise _invalid("rht", self.rht, "False with block=(16, 16) (TransformerEngine applies the "
                     "Hadamard transform to 1x16-block operands only)")

  elem = FloatFormat.from_name("float4_e2m1fn")
  scale_format = FloatFormat.from_name("float8_e4m3fn")

  def check_rank(self, ndim: int) -> None:
    _check_rank(self.axis, ndim)

  def representable_in(self, dtype) -> bool:
    del dtype  # products of E2M1, E4M3 and a float32 scale: float32 only
    return False

  def __repr__(self) -> str:
    fields = [f"block={self.block}"]
    for f in dataclasses.fields(self)[1:]:
      v = getattr(self, f.name)
      if v != f.default:
        fields.append(f"{f.name}={v!r}")
    return "NVFP4Format(" + ", ".join(fields) + ")"


@dataclasses.dataclass(frozen=True)
class BlockScaledFormat:
  """A float32 scale per block, elements in a float format (DeepSeek-V3's fine-grained FP8).

  Attributes:
    elem: the element format (a FloatFormat or a name, default "float8_e4m3fn"); rounded to
      nearest even and saturated to ±elem.max.
    block: (rows, elements along `axis`): (1, 128) for activations and gradients, (128, 128)
      for weights; a partial edge block uses its own amax.
    axis: the axis the block's second entry runs along (moved last; the other axes are rows).
    pow2_scale: round the scale up to a power of two, s = 2^ceil(log2(amax / elem.max))
      ("divide"; "reciprocal": the multiplier rounded down to a power of two, TE's
      `force_pow_2_scales`).
    scale_rule: "divide" (DeepSeek-V3's rule): s = amax_block / elem.max (a float32 division;
      s = 1 for an all-zero block) and the value is float32(elem(x / s)) * s. "reciprocal"
      (TransformerEngine's `compute_scale_from_amax`, shared by Float8CurrentScaling and
      Float8BlockScaling): the multiplier m = elem.max / amax_block (a float32 division; 1 for
      an all-zero block, float32's max where the quotient overflows), the value
      float32(elem(x * m)) * float32(1 / m). The two can differ in the last bit of a value
      (`jlp.numerics.block_scaled`).

  A block of `TENSOR_BLOCK` covers the whole tensor: one scale per tensor (per-tensor "current"
  scaling, TransformerEngine's Float8CurrentScaling with scale_rule="reciprocal").
  """

  elem: Union[FloatFormat, str] = "float8_e4m3fn"
  block: tuple[int, int] = (1, 128)
  axis: int = -1
  pow2_scale: bool = False
  scale_rule: str = "divide"

  def __post_init__(self):
    if isinstance(self.elem, str):
      object.__setattr__(self, "elem", FloatFormat.from_name(self.elem))
    if not isinstance(self.elem, FloatFormat) or self.elem.compat is not None:
      raise _invalid("elem", self.elem, "a FloatFormat with compat=None, or a format name")
    if self.elem.rounding != "nearest":
      raise _invalid("elem", self.elem, "a FloatFormat with rounding='nearest' (block-scaled "
                     "elements round to nearest even)")
    object.__setattr__(self, "block", _check_block(self.block, "a pair of ints >= 1, e.g. "
                                                   "(1, 128) or (128, 128)"))
    _check_axis(self.axis)
    if not isinstance(self.pow2_scale, bool):
      raise _invalid("pow2_scale", self.pow2_scale, "True or False")
    _check_choice("scale_rule", self.scale_rule, SCALE_RULES)

  rounding = "nearest"

  def check_rank(self, ndim: int) -> None:
    _check_rank(self.axis, ndim)

  def representable_in(self, dtype) -> bool:
    del dtype  # elem x a float32 scale: float32 only
    return False

  def __repr__(self) -> str:
    block = "TENSOR_BLOCK" if self.block == TENSOR_BLOCK else str(self.block)
    return (f"BlockScaledFormat(elem={self.elem.name}, block={block}, axis={self.axis}"
            + (", pow2_scale=True" if self.pow2_scale else "")
            + (f", scale_rule={self.scale_rule!r}" if self.scale_rule != "divide" else "") + ")")
