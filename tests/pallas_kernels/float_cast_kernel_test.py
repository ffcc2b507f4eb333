"""The float cast Pallas kernel (interpret mode) against its XLA path, bit for bit.

Reference: `jlp.numerics.float_cast.float_cast`. Results are compared as uint32
bit patterns (NaN payloads and signed zeros included). Grids stay at <= 16 steps.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.formats import FloatFormat
from jlp.numerics import float_cast as xla_cast
from pallas_kernels.float_cast import float_cast

BLOCK = 1024
SPECIAL_BITS = np.array([
    0x00000000, 0x80000000,                          # ±0
    0x7F800000, 0xFF800000,                          # ±inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,  # quiet / signalling NaNs, payloads
    0x7FBFFFFF, 0x7FFFFFFF, 0xFF812345,
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # float32 subnormals
    0x00400000, 0x00000200, 0x80012345,
    0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF,  # min normal, max finite
    0x3F800000, 0xBF800000, 0x43700000, 0x47600000,  # 1, -1, 240 (e4m3 max), 57344 (e5m2 max)
    0x43F00000, 0x43E00000, 0x40C00000, 0x477FE000,  # 480, 448 (e4m3fn max), 6, 65504
], np.uint32)


def sampled_bits(n: int, seed: int = 0) -> np.ndarray:
  """n uint32 float32 bit patterns: specials, uniform patterns, N(0,1), wide range."""
  rng = np.random.default_rng(seed)
  m = max(n, 4 * SPECIAL_BITS.size)
  k = (m - SPECIAL_BITS.size) // 3
  patterns = rng.integers(0, 2 ** 32, size=m - SPECIAL_BITS.size - 2 * k, dtype=np.uint64)
  normal = rng.standard_normal(k).astype(np.float32)
  with np.errstate(over="ignore"):
    wide = (rng.standard_normal(k) * 2.0 ** rng.integers(-150, 128, k)).astype(np.float32)
  out = np.concatenate([SPECIAL_BITS, patterns.astype(np.uint32),
                        normal.view(np.uint32), wide.view(np.uint32)])
  return rng.permutation(out)[:n]


def random_bits(shape, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32)


def assert_bits_equal(got, want, x, fmt=None):
  got = np.asarray(got, np.float32).view(np.uint32)
  want = np.asarray(want, np.float32).view(np.uint32)
  assert got.shape == want.shape
  bad = np.flatnonzero(got.ravel() != want.ravel())
  if bad.size:
    xb = np.asarray(x, np.float32).view(np.uint32).ravel()
    detail = [(hex(xb[i]), hex(want.ravel()[i]), hex(got.ravel()[i])) for i in bad[:8]]
    raise AssertionError(f"{fmt}: {bad.size} of {got.size} differ; (x, want, got): {detail}")


def _casts(fmts: tuple, cast_fn):
  """One jitted function applying `cast_fn` for every format (one compile for all)."""
  return jax.jit(lambda x, r: [cast_fn(x, f, r if f.rounding == "stochastic" else None)
                               for f in fmts])


@functools.lru_cache(maxsize=None)
def _kernel_fn(fmts: tuple, block_size: int):
  return _casts(fmts, functools.partial(float_cast, interpret=True, block_size=block_size))


@functools.lru_cache(maxsize=None)
def _xla_fn(fmts: tuple):
  return _casts(fmts, xla_cast.float_cast)


def check(x: np.ndarray, fmts, block_size: int = BLOCK, seed: int = 1):
  """Kernel == XLA path for each format (grouped so that they share one compile)."""
  fmts = tuple(fmts)
  rbits = random_bits(x.shape, seed)
  for fmt, got, want in zip(fmts, _kernel_fn(fmts, block_size)(x, rbits), _xla_fn(fmts)(x, rbits),
                            strict=True):
    assert got.dtype == jnp.float32 and got.shape == x.shape
    assert_bits_equal(got, want, x, fmt)


FORMAT_GROUPS = {
    "ml_dtypes": [FloatFormat.from_name(n) for n in (
        "e4m3", "e5m2", "float16", "bfloat16", "float8_e4m3fn", "float4_e2m1fn")],
    "options": [
        FloatFormat.from_name("e4m3", overflow="saturate"),
        FloatFormat.from_name("float8_e4m3fn", overflow="saturate"),
        FloatFormat.from_name("e5m2", subnormals=False),
        FloatFormat.from_name("e4m3", rounding="truncate"),
        FloatFormat.from_name("e8m0", rounding="truncate"),
    ],
    "stochastic": [
        FloatFormat.from_name("e4m3", rounding="stochastic"),
        FloatFormat.from_name("bfloat16", rounding="stochastic"),
        FloatFormat.from_name("float4_e2m1fn", rounding="stochastic", subnormals=False),
    ],
    "cpd": [FloatFormat(5, 2, compat="cpd"), FloatFormat(8, 7, compat="cpd")],
    "qtorch": [
        FloatFormat(4, 3, compat="qtorch"),
        FloatFormat(5, 2, rounding="stochastic", compat="qtorch"),
        FloatFormat(8, 7, rounding="stochastic", compat="qtorch"),
    ],
}


@pytest.mark.parametrize("group", FORMAT_GROUPS)
def test_matches_xla_path_on_sampled_bit_patterns(group):
  # 16 tiles, the last one padded.
  x = sampled_bits(16 * BLOCK - 3).view(np.float32)
  check(x, FORMAT_GROUPS[group])


E4M3_SR = FloatFormat.from_name("e4m3", rounding="stochastic")


@pytest.mark.parametrize("shape,block_size,fmt", [
    ((), 1024, FloatFormat.from_name("e4m3")),    # a scalar: one tile of 1
    ((1,), 1024, E4M3_SR),
    ((3, 5, 7), 16, E4M3_SR),                     # 105 elements: 7 tiles, 7 padded
    ((2, 3, 4, 5), 8, FloatFormat.from_name("e5m2")),  # 120 elements: 15 tiles
    ((16, 64), 64, E4M3_SR),                      # no padding
    ((100,), 4096, FloatFormat.from_name("e4m3")),  # smaller than a tile: one tile of 128
], ids=str)
def test_odd_shapes_and_padding(shape, block_size, fmt):
  n = int(np.prod(shape, dtype=np.int64))
  x = sampled_bits(n, seed=n).view(np.float32).reshape(shape)
  check(x, [fmt], block_size)


def test_default_block_size():
  # 8000 elements: 2 tiles of 4096, the second padded.
  fmt = FloatFormat.from_name("float8_e4m3fn")
  x = jnp.asarray(sampled_bits(8000).view(np.float32).reshape(8, 1000))
  got = jax.jit(lambda x: float_cast(x, fmt, interpret=True))(x)
  assert_bits_equal(got, _xla_fn((fmt,))(x, None)[0], x, fmt)


def test_empty_array():
  x = jnp.zeros((0, 3), jnp.float32)
  out = float_cast(x, FloatFormat.from_name("e4m3"), interpret=True)
  assert out.shape == (0, 3) and out.dtype == jnp.float32


def test_vmap():
  x = sampled_bits(4 * 300).view(np.float32).reshape(4, 300)
  r = random_bits(x.shape)
  kernel = jax.jit(jax.vmap(lambda x, r: float_cast(x, E4M3_SR, r, interpret=True, block_size=128)))
  assert_bits_equal(kernel(x, r), _xla_fn((E4M3_SR,))(x, r)[0], x, E4M3_SR)


def test_same_rbits_give_same_result_different_rbits_differ():
  x = jnp.full((1024,), 1.0 + 2.0 ** -4, jnp.float32)  # halfway between 1 and 1.125
  f = lambda r: _kernel_fn((E4M3_SR,), 256)(x, r)[0]
  a, b = f(random_bits(x.shape, 3)), f(random_bits(x.shape, 4))
  assert_bits_equal(a, f(random_bits(x.shape, 3)), x)
  assert not np.array_equal(np.asarray(a), np.asarray(b))
  assert 0.4 < float(jnp.mean(a == 1.125)) < 0.6


def test_argument_errors():
  x = jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError, match="rbits"):
    float_cast(x, FloatFormat.from_name("e4m3", rounding="stochastic"), interpret=True)
  with pytest.raises(ValueError, match="rbits"):
    float_cast(x, FloatFormat.from_name("e4m3", rounding="stochastic"),
               jnp.ones((4,), jnp.uint32), interpret=True)
  with pytest.raises(ValueError, match="block_size"):
    float_cast(x, FloatFormat.from_name("e4m3"), interpret=True, block_size=1000)
  with pytest.raises(ValueError, match="float32"):
    float_cast(x.astype(jnp.bfloat16), FloatFormat.from_name("e4m3"), interpret=True)
  with pytest.raises(TypeError):
    float_cast(x, "e4m3", interpret=True)


# -- draws generated in the kernel from a key ---------------------------------------------------

KEY = jax.random.fold_in(jax.random.key(11), 3)


@functools.lru_cache(maxsize=None)
def _keyed_fns(fmts: tuple, block_size: int, rng: str, offset):
  """(kernel, XLA path) for every format, jitted; offset None means a traced int32 argument."""
  def casts(cast_fn):
    def f(x, key, traced_offset):
      off = traced_offset if offset is None else offset
      return [cast_fn(x, fmt, key=key, index_offset=off, rng=rng) for fmt in fmts]
    return jax.jit(f)
  return (casts(functools.partial(float_cast, interpret=True, block_size=block_size)),
          casts(xla_cast.float_cast))


KEYED_FORMATS = tuple(FORMAT_GROUPS["stochastic"]) + (FloatFormat(5, 2, rounding="stochastic",
                                                                 compat="qtorch"),)
KEYED_LAYOUTS = [
    ((16 * BLOCK - 4,), BLOCK, 0, "pairs"),   # 16 tiles of (512, 2) rows, the last one padded
    ((3, 5, 7), 16, 0, "pairs"),              # odd size: one hash per element
    ((16, 64), 64, 2 ** 32 - 6, "pairs"),     # pair counters carry into the high word
    ((100,), 32, 7, "pairs"),                 # odd static offset
    ((100,), 32, None, "pairs"),              # traced offset (7)
    ((2, 3, 4, 5), 8, 2 ** 40 + 2, "jax"),
    ((1,), 1024, 0, "pairs"),
    ((2,), 1, 0, "pairs"),                    # block_size 1: pair tiles of one row
]


def _keyed_params():
  """The first layout with every format; each other layout with one format (in turn) in the
  default tier and the other three slow: the draws (counters, offsets, tiles) do not depend on
  the format, and each format's cast of them runs on the first layout."""
  params = [pytest.param(*KEYED_LAYOUTS[0], KEYED_FORMATS, id=str(KEYED_LAYOUTS[0]))]
  for i, layout in enumerate(KEYED_LAYOUTS[1:]):
    one = KEYED_FORMATS[i % len(KEYED_FORMATS)]
    rest = tuple(f for f in KEYED_FORMATS if f != one)
    params.append(pytest.param(*layout, (one,), id=f"{layout}-{one!r}"))
    params.append(pytest.param(*layout, rest, id=f"{layout}-others", marks=pytest.mark.slow))
  return params


