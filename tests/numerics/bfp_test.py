"""BFP quantization against BFPsim's test vectors and plain-numpy references.

References (written here from bfp.md §1, never from jlp code):
  `truncate_reference`: BFPsim's bit rule (§1.1) on int32 views, one group at a time.
  `arithmetic_reference`: the §1.2 form sign · floor(|x| / Δ) · Δ for normal groups.
  `rounding_reference`: nearest / stochastic on the same grid in float64 arithmetic.
Besides, `_previous_bfp_quantize` keeps the XLA path as it was before issue 13 (group
maxima by one padded reduction, broadcast back) to check that the faster grouping computes
the same bits.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp import BFPFormat
from jlp.numerics.bfp import bfp_bits, bfp_quantize, group_rows
from jlp.numerics.float_cast import from_bits, to_bits, u32
import references as ref


@functools.lru_cache(maxsize=None)
def _jitted(fmt):
  return jax.jit(lambda x, r: bfp_quantize(x, fmt, r))


def group_sizes(shape, block):
  """Elements per group (padding excluded) and the (G, P) shape of `group_rows`."""
  rows = jax.jit(lambda x: group_rows(x, block)[0])(jnp.ones(shape, jnp.int32))
  return np.asarray(rows).sum(1), rows.shape


def quantize(x, fmt, rbits=None):
  rbits = None if rbits is None else jnp.asarray(rbits, jnp.uint32)
  return np.asarray(_jitted(fmt)(jnp.asarray(x, jnp.float32), rbits))


def boxes(shape, dims):
  """Index tuples of the groups: axis-aligned boxes, the last one per axis smaller."""
  starts = [range(0, s, d) for s, d in zip(shape, dims)]
  for corner in itertools.product(*starts):
    yield tuple(slice(c, c + d) for c, d in zip(corner, dims))


def truncate_reference(x, gm, dims):
  bits = np.array(x, np.float32).view(np.int32).copy()
  for box in boxes(bits.shape, dims):
    group = bits[box]
    exps = (group & 0x7F800000) >> 23
    top = exps.max()
    if top == 0:
      continue
    keep = gm - 1 - (top - exps)
    masks = np.left_shift(np.int32(-1), 23 - np.clip(keep, 0, 23))
    bits[box] = np.where(keep >= 0, group & masks, 0)
  return bits.view(np.float32)


def arithmetic_reference(x, gm, dims):
  out = np.zeros(x.shape, np.float64)
  v = np.asarray(x, np.float64)
  for box in boxes(x.shape, dims):
    group = v[box]
    _, exp2 = np.frexp(np.abs(group).max())
    step = 2.0 ** (exp2 - 1 - gm + 1)
    out[box] = np.sign(group) * np.floor(np.abs(group) / step) * step
  return (out + 0.0).astype(np.float32)  # + 0.0 turns -0.0 into +0.0


def rounding_reference(x, gm, dims, rounding, rbits=None):
  x = np.asarray(x, np.float32)
  out = x.copy()
  for box in boxes(x.shape, dims):
    group = x[box]
    top = int(((group.view(np.uint32) >> 23) & 0xFF).max())
    if top == 0:
      continue
    if top == 255:
      out[box] = np.where(np.isnan(group), np.copysign(np.float32(np.nan), group),
                          np.where(np.isinf(group), group, np.float32(0)))
      continue
    v = group.astype(np.float64)
    step = 2.0 ** (top - 127 - gm + 1)
    n = np.abs(v) / step
    low = np.floor(n)
    frac = n - low
    if rounding == "nearest":
      up = (frac > 0.5) | ((frac == 0.5) & (low % 2 == 1))
    else:
      up = rbits[box].astype(np.float64) < np.floor(frac * 2.0 ** 32)
    count = np.minimum(low + up, 2.0 ** gm - 1)
    out[box] = np.where(count == 0, 0.0, np.copysign(count * step, v)).astype(np.float32)
  return out


def random_array(rng, shape, dims, specials=True):
  """Wide-ranging float32 values with zeros, -0, subnormals, inf, NaN and a zero/subnormal group."""
  size = int(np.prod(shape))
  base = rng.integers(-90, 90)
  spread = rng.choice([2, 10, 40])
  exps = base + rng.integers(-spread, 3, size)
  x = rng.uniform(1, 2, size) * 2.0 ** exps
  wide = rng.random(size) < 0.15
  x[wide] = 10.0 ** rng.uniform(-30, 30, wide.sum())
  x *= rng.choice([-1.0, 1.0], size)
  kind = rng.random(size)
  subnormals = rng.integers(1, 2 ** 23, size, dtype=np.uint32).view(np.float32)
  x = x.astype(np.float32)
  x[kind < 0.05] = 0.0
  x[(kind >= 0.05) & (kind < 0.08)] = -0.0
  x[(kind >= 0.08) & (kind < 0.11)] = subnormals[(kind >= 0.08) & (kind < 0.11)]
  if specials:
    x[(kind >= 0.11) & (kind < 0.113)] = np.inf
    x[(kind >= 0.113) & (kind < 0.116)] = -np.inf
    x[(kind >= 0.116) & (kind < 0.119)] = np.nan
    x[(kind >= 0.119) & (kind < 0.120)] = np.uint32(0xFF800001).view(np.float32)  # sNaN, low payload
  x = x.reshape(shape)
  tiny = np.where(rng.random(shape) < 0.5, subnormals.reshape(shape), np.float32(0.0))
  first = tuple([slice(0, dims[0])] + [slice(None)] * (len(shape) - 1))
  x[first] = tiny[first]  # the first groups along axis 0 hold only zeros and subnormals
  small = (rng.uniform(1, 2, shape) * 2.0 ** rng.integers(-126, -112, shape)).astype(np.float32)
  small = np.where(rng.random(shape) < 0.5, small, -tiny)
  second = tuple([slice(dims[0], 2 * dims[0])] + [slice(None)] * (len(shape) - 1))
  x[second] = small[second]  # the next ones mix subnormals with the smallest normals
  return x


SHAPES = [((37,), (8,)), ((5,), (16,)), ((7, 10), (3, 4)), ((9, 5), (1, 5)),
          ((5, 6, 7), (2, 3, 4)), ((4, 26, 3), (1, 24, 3)), ((2, 30, 5, 7), (1, 24, 3, 3)),
          ((3, 5, 4, 4), (2, 2, 2, 2)), ((2, 3, 4, 5), (1, 1, 1, 1))]
GMS = [1, 2, 4, 8, 16, 23, 24]
CASES = [(shape, dims, GMS[(2 * i + j) % len(GMS)])
         for i, (shape, dims) in enumerate(SHAPES) for j in range(2)]


def case_id(case):
  shape, dims, gm = case
  return f"{shape}-{dims}-gm{gm}"


# -- BFPsim test vectors (bfp.md §1.6) ----------------------------------------

ONE_GROUP = np.array([1.0, 0.75, 0.3, -0.2, 0.01, 0.0, -1.9], np.float32)


@pytest.mark.parametrize("gm, want", [
    (2, [1.0, 0.5, 0, 0, 0, 0, -1.5]),
    (4, [1.0, 0.75, 0.25, -0.125, 0, 0, -1.875]),
    (8, [1.0, 0.75, 0.296875, -0.1953125, 0.0078125, 0, -1.8984375]),
])
def test_one_group_vectors(gm, want):
  got = quantize(ONE_GROUP, BFPFormat(gm, (7,)))
  ref.assert_same_bits(got, np.array(want, np.float32) + np.float32(0.0), ONE_GROUP)


def test_all_subnormal_group_is_unchanged():
  x = np.array([3e-39, -1e-39, 0.0], np.float32)
  ref.assert_same_bits(quantize(x, BFPFormat(4, (3,))), x)
  for rounding in ("nearest", "stochastic"):
    rbits = np.zeros(3, np.uint32)
    ref.assert_same_bits(quantize(x, BFPFormat(4, (3,), rounding), rbits), x)


def test_two_d_ragged_groups():
  x = (np.arange(15).reshape(3, 5) - 7.3).astype(np.float32)
  want = np.array([[-7, -6, -5, -4, -3], [-2, -1, 0, 0, 1.5], [2.5, 3.5, 4, 5, 6]], np.float32)
  ref.assert_same_bits(quantize(x, BFPFormat(3, (2, 2))), want + np.float32(0.0))
  sizes, shape = group_sizes(x.shape, (2, 2))
  assert shape == (6, 4) and sizes.tolist() == [4, 4, 2, 2, 2, 1]


# -- references ---------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_truncate_matches_bit_rule_reference(case):
  shape, dims, gm = case
  rng = np.random.default_rng(hash(case) % 2 ** 32)
  x = random_array(rng, shape, dims)
  got = quantize(x, BFPFormat(gm, dims))
  want = truncate_reference(x, gm, dims)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("gm", GMS)
def test_truncate_matches_arithmetic_form_on_normal_groups(gm):
  rng = np.random.default_rng(gm)
  shape, dims = (6, 50), (2, 7)
  x = (rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(-30, 30, shape)).astype(np.float32)
  x *= rng.random(shape) > 0.1  # exact zeros
  x = np.concatenate([x, rng.standard_normal((3, 50)).astype(np.float32)])
  ref.assert_same_bits(quantize(x, BFPFormat(gm, dims)), arithmetic_reference(x, gm, dims), x)


@pytest.mark.parametrize("case", CASES[::2], ids=case_id)
def test_nearest_matches_reference(case):
  shape, dims, gm = case
  rng = np.random.default_rng(hash(case) % 2 ** 32 + 1)
  x = random_array(rng, shape, dims)
  got = quantize(x, BFPFormat(gm, dims, "nearest"))
  ref.assert_same_bits(got, rounding_reference(x, gm, dims, "nearest"), x)


@pytest.mark.parametrize("case", CASES[1::2], ids=case_id)
def test_stochastic_matches_reference(case):
  shape, dims, gm = case
  rng = np.random.default_rng(hash(case) % 2 ** 32 + 2)
  x = random_array(rng, shape, dims)
  rbits = rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)
  got = quantize(x, BFPFormat(gm, dims, "stochastic"), rbits)
  ref.assert_same_bits(got, rounding_reference(x, gm, dims, "stochastic", rbits), x)


def test_nearest_ties_clamp_and_zeros():
  fmt = BFPFormat(2, (8,), "nearest")  # grid 0.5 below 2
  x = np.array([1.99, 0.75, 1.25, 0.25, 0.26, -0.2, -0.0, 1e-40], np.float32)
  want = np.array([1.5, 1.0, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0], np.float32)
  ref.assert_same_bits(quantize(x, fmt), want, x)


def test_inf_nan_groups():
  x = np.array([np.inf, 3.0, -np.nan, -2.0, 1e38, -np.inf, 0.0, -0.0], np.float32)
  near = quantize(x, BFPFormat(8, (8,), "nearest"))
  ref.assert_same_bits(near, np.array([np.inf, 0, -np.nan, 0, 0, -np.inf, 0, 0], np.float32))
  # truncation keeps the bit rule: with gm = 24 large finite values survive
  got = quantize(x, BFPFormat(24, (8,)))
  np.testing.assert_array_equal(got.view(np.uint32), truncate_reference(x, 24, (8,)).view(np.uint32))
  assert got[4] != 0 and got[1] == 0


# -- properties ---------------------------------------------------------------

@pytest.mark.parametrize("rounding", ["truncate", "nearest"])
def test_idempotent(rounding):
  rng = np.random.default_rng(7)
  for gm, (shape, dims) in zip([1, 8, 24], SHAPES[4:7]):
    fmt = BFPFormat(gm, dims, rounding)
    once = quantize(random_array(rng, shape, dims), fmt)
    np.testing.assert_array_equal(quantize(once, fmt).view(np.uint32), once.view(np.uint32))


def test_all_ones_block_with_24_bits_is_identity():
  rng = np.random.default_rng(3)
  x = random_array(rng, (4, 6, 5), (1, 1, 1))
  got = quantize(x, BFPFormat(24, (1, 1, 1)))
  np.testing.assert_array_equal(got.view(np.uint32), x.view(np.uint32))
  normals = x[np.isfinite(x) & (np.abs(x) >= 2.0 ** -126)]
  ref.assert_same_bits(quantize(normals, BFPFormat(24, (1,), "nearest")), normals)


@pytest.mark.parametrize("block, splits", [
    ((1, 24, 3, 3), {64: (2, 16), 128: (5, 8), 256: (10, 16), 512: (21, 8)}),   # FB12
    ((1, 12, 3, 3), {64: (5, 4), 128: (10, 8), 256: (21, 4), 512: (42, 8)}),    # FB16
    ((1, 6, 3, 3), {64: (10, 4), 128: (21, 2), 256: (42, 4), 512: (85, 2)}),    # FB24
])
def test_flexblock_channel_splits(block, splits):
  width = 256 if block[1] > 12 else 128 if block[1] > 6 else 64
  for channels, (full, rest) in splits.items():
    rows = jax.eval_shape(lambda x: group_rows(x, block)[0], jnp.ones((1, channels, 3, 3)))
    assert rows.shape == (full + 1, width)
  full, rest = splits[64]
  sizes, _ = group_sizes((1, 64, 3, 3), block)
  assert sizes.tolist() == [block[1] * 9] * full + [rest * 9]


def test_spatial_tiles_and_narrow_axes():
  rows = jax.eval_shape(lambda x: group_rows(x, (1, 24, 3, 3))[0], jnp.ones((2, 64, 32, 32)))
  assert rows.shape == (2 * 3 * 11 * 11, 256)
  sizes, _ = group_sizes((1, 24, 32, 32), (1, 24, 3, 3))
  sizes = sizes.reshape(11, 11)
  assert sizes[:10, :10].min() == 216 and sizes[:10, 10].tolist() == [144] * 10 and sizes[10, 10] == 96
  sizes, shape = group_sizes((8, 48, 1, 1), (1, 24, 3, 3))  # 1x1 conv weights
  assert shape == (16, 32) and sizes.tolist() == [24] * 16


@pytest.mark.parametrize("shape, dims", SHAPES, ids=str)
def test_group_rows_layout_and_round_trip(shape, dims):
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
  rows = np.asarray(jax.jit(lambda v: group_rows(v, dims)[0])(x))
  back = jax.jit(lambda v, r: group_rows(v, dims)[1](r))(x, rows)
  assert rows.shape[1] & (rows.shape[1] - 1) == 0
  dims = tuple(min(d, s) for d, s in zip(dims, shape))
  padded = np.zeros([-(-s // d) * d for s, d in zip(shape, dims)], np.float32)
  padded[tuple(slice(0, s) for s in shape)] = x
  for g, box in enumerate(boxes(padded.shape, dims)):
    np.testing.assert_array_equal(rows[g, :np.prod(dims)], padded[box].ravel())
    assert not rows[g, np.prod(dims):].any()
  assert rows.shape[0] == g + 1
  np.testing.assert_array_equal(np.asarray(back), x)


def test_stochastic_is_unbiased_and_uses_the_two_neighbours():
  fmt = BFPFormat(4, (8,), "stochastic")  # grid 1/8 below 2
  x = np.array([1.0, 0.3, -0.71, 0.05, -0.01, 1.83, 0.126, -1.5], np.float32)
  rbits = np.random.default_rng(0).integers(0, 2 ** 32, (20000, x.size), dtype=np.uint64)
  draws = np.asarray(jax.jit(jax.vmap(lambda r: bfp_quantize(jnp.asarray(x), fmt, r)))(
      jnp.asarray(rbits.astype(np.uint32))))
  step = 0.125
  down = np.sign(x) * np.floor(np.abs(x) / step) * step
  up = down + np.sign(x) * step
  assert np.all((draws == down) | (draws == up))
  p = (np.abs(x) - np.abs(down)) / step
  se = step * np.sqrt(p * (1 - p) / draws.shape[0])
  np.testing.assert_array_less(np.abs(draws.mean(0) - x), 5 * se + 1e-7)


# -- transformations and validation --------------------------------------------

def test_jit_and_vmap():
  rng = np.random.default_rng(11)
  x = random_array(rng, (4, 9, 10), (1, 4, 4))
  whole = quantize(x, BFPFormat(4, (1, 4, 4)))
  per_sample = jax.jit(jax.vmap(lambda r: bfp_quantize(r, BFPFormat(4, (4, 4)))))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(per_sample).view(np.uint32), whole.view(np.uint32))


def test_validation():
  with pytest.raises(ValueError, match="ndim"):
    bfp_quantize(jnp.ones((4, 4)), BFPFormat(4, (4,)))
  with pytest.raises(ValueError, match="rbits"):
    bfp_quantize(jnp.ones((4,)), BFPFormat(4, (4,), "stochastic"))


# -- the grouping against the previous XLA path ----------------------------------

def _previous_bfp_quantize(x, fmt, rbits=None, man=None):
  """`jlp.numerics.bfp.bfp_quantize` before issue 13, verbatim but for the docstring and one
  line break."""
  fmt.check_rank(x.ndim)
  if fmt.rounding == "stochastic" and rbits is None:
    raise ValueError("stochastic rounding needs rbits (uint32, x.shape)")
  shape = tuple(x.shape)
  dims = tuple(max(1, min(int(d), n)) for d, n in zip(fmt.block, shape))
  counts = tuple(-(-n // d) for n, d in zip(shape, dims))
  padded_shape = tuple(c * d for c, d in zip(counts, dims))
  split = tuple(v for cd in zip(counts, dims) for v in cd)
  ragged = padded_shape != shape

  u = to_bits(jnp.asarray(x, jnp.float32))
  exponents = (u >> 23) & u32(0xFF)
  if ragged:  # zeros never raise a group's maximum
    exponents = jnp.pad(exponents, [(0, p - n) for p, n in zip(padded_shape, shape)])
  group_max = jnp.max(exponents.reshape(split), axis=tuple(range(1, 2 * len(shape), 2)),
                      keepdims=True)
  group_max = jnp.broadcast_to(group_max, split).reshape(padded_shape)
  if ragged:
    group_max = group_max[tuple(slice(0, n) for n in shape)]
  r = None if fmt.rounding != "stochastic" else jnp.asarray(rbits, jnp.uint32)
  return from_bits(bfp_bits(u, group_max, fmt, r, man))


# Both grouping paths (last block entry < 8: one reduction over boxes; >= 8: runs along the
# last axis, as element-wise maxima of up to 32 runs of gcd(d, 8) or else one reduction, then
# the other axes), ragged tails on every axis, blocks wider than their axis, whole-array groups
# and rank 1 to 4; then random shapes and blocks.
GROUPING_CASES = [
    ((3, 1024), (1, 24)), ((2, 1000), (1, 24)), ((4, 7, 8, 50), (1, 3, 3, 24)),
    ((2, 6, 6, 48), (1, 3, 3, 24)), ((3, 50, 7, 7), (1, 24, 3, 3)), ((5, 70), (1, 16)),
    ((37,), (8,)), ((301,), (264,)), ((9, 300), (2, 264)), ((6, 90), (1, 40)),
    ((4, 3, 33), (2, 2, 9)), ((11, 13), (4, 4)), ((40, 6), (16, 1)), ((3, 5), (4, 8)),
    ((2, 3, 4, 5), (1, 1, 1, 1)), ((7, 9, 17), (3, 1, 8)),
]


def _random_grouping_cases(count, seed=13):
  rng = np.random.default_rng(seed)
  cases = []
  for _ in range(count):
    rank = int(rng.integers(1, 5))
    shape = tuple(int(n) for n in rng.integers(1, 13, rank - 1)) + (int(rng.integers(1, 120)),)
    block = tuple(int(rng.integers(1, n + 3)) for n in shape[:-1]) + (int(rng.integers(1, 41)),)
    cases.append((shape, block))
  return cases


# Slow, each with a default case on the same branches of `group_exponent_maxima`: (2, 1000)
# (runs of lanes with a ragged tail: (3, 1024)), (5, 70) and (6, 90) (the same, 2 and 5 runs),
# (40, 6) (boxes only, padded: (11, 13)), (7, 9, 17) (one reduction along the last axis, then the
# outer boxes: (9, 300)), (2, 3, 4, 5) (boxes only, no padding: (3, 5) with the block (4, 8), and
# rank 4 in (3, 50, 7, 7)), and the random cases.
_SLOW_GROUPING = {((2, 1000), (1, 24)), ((5, 70), (1, 16)), ((6, 90), (1, 40)),
                  ((40, 6), (16, 1)), ((7, 9, 17), (3, 1, 8)), ((2, 3, 4, 5), (1, 1, 1, 1))}


# The casts of a case: each rounding and a traced width (VARIANTS). They share the grouping (the
# group maxima, then the same `bfp_bits` on both sides), so each default case casts one variant
# (the variants in turn over the default cases, each on two or three of them) and its other three
# variants are slow.
VARIANTS = ("truncate", "nearest", "stochastic", "traced man")


def _grouping_params():
  params = []
  for i, c in enumerate(GROUPING_CASES + _random_grouping_cases(8)):
    name = str(c[0]) + "-" + str(c[1])
    if c in _SLOW_GROUPING or i >= len(GROUPING_CASES):
      params.append(pytest.param(*c, tuple(range(4)), marks=pytest.mark.slow, id=name))
      continue
    default = _DEFAULT_VARIANT[c]
    rest = tuple(v for v in range(4) if v != default)
    params.append(pytest.param(*c, (default,), id=f"{name}-{VARIANTS[default]}"))
    params.append(pytest.param(*c, rest, marks=pytest.mark.slow,
                               id=f"{name}-" + "+".join(VARIANTS[v] for v in rest)))
  return params


_DEFAULT_GROUPING = [c for c in GROUPING_CASES if c not in _SLOW_GROUPING]
_DEFAULT_VARIANT = {c: i % len(VARIANTS) for i, c in enumerate(_DEFAULT_GROUPING)}


@pytest.mark.parametrize("shape, block, variants", _grouping_params())
def test_grouping_matches_previous_xla_path(shape, block, variants, request):
  """Reference: `_previous_bfp_quantize`, every rounding and a traced width (`variants` of
  VARIANTS), bit for bit, on `random_array` values (zeros, subnormals, inf, NaN,
  zero/subnormal-only groups)."""
  fmts, args = grouping_inputs(shape, block)
  if variants == (_DEFAULT_VARIANT.get((shape, block)),):  # cast with the other default cases
    bfmts, bargs, got, want = request.getfixturevalue("default_groupings")[(shape, block)]
    assert bfmts == fmts and all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                                 for a, b in zip(args, bargs, strict=True))
  else:
    got, want = jax.jit(lambda args: (
        grouping_casts(bfp_quantize, fmts, *args, variants=variants),
        grouping_casts(_previous_bfp_quantize, fmts, *args, variants=variants)))(args)
  labels = [str(fmts[v]) if v < 3 else "traced man" for v in variants]
  for label, g, w in zip(labels, got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32),
                                  err_msg=label)


def grouping_inputs(shape, block):
  """The formats (each rounding, a random width) and (x, rbits, traced width) of a case."""
  rng = np.random.default_rng(sum(shape) * 31 + sum(block))
  dims = tuple(min(d, n) for d, n in zip(block, shape))
  x = random_array(rng, shape, dims)
  rbits = rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)
  fmts = [BFPFormat(int(rng.integers(1, 25)), block, r)
          for r in ("truncate", "nearest", "stochastic")]
  return fmts, (x, rbits, np.int32(rng.integers(1, 25)))


def grouping_casts(quantize_fn, fmts, x, r, m, variants=tuple(range(len(VARIANTS)))):
  """The casts `variants` (indices into VARIANTS: fmts[0..2], fmts[0] with the traced width m)."""
  return [quantize_fn(x, fmts[v], r if fmts[v].rounding == "stochastic" else None) if v < 3
          else quantize_fn(x, fmts[0], None, man=m) for v in variants]


@pytest.fixture(scope="module")
def default_groupings():
  """{case: (fmts, args, casts, previous casts)} of the default tier's cases of
  test_grouping_matches_previous_xla_path, all in one jitted program (a program per case
  compiles each apart)."""
  cases = [grouping_inputs(*c) for c in _DEFAULT_GROUPING]
  variants = [(_DEFAULT_VARIANT[c],) for c in _DEFAULT_GROUPING]
  outs = jax.jit(lambda all_args: [
      (grouping_casts(bfp_quantize, fmts, *args, variants=v),
       grouping_casts(_previous_bfp_quantize, fmts, *args, variants=v))
      for (fmts, _), args, v in zip(cases, all_args, variants)])([args for _, args in cases])
  return {c: (fmts, args, got, want)
          for c, (fmts, args), (got, want) in zip(_DEFAULT_GROUPING, cases, outs, strict=True)}
