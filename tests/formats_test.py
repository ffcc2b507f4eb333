"""FloatFormat / BFPFormat / MXFormat: validation, properties, names.

Reference values: ml_dtypes.finfo for the ml_dtypes types; cpd.md §1.3 for CPD's table.
"""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

from jlp import BFPFormat, FloatFormat, MXFormat

ML_NAMES = ["bfloat16", "float16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e3m4",
            "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"]


@pytest.mark.parametrize("name", ML_NAMES)
def test_properties_match_ml_dtypes_finfo(name):
  fmt = FloatFormat.from_name(name)
  dtype = np.float16 if name == "float16" else getattr(ml_dtypes, name)
  info = ml_dtypes.finfo(dtype)
  assert fmt.max == float(info.max)
  assert fmt.smallest_normal == float(info.smallest_normal)
  assert fmt.smallest_subnormal == float(info.smallest_subnormal)
  assert fmt.eps == float(info.eps)
  assert fmt.bits == info.bits
  assert fmt.emax == int(info.maxexp) - 1
  assert fmt.ml_dtype is dtype
  assert fmt.name == name
  assert name in repr(fmt)


def test_cpd_table_constants():
  """cpd.md §1.3."""
  e4m3, e5m2, e3m0, e5m10 = (FloatFormat(4, 3), FloatFormat(5, 2), FloatFormat(3, 0), FloatFormat(5, 10))
  assert (e4m3.max, e4m3.smallest_normal, e4m3.smallest_subnormal) == (240, 2 ** -6, 2 ** -9)
  assert (e5m2.max, e5m2.smallest_normal, e5m2.smallest_subnormal) == (57344, 2 ** -14, 2 ** -16)
  assert (e3m0.max, e3m0.smallest_normal, e3m0.smallest_subnormal) == (8, 0.25, 0.25)
  assert (e5m10.max, e5m10.smallest_subnormal) == (65504, 2 ** -24)
  assert FloatFormat(4, 3, compat="cpd").largest_output == 256
  assert FloatFormat(4, 3, compat="qtorch").max == 480
  assert FloatFormat(5, 2, compat="qtorch").max == 114688


def test_e_m_names_and_overrides():
  assert FloatFormat.from_name("e4m3") == FloatFormat(4, 3)
  assert FloatFormat.from_name("E5M2", rounding="stochastic") == FloatFormat(5, 2, rounding="stochastic")
  assert FloatFormat.from_name("float8_e4m3fn", overflow="saturate").specials == "nan_only"
  assert FloatFormat(4, 3, subnormals=False).smallest_subnormal == 2 ** -6


def test_formats_are_hashable_static_arguments():
  fmts = {FloatFormat(4, 3), FloatFormat(4, 3), BFPFormat(8, [1, 24, 3, 3]), MXFormat("float4_e2m1fn")}
  assert len(fmts) == 3
  assert BFPFormat(8, [1, 24]) == BFPFormat(8, (1, 24))
  with pytest.raises(dataclasses.FrozenInstanceError):
    FloatFormat(4, 3).man = 2
  f = jax.jit(lambda x, fmt: x * fmt.max, static_argnums=1)
  assert float(f(1.0, FloatFormat(4, 3))) == 240.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(exp=1, man=3), "exp"), (dict(exp=9, man=3), "exp"), (dict(exp=4, man=24), "man"),
    (dict(exp=4, man=-1), "man"), (dict(exp=4.0, man=3), "exp"), (dict(exp=True, man=3), "exp"),
    (dict(exp=4, man=3, rounding="up"), "rounding"), (dict(exp=4, man=3, overflow="nan"), "overflow"),
    (dict(exp=4, man=3, specials="fn"), "specials"), (dict(exp=4, man=3, compat="torch"), "compat"),
    (dict(exp=4, man=3, subnormals=1), "subnormals"), (dict(exp=8, man=3, specials="none"), "specials"),
    (dict(exp=4, man=3, compat="cpd", rounding="stochastic"), "rounding"),
    (dict(exp=4, man=23, compat="cpd"), "man"), (dict(exp=4, man=3, compat="qtorch", rounding="truncate"), "rounding"),
    (dict(exp=4, man=3, compat="cpd", overflow="saturate"), "overflow"),
])
def test_float_format_errors_name_the_field_value_and_allowed(kwargs, field):
  with pytest.raises(ValueError) as err:
    FloatFormat(**kwargs)
  msg = str(err.value)
  assert msg.startswith(f"{field}=") and "expected" in msg
  assert repr(kwargs[field]) in msg


def test_from_name_errors():
  with pytest.raises(ValueError, match="name='float7'.*expected"):
    FloatFormat.from_name("float7")
  with pytest.raises(ValueError, match="float8_e4m3fnuz.*not supported"):
    FloatFormat.from_name("float8_e4m3fnuz")
  with pytest.raises(ValueError, match="exp=9"):
    FloatFormat.from_name("e9m2")


def test_bfp_and_mx_validation():
  with pytest.raises(ValueError, match="man=0"):
    BFPFormat(0, (1, 4))
  with pytest.raises(ValueError, match="man=25"):
    BFPFormat(25, (1, 4))
  with pytest.raises(ValueError, match=r"block=\(1, 0\)"):
    BFPFormat(8, (1, 0))
  with pytest.raises(ValueError, match="block=()"):
    BFPFormat(8, ())
  with pytest.raises(ValueError, match="rounding='up'"):
    BFPFormat(8, (4,), rounding="up")
  with pytest.raises(ValueError, match="ndim=2"):
    BFPFormat(8, (1, 24, 3, 3)).check_rank(2)
  assert MXFormat("float8_e4m3fn").elem == FloatFormat.from_name("float8_e4m3fn")
  assert MXFormat("INT8").elem == "int8"
  assert MXFormat("int8").elem_max == 127 / 64
  with pytest.raises(ValueError, match="elem=3"):
    MXFormat(3)
  with pytest.raises(ValueError, match="block=0"):
    MXFormat("float8_e5m2", block=0)
  with pytest.raises(ValueError, match="axis=2"):
    MXFormat("float8_e5m2", axis=2).check_rank(2)


def test_representable_in():
  assert FloatFormat(4, 3).representable_in(ml_dtypes.bfloat16)
  assert FloatFormat(5, 2).representable_in(np.float16)
  assert not FloatFormat(5, 10).representable_in(ml_dtypes.bfloat16)   # 10 mantissa bits
  assert not FloatFormat(8, 7).representable_in(np.float16)            # range
  assert not FloatFormat(5, 10, compat="cpd").representable_in(np.float16)  # 65536 (quirk A)
  assert BFPFormat(8, (4,)).representable_in(ml_dtypes.bfloat16)
  assert not BFPFormat(9, (4,)).representable_in(ml_dtypes.bfloat16)
