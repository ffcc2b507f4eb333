"""Block formats with a power-of-two scale per group: `BFPFormat` (BFPsim / FlexBlock) and
`MXFormat` (OCP Microscaling).

References:
  BFPsim / FlexBlock: Noh et al., IEEE Trans. Computers 72(9), 2023 (arXiv:2203.06673).
  OCP Microscaling Formats (MX) Specification v1.0, 2023.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import ml_dtypes
import numpy as np

from jlp.formats.float_format import (ROUNDINGS, FloatFormat, Rounding, _check_choice, _check_int,
                                      _invalid)

BFP_ROUNDINGS = ROUNDINGS
#: MXFormat.scale_mode: torchao's ScaleCalculationMode of the same name ("floor": the OCP rule).
MX_SCALE_MODES = ("floor", "rceil", "ceil", "even")


@dataclasses.dataclass(frozen=True)
class BFPFormat:
  """Block floating point: groups sharing one power-of-two exponent (BFPsim / FlexBlock).

  Attributes:
    man: magnitude bits per element, 1..24, counting the leading one of the
      group's largest element (BFPsim's `*_bit`; the sign is extra).
    block: group shape, one entry per axis of the array it quantizes. A group is
      an axis-aligned box in the array's own layout; the last group along an axis
      may be smaller (BFPsim's `*_dim`).
    rounding: "truncate" (BFPsim bit for bit: magnitudes truncated toward zero,
      elements below the grid become +0), "nearest" (ties to even on the same grid;
      a value rounding past the largest grid point is clamped to it) or
      "stochastic" (on the same grid, random bits as `FloatFormat`).

  In a group whose largest float32 exponent E is that of a normal number, every
  finite element becomes sign * n * 2^(E - man + 1) with 0 <= n < 2^man (a zero
  result is +0.0); groups of only zeros and float32 subnormals are unchanged.
  With "truncate", groups holding inf/NaN and float32-subnormal elements follow
  BFPsim's bit rule exactly (see `jlp.numerics.bfp`).
  """

  man: int
  block: tuple[int, ...]
  rounding: Rounding = "truncate"

  def __post_init__(self):
    _check_int("man", self.man, 1, 24)
    if isinstance(self.block, (int, np.integer)):
      object.__setattr__(self, "block", (self.block,))
    if not isinstance(self.block, (tuple, list)) or not self.block:
      raise _invalid("block", self.block, "a non-empty tuple of ints >= 1, one per axis")
    object.__setattr__(self, "block", tuple(self.block))
    for b in self.block:
      if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
        raise _invalid("block", self.block, "a non-empty tuple of ints >= 1, one per axis")
    object.__setattr__(self, "block", tuple(int(b) for b in self.block))
    _check_choice("rounding", self.rounding, BFP_ROUNDINGS)

  def check_rank(self, ndim: int) -> None:
    if len(self.block) != ndim:
      raise ValueError(f"block={self.block!r} has {len(self.block)} entries but the array has "
                       f"ndim={ndim}; expected one block entry per axis.")

  def representable_in(self, dtype) -> bool:
    info = ml_dtypes.finfo(dtype)
    return int(info.nexp) == 8 and self.man <= int(info.nmant) + 1

  def __repr__(self) -> str:
    r = "" if self.rounding == "truncate" else f", rounding={self.rounding!r}"
    return f"BFPFormat(man={self.man}, block={self.block}{r})"


INT8 = "int8"


@dataclasses.dataclass(frozen=True)
class MXFormat:
  """OCP Microscaling (MX v1.0): an E8M0 scale per `block` elements along `axis`.

  Attributes:
    elem: the element format: a FloatFormat (or a name for `FloatFormat.from_name`,
      e.g. "float8_e4m3fn", "float6_e2m3fn", "float4_e2m1fn") or "int8" (MXINT8:
      two's complement with an implicit 2^-6 scale, -128 unused).
    block: elements per scale (32 in the OCP formats).
    axis: the axis the blocks run along; the last block is zero-padded.
    scale_mode: how the shared exponent is chosen, torchao's `ScaleCalculationMode` of the same
      name bit for bit: "floor" (the OCP rule, below), "rceil", "ceil" or "even" (see
      `jlp.numerics.mx`).
    prescale: p, a float32 in (0, 1] (default 1.0: plain OCP MX). The shared exponent is chosen
      from the block as given; the elements are then multiplied by p before the element cast and
      divided by p after it, so the block's effective scale is 2^shared_exp / p:
        value = fl32(fl32(elem(fl32(x · p) / 2^shared_exp) · 2^shared_exp) / p)
      (one IEEE float32 multiply and one division, subnormals exact; the power-of-two scalings
      as without p). p = 0.75 is Tseng et al.'s scaling for stochastic rounding (Tseng, Yu,
      Park, "Training LLMs with MXFP4", arXiv:2502.20586; in their code,
      amazon-science/mxfp4-llm, microxcaling's `dither_scale` rounding quantizes
      3·x / 2^(shared_exp + 2) and multiplies the result by 2^(shared_exp + 2) / 3: the same
      float32 values wherever no intermediate is a float32 subnormal or overflows; the random
      draws are jlp's). With the "floor" exponent max|x| / 2^shared_exp < 2^(emax + 1), so
      p·|x| / 2^shared_exp stays below 0.75 · 8 = 6 = max(E2M1): no element is clipped, and
      stochastic rounding stays unbiased (E[elem(v)] = v, v = fl32(x · p) / 2^shared_exp).

  Scale exponent ("floor") = floor(log2(max|x| in block)) - emax(elem), clamped below at
  -127; elements are rounded with the element format's rounding and clamped to
  ±max(elem) (OCP: saturating); a block holding inf or NaN becomes all NaN.
  """

  elem: Union[FloatFormat, str]
  block: int = 32
  axis: int = -1
  scale_mode: str = "floor"
  prescale: float = 1.0

  def __post_init__(self):
    if isinstance(self.elem, str) and self.elem.lower() != INT8:
      object.__setattr__(self, "elem", FloatFormat.from_name(self.elem))
    elif isinstance(self.elem, str):
      object.__setattr__(self, "elem", INT8)
    elif not isinstance(self.elem, FloatFormat):
      raise _invalid("elem", self.elem, "a FloatFormat, a format name or 'int8'")
    if isinstance(self.elem, FloatFormat) and self.elem.compat is not None:
      raise _invalid("elem", self.elem, "a FloatFormat with compat=None")
    _check_int("block", self.block, 1, 2 ** 20)
    if isinstance(self.axis, bool) or not isinstance(self.axis, (int, np.integer)):
      raise _invalid("axis", self.axis, "an int")
    _check_choice("scale_mode", self.scale_mode, MX_SCALE_MODES)
    p = self.prescale
    if (isinstance(p, bool) or not isinstance(p, (int, float, np.floating)) or not 0 < p <= 1
        or float(np.float32(p)) != float(p)):
      raise _invalid("prescale", p, "a float32 in (0, 1], e.g. 0.75 (Tseng et al.) or 1.0 (none)")
    object.__setattr__(self, "prescale", float(p))

  @property
  def elem_emax(self) -> int:
    return 0 if self.elem == INT8 else self.elem.emax

  @property
  def elem_max(self) -> float:
    return 127 / 64 if self.elem == INT8 else self.elem.max

  @property
  def rounding(self) -> str:
    return "nearest" if self.elem == INT8 else self.elem.rounding

  def check_rank(self, ndim: int) -> None:
    if not -ndim <= self.axis < ndim:
      raise ValueError(f"axis={self.axis!r} is out of range for an array with ndim={ndim}.")

  def representable_in(self, dtype) -> bool:
    info = ml_dtypes.finfo(dtype)
    if self.prescale != 1.0:  # q · 2^shared_exp / p: any float32
      return int(info.nexp) == 8 and int(info.nmant) >= 23
    elem_man, elem_low = (6, -6) if self.elem == INT8 else (self.elem.man, self.elem.emin - self.elem.man)
    return (int(info.nexp) == 8 and elem_man <= int(info.nmant)
            and elem_low - 127 >= int(np.log2(float(info.smallest_subnormal))))

  def __repr__(self) -> str:
    e = "int8" if self.elem == INT8 else self.elem.name
    mode = "" if self.scale_mode == "floor" else f", scale_mode={self.scale_mode!r}"
    if self.prescale != 1.0:
      mode += f", prescale={self.prescale!r}"
    return f"MXFormat(elem={e}, block={self.block}, axis={self.axis}{mode})"
