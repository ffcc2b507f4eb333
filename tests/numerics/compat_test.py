"""compat="cpd" and compat="qtorch" casts, bit for bit, against independent references.

* CPD: the reference table of docs cpd.md §1.5 and the constants of §1.3, a numpy
  transcription of the algorithm of §1.2 (integers on the bit pattern, the value
  rebuilt in float64 as CPD does in float32), and the §1.4 characterisation
  "ml_dtypes round to nearest even + quirks A, B, C".
* QPyTorch 0.3.0: the values measured in cpd.md §1.7 and a numpy transcription of
  its CPU `float_quantize` (quant_cpu.cpp + bit_helper.cpp: raw-bit add and mask in
  uint32, the subnormal path in float32 arithmetic, which numpy does without
  flushing subnormals).

Every cast goes through `jlp.numerics.float_cast.float_cast` (the compat dispatch).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jlp import FloatFormat
from jlp.numerics.float_cast import cast_bits, float_cast

U32 = np.uint32


@functools.lru_cache(maxsize=None)
def _jitted(fmt):
  return jax.jit(lambda x, r: float_cast(x, fmt, r))


def _padded(values: np.ndarray, size: int) -> np.ndarray:
  out = np.zeros(size, values.dtype)
  out[:values.size] = values.ravel()
  return out


def cast(x, fmt, rbits=None) -> np.ndarray:
  """float_cast under jit, on x padded to a power of two (fewer compilations)."""
  x = np.asarray(x, np.float32)
  size = max(1024, 1 << (x.size - 1).bit_length())
  r = None if rbits is None else _padded(np.asarray(rbits, U32), size)
  out = _jitted(fmt)(_padded(x, size), r)
  return np.asarray(out)[:x.size].reshape(x.shape)


def bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).view(U32)


def from_hex(*patterns) -> np.ndarray:
  return np.array(patterns, U32).view(np.float32)


def assert_same_bits(got, want, x, msg=""):
  bad = bits(got) != bits(want)
  if bad.any():
    idx = np.flatnonzero(bad)[:8]
    detail = [(hex(bits(x)[i]), hex(bits(want)[i]), hex(bits(got)[i])) for i in idx]
    raise AssertionError(f"{msg}: {bad.sum()} of {bad.size} differ; (x, want, got): {detail}")


SPECIAL_PATTERNS = [0x0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                    0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFA00000, 0x7FFFF000,
                    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00400000, 0x00800000,
                    0x80800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000100]


def sampled_inputs(exp: int, man: int, n: int, seed: int = 0) -> np.ndarray:
  """Random bit patterns plus inputs concentrated where (exp, man) formats round.

  Random patterns (NaN, inf and float32 subnormals included), random values over
  the format's binades, midpoints of every grid spacing from the subnormal step
  to beyond the overflow threshold with float32 offsets of a few ulps, the
  neighbours of the overflow edges of both the IEEE-style and the QPyTorch
  ranges, float32 subnormals and specials.
  """
  rng = np.random.default_rng(seed)
  bias = 2 ** (exp - 1) - 1
  emin = 1 - bias
  q = n // 5
  random_patterns = rng.integers(0, 2 ** 32, size=q, dtype=np.uint64).astype(U32)
  lo_field, hi_field = max(1, emin + 127 - man - 4), min(254, bias + 130)
  fields = rng.integers(lo_field, hi_field + 1, size=q).astype(U32)
  in_range = (fields << U32(23)) | rng.integers(0, 2 ** 23, size=q).astype(U32)
  with np.errstate(over="ignore"):  # midpoints past float32's range become inf
    step_exp = rng.integers(max(emin - man, -148), min(bias + 3 - man, 127) + 1, size=2 * q)
    k = rng.integers(0, 2 ** (man + 1), size=2 * q)
    midpoints = bits(((k + 0.5) * np.exp2(step_exp.astype(np.float64))).astype(np.float32))
  offsets = rng.integers(-3, 4, size=2 * q).astype(np.int64)
  near_ties = np.clip(midpoints.astype(np.int64) + offsets, 0, 0x7F800000).astype(U32)
  edges = []
  for v in [2.0 ** bias * (2 - 2.0 ** -man), 2.0 ** (bias + 1) * (2 - 2.0 ** -man),
            2.0 ** bias * (2 - 2.0 ** (-man - 1)), 2.0 ** (bias + 1) * (2 - 2.0 ** (-man - 1)),
            2.0 ** (bias + 1), 2.0 ** (bias + 2), 2.0 ** emin, 2.0 ** (emin - man),
            2.0 ** (emin - man - 1)]:
    if v < float(np.finfo(np.float32).max):
      edges.append(int(bits(np.float32(v))) + np.arange(-8, 9))
  edges = np.clip(np.concatenate(edges), 0, 0x7F800000).astype(U32)
  f32_subnormals = rng.integers(1, 2 ** 23, size=q // 8).astype(U32)
  magnitudes = np.concatenate([in_range, near_ties, edges, f32_subnormals])
  signs = rng.integers(0, 2, size=magnitudes.size).astype(U32) << U32(31)
  return np.concatenate([random_patterns, magnitudes | signs,
                         np.array(SPECIAL_PATTERNS, U32)]).view(np.float32)


# ----------------------------------------------------------------------------------
# CPD reference: cpd.md §1.2, step by step, on int64 copies of the bit patterns.

def cpd_reference(x: np.ndarray, exp: int, man: int) -> np.ndarray:
  b = bits(x).astype(np.int64)
  e8 = (b >> 23) & 0xFF
  frac = b & 0x7FFFFF
  negative = (b >> 31) == 1
  true_exp = e8 - 127
  bias = 2 ** (exp - 1) - 1
  s = 23 - man
  m = frac | (1 << 23)                                   # step 3
  new_e = true_exp + bias
  overflow = new_e >= 2 ** exp - 1                       # step 4, before rounding
  subnormal = new_e <= 0                                 # step 6: shift first
  right_shift = np.where(subnormal, 1 - new_e, 0)
  m = np.where(right_shift >= 32, 0, m >> np.minimum(right_shift, 40))
  big_e = np.where(subnormal, 1 - bias, true_exp)
  if man < 23:                                           # steps 5 / 6: RNE at bit s
    guard = (m >> (s - 1)) & 1
    sticky = m & ((1 << (s - 1)) - 1)
    lsb = (m >> s) & 1
    up = (guard == 1) & ((sticky != 0) | (lsb == 1))
    m = np.where(up, m + (1 << (s - 1)), m) >> s << s
  with np.errstate(over="ignore"):                       # step 7 (exp = 8 carry -> inf)
    value = m.astype(np.float64) / 2.0 ** 23 * np.exp2(big_e.astype(np.float64))
    value = value.astype(np.float32)
  value = np.where(negative, -value, value)
  value = np.where(overflow, np.where(negative, -np.inf, np.inf), value).astype(np.float32)
  out = bits(value)
  out = np.where((e8 == 0) & (frac != 0), U32(0), out)     # step 2: +0.0
  return np.where((e8 == 0xFF) | ((b & 0x7FFFFFFF) == 0), bits(x), out).view(np.float32)  # step 1


CPD_FORMATS = [(4, 3), (5, 2), (3, 0), (5, 10), (3, 4), (8, 7), (2, 1), (6, 9), (8, 0), (8, 23)]


@pytest.mark.parametrize("exp,man", CPD_FORMATS, ids=lambda v: str(v))
def test_cpd_matches_reference_on_sampled_inputs(exp, man):
  x = sampled_inputs(exp, man, 30_000, seed=exp * 100 + man)
  assert_same_bits(cast(x, FloatFormat(exp, man, compat="cpd")), cpd_reference(x, exp, man), x,
                   f"cpd e{exp}m{man}")


INF = float("inf")
CPD_TABLE = [  # cpd.md §1.5, CPD column: (exp, man, input bits, output)
    (4, 3, 0x3F880000, 1.0), (4, 3, 0x3F980000, 1.25), (4, 3, 0x4377FFFF, 240.0),
    (4, 3, 0x43780000, 256.0), (4, 3, 0x43800000, INF), (4, 3, 0x3A83126F, 0.001953125),
    (4, 3, 0x3BA00000, 0.00390625), (4, 3, 0x3BA00001, 0.00390625), (4, 3, 0x80000001, 0.0),
    (5, 2, 0x3F900000, 1.0), (5, 2, 0x3FB00000, 1.5), (5, 2, 0x47700000, 65536.0),
    (5, 2, 0x37000001, 0.0), (5, 2, 0xB7000000, -0.0),
] + [(3, 0, int(bits(np.float32(v))), want) for v, want in [
    (0.125, 0.0), (0.1875, 0.25), (0.375, 0.5), (0.75, 1.0), (1.5, 2.0), (3.0, 4.0), (6.0, 8.0),
    (12.0, 16.0), (16.0, INF), (-0.3, -0.25)]]


@pytest.mark.parametrize("exp,man,pattern,want", CPD_TABLE,
                         ids=[f"e{e}m{m}-{p:08x}" for e, m, p, _ in CPD_TABLE])
def test_cpd_reference_table(exp, man, pattern, want):
  x = from_hex(pattern)
  assert_same_bits(cast(x, FloatFormat(exp, man, compat="cpd")), np.float32([want]), x)


@pytest.mark.parametrize("exp,man", [(4, 3), (5, 2), (3, 0), (5, 10), (8, 7), (2, 1)])
def test_cpd_passes_zeros_infs_and_nans_through(exp, man):
  x = from_hex(0x0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
               0x7FBFFFFF, 0xFFFFFFFF, 0x7FC0BEEF)
  assert_same_bits(cast(x, FloatFormat(exp, man, compat="cpd")), x, x)


CPD_CONSTANTS = {  # cpd.md §1.3: max finite, quirk-A band start, min normal, min subnormal
    (4, 3): (240.0, 248.0, 2.0 ** -6, 2.0 ** -9),
    (5, 2): (57344.0, 61440.0, 2.0 ** -14, 2.0 ** -16),
    (3, 0): (8.0, 12.0, 0.25, None),
    (5, 10): (65504.0, 65520.0, 2.0 ** -14, 2.0 ** -24),
}


@pytest.mark.parametrize("exp,man", list(CPD_CONSTANTS), ids=lambda v: str(v))
def test_cpd_format_constants(exp, man):
  fmt = FloatFormat(exp, man, compat="cpd")
  max_finite, band_start, min_normal, min_subnormal = CPD_CONSTANTS[(exp, man)]
  carry = 2.0 ** (fmt.bias + 1)
  assert fmt.largest_output == carry
  below = lambda v: np.nextafter(np.float32(v), np.float32(0))
  x = np.float32([max_finite, below(band_start), band_start, below(carry), carry,
                  np.nextafter(np.float32(carry), np.float32(INF)), 3e38, min_normal])
  want = np.float32([max_finite, max_finite, carry, carry, INF, INF, INF, min_normal])
  if min_subnormal is not None:
    x = np.append(x, np.float32([min_subnormal, min_subnormal / 2, min_subnormal * 0.75]))
    want = np.append(want, np.float32([min_subnormal, 0.0, min_subnormal]))
  else:  # no subnormals: the smallest positive output is the smallest normal
    x = np.append(x, np.float32([min_normal * 0.8, min_normal * 0.4]))
    want = np.append(want, np.float32([min_normal, 0.0]))
  x = np.concatenate([x, -x])
  want = np.concatenate([want, -want])
  assert_same_bits(cast(x, fmt), want, x)


def test_cpd_e8m7_is_bfloat16_with_ieee_overflow_and_ftz_inputs():
  fmt = FloatFormat(8, 7, compat="cpd")
  bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  x = from_hex(0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x00800000, 0x00400000, 0x807FFFFF, 0x00000001)
  want = np.float32([bf16_max, INF, INF, 2.0 ** -126, 0.0, 0.0, 0.0])
  assert_same_bits(cast(x, fmt), want, x)
  assert_same_bits(cast(-x[:4], fmt), -want[:4], -x[:4])


# §1.4: CPD = ml_dtypes (IEEE round to nearest even) except on quirks A, B and C.

def ieee_reference(x, dtype) -> np.ndarray:
  with np.errstate(all="ignore"):
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def classify_cpd_quirks(x, ieee, exp, man):
  """Boolean masks (A, B, C) of the inputs where CPD must differ from IEEE, from values.

  The float arithmetic is exact: power-of-two scalings of |x| < 2^emin (no
  overflow, no underflow) and floors of values below 2^24.
  """
  bias = 2 ** (exp - 1) - 1
  emin, emax = 1 - bias, bias
  v = np.abs(np.asarray(x, np.float32))
  f32_subnormal = (v > 0) & (v < np.float32(2.0 ** -126))
  quirk_c = f32_subnormal & (bits(ieee) != 0)
  quirk_a = np.zeros(v.shape, bool)
  quirk_b = np.zeros(v.shape, bool)
  if exp == 8:  # the carry past the max reaches float32's inf as in IEEE; no subnormals
    return quirk_a, quirk_b, quirk_c
  quirk_a = np.isinf(ieee) & np.isfinite(v) & (v < np.float32(2.0 ** (emax + 1)))
  # B: below 2^emin, the value cut to multiples of 2^(emin-23) (CPD's shift) is an
  # exact tie on the 2^(emin-man) grid above an even point, the full value is above it.
  small = ~f32_subnormal & (v < np.float32(2.0 ** emin))
  cut_units = np.floor(np.where(small, v, 0) * np.float32(2.0 ** (23 - emin)))  # < 2^23
  tie_bits = cut_units.astype(np.int32) & ((1 << (23 - man)) - 1)
  candidates = np.flatnonzero(small & (tie_bits == 1 << (22 - man)))
  grid = v[candidates] * (2.0 ** (man - emin))
  lower = np.floor(grid)
  cut = cut_units[candidates] * (2.0 ** (man - 23))
  quirk_b[candidates] = (cut - lower == 0.5) & (grid > cut) & (np.floor(lower * 0.5) * 2 == lower)
  return quirk_a, quirk_b, quirk_c


def check_cpd_against_ieee(x, exp, man, dtype):
  """Asserts the differences are exactly the quirk inputs, with the quirks' values."""
  fmt = FloatFormat(exp, man, compat="cpd")
  got, ieee = cast(x, fmt), ieee_reference(x, dtype)
  quirk_a, quirk_b, quirk_c = classify_cpd_quirks(x, ieee, exp, man)
  differ = bits(got) != bits(ieee)
  unexplained = differ != (quirk_a | quirk_b | quirk_c)
  assert not unexplained.any(), [hex(p) for p in bits(x)[unexplained][:8]]
  carry = np.copysign(np.float32(fmt.largest_output), x[quirk_a])
  assert_same_bits(got[quirk_a], carry, x[quirk_a], "quirk A")
  one_step_down = np.abs(ieee[quirk_b]) - np.abs(got[quirk_b])
  np.testing.assert_array_equal(one_step_down, np.float32(2.0 ** (fmt.emin - man)))
  assert np.all(np.sign(got[quirk_b]) * np.sign(ieee[quirk_b]) >= 0)
  assert not bits(got[quirk_c]).any()  # +0.0
  return quirk_a.sum(), quirk_b.sum(), quirk_c.sum()


