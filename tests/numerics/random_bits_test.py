"""Stochastic rounding's random bits (`jlp.numerics.random_bits`): stream, statistics, sharding.

References: Random123's known-answer vectors for Threefry-2x32-20 (the same ones jax tests);
`references.threefry2x32_20` / `references.stochastic_draws` (numpy, written from the SC'11
paper and the documented streams); `jax.random.bits` for the "jax" stream. The statistical
tests use fixed keys (deterministic) with bounds at about 4 standard deviations; each is shown
to reject a weak stream, so it can fail.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jlp
from jlp import FloatFormat
from jlp.numerics import random_bits as rb
from jlp.numerics.float_cast import float_cast
from jlp.quantize import backward_key
import references as ref

KEY = jax.random.fold_in(jax.random.key(2024), 7)
N_STAT = 1 << 21


def key_ints(key):
  return [int(v) for v in np.asarray(jax.random.key_data(key))]


@pytest.mark.parametrize("key,counter,want", [
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
])
def test_threefry_matches_random123_known_answers(key, counter, want):
  c = tuple(np.array([v], np.uint32) for v in counter)
  assert tuple(int(w[0]) for w in ref.threefry2x32_20(key, c)) == want
  got = jax.jit(rb.threefry2x32)(np.uint32(key[0]), np.uint32(key[1]), *c)
  assert tuple(int(w[0]) for w in got) == want


_STREAM_CASES = [((7,), 0), ((3, 5, 4), 0), ((33,), 1), ((8, 6), 10), ((10,), 2 ** 32 - 5),
                 ((5, 3), 2 ** 45 + 3)]
# Default: "pairs" with an odd size, an odd offset, a carry into the high word and a 64-bit offset,
# "jax" with an even size and offset, an even offset, the carry and the 64-bit offset (each
# (shape, offset) with at least one stream, the aligned and unaligned "pairs" paths); the others
# slow.
_STREAM_DEFAULT = {((7,), 0, "pairs"), ((33,), 1, "pairs"), ((8, 6), 10, "pairs"),
                   ((10,), 2 ** 32 - 5, "pairs"), ((5, 3), 2 ** 45 + 3, "pairs"),
                   ((3, 5, 4), 0, "jax"), ((8, 6), 10, "jax"), ((10,), 2 ** 32 - 5, "jax"),
                   ((5, 3), 2 ** 45 + 3, "jax")}


@pytest.mark.parametrize("shape,offset,rng", [
    pytest.param(shape, offset, rng, id=f"{rng}-{shape}-{offset}",
                 marks=() if (shape, offset, rng) in _STREAM_DEFAULT else pytest.mark.slow)
    for rng in ("pairs", "jax") for shape, offset in _STREAM_CASES])
def test_streams_match_the_reference(shape, offset, rng):
  n = math.prod(shape)
  # the static and (below 2^31) the traced offset in one program
  both = jax.jit(lambda k, o: (rb.random_bits(k, shape, index_offset=offset, rng=rng),
                               None if o is None else rb.random_bits(k, shape, index_offset=o,
                                                                     rng=rng)))
  got, traced = both(KEY, jnp.int32(offset) if offset < 2 ** 31 else None)
  got = np.asarray(got)
  np.testing.assert_array_equal(got.ravel(), ref.stochastic_draws(key_ints(KEY), n, offset, rng))
  if offset < 2 ** 31:
    np.testing.assert_array_equal(np.asarray(traced), got)


def test_jax_stream_is_jax_random_bits():
  shapes = [(5,), (3, 7), (2, 3, 4), (64, 33)]
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 9)).astype(np.float32))
  fmt = FloatFormat(4, 3, rounding="stochastic")

  @jax.jit  # one program (eagerly, each op compiles on its own for each shape)
  def streams(k, x):
    return ([(rb.random_bits(k, s, rng="jax"), jax.random.bits(k, s, jnp.uint32)) for s in shapes],
            float_cast(x, fmt, key=k, rng="jax"), jax.random.bits(k, x.shape, jnp.uint32))

  pairs, cast, bits = streams(KEY, x)
  for got, want in pairs:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  ref.assert_same_bits(cast, ref.round_to_format(np.asarray(x), fmt, np.asarray(bits)))


def test_deterministic_per_key_and_flat_index():
  a = np.asarray(rb.random_bits(KEY, (48, 16)))  # eagerly; the rest in one program
  jitted, flat, b = jax.jit(lambda k: (rb.random_bits(k, (48, 16)), rb.random_bits(k, (768,)),
                                       rb.random_bits(jax.random.fold_in(k, 1), (48, 16))))(KEY)
  np.testing.assert_array_equal(a, np.asarray(jitted))
  np.testing.assert_array_equal(a.ravel(), np.asarray(flat))
  assert np.mean(a == np.asarray(b)) < 0.01


def test_argument_errors():
  with pytest.raises(ValueError, match="rng='philox'"):
    rb.random_bits(KEY, (4,), rng="philox")
  with pytest.raises(ValueError, match="index_offset=-1"):
    rb.random_bits(KEY, (4,), index_offset=-1)
  with pytest.raises(ValueError, match="index_offset of shape"):
    rb.random_bits(KEY, (4,), index_offset=jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match="threefry2x32"):
    rb.random_bits(jax.random.key(0, impl="rbg"), (4,))


# -- statistics ------------------------------------------------------------------------------


def chi_square_z(counts: np.ndarray) -> float:
  """Pearson's chi-square statistic of uniform-bin counts as a standard normal deviate
  (Wilson-Hilferty; k = bins - 1 >= 255 degrees of freedom)."""
  counts = counts.astype(np.float64)
  expected = counts.sum() / counts.size
  x2 = float(((counts - expected) ** 2).sum() / expected)
  k = counts.size - 1
  return ((x2 / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))


def byte_statistics(words: np.ndarray) -> dict:
  """z of: all bytes (256 bins); pairs of consecutive bytes in a word; the top bytes of
  neighbouring elements 2i, 2i+1 and 2i+1, 2i+2 (65536 bins each)."""
  b = words.view(np.uint8).reshape(-1, 4).astype(np.int64)  # little endian: b[:, 3] is the top
  top = b[:, 3]
  pair = lambda hi, lo: np.bincount(hi * 256 + lo, minlength=65536)
  return {
      "bytes": chi_square_z(np.bincount(b.ravel(), minlength=256)),
      "byte pairs": chi_square_z(pair(np.concatenate([b[:, 1], b[:, 3]]),
                                      np.concatenate([b[:, 0], b[:, 2]]))),
      "elements 2i, 2i+1": chi_square_z(pair(top[0::2], top[1::2])),
      "elements 2i+1, 2i+2": chi_square_z(pair(top[1:-1:2], top[2::2])),
  }


@pytest.fixture(scope="module")
def stat_streams():
  """N_STAT draws of KEY's "pairs" and "jax" streams and of the "pairs" streams of its backward
  key and of a neighbouring folded key, from one jitted program (shared by the statistical tests;
  eagerly each stream would be generated again op by op)."""
  streams = jax.jit(lambda k: {
      "pairs": rb.random_bits(k, (N_STAT,), rng="pairs"),
      "jax": rb.random_bits(k, (N_STAT,), rng="jax"),
      "backward": rb.random_bits(backward_key(k), (N_STAT,)),
      "folded": rb.random_bits(jax.random.fold_in(k, 2), (N_STAT,))})(KEY)
  return {name: np.asarray(words) for name, words in streams.items()}


@pytest.mark.parametrize("rng", ["pairs", "jax"])
def test_bytes_and_byte_pairs_are_uniform(rng, stat_streams):
  words = stat_streams[rng]
  z = byte_statistics(words)
  assert all(abs(v) < 4.5 for v in z.values()), z


def lcg_stream(n: int) -> np.ndarray:
  """x_{i+1} = 69069 x_i + 1 mod 2^32 from x_0 = 1: a classic weak generator (its low bytes
  have short periods and its low bits alternate)."""
  powers = np.cumprod(np.full(n, 69069, np.uint64))  # 69069^(i+1) mod 2^64
  sums = np.cumsum(np.concatenate([[np.uint64(1)], powers[:-1]]))  # sum_{j<=i} 69069^j
  return ((powers + sums) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def test_the_tests_reject_weak_streams():
  lcg = lcg_stream(N_STAT)
  assert max(abs(v) for v in byte_statistics(lcg).values()) > 50
  g = np.arange(N_STAT, dtype=np.uint64)
  weyl = ((g * 0x9E3779B9) & 0xFFFFFFFF).astype(np.uint32)  # a hash-free counter stream
  assert byte_statistics(weyl)["elements 2i, 2i+1"] > 50
  assert max(abs(c) for c in neighbour_correlations(lcg)) > 10 * 4.5 / math.sqrt(N_STAT)


def correlations(u: np.ndarray, v: np.ndarray) -> float:
  u = u.astype(np.float64) - u.mean()
  v = v.astype(np.float64) - v.mean()
  return float((u * v).sum() / math.sqrt((u * u).sum() * (v * v).sum()))


def neighbour_correlations(words: np.ndarray) -> list:
  """Pearson correlations of the draws (and of single bits) of elements i and i + lag."""
  out = []
  for lag in (1, 2, 3, 1024):
    out.append(correlations(words[:-lag], words[lag:]))
    for bit in (0, 15, 31):
      w = (words >> np.uint32(bit)) & np.uint32(1)
      out.append(correlations(w[:-lag], w[lag:]))
  return out


def test_no_correlation_between_neighbouring_elements(stat_streams):
  bound = 4.5 / math.sqrt(N_STAT)
  for rng in ("pairs", "jax"):
    words = stat_streams[rng]
    assert max(abs(c) for c in neighbour_correlations(words)) < bound, rng
  # the forward ("pairs", the default stream) and backward streams, and the streams of
  # neighbouring folded keys
  fwd = stat_streams["pairs"]
  for other in ("backward", "folded"):
    assert abs(correlations(fwd, stat_streams[other])) < bound, other


# -- stochastic rounding with a key ------------------------------------------------------------


@pytest.mark.parametrize("fmt", [FloatFormat(4, 3, rounding="stochastic"),
                                 FloatFormat(2, 1, rounding="stochastic")], ids=repr)
def test_keyed_rounding_is_unbiased_and_uses_the_two_neighbours(fmt):
  """Mean over 4000 keys (and over 2^16 elements of one key) within 5 standard errors of x."""
  x = np.array([0.3, -1.1, 2.7, 0.013, 0.0021, -5.5], np.float32)
  if fmt.exp == 2:
    x = np.array([0.3, -1.1, 2.7, 0.13, 0.21, -1.7], np.float32)
  down = ref.round_to_format(x, FloatFormat(fmt.exp, fmt.man, rounding="truncate"))
  values = np.sort(np.abs(ref.format_values(fmt)))
  up = np.sign(x) * values[np.searchsorted(values, np.abs(down), side="right")]
  p = (np.abs(x) - np.abs(down)) / (np.abs(up) - np.abs(down))
  keys = jax.random.split(KEY, 4000)
  both = jax.jit(lambda keys, xs: (  # one program
      jax.vmap(lambda k: jlp.quantize(jnp.asarray(x), fmt, key=k))(keys),
      jlp.quantize(xs, fmt, key=KEY)))
  over_keys, over_elements = both(keys, jnp.asarray(np.repeat(x, 1 << 16)))
  over_keys = np.asarray(over_keys)
  over_elements = np.asarray(over_elements).reshape(x.size, -1).T
  for draws in (over_keys, over_elements):
    assert np.all((draws == down) | (draws == up))
    se = np.abs(up - down) * np.sqrt(p * (1 - p) / draws.shape[0])
    np.testing.assert_array_less(np.abs(draws.mean(0) - x), 5 * se + 1e-7)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
# Slow: (4, 6); with (3, 5) the shards have even and odd offsets (draw pairs split between
# shards), the static blocks take the unaligned "pairs" path and the unsharded calls (even size,
# offset 0) the aligned one, each impl.
@pytest.mark.parametrize("local_shape", [pytest.param((4, 6), marks=pytest.mark.slow, id="(4, 6)"),
                                         (3, 5)], ids=str)
def test_sharded_equals_unsharded_on_8_devices(impl, local_shape):
  """Leading-axis shard_map with index_offset = axis_index * local size, forward and
  backward, equals the unsharded call bit for bit (odd local sizes included)."""
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  rows, cols = local_shape
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8 * rows, cols)).astype(np.float32))
  w = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape).astype(np.float32))
  fmt = FloatFormat(4, 3, rounding="stochastic")

  def value_and_grad(x, w, offset):
    return jax.value_and_grad(lambda x: jnp.sum(jlp.quantize(
        x, fmt, bwd=fmt, key=KEY, impl=impl, index_offset=offset) * w))(x)

  def forward(x, offset):
    return jlp.quantize(x, fmt, key=KEY, impl=impl, index_offset=offset)

  def local(xb, wb):
    offset = lax.axis_index("d") * xb.size
    return forward(xb, offset), value_and_grad(xb, wb, offset)[1]

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d")),
                                  out_specs=(P("d"), P("d")), check_vma=False))
  q, g = sharded(x, w)
  n = rows * cols
  # unsharded, and with static offsets each block on its own, in one program
  q1, g1, blocks = jax.jit(lambda x, w: (
      forward(x, 0), value_and_grad(x, w, 0)[1],
      jnp.concatenate([forward(x[i * rows:(i + 1) * rows], i * n) for i in range(8)])))(x, w)
  ref.assert_same_bits(q, q1)
  ref.assert_same_bits(g, g1)
  ref.assert_same_bits(blocks, q)
