"""Zero-setting error (bfp.md §3.1) and traced BFP mantissa widths (bfp.md §1.7)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.formats import BFPFormat
from jlp.nn.zse import zero_setting_error
from jlp.numerics.bfp import bfp_bits, bfp_quantize, group_rows


def _fields(x):
  return ((np.asarray(x, np.float32).view(np.uint32) >> 23) & 0xFF).astype(np.int64)


def _zse_reference(x, block, man):
  """Plain-Python transcription of BFPsim's get_zse, generalised to any rank."""
  x = np.asarray(x, np.float32)
  e = _fields(x)
  starts = [range(0, n, d) for n, d in zip(x.shape, block)]
  count = 0
  for corner in itertools.product(*starts):
    box = tuple(slice(s, min(s + d, n)) for s, d, n in zip(corner, block, x.shape))
    g = e[box].ravel().tolist()
    m = max(g)
    if m == 0:
      continue
    count += sum(1 for ei in g if m - ei + 1 > man)
  return count / x.size


VEC = np.array([1.0, 0.75, 0.3, -0.2, 0.01, 0.0, -1.9], np.float32)
# ZSE of a static format, jitted: one compile per shape and format instead of its ops one by one
# (test_empty_and_bad_input and test_matches_reference_and_truncation_zeros keep eager calls)
_zse = jax.jit(zero_setting_error, static_argnums=1)
# the traced-width ZSE of VEC: one jitted function (one compile) for every case
_ZSE_VEC_TRACED = jax.jit(lambda x, m: zero_setting_error(x, BFPFormat(24, (7,)), man=m))


@pytest.mark.parametrize("man,expected", [(2, 4 / 7), (4, 2 / 7), (8, 1 / 7)])
def test_hand_vector_1d(man, expected):
  fmt = BFPFormat(man, (7,))
  assert float(_zse(VEC, fmt)) == pytest.approx(expected, rel=1e-7)
  # the same with a traced width under jit
  assert float(_ZSE_VEC_TRACED(VEC, jnp.int32(man))) == pytest.approx(expected, rel=1e-7)
  assert _ZSE_VEC_TRACED._cache_size() == 1


def test_hand_vector_2d_ragged():
  x = np.arange(15, dtype=np.float32).reshape(3, 5) - np.float32(7.3)
  assert float(_zse(x, BFPFormat(3, (2, 2)))) == pytest.approx(2 / 15, rel=1e-7)
  assert _zse_reference(x, (2, 2), 3) == pytest.approx(2 / 15)


def test_subnormal_and_zero_groups_count_nothing():
  x = np.array([3e-39, -1e-39, 0.0], np.float32)
  assert float(_zse(x, BFPFormat(4, (3,)))) == 0.0
  assert float(_zse(np.zeros((4, 6), np.float32), BFPFormat(2, (2, 3)))) == 0.0
  # a zero group next to a normal group: only the normal group's zeros count
  y = np.array([0, 0, 0, 1.0, 0, 2.0**-10], np.float32)
  assert float(_zse(y, BFPFormat(4, (3,)))) == pytest.approx(2 / 6)


def test_padding_is_not_counted():
  # 5 elements, block 4: the ragged last group [1.0] is padded with 3 zeros.
  x = np.array([1.0, 1.0, 1.0, 1.0, 1.0], np.float32)
  assert float(_zse(x, BFPFormat(2, (4,)))) == 0.0
  # groups [[1, 2^-20], [0, 0]] (3 zeroed) and [[1], [0]] (1 zeroed; its padding column not)
  x2 = np.array([[1.0, 2.0**-20, 1.0], [0.0, 0.0, 0.0]], np.float32)
  assert float(_zse(x2, BFPFormat(4, (2, 2)))) == pytest.approx(4 / 6)
  assert _zse_reference(x2, (2, 2), 4) == pytest.approx(4 / 6)


def _random(rng, shape):
  x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape))
  x = np.where(rng.random(shape) < 0.1, 0.0, x).astype(np.float32)
  return x


# The 3-D and 5-D cases run in the slow tier: the grouping is the same code for every rank, and
# the 1-D (a power-of-two group), 2-D and 4-D (padded groups, ragged edges) cases keep its paths.
@pytest.mark.parametrize("shape,block", [
    ((37,), (8,)), ((5, 7), (2, 3)), pytest.param((3, 4, 5), (2, 3, 2), marks=pytest.mark.slow),
    ((2, 5, 3, 3), (1, 4, 3, 3)),
    pytest.param((2, 3, 2, 2, 3), (1, 2, 2, 1, 2), marks=pytest.mark.slow)])