def binade(e8: int) -> np.ndarray:
  return ((np.uint32(e8) << U32(23)) | np.arange(2 ** 23, dtype=U32)).view(np.float32)


def test_cpd_is_ieee_plus_quirks_on_every_float32_where_e5m2_quirks_can_occur():
  """Every positive float32 where quirks A and B can occur; counts from cpd.md §1.4.

  Quirk B needs a dropped bit below a guard bit, which happens only in the man + 1
  binades just below 2^emin; quirk A lies in [max, 2^(emax+1)). §1.4 counted them
  over [2^-30, 2^17), which holds all of these.
  """
  exp, man, bias = 5, 2, 15
  chunks = [binade(e8) for e8 in range(127 + 1 - bias - man - 1, 127 + 1 - bias)]
  chunks.append(np.arange(bits(np.float32(57344.0)), bits(np.float32(2.0 ** 16 * 1.125)),
                          dtype=U32).view(np.float32))
  counts = np.sum([check_cpd_against_ieee(c, exp, man, ml_dtypes.float8_e5m2) for c in chunks], 0)
  assert tuple(counts) == (1_048_576, 8, 0)


@pytest.mark.slow
@pytest.mark.parametrize("exp,man,dtype,quirk_a_count,quirk_b_count", [
    (5, 2, ml_dtypes.float8_e5m2, 1_048_576, 8), (4, 3, ml_dtypes.float8_e4m3, 524_288, 20),
    (3, 4, ml_dtypes.float8_e3m4, 262_144, 48), (5, 10, np.float16, 4_096, 6_144),
    (8, 7, ml_dtypes.bfloat16, 0, 0)], ids=["e5m2", "e4m3", "e3m4", "e5m10", "e8m7"])
