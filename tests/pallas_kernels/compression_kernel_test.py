"""The compression kernels (interpret mode): bit packing and threshold selection.

References: for pack_bits / unpack_bits, numpy written from the layout (code i's low `bits`
bits at bit offset bits*(i mod 8/bits) of byte i // (8/bits), tail slots `pad`), and the XLA
path `jlp.compression.ops.pack_bits_xla` / `unpack_bits_xla`, both bit for bit; for
threshold_select, `np.nonzero(np.abs(v) > thr)` cut at the capacity and filled with n, and the
XLA path `jlp.compression.ops.capacity_filter`. Grids stay at <= 16 steps.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.compression import ops
from pallas_kernels import pack_bits as pack_kernel
from pallas_kernels import threshold_select as select_kernel

BITS = (1, 2, 4, 8)
# (n, block_codes): one partial tile, exact tiles, ragged multi-tile grids of up to 16 steps.
SIZES = ((1, 8192), (3, 8192), (31, 8192), (1000, 8192), (2048, 256), (4000, 256), (777, 64))


def pack_reference(codes: np.ndarray, bits: int, pad: int) -> np.ndarray:
  per = 8 // bits
  n = codes.size
  m = -(-n * bits // 8)
  slots = np.full(m * per, pad, np.uint64)
  slots[:n] = codes & ((1 << bits) - 1)
  out = np.zeros(m, np.uint64)
  for i in range(per):
    out |= slots[i::per] << np.uint64(bits * i)
  return out.astype(np.uint8)


def unpack_reference(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
  per = 8 // bits
  i = np.arange(n)
  return ((packed[i // per] >> (bits * (i % per))) & ((1 << bits) - 1)).astype(np.uint8)


def codes_for(n: int, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {"random": rng.integers(0, 256, n).astype(np.uint8),  # high bits set: dropped
          "zeros": np.zeros(n, np.uint8), "max": np.full(n, 255, np.uint8)}


@functools.lru_cache(maxsize=None)
def _pack_fns(bits: int, pad: int, block_codes: int):
  kernel = jax.jit(functools.partial(pack_kernel.pack_bits, bits=bits, pad=pad, interpret=True,
                                     block_codes=block_codes))
  xla = jax.jit(functools.partial(ops.pack_bits_xla, bits=bits, pad=pad))
  return kernel, xla


@functools.lru_cache(maxsize=None)
def _unpack_fns(bits: int, n: int, block_codes: int):
  kernel = jax.jit(functools.partial(pack_kernel.unpack_bits, bits=bits, n=n, interpret=True,
                                     block_codes=block_codes))
  xla = jax.jit(functools.partial(ops.unpack_bits_xla, bits=bits, n=n))
  return kernel, xla


# The default tier runs every width on a ragged multi-tile grid (4000, 256), exact tiles
# (2048, 256) with 1 and 8 bits, and each other size with one width; the kernels take the same
# branches (tail padding or not, one or several tiles) for the other (size, bits) pairs, slow.
_SIZES_DEFAULT = {(4000, 256, b) for b in BITS} | {
    (2048, 256, 1), (2048, 256, 8), (1, 8192, 1), (3, 8192, 2), (31, 8192, 4), (1000, 8192, 8),
    (777, 64, 2)}
SIZES_BITS = [pytest.param(n, block_codes, bits, id=f"{(n, block_codes)}-{bits}",
                           marks=() if (n, block_codes, bits) in _SIZES_DEFAULT
                           else pytest.mark.slow)
              for n, block_codes in SIZES for bits in BITS]


@pytest.mark.parametrize("n,block_codes,bits", SIZES_BITS)
def test_pack_bits_matches_reference_and_xla(bits, n, block_codes):
  for pad in sorted({0, 1, (1 << bits) - 1}):
    kernel, xla = _pack_fns(bits, pad, block_codes)
    for name, codes in codes_for(n, seed=n + bits).items():
      want = pack_reference(codes, bits, pad)
      got = np.asarray(kernel(codes))
      assert got.dtype == np.uint8 and got.shape == want.shape
      np.testing.assert_array_equal(got, want, err_msg=f"{name} pad={pad}")
      np.testing.assert_array_equal(np.asarray(xla(jnp.asarray(codes))), want)


@pytest.mark.parametrize("n,block_codes,bits", SIZES_BITS)
def test_unpack_bits_matches_reference_and_xla(bits, n, block_codes):
  kernel, xla = _unpack_fns(bits, n, block_codes)
  m = -(-n * bits // 8)
  rng = np.random.default_rng(n * bits)
  # Every byte pattern (unused tail slots included), all-zero and all-one bytes.
  for packed in (rng.integers(0, 256, m).astype(np.uint8), np.zeros(m, np.uint8),
                 np.full(m, 255, np.uint8)):
    want = unpack_reference(packed, bits, n)
    got = np.asarray(kernel(packed))
    assert got.dtype == np.uint8 and got.shape == (n,)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(xla(jnp.asarray(packed))), want)


@pytest.mark.parametrize("bits", BITS)
def test_unpack_inverts_pack(bits):
  # n = 4000 in tiles of 256 (ragged): the jitted kernels of the (4000, 256) cases above, default
  # pad, so no further compile.
  n = 4000
  codes = np.random.default_rng(bits).integers(0, 1 << bits, n).astype(np.uint8)
  packed = _pack_fns(bits, 0, 256)[0](codes)
  np.testing.assert_array_equal(np.asarray(_unpack_fns(bits, n, 256)[0](packed)), codes)


def test_pack_bits_empty_and_invalid():
  assert pack_kernel.pack_bits(np.zeros(0, np.uint8), 2, interpret=True).shape == (0,)
  assert pack_kernel.unpack_bits(np.zeros(0, np.uint8), 2, 0, interpret=True).shape == (0,)
  codes = np.zeros(8, np.uint8)
  with pytest.raises(ValueError, match="bits=3"):
    pack_kernel.pack_bits(codes, 3, interpret=True)
  with pytest.raises(ValueError, match="pad=4"):
    pack_kernel.pack_bits(codes, 2, 4, interpret=True)
  with pytest.raises(ValueError, match="block_codes=100"):
    pack_kernel.pack_bits(codes, 2, interpret=True, block_codes=100)
  with pytest.raises(ValueError, match="dtype"):
    pack_kernel.pack_bits(codes.astype(np.int32), 2, interpret=True)
  with pytest.raises(ValueError, match="expected ceil"):
    pack_kernel.unpack_bits(np.zeros(3, np.uint8), 2, 8, interpret=True)


# -- threshold select -----------------------------------------------------------------------------


def select_reference(v: np.ndarray, thr: float, capacity: int) -> tuple[np.ndarray, int]:
  """(indices, uncapped count): np.nonzero(|v| > thr), the first `capacity`, then n."""
  (idx,) = np.nonzero(np.abs(v) > np.float32(thr))
  out = np.full(capacity, v.size, np.int64)
  k = min(capacity, idx.size)
  out[:k] = idx[:k]
  return out, idx.size


@functools.lru_cache(maxsize=None)
def _select_fn(capacities: tuple[int, ...], block_size: int):
  """For each capacity: the kernel's (indices, total) and capacity_filter's (indices, count),
  in one jitted function (one compile for every capacity and threshold)."""
  def run(v, thr):
    return [(select_kernel.threshold_select(v, thr, c, interpret=True, block_size=block_size),
             ops.capacity_filter(jnp.abs(v) > thr, c)) for c in capacities]
  return jax.jit(run)


def check_select(v: np.ndarray, thresholds, capacities, block_size: int):
  capacities = tuple(capacities)
  for thr in thresholds:
    results = _select_fn(capacities, block_size)(v, np.float32(thr))
    for capacity, ((idx, total), (xla_idx, xla_count)) in zip(capacities, results, strict=True):
      want, want_total = select_reference(v, thr, capacity)
      assert idx.dtype == jnp.int32 and idx.shape == (capacity,)
      np.testing.assert_array_equal(np.asarray(idx), want, err_msg=f"thr={thr} cap={capacity}")
      assert int(total) == want_total
      np.testing.assert_array_equal(np.asarray(xla_idx), want)
      assert int(xla_count) == min(want_total, capacity)


# (n, block_size): one partial tile, exact and ragged multi-tile grids of up to 16 steps.
SELECT_SIZES = ((1, 4096), (100, 4096), (1024, 64), (1000, 64), (4000, 256))


# Slow: (100, 4096), one partial tile like (1, 4096), and (4000, 256), a ragged multi-tile grid
# like (1000, 64).
@pytest.mark.parametrize("n,block_size", [
    pytest.param(*c, marks=pytest.mark.slow, id=str(c)) if c in ((100, 4096), (4000, 256)) else c
    for c in SELECT_SIZES], ids=str)
def test_threshold_select_matches_nonzero(n, block_size):
  v = np.random.default_rng(n).standard_normal(n).astype(np.float32)
  # Thresholds selecting ~none, few, ~a third, all; negative: padding must stay unselected.
  # Capacities: none, a few (over capacity), about the selection, all of n, more than n.
  check_select(v, (np.inf, 3.0, 1.0, 0.0, -1.0), sorted({0, 3, n // 3, n, n + 5}), block_size)


def test_threshold_select_ties_nan_and_signed_zero():
  """|v| == thr is not selected; ±thr alike; NaN never; -0.0 is 0."""
  n = 1000
  rng = np.random.default_rng(7)
  v = rng.choice(np.array([0.5, -0.5, 0.25, -0.25, 1.0, -1.0, 0.0, -0.0], np.float32), n)
  v[rng.random(n) < 0.05] = np.nan
  v[rng.random(n) < 0.02] = np.inf
  v[rng.random(n) < 0.02] = -np.inf
  check_select(v, (0.5, 0.25, 0.0, -0.0, -np.inf), (5, 300, n), 128)


def test_threshold_select_skips_tiles_past_capacity():
  """All selected: only the first tiles store; the slots are still the first indices."""
  check_select(np.ones(2048, np.float32), (0.5,), (100, 2048), 128)


def test_threshold_select_empty_and_invalid():
  idx, total = select_kernel.threshold_select(np.zeros(0, np.float32), 0.0, 4, interpret=True)
  np.testing.assert_array_equal(np.asarray(idx), np.zeros(4))
  assert int(total) == 0
  v = np.zeros(8, np.float32)
  with pytest.raises(ValueError, match="capacity=-1"):
    select_kernel.threshold_select(v, 0.0, -1, interpret=True)
  with pytest.raises(ValueError, match="block_size=100"):
    select_kernel.threshold_select(v, 0.0, 4, interpret=True, block_size=100)
  with pytest.raises(ValueError, match="dtype"):
    select_kernel.threshold_select(v.astype(np.float16), 0.0, 4, interpret=True)
  with pytest.raises(ValueError, match="scalar"):
    select_kernel.threshold_select(v, np.zeros(2, np.float32), 4, interpret=True)


# -- ops dispatch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_ops_pack_bits_pallas_equals_xla(bits):
  n = 777
  codes = np.random.default_rng(bits).integers(0, 256, n).astype(np.uint8)
  pad = (1 << bits) - 1
  packed = ops.pack_bits(codes, bits, pad, impl="pallas")
  np.testing.assert_array_equal(np.asarray(packed), pack_reference(codes, bits, pad))
  np.testing.assert_array_equal(np.asarray(ops.unpack_bits(packed, bits, n, impl="pallas")),
                                codes & ((1 << bits) - 1))


def test_ops_pack_bits_rejects_wide_pad():
  with pytest.raises(ValueError, match="pad=4"):
    ops.pack_bits(np.zeros(8, np.uint8), 2, 4)


def capped_reference(v: np.ndarray, thr: float, capacity: int) -> tuple[np.ndarray, int]:
  """Every index with |v| > thr if at most `capacity`, else the `capacity` largest |v| (ties:
  lower index), ascending, then n."""
  mag = np.abs(v.astype(np.float64))
  (idx,) = np.nonzero(mag > thr)
  capacity = min(capacity, v.size)
  if idx.size > capacity:
    order = sorted(idx, key=lambda i: (-mag[i], i))
    idx = np.sort(np.array(order[:capacity], np.int64))
  out = np.full(capacity, v.size, np.int64)
  out[:idx.size] = idx
  return out, idx.size


N_OPS = 1500


# Slow: impl="pallas" with capacities 0 and n. The selection after the kernel (the ops layer's
# truncation) is the same code for both impls and runs with every capacity for "xla"; the kernel
# with capacities 0 and n runs in test_threshold_select_matches_nonzero.
@pytest.mark.parametrize("impl,capacities", [
    ("xla", (0, 10, 400, N_OPS, N_OPS + 3)),
    ("pallas", (10, 400, N_OPS + 3)),
    pytest.param("pallas", (0, N_OPS), marks=pytest.mark.slow)], ids=str)
def test_ops_threshold_selections(impl, capacities):
  n = N_OPS
  rng = np.random.default_rng(3)
  v = rng.standard_normal(n).astype(np.float32)
  v[::7] = np.float32(1.5)  # ties in the truncation by magnitude
  v[::11] = np.float32(-1.5)
  run = jax.jit(lambda v, thr: [(ops.threshold_select(v, thr, c, impl=impl),
                                 ops.capped_threshold_select(v, thr, c, impl=impl))
                                for c in capacities])
  for thr in (np.inf, 2.5, 1.5, 1.0, -1.0):
    for capacity, ((idx, count), (capped, capped_count)) in zip(capacities, run(v, thr),
                                                                strict=True):
      want, total = select_reference(v, thr, capacity)
      np.testing.assert_array_equal(np.asarray(idx), want)
      assert int(count) == min(total, capacity)
      want, total = capped_reference(v, thr, capacity)
      np.testing.assert_array_equal(np.asarray(capped), want, err_msg=f"thr={thr} cap={capacity}")
      assert int(capped_count) == total
