"""The default (compat=None) float cast against ml_dtypes and a float64 reference.

References: ml_dtypes casts (`astype`) for the formats ml_dtypes has, and
`references.round_to_format` (float64 arithmetic written from the format rules)
for every other format and option.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jlp import FloatFormat
from jlp.numerics.float_cast import float_cast
import references as ref

ML_DTYPES_NAMES = ["float8_e4m3", "float8_e5m2", "float8_e3m4", "float16", "bfloat16",
                   "float8_e4m3fn", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"]


@functools.lru_cache(maxsize=None)
def _jitted(fmt):
  return jax.jit(lambda x, r: float_cast(x, fmt, r))


def cast(x, fmt, rbits=None):
  return np.asarray(_jitted(fmt)(jnp.asarray(x, jnp.float32), rbits))


def ml_dtypes_cast(x, name):
  dtype = np.float16 if name == "float16" else getattr(ml_dtypes, name)
  with np.errstate(all="ignore"):
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


SAMPLES = ref.sampled_inputs(3_000_000)


@pytest.mark.parametrize("name", ML_DTYPES_NAMES)
def test_matches_ml_dtypes_on_sampled_bit_patterns(name):
  fmt = FloatFormat.from_name(name)
  ref.assert_same_bits(cast(SAMPLES, fmt), ml_dtypes_cast(SAMPLES, name), SAMPLES, name)


@pytest.mark.parametrize("name", ML_DTYPES_NAMES)
def test_matches_ml_dtypes_on_values_midpoints_and_edges(name):
  fmt = FloatFormat.from_name(name)
  x = np.concatenate([ref.format_values(fmt), ref.midpoints_and_neighbours(fmt),
                      ref.special_inputs()])
  if name == "bfloat16":  # too many values to list; binades around the subnormal range and the top
    x = x[(np.abs(x) < 2.0 ** -100) | (np.abs(x) > 2.0 ** 100) | ~np.isfinite(x)]
  ref.assert_same_bits(cast(x, fmt), ml_dtypes_cast(x, name), x, name)
  # every representable value maps to itself
  values = ref.format_values(fmt)
  ref.assert_same_bits(cast(values, fmt), values, values, name + " identity")


def test_float_reference_agrees_with_ml_dtypes():
  """The float64 reference used below is itself checked against ml_dtypes."""
  x = SAMPLES[:300_000]
  for name in ML_DTYPES_NAMES:
    ref.assert_same_bits(ref.round_to_format(x, FloatFormat.from_name(name)),
                         ml_dtypes_cast(x, name), x, name)


OTHER_FORMATS = [
    FloatFormat(3, 0), FloatFormat(2, 0), FloatFormat(8, 0), FloatFormat(6, 9), FloatFormat(2, 1),
    FloatFormat(7, 23), FloatFormat(8, 23), FloatFormat(5, 2, overflow="saturate"),
    FloatFormat(4, 3, specials="nan_only", overflow="saturate"),
    FloatFormat(3, 2, specials="none", overflow="saturate"),
    FloatFormat(5, 2, subnormals=False), FloatFormat(8, 7, subnormals=False),
    FloatFormat(4, 3, rounding="truncate"), FloatFormat(8, 7, rounding="truncate"),
    FloatFormat(4, 3, specials="nan_only", rounding="truncate"),
    FloatFormat(3, 0, rounding="truncate", overflow="saturate"),
    FloatFormat(4, 0, specials="nan_only"), FloatFormat(5, 0, specials="none"),
]


@pytest.mark.parametrize("fmt", OTHER_FORMATS, ids=repr)
def test_matches_float64_reference(fmt):
  x = np.concatenate([SAMPLES[:600_000], ref.special_inputs()])
  if fmt.exp < 8 and fmt.man <= 12:
    x = np.concatenate([x, ref.midpoints_and_neighbours(fmt), ref.format_values(fmt)])
  ref.assert_same_bits(cast(x, fmt), ref.round_to_format(x, fmt), x, repr(fmt))


@pytest.mark.parametrize("fmt", [FloatFormat(4, 3, rounding="stochastic"),
                                 FloatFormat(8, 7, rounding="stochastic"),
                                 FloatFormat(3, 0, rounding="stochastic", overflow="saturate"),
                                 FloatFormat(5, 10, rounding="stochastic", specials="none")], ids=repr)
def test_stochastic_matches_float64_reference(fmt):
  x = np.concatenate([SAMPLES[:300_000], ref.special_inputs()])
  if fmt.exp < 8:
    x = np.concatenate([x, ref.midpoints_and_neighbours(fmt)])
  rbits = np.random.default_rng(1).integers(0, 2 ** 32, size=x.shape, dtype=np.uint64).astype(np.uint32)
  got = cast(x, fmt, jnp.asarray(rbits))
  ref.assert_same_bits(got, ref.round_to_format(x, fmt, rbits), x, repr(fmt))


@pytest.mark.parametrize("fmt", [FloatFormat(4, 3, rounding="stochastic"),
                                 FloatFormat(2, 1, rounding="stochastic")], ids=repr)
def test_stochastic_is_unbiased_and_uses_the_two_neighbours(fmt):
  x = np.array([0.3, -1.1, 2.7, 0.013, 0.0021, -5.5], np.float32)
  if fmt.exp == 2:
    x = np.array([0.3, -1.1, 2.7, 0.13, 0.21, -1.7], np.float32)
  keys = jax.random.split(jax.random.key(0), 4000)
  draws = jax.jit(jax.vmap(  # one program (eagerly, each op compiles on its own)
      lambda k: float_cast(jnp.asarray(x), fmt, jax.random.bits(k, x.shape, jnp.uint32))))(keys)
  draws = np.asarray(draws)
  down = ref.round_to_format(x, FloatFormat(fmt.exp, fmt.man, rounding="truncate"))
  values = np.sort(np.abs(ref.format_values(fmt)))
  up = np.sign(x) * values[np.searchsorted(values, np.abs(down), side="right")]
  assert np.all((draws == down) | (draws == up))
  # mean within 5 standard errors of x
  p = (np.abs(x) - np.abs(down)) / (np.abs(up) - np.abs(down))
  se = np.abs(up - down) * np.sqrt(p * (1 - p) / draws.shape[0])
  np.testing.assert_array_less(np.abs(draws.mean(0) - x), 5 * se + 1e-7)


def test_same_bits_same_result_and_jit_vmap():
  fmt = FloatFormat(5, 2)
  x = jnp.asarray(SAMPLES[:4096].reshape(64, 64))
  eager = np.asarray(float_cast(x, fmt))
  vmapped = np.asarray(jax.jit(jax.vmap(lambda r: float_cast(r, fmt)))(x))
  ref.assert_same_bits(vmapped, eager)