def test_cpd_is_ieee_plus_quirks_on_every_positive_float32_of_cpd_md(
    exp, man, dtype, quirk_a_count, quirk_b_count):
  """cpd.md §1.4 exactly: every positive float32 in [2^-30, 2^17), 47 binades."""
  counts = np.sum([check_cpd_against_ieee(binade(e8), exp, man, dtype)
                   for e8 in range(127 - 30, 127 + 17)], axis=0)
  assert tuple(counts) == (quirk_a_count, quirk_b_count, 0)


@pytest.mark.parametrize("exp,man,dtype", [
    (4, 3, ml_dtypes.float8_e4m3), (5, 2, ml_dtypes.float8_e5m2),
    (3, 4, ml_dtypes.float8_e3m4), (5, 10, np.float16), (8, 7, ml_dtypes.bfloat16),
], ids=["e4m3", "e5m2", "e3m4", "e5m10", "e8m7"])
def test_cpd_is_ieee_plus_quirks_on_sampled_inputs(exp, man, dtype):
  x = sampled_inputs(exp, man, 40_000, seed=7)
  x = x[~np.isnan(x)]  # NaN payloads: CPD keeps them, ml_dtypes doesn't (tested above)
  _, quirk_b, quirk_c = check_cpd_against_ieee(x, exp, man, dtype)
  if exp < 8:
    assert quirk_b > 0
  assert quirk_c > 0


