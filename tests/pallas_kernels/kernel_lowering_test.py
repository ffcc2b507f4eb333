"""The Pallas kernels lower to Triton for cuda (no GPU needed), and respect Triton's shift rules.

Lowering tier (`-m lowering`): each kernel, interpret=False, is lowered for the
cuda platform under an abstract H100 (toolchain.md §3), which runs the Pallas
Triton lowering and so catches its errors (non-power-of-two block shapes,
unsupported ops or dtypes) on a CPU-only machine.

Shift semantics: XLA defines `x << s` and `x >> s` as 0 for s >= the bit width,
while the Triton lowering emits LLVM shifts, which are poison there. The kernel
bodies (`cast_bits`, `bfp_rows_bits`, `mx_rows_bits`) are evaluated op by op on sampled inputs
and every shift amount is checked to be below 32, so that the GPU kernels cannot
differ from the XLA path through shifts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.extend.core import Literal
from jax.sharding import AxisType

from jlp.formats import BFPFormat, FloatFormat, MXFormat
from jlp.numerics import random_bits
from jlp.numerics.bfp import bfp_rows_bits
from jlp.numerics.float_cast import cast_bits
from jlp.numerics.mx import mx_rows_bits
from pallas_kernels import accum_matmul as accum_matmul_kernel
from pallas_kernels import bfp as bfp_kernel
from pallas_kernels import float_cast as float_cast_kernel
from pallas_kernels import mx as mx_kernel
from pallas_kernels import pack_bits as pack_kernel
from pallas_kernels import threshold_select as select_kernel

TRITON_CALL = "__gpu$xla.gpu.triton"

FLOAT_FORMATS = [
    FloatFormat.from_name("e4m3"),
    FloatFormat.from_name("e5m2"),
    FloatFormat.from_name("float16"),
    FloatFormat.from_name("bfloat16"),
    FloatFormat.from_name("float8_e4m3fn"),
    FloatFormat.from_name("float4_e2m1fn"),
    FloatFormat.from_name("e4m3", overflow="saturate"),
    FloatFormat.from_name("e5m2", subnormals=False),
    FloatFormat.from_name("e4m3", rounding="truncate"),
    FloatFormat.from_name("e8m0", rounding="truncate"),
    FloatFormat.from_name("e4m3", rounding="stochastic"),
    FloatFormat.from_name("bfloat16", rounding="stochastic"),
    FloatFormat(5, 2, compat="cpd"),
    FloatFormat(8, 7, compat="cpd"),
    FloatFormat(4, 3, compat="qtorch"),
    FloatFormat(5, 2, rounding="stochastic", compat="qtorch"),
    FloatFormat(8, 0, rounding="stochastic", compat="qtorch"),
]


def lower_for_h100(f, *args: jax.ShapeDtypeStruct) -> str:
  """StableHLO text of `f` lowered for cuda under an abstract H100."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                       platform="gpu")
  mesh = jax.sharding.AbstractMesh((8,), ("d",), (AxisType.Explicit,), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def covering_grid(a, b, ids=str):
  """pytest.params for every pair (x, y) of the lists of argument tuples a and b, with the pairs
  (a[k % len(a)], b[k % len(b)]), k < max(len(a), len(b)), in the default tier (every value of
  each axis at least once) and the others slow: the lowering of one axis's value does not depend
  on the other's (e.g. an element format's ops and a grid's tiles)."""
  default = {(k % len(a), k % len(b)) for k in range(max(len(a), len(b)))}
  return [pytest.param(*x, *y, id="-".join(ids(v) for v in (*x, *y)),
                       marks=() if (i, j) in default else pytest.mark.slow)
          for i, x in enumerate(a) for j, y in enumerate(b)]


@pytest.mark.lowering
@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=repr)
def test_float_cast_lowers_to_triton(fmt):
  shape = (1000, 37)  # 37000 elements: 10 tiles of 4096, padded
  hlo = lower_for_h100(lambda x, r: float_cast_kernel.float_cast(x, fmt, r),
                       _sds(shape, jnp.float32), _sds(shape, jnp.uint32))
  assert TRITON_CALL in hlo
  assert "grid_x = 10 " in hlo