@pytest.mark.parametrize("shape,block_size,offset,rng,fmts", _keyed_params())
def test_keyed_matches_xla_path(shape, block_size, offset, rng, fmts):
  n = int(np.prod(shape, dtype=np.int64))
  x = sampled_bits(max(n, 128), seed=n)[:n].view(np.float32).reshape(shape)
  kernel, xla = _keyed_fns(fmts, block_size, rng, offset)
  for fmt, got, want in zip(fmts, kernel(x, KEY, jnp.int32(7)), xla(x, KEY, jnp.int32(7)),
                            strict=True):
    assert got.dtype == jnp.float32 and got.shape == x.shape
    assert_bits_equal(got, want, x, fmt)


def test_keyed_vmap_over_keys():
  x = sampled_bits(4 * 300).view(np.float32).reshape(4, 300)
  keys = jax.random.split(KEY, 4)
  kernel = jax.jit(jax.vmap(lambda x, k: float_cast(x, E4M3_SR, key=k, interpret=True,
                                                    block_size=128)))
  xla = jax.jit(lambda x, k: xla_cast.float_cast(x, E4M3_SR, key=k))  # one compile, not per op
  want = np.stack([np.asarray(xla(x[i], keys[i])) for i in range(4)])
  assert_bits_equal(kernel(x, keys), want, x, E4M3_SR)


def test_keyed_argument_errors():
  x = jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError, match="rng='threefry'"):
    float_cast(x, E4M3_SR, key=KEY, rng="threefry", interpret=True)
  with pytest.raises(ValueError, match="index_offset=-1"):
    float_cast(x, E4M3_SR, key=KEY, index_offset=-1, interpret=True)