def test_cpd_quirk_a_band_of_e5m10_and_e3m4():
  """cpd.md §1.4: 4,096 (e5m10 vs float16) and 262,144 (e3m4) quirk-A inputs."""
  for exp, man, dtype, lo, hi, count in [(5, 10, np.float16, 65000.0, 70000.0, 4096),
                                         (3, 4, ml_dtypes.float8_e3m4, 15.0, 17.0, 262_144)]:
    x = np.arange(bits(np.float32(lo)), bits(np.float32(hi)), dtype=U32).view(np.float32)
    quirk_a, quirk_b, _ = check_cpd_against_ieee(x, exp, man, dtype)
    assert (quirk_a, quirk_b) == (count, 0)


# ----------------------------------------------------------------------------------
# QPyTorch 0.3.0 reference: quant_cpu.cpp's float_quantize line by line, vectorised.

def qtorch_reference(x: np.ndarray, exp: int, man: int, rand=None) -> np.ndarray:
  x = np.asarray(x, np.float32)
  target = bits(x)
  mask = U32((1 << (23 - man)) - 1)
  rand_prob = (rand & mask) if rand is not None else U32(1 << (23 - man - 1))

  def round_bitwise(t):                     # uint32 arithmetic wraps modulo 2^32, as in C
    return (t + rand_prob) & ~mask

  def clip_exponent(old_num, quantized_num):
    quantized_exponent_store = (quantized_num << U32(1) >> U32(1) >> U32(23)).astype(np.int64)
    max_exponent_store = (1 << (exp - 1)) + 127
    max_man = U32(0xFFFFFFFF) << U32(9) >> U32(9) >> U32(23 - man) << U32(23 - man)
    max_num = (U32(max_exponent_store) << U32(23)) | max_man
    old_sign = old_num >> U32(31) << U32(31)
    clipped = np.where(quantized_exponent_store > max_exponent_store, old_sign | max_num,
                       quantized_num)
    return np.where(quantized_num == 0, quantized_num, clipped)

  target_exp = (target << U32(1) >> U32(1) >> U32(23)).astype(np.int64) - 127
  min_exp = -((1 << (exp - 1)) - 2)
  subnormal = target_exp < min_exp
  shift_bits = (U32(127 + min_exp) << U32(23)) | (target >> U32(31) << U32(31))
  shift_float = shift_bits.view(np.float32)
  with np.errstate(all="ignore"):
    val = x + shift_float                   # float32, IEEE, no flushing
    quantized_sub = round_bitwise(bits(val)).view(np.float32) - shift_float
  quantized = clip_exponent(target, round_bitwise(target)).view(np.float32)
  return np.where(subnormal, quantized_sub, quantized).astype(np.float32)