@pytest.mark.lowering
@pytest.mark.parametrize("shape,block_size", [((3,), 1024), ((7, 9), 16), ((64,), 1)], ids=str)
def test_float_cast_lowers_small_and_odd_tiles(shape, block_size):
  fmt = FloatFormat.from_name("e4m3", rounding="stochastic")
  hlo = lower_for_h100(lambda x, r: float_cast_kernel.float_cast(x, fmt, r, block_size=block_size),
                       _sds(shape, jnp.float32), _sds(shape, jnp.uint32))
  assert TRITON_CALL in hlo


@pytest.mark.lowering
@pytest.mark.parametrize("fmt,rng,offset", covering_grid(
    [(FloatFormat.from_name("e4m3", rounding="stochastic"),),
     (FloatFormat.from_name("bfloat16", rounding="stochastic"),),
     (FloatFormat(5, 2, rounding="stochastic", compat="qtorch"),)],
    [("pairs", 0), ("pairs", 3), ("pairs", None), ("jax", 0)], ids=repr))
def test_float_cast_with_key_lowers_to_triton(fmt, rng, offset):
  """Draws generated in the kernel: (2048, 2) pair tiles, or 1-D tiles (odd / traced offset)."""
  def f(x, key, traced_offset):
    off = traced_offset if offset is None else offset
    return float_cast_kernel.float_cast(x, fmt, key=key, index_offset=off, rng=rng)
  hlo = lower_for_h100(f, _sds((1000, 37), jnp.float32), _sds((), jax.random.key(0).dtype),
                       _sds((), jnp.int32))
  assert TRITON_CALL in hlo
  assert "grid_x = 10 " in hlo


@pytest.mark.lowering
@pytest.mark.parametrize("shape,block,man,rows_per_tile,rounding", covering_grid([
    ((256, 1000), (1, 32), 8, None),             # default tiles: (128, 32)
    ((4, 48, 14, 14), (1, 24, 3, 3), 12, None),  # FB12 NCHW, ragged: P = 256, tiles (16, 256)
    ((4, 14, 14, 48), (1, 3, 3, 24), 12, 4),     # FB12 NHWC
    ((10, 7), (10, 7), 1, None),                 # one group of 70 -> P = 128, a (1, 128) tile
], [("truncate",), ("nearest",), ("stochastic",)]))
def test_bfp_lowers_to_triton(shape, block, man, rows_per_tile, rounding):
  fmt = BFPFormat(man, block, rounding)
  hlo = lower_for_h100(lambda x, r: bfp_kernel.bfp_quantize(x, fmt, r, rows_per_tile=rows_per_tile),
                       _sds(shape, jnp.float32), _sds(shape, jnp.uint32))
  assert TRITON_CALL in hlo


MX_ELEMS = ["float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
            "int8", FloatFormat.from_name("float8_e4m3fn", rounding="stochastic")]


@pytest.mark.lowering
@pytest.mark.parametrize("shape,axis,grid,elem", covering_grid([
    ((256, 1024), -1, 64),  # 8192 blocks of 32, default tiles (128, 32)
    ((1000, 37), 0, 10),    # along axis 0, ragged (1000 = 31 * 32 + 8): 1184 blocks, 1280 padded
    ((257, 1000), 1, 65),   # along the last axis, ragged: 8224 blocks
], [(e,) for e in MX_ELEMS]))
def test_mx_lowers_to_triton(shape, axis, grid, elem):
  fmt = MXFormat(elem, block=32, axis=axis)
  hlo = lower_for_h100(lambda x, r: mx_kernel.mx_quantize(x, fmt, r),
                       _sds(shape, jnp.float32), _sds(shape, jnp.uint32))
  assert TRITON_CALL in hlo
  assert f"grid_x = {grid} " in hlo