def test_matches_reference_and_truncation_zeros(shape, block):
  rng = np.random.default_rng(sum(shape))
  x = _random(rng, shape)
  f = jax.jit(lambda x, m: zero_setting_error(x, BFPFormat(8, block), man=m))
  q = jax.jit(lambda x, m: bfp_quantize(x, BFPFormat(8, block), man=m))
  e = _fields(x)
  for man in (1, 2, 4, 8, 16):
    got = float(f(x, jnp.int32(man)))
    assert got == pytest.approx(_zse_reference(x, block, man), rel=1e-6, abs=0)
    assert float(zero_setting_error(x, BFPFormat(man, block))) == got
    # ZSE = elements that truncation sets to +0 (k < 0), from groups with M > 0, over size.
    # Exponents here are far above man, so k < 0 <=> the output is +0 with a nonzero group.
    out = np.asarray(q(x, jnp.int32(man))).view(np.uint32)
    nonzero_group = _group_max(e, block) > 0
    assert got == pytest.approx(np.sum((out == 0) & nonzero_group) / x.size, rel=1e-6, abs=0)
  assert f._cache_size() == 1


def _group_max(e, block):
  out = np.zeros_like(e)
  for corner in itertools.product(*[range(0, n, d) for n, d in zip(e.shape, block)]):
    box = tuple(slice(s, min(s + d, n)) for s, d, n in zip(corner, block, e.shape))
    out[box] = e[box].max()
  return out


def test_empty_and_bad_input():
  assert float(zero_setting_error(jnp.zeros((0, 3)), BFPFormat(4, (1, 3)))) == 0.0
  with pytest.raises(ValueError, match="block"):
    zero_setting_error(jnp.ones((4, 4)), BFPFormat(4, (4,)))
  with pytest.raises(ValueError, match="man"):
    zero_setting_error(jnp.ones((4,)), BFPFormat(4, (4,)), man=0)
  with pytest.raises(ValueError, match="integer"):
    zero_setting_error(jnp.ones((4,)), BFPFormat(4, (4,)), man=jnp.float32(4))


# -- traced widths in bfp_quantize ----------------------------------------------------------

def _special_input(rng, shape):
  x = _random(rng, shape)
  flat = x.reshape(-1)
  flat[:6] = [np.inf, -np.inf, np.nan, 1e-40, -3e-39, 0.0]
  return x


@pytest.mark.parametrize("rounding", ["truncate", "nearest", "stochastic"])
def test_traced_man_equals_static_format_bit_for_bit(rounding):
  rng = np.random.default_rng(7)
  x = _special_input(rng, (9, 12))
  x[6:, 8:] = 0.0
  x[0:3, 9:12] = np.float32(1e-39)  # an all-subnormal group (M == 0)
  rbits = jnp.asarray(rng.integers(0, 2**32, x.shape, dtype=np.uint32))
  block = (3, 4)
  stoch = rounding == "stochastic"
  traces = []

  def fn(x, m, r):
    traces.append(1)
    return bfp_quantize(x, BFPFormat(8, block, rounding), r if stoch else None, man=m)

  f = jax.jit(fn)
  static = jax.jit(lambda x, r, fmt: bfp_quantize(x, fmt, r if stoch else None), static_argnums=2)
  for m in (1, 2, 3, 4, 8, 11, 16, 23, 24):
    got = np.asarray(f(x, jnp.int32(m), rbits)).view(np.uint32)
    want = np.asarray(static(x, rbits, BFPFormat(m, block, rounding))).view(np.uint32)
    np.testing.assert_array_equal(got, want, err_msg=f"man={m}")
  assert len(traces) == 1 and f._cache_size() == 1


def test_static_int_man_and_none_are_the_static_path():
  x = jnp.asarray(_random(np.random.default_rng(3), (4, 8)))
  fmt = BFPFormat(8, (2, 4))
  a = jax.make_jaxpr(lambda x: bfp_quantize(x, fmt))(x)
  b = jax.make_jaxpr(lambda x: bfp_quantize(x, BFPFormat(4, (2, 4)), man=8))(x)
  assert str(a) == str(b)
  np.testing.assert_array_equal(np.asarray(bfp_quantize(x, fmt, man=4)),
                                np.asarray(bfp_quantize(x, BFPFormat(4, (2, 4)))))
  with pytest.raises(ValueError, match="man"):
    bfp_quantize(x, fmt, man=25)


def test_bfp_bits_traced_man_on_rows():
  rng = np.random.default_rng(11)
  x = jnp.asarray(_special_input(rng, (6, 10)))
  fmt = BFPFormat(8, (2, 5))
  rows, ungroup = group_rows(jax.lax.bitcast_convert_type(x, jnp.uint32), fmt.block)
  group_max = jnp.max((rows >> 23) & 0xFF, axis=1, keepdims=True)
  f = jax.jit(lambda u, g, m: bfp_bits(u, g, fmt, man=m))
  for m in (2, 4, 8, 16):
    got = np.asarray(ungroup(f(rows, group_max, jnp.int32(m))))
    want = np.asarray(bfp_quantize(x, BFPFormat(m, fmt.block))).view(np.uint32)
    np.testing.assert_array_equal(got, want)
  assert f._cache_size() == 1