def assert_matches_qtorch(got, want, x, exp, msg):
  if exp == 8:  # the one deviation: QPyTorch's exp = 8 NaN garbage -> quiet NaN of x's sign
    nan_in = np.isnan(x)
    quiet_nan = (bits(x) & U32(0x80000000)) | U32(0x7FC00000)
    want = np.where(nan_in, quiet_nan, bits(want)).view(np.float32)
  assert_same_bits(got, want, x, msg)


QTORCH_FORMATS = [(4, 3), (5, 2), (5, 10), (3, 4), (2, 1), (6, 9), (8, 7), (3, 0), (8, 0), (7, 22)]


@pytest.mark.parametrize("exp,man", QTORCH_FORMATS, ids=lambda v: str(v))
def test_qtorch_nearest_matches_transcription(exp, man):
  x = sampled_inputs(exp, man, 30_000, seed=exp * 100 + man + 1)
  got = cast(x, FloatFormat(exp, man, compat="qtorch"))
  assert_matches_qtorch(got, qtorch_reference(x, exp, man), x, exp, f"qtorch e{exp}m{man}")


@pytest.mark.parametrize("exp,man", [(4, 3), (5, 2), (5, 10), (2, 1), (8, 7), (3, 0)],
                         ids=lambda v: str(v))