@pytest.mark.lowering
@pytest.mark.parametrize("n,block_codes,grid,bits", covering_grid([
    (100_000, 8192, 13),  # default tiles, ragged
    (5, 8192, 1),         # less than one word
    (4000, 256, 16),      # small tiles
], [(1,), (2,), (4,), (8,)]))
def test_pack_bits_lowers_to_triton(bits, n, block_codes, grid):
  hlo = lower_for_h100(lambda c: pack_kernel.pack_bits(c, bits, 1, block_codes=block_codes),
                       _sds((n,), jnp.uint8))
  assert TRITON_CALL in hlo
  assert f"grid_x = {grid} " in hlo
  hlo = lower_for_h100(lambda p: pack_kernel.unpack_bits(p, bits, n, block_codes=block_codes),
                       _sds((-(-n * bits // 8),), jnp.uint8))
  assert TRITON_CALL in hlo
  assert f"grid_x = {grid} " in hlo


@pytest.mark.lowering
@pytest.mark.parametrize("n,capacity,block_size,grid", [
    (100_000, 100, 4096, 25),  # DGC's density 0.001; ragged last tile
    (100_000, 1000, 4096, 25),
    (3000, 37, 256, 12),
    (5, 9, 4096, 1),           # capacity > n, one tile of 8
], ids=str)
def test_threshold_select_lowers_to_triton(n, capacity, block_size, grid):
  hlo = lower_for_h100(
      lambda v, t: select_kernel.threshold_select(v, t, capacity, block_size=block_size),
      _sds((n,), jnp.float32), _sds((), jnp.float32))
  assert hlo.count(TRITON_CALL) == 2  # tile counts, compaction
  assert hlo.count(f"grid_x = {grid} ") == 2


@pytest.mark.lowering
@pytest.mark.parametrize("m,k,n,padded_k,grid,kahan,chunk", covering_grid([
    (64, 147_456, 64, 147_456, (2, 2)),    # conv weight gradient, K = 256 x 24 x 24
    (64, 802_816, 128, 802_816, (2, 4)),   # K = 256 x 56 x 56
    (64, 147_461, 64, 147_472, (2, 2)),    # ragged K: padded to a multiple of the K block (16)
], [(False, 1), (True, 1), (True, 32), (False, 3)]))
def test_accum_matmul_lowers_for_large_k(m, k, n, padded_k, grid, kahan, chunk):
  """The operands reach the Triton call unpadded (K padded only to a multiple of 16)."""
  fmt = FloatFormat.from_name("e5m2")
  hlo = lower_for_h100(
      lambda a, b: accum_matmul_kernel.accum_matmul(a, b, fmt, kahan=kahan, chunk=chunk),
      _sds((m, k), jnp.float32), _sds((k, n), jnp.float32))
  assert hlo.count(TRITON_CALL) == 1
  assert f"grid_x = {grid[0]} " in hlo and f"grid_y = {grid[1]} " in hlo
  assert (f"(tensor<1x1xui32>, tensor<{m}x{padded_k}xf32>, tensor<{padded_k}x{n}xf32>) -> "
          f"tensor<{m}x{n}xf32>") in hlo
  assert ("stablehlo.pad" in hlo) == (padded_k != k)


@pytest.mark.lowering
def test_lowering_catches_triton_errors():
  """The harness really runs the Triton lowering: a 1000-element block is refused."""
  def copy(x):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...]
    spec = pl.BlockSpec((1000,), lambda i: (i,))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[spec], out_specs=spec)(x)

  with pytest.raises(Exception, match="power of 2"):
    lower_for_h100(copy, _sds((2000,), jnp.float32))


# -- shift amounts ------------------------------------------------------------

SHIFTS = ("shift_left", "shift_right_logical", "shift_right_arithmetic")


def _eval_recording_shifts(jaxpr, consts, args, amounts: list):
  """Evaluates `jaxpr`, appending (op, width, max shift amount) for every shift op."""
  env = {}

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive.name in SHIFTS:
      width = jnp.dtype(eqn.invars[0].aval.dtype).itemsize * 8
      amounts.append((eqn.primitive.name, width, jnp.max(jnp.asarray(ins[1]).astype(jnp.uint32))))
    if eqn.primitive.name in ("jit", "pjit"):
      sub = eqn.params["jaxpr"]
      outs = _eval_recording_shifts(sub.jaxpr, sub.consts, ins, amounts)
    else:
      outs = eqn.primitive.bind(*ins, **eqn.params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def shifts_at_or_above_width(bodies: dict, *args) -> list:
  """(label, op, width, amount) for shifts in `bodies[label](*args)` by >= the operand width.

  All bodies are evaluated in one jitted function (one compile).
  """
  labels = []

  def run(*args):
    maxima = []
    for label, body in bodies.items():
      closed = jax.make_jaxpr(body)(*args)
      amounts = []
      _eval_recording_shifts(closed.jaxpr, closed.consts, jax.tree.leaves(args), amounts)
      labels.extend((label, op, width) for op, width, _ in amounts)
      maxima.extend(m for _, _, m in amounts)
    return maxima

  maxima = jax.jit(run)(*args)
  assert labels, "no shift ops found"
  return [(*lab, int(m)) for lab, m in zip(labels, maxima) if int(m) >= lab[2]]


def _sampled_bits(n, seed=0):
  rng = np.random.default_rng(seed)
  patterns = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
  specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                       1, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF], np.uint32)
  wide = (rng.standard_normal(n) * 2.0 ** rng.integers(-150, 100, n)).astype(np.float32)
  return np.concatenate([specials, patterns, wide.view(np.uint32)])


def _random_bits(shape, seed):
  return np.random.default_rng(seed).integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)


