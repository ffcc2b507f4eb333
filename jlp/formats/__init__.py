"""Number formats: custom floats, block floating point, OCP microscaling, NVFP4 and block-scaled
FP8.

Formats are frozen, hashable dataclasses so that they can be static arguments of jitted functions
and `jax.custom_vjp` rules. They only describe a format and check that the description is valid;
the arithmetic lives in `jlp.numerics`. Modules: `float_format` (FloatFormat), `block`
(BFPFormat, MXFormat: a power-of-two scale per group), `scaled` (NVFP4Format, BlockScaledFormat:
a float scale per block).
"""

from __future__ import annotations

from typing import Any, Union

from jlp.formats.block import BFP_ROUNDINGS, INT8, MX_SCALE_MODES, BFPFormat, MXFormat
from jlp.formats.float_format import (COMPATS, OVERFLOWS, ROUNDINGS, SPECIALS, FloatFormat,
                                      Rounding, _invalid)
from jlp.formats.scaled import SCALE_RULES, TENSOR_BLOCK, BlockScaledFormat, NVFP4Format

__all__ = ["BFPFormat", "BlockScaledFormat", "FloatFormat", "Format", "MXFormat", "NVFP4Format",
           "TENSOR_BLOCK", "as_format"]

Format = Union[FloatFormat, BFPFormat, MXFormat, NVFP4Format, BlockScaledFormat]
_FORMAT_TYPES = (FloatFormat, BFPFormat, MXFormat, NVFP4Format, BlockScaledFormat)


def as_format(fmt: Any, field: str = "fmt") -> Format:
  """Accepts a format object or a FloatFormat name."""
  if isinstance(fmt, _FORMAT_TYPES):
    return fmt
  if isinstance(fmt, str):
    return FloatFormat.from_name(fmt)
  raise _invalid(field, fmt, "a FloatFormat, BFPFormat, MXFormat, NVFP4Format, "
                 "BlockScaledFormat or a format name")