def test_qtorch_stochastic_matches_transcription(exp, man):
  x = sampled_inputs(exp, man, 30_000, seed=exp * 100 + man + 2)
  rbits = np.random.default_rng(exp + man).integers(0, 2 ** 32, size=x.shape,
                                                    dtype=np.uint64).astype(U32)
  fmt = FloatFormat(exp, man, rounding="stochastic", compat="qtorch")
  got = cast(x, fmt, jnp.asarray(rbits))
  want = qtorch_reference(x, exp, man, rbits)
  assert_matches_qtorch(got, want, x, exp, f"qtorch stochastic e{exp}m{man}")
  # Only the low 23 - man bits of rbits are used.
  high_bits_flipped = rbits ^ U32(0xFFFFFFFF << (23 - man) & 0xFFFFFFFF)
  assert_same_bits(cast(x, fmt, jnp.asarray(high_bits_flipped)), got, x, "rbits high bits")


QTORCH_TABLE = [  # (exp, man, input bits, QPyTorch 0.3.0 output)
    # cpd.md §1.5 inputs; the "QPyTorch 2020" column holds for these ...
    (4, 3, 0x3F880000, 1.125), (4, 3, 0x3F980000, 1.25), (4, 3, 0x4377FFFF, 240.0),
    (5, 2, 0x3F900000, 1.25), (5, 2, 0x3FB00000, 1.5),
    # ... but not for these: 0.3.0 has emax = bias + 1 and subnormals (cpd.md §1.7)
    (4, 3, 0x43780000, 256.0), (4, 3, 0x43800000, 256.0), (4, 3, 0x3A83126F, 0.001953125),
    (4, 3, 0x3BA00000, 0.005859375), (5, 2, 0x47700000, 65536.0),
    (5, 2, 0x37000001, 2.0 ** -16), (5, 2, 0xB7000000, -(2.0 ** -16)),
    # §1.7: double rounding below 2^emin
    (4, 3, 0x3A7FFFFF, 2.0 ** -9),
] + [(3, 0, int(bits(np.float32(v))), want) for v, want in [
    (0.125, 0.25), (0.1875, 0.25), (0.375, 0.5), (0.75, 1.0), (1.5, 2.0), (3.0, 4.0), (6.0, 8.0),
    (12.0, 16.0), (16.0, 16.0), (24.0, 16.0), (-0.3, -0.25), (0.0625, 0.0), (-0.0625, 0.0)]]