def test_float_cast_kernel_body_shifts_below_width():
  u = _sampled_bits(4096)
  bodies = {repr(f): (lambda u, r, f=f: cast_bits(u, f, r if f.rounding == "stochastic" else None))
            for f in FLOAT_FORMATS}
  assert shifts_at_or_above_width(bodies, u, _random_bits(u.shape, 1)) == []


def test_keyed_float_cast_kernel_body_shifts_below_width():
  """The draws' hash (both streams, both layouts) and the casts that consume them."""
  u = _sampled_bits(4096)
  u = u[:u.size // 2 * 2]
  r = _random_bits(u.shape, 3)
  formats = [f for f in FLOAT_FORMATS if f.rounding == "stochastic"]
  bodies = {}
  for f in formats:
    for stream in random_bits.RNGS:
      bodies[f"{f!r} {stream}"] = (lambda u, r, f=f, s=stream: cast_bits(
          u, f, random_bits.bits_at(r[0], r[1], r >> np.uint32(7), r, s)))
    bodies[f"{f!r} pair rows"] = (lambda u, r, f=f: cast_bits(
        u.reshape(-1, 2), f, random_bits.pair_bits(r[0], r[1], r[:u.size // 2, None] >> 9,
                                                   r[u.size // 2:, None])))
  assert shifts_at_or_above_width(bodies, u, r) == []


def test_bfp_kernel_body_shifts_below_width():
  u = _sampled_bits(4096)
  u = u[:u.size // 32 * 32].reshape(-1, 32)
  # Groups with small and with zero/subnormal largest exponents.
  u[::4] &= np.uint32(0x807FFFFF)
  u[1::4] = (u[1::4] & np.uint32(0x80FFFFFF)) | np.uint32(0x01000000)
  formats = [BFPFormat(man, (32,), rounding) for man in (1, 8, 24)
             for rounding in ("truncate", "nearest", "stochastic")]
  bodies = {repr(f): (lambda u, r, f=f: bfp_rows_bits(u, f, r if f.rounding == "stochastic" else None))
            for f in formats}
  assert shifts_at_or_above_width(bodies, u, _random_bits(u.shape, 2)) == []


def test_mx_kernel_body_shifts_below_width():
  u = _sampled_bits(4096)
  u = u[:u.size // 32 * 32].reshape(-1, 32)
  # Blocks with zero/subnormal maxima (smallest scale), small and near-float32-max maxima.
  u[::4] &= np.uint32(0x807FFFFF)
  u[1::4] = (u[1::4] & np.uint32(0x80FFFFFF)) | np.uint32(0x01000000)
  u[2::8] = (u[2::8] & np.uint32(0x80FFFFFF)) | np.uint32(0x7E000000)
  formats = [MXFormat(e) for e in MX_ELEMS]
  bodies = {repr(f): lambda u, r, f=f: mx_rows_bits(u, f, r if f.rounding == "stochastic" else None)
            for f in formats}
  assert shifts_at_or_above_width(bodies, u, _random_bits(u.shape, 5)) == []


def test_pack_kernel_bodies_shift_below_width():
  codes = np.random.default_rng(3).integers(0, 256, 4096).astype(np.uint8)
  codes[:64] = 255
  words = _random_bits((1024,), 4)
  words[:4] = 0xFFFFFFFF
  bodies = {}
  for bits in (1, 2, 4, 8):
    bodies[f"pack {bits}"] = lambda c, w, b=bits: pack_kernel.pack_words(c.reshape(-1, 32 // b), b)
    bodies[f"unpack {bits}"] = lambda c, w, b=bits: pack_kernel.unpack_words(w, b)
  assert shifts_at_or_above_width(bodies, codes, words) == []
