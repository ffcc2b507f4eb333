"""`FloatFormat`: any float with up to 8 exponent and 23 mantissa bits, emulated in float32, and the
argument checks the other formats share.

References:
  CPD: Han, Demmel, You, "Auto-Precision Scaling for Distributed Deep Learning"
    (arXiv:1911.08907) and github.com/drcut/CPD.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, Union

import ml_dtypes
import numpy as np

Rounding = Literal["nearest", "stochastic", "truncate"]
ROUNDINGS = ("nearest", "stochastic", "truncate")
OVERFLOWS = ("inf", "saturate")
SPECIALS = ("ieee", "nan_only", "none")
COMPATS = (None, "cpd", "qtorch")


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def _check_int(field: str, value: Any, lo: int, hi: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise _invalid(field, value, f"an int in [{lo}, {hi}]")
  if not lo <= value <= hi:
    raise _invalid(field, value, f"an int in [{lo}, {hi}]")


def _check_choice(field: str, value: Any, choices: tuple) -> None:
  if value not in choices:
    raise _invalid(field, value, "one of " + ", ".join(repr(c) for c in choices))


def _fmt_num(v: float) -> str:
  return f"{v:.6g}"


# ml_dtypes float types and the FloatFormat arguments with exactly their semantics.
_ML_DTYPES_FORMATS = {
    "bfloat16": (8, 7, "ieee"),
    "float16": (5, 10, "ieee"),
    "float8_e5m2": (5, 2, "ieee"),
    "float8_e4m3": (4, 3, "ieee"),
    "float8_e3m4": (3, 4, "ieee"),
    "float8_e4m3fn": (4, 3, "nan_only"),
    "float6_e3m2fn": (3, 2, "none"),
    "float6_e2m3fn": (2, 3, "none"),
    "float4_e2m1fn": (2, 1, "none"),
}
_UNSUPPORTED_ML_DTYPES = {
    "float8_e4m3fnuz": "it has a non-standard bias and no negative zero",
    "float8_e5m2fnuz": "it has a non-standard bias and no negative zero",
    "float8_e4m3b11fnuz": "it has a non-standard bias and no negative zero",
    "float8_e8m0fnu": "it is an unsigned power-of-two scale type (used inside MXFormat)",
}


@dataclasses.dataclass(frozen=True)
class FloatFormat:
  """A binary floating-point format with `exp` exponent and `man` mantissa bits.

  Values are emulated in float32: `jlp.quantize(x, fmt)` returns the float32
  value of x rounded to this format.

  Attributes:
    exp: exponent bits, 2..8. The bias is 2^(exp-1) - 1.
    man: stored mantissa (fraction) bits, 0..23.
    rounding: "nearest" (ties to even, as ml_dtypes; with man = 0 a tie between
      2^e and 2^(e+1) goes up, the significand 1 being odd), "stochastic"
      (round up with probability equal to the dropped fraction, resolved to
      2^-32) or "truncate" (toward zero; as IEEE 754 roundTowardZero a finite
      value past the largest finite one becomes the largest finite one).
    overflow: "inf" (as ml_dtypes casts: past max finite gives ±inf, or NaN for
      "nan_only", or ±max for "none") or "saturate" (clamp to ±max finite; ±inf
      inputs become ±max too; NaN stays NaN where the format has one).
    subnormals: False flushes nonzero results below the smallest normal to a zero
      of the same sign (after rounding as if subnormals existed).
    specials: "ieee" (top exponent reserved for ±inf/NaN), "nan_only" (no inf;
      the all-ones encoding is NaN, as float8_e4m3fn) or "none" (every encoding
      finite, as float6_e2m3fn / float4_e2m1fn; NaN becomes a zero, as ml_dtypes).
    compat: None, "cpd" (CPD's float_quantize bit for bit, quirks included; see
      docs of `jlp.numerics.float_cast`) or "qtorch" (QPyTorch 0.3 float_quantize).
  """

  exp: int
  man: int
  rounding: Rounding = "nearest"
  overflow: Literal["inf", "saturate"] = "inf"
  subnormals: bool = True
  specials: Literal["ieee", "nan_only", "none"] = "ieee"
  compat: Literal["cpd", "qtorch"] | None = None

  def __post_init__(self):
    _check_int("exp", self.exp, 2, 8)
    _check_int("man", self.man, 0, 23)
    _check_choice("rounding", self.rounding, ROUNDINGS)
    _check_choice("overflow", self.overflow, OVERFLOWS)
    _check_choice("specials", self.specials, SPECIALS)
    _check_choice("compat", self.compat, COMPATS)
    if not isinstance(self.subnormals, bool):
      raise _invalid("subnormals", self.subnormals, "True or False")
    if self.exp == 8 and self.specials != "ieee":
      raise _invalid("specials", self.specials,
                     "'ieee' when exp=8 (float32 cannot hold a larger exponent range)")
    if self.compat is not None:
      default = dict(overflow="inf", subnormals=True, specials="ieee")
      changed = [k for k, v in default.items() if getattr(self, k) != v]
      if changed:
        raise _invalid(changed[0], getattr(self, changed[0]),
                       f"the default ({default[changed[0]]!r}) with compat={self.compat!r}")
    if self.compat == "cpd":
      if self.rounding != "nearest":
        raise _invalid("rounding", self.rounding, "'nearest' with compat='cpd' (CPD has no other mode)")
      if self.man == 23 and self.exp != 8:
        raise _invalid("man", self.man, "man <= 22 with compat='cpd' and exp < 8 "
                       "(CPD evaluates 1 << -1 there, undefined behaviour)")
    if self.compat == "qtorch":
      if self.rounding == "truncate":
        raise _invalid("rounding", self.rounding,
                       "'nearest' or 'stochastic' with compat='qtorch'")
      if self.man == 23:
        raise _invalid("man", self.man, "man <= 22 with compat='qtorch' "
                       "(QPyTorch evaluates 1 << -1 there, its issue #48)")

  @classmethod
  def from_name(cls, name: str, **kwargs) -> "FloatFormat":
    """A format from a name: "e4m3"-style (IEEE-like) or an ml_dtypes type name.

    ml_dtypes names give exactly that type's semantics ("float8_e4m3fn": NaN only,
    max 448; "float4_e2m1fn": no inf, no NaN). Keyword arguments override fields.
    """
    if not isinstance(name, str):
      raise _invalid("name", name, "a string such as 'e4m3' or 'float8_e4m3fn'")
    key = name.strip().lower()
    m = re.fullmatch(r"e(\d+)m(\d+)", key)
    if m:
      return cls(int(m.group(1)), int(m.group(2)), **kwargs)
    if key in _ML_DTYPES_FORMATS:
      exp, man, specials = _ML_DTYPES_FORMATS[key]
      return cls(exp, man, **{"specials": specials, **kwargs})
    if key in _UNSUPPORTED_ML_DTYPES:
      raise ValueError(f"name={name!r} is not supported: {_UNSUPPORTED_ML_DTYPES[key]}.")
    raise _invalid("name", name, "'eXmY' (2 <= X <= 8, 0 <= Y <= 23) or one of "
                   + ", ".join(repr(n) for n in _ML_DTYPES_FORMATS))

  # -- properties -------------------------------------------------------------
  @property
  def bits(self) -> int:
    """Storage bits: sign + exponent + mantissa."""
    return 1 + self.exp + self.man

  @property
  def bias(self) -> int:
    return 2 ** (self.exp - 1) - 1

  @property
  def emin(self) -> int:
    """Exponent of the smallest normal number."""
    return 1 - self.bias

  @property
  def emax(self) -> int:
    """Exponent of the largest finite number."""
    if self.compat == "qtorch" or self.specials == "none":
      return self.bias + 1
    if self.specials == "nan_only":
      return self.bias + 1 if self.man > 0 else self.bias
    return self.bias

  @property
  def max(self) -> float:
    """The largest finite value."""
    if self.specials == "nan_only" and self.man > 0:
      return float(2.0 ** self.emax * (2 - 2.0 ** (1 - self.man)))
    return float(2.0 ** self.emax * (2 - 2.0 ** -self.man))

  @property
  def smallest_normal(self) -> float:
    return float(2.0 ** self.emin)

  @property
  def smallest_subnormal(self) -> float:
    """The smallest positive value (the smallest normal when there are no subnormals)."""
    if not self.subnormals:
      return self.smallest_normal
    return float(2.0 ** (self.emin - self.man))

  @property
  def eps(self) -> float:
    """Machine epsilon: the distance from 1 to the next larger value."""
    return float(2.0 ** -self.man)

  @property
  def has_inf(self) -> bool:
    if self.compat == "qtorch":  # QPyTorch saturates, except that exp=8 overflows float32 itself
      return self.exp == 8
    return self.specials == "ieee"

  @property
  def has_nan(self) -> bool:
    return self.specials != "none"

  @property
  def name(self) -> str:
    """The ml_dtypes type name when this format is exactly one, else "eXmY"."""
    dtype = self.ml_dtype
    return dtype.__name__ if dtype is not None else f"e{self.exp}m{self.man}"

  @property
  def ml_dtype(self) -> type | None:
    """The ml_dtypes / numpy type with exactly these semantics, if there is one."""
    if (self.rounding, self.overflow, self.subnormals, self.compat) != ("nearest", "inf", True, None):
      return None
    for name, args in _ML_DTYPES_FORMATS.items():
      if args == (self.exp, self.man, self.specials):
        return np.float16 if name == "float16" else getattr(ml_dtypes, name)
    return None

  @property
  def largest_output(self) -> float:
    """The largest finite value `quantize` can return (CPD's quirk A can exceed `max`)."""
    if self.compat == "cpd" and self.exp < 8:
      return float(2.0 ** (self.emax + 1))
    return self.max

  def representable_in(self, dtype) -> bool:
    """Whether every value this format produces is a value of `dtype`."""
    info = ml_dtypes.finfo(dtype)
    d_man, d_min_exp = int(info.nmant), int(np.log2(float(info.smallest_subnormal)))
    return (self.man <= d_man and self.emin - self.man >= d_min_exp
            and self.largest_output <= float(info.max))

  def __repr__(self) -> str:
    fields = [f"e{self.exp}m{self.man}"]
    if self.name != fields[0]:
      fields.append(self.name)
    for f in dataclasses.fields(self)[2:]:
      v = getattr(self, f.name)
      if v != f.default:
        fields.append(f"{f.name}={v!r}")
    fields.append(f"max={_fmt_num(self.max)}")
    return "FloatFormat(" + ", ".join(fields) + ")"