@pytest.mark.parametrize("exp,man,pattern,want", QTORCH_TABLE,
                         ids=[f"e{e}m{m}-{p:08x}" for e, m, p, _ in QTORCH_TABLE])
def test_qtorch_reference_table(exp, man, pattern, want):
  x = from_hex(pattern)
  assert_same_bits(cast(x, FloatFormat(exp, man, compat="qtorch")), np.float32([want]), x)


@pytest.mark.parametrize("exp,man,largest", [
    (4, 3, 480.0), (5, 2, 114688.0), (5, 10, 131008.0), (3, 4, 31.0), (2, 1, 6.0),
    (6, 9, 2.0 ** 32 * (2 - 2.0 ** -9))], ids=lambda v: str(v))
def test_qtorch_largest_outputs_saturate(exp, man, largest):
  fmt = FloatFormat(exp, man, compat="qtorch")
  assert fmt.max == largest
  x = np.float32([largest, largest * (1 + 2.0 ** (-man - 2)), 2 * largest, 3e38, INF, 2.0 ** 127])
  x = np.concatenate([x, -x])
  # and nothing exceeds it on a sweep of the top binades
  sweep = np.arange(bits(np.float32(largest / 4)), bits(np.float32(largest * 4)), 97,
                    dtype=U32).view(np.float32)
  got = cast(np.concatenate([x, sweep]), fmt)
  assert_same_bits(got[:x.size], np.copysign(np.float32(largest), x), x)
  assert np.abs(got).max() == largest


def test_qtorch_exp8_does_not_saturate():
  fmt = FloatFormat(8, 7, compat="qtorch")
  x = from_hex(0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0xFF7F8000, 0xFF800000)
  want = from_hex(0x7F7F0000, 0x7F800000, 0x7F800000, 0x7F800000, 0xFF800000, 0xFF800000)
  assert_same_bits(cast(x, fmt), want, x)


def test_qtorch_exp8_float32_subnormals_are_rounded_exactly():
  """x + 2^-126 is exact there: results on the bf16 subnormal grid (step 2^-133 =
  0x00010000), ties away from zero, kept (no FTZ), -0.0 -> +0.0."""
  fmt = FloatFormat(8, 7, compat="qtorch")
  x = from_hex(0x00000001, 0x00008000, 0x00004000, 0x00003FFF, 0x0000C000, 0x00018000,
               0x807FFFFF, 0x80010000, 0x80008000, 0x80004000)
  want = from_hex(0x0, 0x00010000, 0x0, 0x0, 0x00010000, 0x00020000,
                  0x80800000, 0x80010000, 0x80010000, 0x0)
  assert_same_bits(cast(x, fmt), want, x)


@pytest.mark.parametrize("exp,man", [(4, 3), (5, 2), (8, 7), (3, 0)], ids=lambda v: str(v))
def test_qtorch_every_zero_result_is_positive_zero(exp, man):
  x = sampled_inputs(exp, man, 20_000, seed=3)
  tiny = np.random.default_rng(4).uniform(-0.6, 0.6, 2000) * 2.0 ** (2 - 2 ** (exp - 1) - man)
  x = np.concatenate([x[np.isfinite(x)], tiny.astype(np.float32), np.float32([-0.0, -1e-30])])
  got = cast(x, FloatFormat(exp, man, compat="qtorch"))
  zero = got == 0
  assert zero.sum() > 500 and np.signbit(x[zero]).sum() > 200
  assert not bits(got[zero]).any()


def test_qtorch_inf_and_nan_inputs():
  """exp < 8: ±inf and NaN -> ±max, except that the raw-bit add wraps NaNs whose
  fraction is near all ones: +NaN -> -0.0, -NaN -> +0.0 (quant_cpu.cpp, unsigned add)."""
  e4m3 = FloatFormat(4, 3, compat="qtorch")
  x = from_hex(0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FF00000, 0x7FFFFFFF, 0xFFFFFFFF)
  want = np.float32([480, -480, 480, -480, 480, -0.0, 0.0])
  assert_same_bits(cast(x, e4m3), want, x)
  e3m0 = FloatFormat(3, 0, compat="qtorch")  # 0x7FC00000 + 2^22 wraps already
  x = from_hex(0x7FC00000, 0xFFC00000, 0x7FA00000)
  assert_same_bits(cast(x, e3m0), np.float32([-0.0, 0.0, 16.0]), x)
  bf16 = FloatFormat(8, 7, compat="qtorch")  # the deviation: quiet NaN, x's sign
  x = from_hex(0x7FC00000, 0xFFFFFFFF, 0x7F800001)
  assert_same_bits(cast(x, bf16), from_hex(0x7FC00000, 0xFFC00000, 0x7FC00000), x)


# ----------------------------------------------------------------------------------
# Transformations and kernel-friendliness.

TRANSFORM_FORMATS = [
    FloatFormat(4, 3, compat="cpd"), FloatFormat(8, 7, compat="cpd"),
    FloatFormat(8, 7, compat="qtorch"), FloatFormat(4, 3, rounding="stochastic", compat="qtorch")]


@pytest.mark.parametrize("fmt", TRANSFORM_FORMATS, ids=repr)
def test_jit_and_vmap_agree(fmt):
  x = np.resize(sampled_inputs(fmt.exp, fmt.man, 4000, seed=11), (64, 64))
  rbits = np.random.default_rng(0).integers(0, 2 ** 32, size=x.shape, dtype=np.uint64).astype(U32)
  r = jnp.asarray(rbits) if fmt.rounding == "stochastic" else None
  flat = cast(x.ravel(), fmt, None if r is None else rbits.ravel()).reshape(x.shape)
  two_d = jax.jit(lambda v, rr: float_cast(v, fmt, rr))(jnp.asarray(x), r)
  if r is None:
    vmapped = jax.jit(jax.vmap(lambda row: float_cast(row, fmt)))(jnp.asarray(x))
  else:
    vmapped = jax.jit(jax.vmap(lambda row, rr: float_cast(row, fmt, rr)))(jnp.asarray(x), r)
  assert_same_bits(np.asarray(two_d), flat, x, "2-D")
  assert_same_bits(np.asarray(vmapped), flat, x, "vmap")
  if fmt.compat == "cpd":
    assert_same_bits(flat, cpd_reference(x, fmt.exp, fmt.man), x, repr(fmt))
  else:
    want = qtorch_reference(x, fmt.exp, fmt.man, None if r is None else rbits)
    assert_matches_qtorch(flat, want, x, fmt.exp, repr(fmt))


KERNEL_SAFE_PRIMITIVES = {
    "and", "or", "not", "shift_left", "shift_right_logical", "add", "sub", "eq", "ne", "lt",
    "le", "gt", "ge", "min", "max", "select_n", "bitcast_convert_type", "broadcast_in_dim",
    "pjit", "jit", "convert_element_type"}


def _equations(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        yield from _equations(getattr(inner, "jaxpr", inner))


@pytest.mark.parametrize("fmt", TRANSFORM_FORMATS, ids=repr)
def test_only_elementwise_32_bit_ops(fmt):
  """What Pallas/Triton blocks need: element-wise ops on uint32/float32/bool only."""
  block = jax.ShapeDtypeStruct((8, 128), jnp.uint32)
  closed = jax.make_jaxpr(lambda u, r: cast_bits(u, fmt, r))(block, block)
  for eqn in _equations(closed.jaxpr):
    assert eqn.primitive.name in KERNEL_SAFE_PRIMITIVES, eqn
    for var in list(eqn.invars) + list(eqn.outvars):
      assert var.aval.dtype in (jnp.uint32, jnp.int32, jnp.float32, jnp.bool_), eqn
      assert var.aval.shape in ((), (8, 128)), eqn
