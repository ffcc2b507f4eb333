"""NVFP4 quantization (`NVFP4Format`): E2M1 elements, E4M3 scales per tile, a float32 tensor scale.

The array is viewed as a matrix: `fmt.axis` is moved last and the other axes are flattened into
rows (as TransformerEngine's quantizers see a 2-D tensor). A tile covers 1 x 16 elements (one row,
16 consecutive elements along the axis) or 16 x 16 (16 consecutive rows); axes that are not
multiples of the tile are zero-padded, as TE's reference pads (zeros never change a tile's amax).
Every step below is one float32 operation, in the peer's order, computed exactly with integer
operations (`jlp.numerics.ieee_f32` for products and quotients, with IEEE's special operands
added here; `jlp.numerics.ieee_f32.ieee_add` for the transform's sums: round to nearest even, gradual
underflow), so float32 subnormal operands and results are exact on backends that flush them
(XLA:CPU) and the same in a Pallas kernel. A NaN result is the quiet NaN 0x7FC00000. In the
formulas, `amax` is max |x| over the tensor and `vmax` over the tile (NaN propagates), `/` and
`*` are float32 operations, `min` and `clamp` propagate NaN, `e4m3` is the round-to-nearest-even
cast to float8_e4m3fn and `e2m1` the cast to FP4 E2M1 (nearest even or stochastic).

compat=None (TransformerEngine's `NVFP4QuantizerRef._quantize_blockwise_reference`, rowwise,
custom_recipes/quantization_nvfp4.py as of 2026, which folds 1/6 into the global multiplier to
match TE's kernel; earlier versions computed (vmax / 6) * ges; two-level scaling as in
arXiv:2509.25149 §2):
  per tensor: ges  = min(2688 / amax, FLT_MAX); ges = 1 if ges == 0   (2688 = 448 * 6)
              gds  = 1 / ges
              mult = ges * r6, r6 = float32(1 / 6) (torch.reciprocal(6))
  per tile:   s    = e4m3(clamp(min(vmax * mult, FLT_MAX), -448, 448))          (the scale)
              es   = min(1 / (float32(s) * gds), FLT_MAX)                        (encode scale)
  per element: v = clamp(x * es, -6, 6); code = e2m1(|v|) with sign bit 8 iff v < 0
    (TE's `cast_to_fp4x2`: -0.0 gives code 0, a NaN gives code 0).
  decode (TE has no element-wise decode of its own; this is the GEMM's scaling applied to one
    element): value = (e2m1 * float32(s)) * (amax / 2688), left to right.
compat="torchao" (torchao 0.18 `nvfp4_quantize`, `per_tensor_amax_to_scale`,
  `NVFP4Tensor.dequantize`, on CPU, where a tensor divided by a Python float is a true division):
  single level (tensor_scale=False), per tile:
              s = e4m3(clamp(vmax / 6, 2^-6, 448));  r = 1 / float32(s)
  two level (tensor_scale=True), per tensor: pts = amax / 2688;  ipts = 1 / pts
              per tile: s = e4m3(clamp((vmax / 6) / pts, 2^-6, 448));  r = ipts / float32(s)
  per element: v = clamp(x * r, -6, 6); code = e2m1(|v|) with torchao's sign (the sign bit of v,
    so -0.0 gives code 8); a NaN v gives code 3 (torchao's bit formula on the quiet NaN
    0x7FC00000; torchao's own code and scale bits for a NaN depend on the sign and payload the
    platform gives the NaN, e.g. 12 and 0xFF for 0 / 0 on x86).
  decode: single level e2m1 * float32(s); two level e2m1 * (pts * float32(s)).
  (torchao on CUDA computes a tensor divided by a Python float as a product with the float's
  reciprocal, so its `vmax / 6` and `amax / 2688` can differ there by an ulp; and with two levels
  an all-zero tensor gives 0 / 0 = NaN scales, which is kept.)
rounding="stochastic" (compat=None): e2m1 rounds |v| away from zero iff its uint32 draw is
  below floor(p * 2^32), p the fraction of the E2M1 grid step dropped (`jlp.numerics.float_cast`),
  so E[e2m1(|v|)] = |v| on [0, 6]: unbiased. Element i takes rbits[i].
rht=True (TE's random Hadamard transform, `NVFP4QuantizerRef._apply_rht` with the default
  random sign mask): each 16-element block along the axis is multiplied by T = D H16 / 4 (row
  vector times T), H16 the Sylvester Hadamard matrix, D = diag(`HADAMARD_SIGNS`); T is
  orthonormal. Order: z_i = (s_i x_i) / 4 (exact, one rounding for a subnormal result), then the
  in-place butterfly on z with strides 8, 4, 2, 1 (a_j, a_j+h) <- (a_j + a_j+h, a_j - a_j+h) in
  IEEE float32 additions (TE's reference is a matmul in x's dtype, whose summation order BLAS
  picks, and TE applies it to the columnwise (transposed) operand; here it runs along `axis`).
  The amax and the codes are those of the transformed tensor; `nvfp4_quantize` maps the decoded
  values back with T^T: w_j = y_j / 4, the same butterfly, then times s_i.

The XLA path (`nvfp4_quantize`) computes the element operations with the hardware's float32
products and sums where they provably give the same bits (`_float_ops`: no operand or result
can be a float32 subnormal; checked at run time from the tensor's exponents) and otherwise,
chosen by `lax.cond`, with the integer operations above; tiles along a non-minor axis are
handled in place (no transposition). The Pallas kernel always uses the integer operations.
Both give the same bits.

References:
  NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, 2025.
  NVIDIA TransformerEngine: transformer_engine/pytorch/custom_recipes/quantization_nvfp4.py
    (NVFP4QuantizerRef, get_wgrad_sign_vector), tests/pytorch/nvfp4/test_nvfp4_*_exact.py.
  pytorch/ao 0.18: torchao/prototype/mx_formats/nvfp4_tensor.py, kernels.py, custom_fp_utils.py.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.formats import FloatFormat, NVFP4Format
from jlp.numerics import ieee_f32
from jlp.numerics import random_bits as rb
from jlp.numerics.bfp import group_rows
from jlp.numerics.bit_max import max_all, max_rows
from jlp.numerics.ieee_f32 import ieee_add
from jlp.numerics.float_cast import (ABS, INF, QNAN, SIGN, cast_bits, float_bits, from_bits,
                                     to_bits, u32)
from jlp.numerics.mx import ldexp_bits

__all__ = ["HADAMARD_SIGNS", "encode", "hadamard_transform", "nvfp4_encode", "nvfp4_quantize"]

# TE's `get_wgrad_sign_vector()`: the fixed signs of its random Hadamard transform.
HADAMARD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

E2M1 = FloatFormat.from_name("float4_e2m1fn")
E2M1_SR = FloatFormat.from_name("float4_e2m1fn", rounding="stochastic")
E4M3 = FloatFormat.from_name("float8_e4m3fn")

_ONE = float_bits(1.0)
_SIX = float_bits(6.0)
_E4M3_MAX = float_bits(448.0)
_E4M3_EPS = float_bits(2.0 ** -6)          # torch.finfo(torch.float8_e4m3fn).tiny
_FLT_MAX = float_bits(np.finfo(np.float32).max)
_GLOBAL = float_bits(448.0 * 6.0)          # 2688
_RECIP6 = float_bits(np.float32(1) / np.float32(6))
# Bit j set iff HADAMARD_SIGNS[j] == -1 (a scalar: Pallas kernels cannot capture array constants).
_NEGATIVE_SIGNS = sum(1 << j for j, s in enumerate(HADAMARD_SIGNS) if s < 0)


def hadamard_transform() -> np.ndarray:
  """T = D H16 / 4 in float64 (x_block @ T is the transform; T @ T.T = I exactly)."""
  h = np.ones((1, 1))
  while h.shape[0] < 16:
    h = np.block([[h, h], [h, -h]])
  return np.diag(np.asarray(HADAMARD_SIGNS, np.float64)) @ h / 4


# -- IEEE float32 arithmetic with special operands -----------------------------------------------

def mul_bits(a: jax.Array, b: jax.Array) -> jax.Array:
  """Bits of fl32(a * b) for any float32 bit patterns (uint32, broadcast): `ieee_f32.mul_bits`
  (exact, subnormals included) with IEEE 754's special operands: a NaN operand or 0 * inf gives
  the quiet NaN 0x7FC00000, inf * x gives a signed inf."""
  a, b = jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32)
  aa, ba = a & ABS, b & ABS
  a_inf, b_inf = aa == INF, ba == INF
  nan = (aa > INF) | (ba > INF) | (a_inf & (ba == 0)) | (b_inf & (aa == 0))
  finite = ieee_f32.mul_bits(jnp.where(aa >= INF, _ONE, a), jnp.where(ba >= INF, _ONE, b))
  out = jnp.where(a_inf | b_inf, ((a ^ b) & SIGN) | INF, finite)
  return jnp.where(nan, QNAN, out)


def div_bits(a: jax.Array, b: jax.Array) -> jax.Array:
  """Bits of fl32(a / b) for any float32 bit patterns (uint32, broadcast): `ieee_f32.div_bits`
  (exact, subnormals included) with IEEE 754's special operands: a NaN operand, 0 / 0 or
  inf / inf gives the quiet NaN 0x7FC00000, inf / x and x / 0 a signed inf, x / inf a signed 0."""
  a, b = jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32)
  aa, ba = a & ABS, b & ABS
  a_inf, b_inf, b_zero = aa == INF, ba == INF, ba == 0
  sign = (a ^ b) & SIGN
  nan = (aa > INF) | (ba > INF) | ((aa == 0) & b_zero) | (a_inf & b_inf)
  finite = ieee_f32.div_bits(jnp.where(aa >= INF, _ONE, a),
                             jnp.where((ba >= INF) | b_zero, _ONE, b))
  out = jnp.where(b_inf, sign, jnp.where(a_inf | b_zero, sign | INF, finite))
  return jnp.where(nan, QNAN, out)


# -- element codes ------------------------------------------------------------------------------

def _min_keep_nan(a: jax.Array, limit) -> jax.Array:
  """min(a, limit) on non-negative float32 bits, NaN kept (torch.min / torch.clamp)."""
  return jnp.where(a > INF, a, jnp.minimum(a, limit))


def _e2m1_code(q: jax.Array) -> jax.Array:
  """The 3-bit magnitude code of E2M1 value bits q (0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0..7)."""
  field = q >> u32(23)
  normal = ((field - u32(126)) << u32(1)) | ((q >> u32(22)) & u32(1))
  return jnp.where(q == 0, u32(0), jnp.where(field < 127, u32(1), normal))


# E2M1's round-to-nearest-even decision points on [0, 6] (float32 bits) and, per point, whether
# the tie goes up (the upper neighbour has the even code): the code is the count passed.
_E2M1_STEPS = tuple((float_bits(b), up) for b, up in
                    ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                     (3.5, True), (5.0, False)))


def _e2m1_nearest_code(va: jax.Array) -> jax.Array:
  """`_e2m1_code(cast_bits(min(va, 6), E2M1))` for magnitude bits va <= INF (round to nearest
  even), by comparisons with the decision points."""
  code = jnp.zeros(va.shape, jnp.uint32)
  for point, up in _E2M1_STEPS:
    code = code + ((va >= point) if up else (va > point)).astype(jnp.uint32)
  return code


def e2m1_bits(code: jax.Array) -> jax.Array:
  """float32 bits of the E2M1 value of 4-bit codes (sign in bit 3; code 8 is -0.0)."""
  code = code.astype(jnp.uint32)
  mag = code & u32(7)
  normal = ((u32(126) + (mag >> u32(1))) << u32(23)) | ((mag & u32(1)) << u32(22))
  bits = jnp.where(mag == 0, u32(0), jnp.where(mag == 1, float_bits(0.5), normal))
  return bits | ((code >> u32(3)) << u32(31))


def _codes(v: jax.Array, fmt: NVFP4Format, rbits: jax.Array | None, *,
           comparisons: bool = False) -> jax.Array:
  """The 4-bit codes of the scaled elements v = x * encode scale (float32 bits). `comparisons`
  rounds to nearest even by comparisons with E2M1's decision points (`_e2m1_nearest_code`,
  the same codes: the float path's cheaper form)."""
  va = v & ABS
  nan = va > INF
  if comparisons and fmt.rounding != "stochastic":
    mag = _e2m1_nearest_code(va)
  else:
    elem = E2M1_SR if fmt.rounding == "stochastic" else E2M1
    mag = _e2m1_code(cast_bits(jnp.minimum(va, _SIX), elem, rbits))
  negative = (v >> u32(31)) << u32(3)
  if fmt.compat is None:  # TE: bit 8 iff v < 0; a NaN matches no bin of cast_to_fp4x2
    return jnp.where(nan, u32(0), mag | jnp.where(va != 0, negative, u32(0)))
  return jnp.where(nan, u32(3), mag | negative)


# -- the Hadamard transform ---------------------------------------------------------------------

def _sign_mask() -> jax.Array:
  """(1, 16) uint32: the sign bit where HADAMARD_SIGNS is -1."""
  j = lax.broadcasted_iota(jnp.uint32, (1, 16), 1)
  return ((u32(_NEGATIVE_SIGNS) >> j) & u32(1)) << u32(31)


def _quarter(u: jax.Array) -> jax.Array:
  """Bits of x / 4 (exact; one rounding to nearest even for a subnormal result)."""
  return jnp.where((u & ABS) >= INF, u, ldexp_bits(u, jnp.int32(-2)))


def _butterfly(u: jax.Array) -> jax.Array:
  """H16 (Sylvester) times each row of 16 float32 bit patterns, by four butterfly stages.

  Each stage maps halves (a, b) to the interleaving of (a + b, a - b), IEEE additions: four
  stages add the pairs of the in-place transform with strides 8, 4, 2, 1, and the fourth leaves
  the natural order. Only split, stack and reshape move data (ops Pallas lowers for Triton).
  """
  rows = u.shape[0]
  for _ in range(4):
    a, b = lax.split(u, (8, 8), axis=1)
    s = to_bits(ieee_add(from_bits(a), from_bits(b)))
    d = to_bits(ieee_add(from_bits(a), from_bits(b ^ SIGN)))
    u = jnp.stack([s, d], axis=-1).reshape(rows, 16)
  return u


def rht_bits(u: jax.Array) -> jax.Array:
  """Rows of 16 float32 bit patterns times T = D H16 / 4 (see the module docstring)."""
  return _butterfly(_quarter(u ^ _sign_mask()))


def inverse_rht_bits(u: jax.Array) -> jax.Array:
  """Rows of 16 float32 bit patterns times T^T = H16 D / 4: w = y / 4, butterfly, signs."""
  return _butterfly(_quarter(u)) ^ _sign_mask()


# -- scales and rows ----------------------------------------------------------------------------

def amax_bits(u: jax.Array) -> jax.Array:
  """(1, 1) bits of max |x| over float32 bit patterns u (NaN if any element is NaN)."""
  a = jnp.max(u & ABS).reshape(1, 1)
  return jnp.where(a > INF, QNAN, a)


def tensor_scalars(amax: jax.Array, fmt: NVFP4Format) -> tuple[jax.Array, ...]:
  """The per-tensor float32 values (as (1, 1) bits) that `encode_rows` / `decode_rows` take:
  (gds, mult, amax / 2688) for compat=None; (pts, 1 / pts) for torchao's two levels; ()."""
  if fmt.compat is None:
    ges = _min_keep_nan(div_bits(_GLOBAL, amax), _FLT_MAX)
    ges = jnp.where(ges == 0, _ONE, ges)
    return div_bits(_ONE, ges), mul_bits(ges, _RECIP6), div_bits(amax, _GLOBAL)
  if fmt.tensor_scale:
    pts = div_bits(amax, _GLOBAL)
    return pts, div_bits(_ONE, pts)
  return ()


def _materialized(x, materialize: bool):
  """x, computed once (XLA would otherwise fuse a per-tile division or a butterfly into each of
  its consumers, recomputing it per element); the identity on values."""
  return lax.optimization_barrier(x) if materialize else x


def tile_scales(vmax: jax.Array, scalars: tuple[jax.Array, ...],
                fmt: NVFP4Format) -> tuple[jax.Array, jax.Array]:
  """(scale bits s, encode scale bits) of tiles with the max |x| bits `vmax` (module docstring)."""
  if fmt.compat is None:
    gds, mult, _ = scalars
    s = cast_bits(_min_keep_nan(mul_bits(vmax, mult), _E4M3_MAX), E4M3)
    encode = _min_keep_nan(div_bits(_ONE, mul_bits(s, gds)), _FLT_MAX)
  else:
    block = div_bits(vmax, _SIX)
    if fmt.tensor_scale:
      pts, ipts = scalars
      block = div_bits(block, pts)
    clamped = jnp.where(block > INF, block, jnp.clip(block, _E4M3_EPS, _E4M3_MAX))
    s = cast_bits(clamped, E4M3)
    encode = div_bits(ipts if fmt.tensor_scale else _ONE, s)
  return s, encode


def encode_rows(u: jax.Array, scalars: tuple[jax.Array, ...], fmt: NVFP4Format,
                rbits: jax.Array | None = None, *,
                materialize: bool = False) -> tuple[jax.Array, jax.Array]:
  """(codes, scale bits) of rows u: one tile per row (uint32 (R, P), zero-padded), already
  transformed when fmt.rht. codes: uint32 (R, P) in 0..15; scale bits: (R, 1), the float32 bits
  of each tile's E4M3 scale. `materialize` (the XLA path) computes the per-tile values once."""
  vmax = jnp.max(u & ABS, axis=1, keepdims=True)
  s, encode = _materialized(tile_scales(vmax, scalars, fmt), materialize)
  return _codes(mul_bits(u, encode), fmt, rbits), s


def decode_rows(codes: jax.Array, s: jax.Array, scalars: tuple[jax.Array, ...],
                fmt: NVFP4Format) -> jax.Array:
  """float32 bits of the decoded values of codes (R, P) with scale bits s (R, 1)."""
  q = e2m1_bits(codes)
  if fmt.compat == "torchao" and fmt.tensor_scale:
    return mul_bits(q, mul_bits(scalars[0], s))
  qs = to_bits(from_bits(q) * from_bits(s))  # exact: normal products of few bits, or 0 / NaN
  return qs if fmt.compat == "torchao" else mul_bits(qs, scalars[2])


def quantize_rows(u: jax.Array, scalars: tuple[jax.Array, ...], fmt: NVFP4Format,
                  rbits: jax.Array | None = None, *, materialize: bool = False) -> jax.Array:
  """Bits of the quantized rows u (the original values; transformed here when fmt.rht): encode,
  decode, and with fmt.rht the inverse transform. The body of the Pallas kernel; the XLA path
  passes `materialize` (optimization barriers, which change no value)."""
  t = _materialized(rht_bits(u), materialize) if fmt.rht else u
  codes, s = encode_rows(t, scalars, fmt, rbits, materialize=materialize)
  out = decode_rows(codes, s, scalars, fmt)
  return inverse_rht_bits(_materialized(out, materialize)) if fmt.rht else out


# -- layout and checks --------------------------------------------------------------------------

def check_args(x, fmt, rbits=None, *, draws: bool = True) -> None:
  """Raises ValueError for a non-NVFP4Format, non-float32 x, an axis out of range, an RHT axis
  that is not a multiple of 16, or (with `draws`) missing or malformed stochastic draws."""
  if not isinstance(fmt, NVFP4Format):
    raise ValueError(f"fmt={fmt!r} is not allowed; expected an NVFP4Format.")
  dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)  # float64 stays
  if dtype != jnp.float32:
    raise ValueError(f"x.dtype={dtype} is not allowed; expected float32 (NVFP4 values are "
                     "products of E2M1, E4M3 and a float32 scale).")
  shape = tuple(jnp.shape(x))
  fmt.check_rank(len(shape))
  n = shape[fmt.axis]
  if fmt.rht and n % 16:
    raise ValueError(f"x.shape[{fmt.axis}]={n} is not allowed with rht=True; expected a multiple "
                     "of 16 (TransformerEngine's Hadamard transform takes whole 16-element "
                     "blocks).")
  if draws and fmt.rounding == "stochastic":
    if rbits is None:
      raise ValueError("rbits=None is not allowed with rounding='stochastic'; expected uint32 "
                       f"draws of shape {shape}.")
    if tuple(jnp.shape(rbits)) != shape or jnp.result_type(rbits) != jnp.uint32:
      raise ValueError(f"rbits of shape {tuple(jnp.shape(rbits))} and dtype "
                       f"{jnp.result_type(rbits)} is not allowed; expected shape {shape} and "
                       "uint32.")


def layout(shape: tuple[int, ...], fmt: NVFP4Format):
  """(to_rows, from_rows, scales, num_scales) for an array of `shape`: its tile rows (uint32
  (G, P) from `jlp.numerics.bfp.group_rows` on the matrix view, and the ungroup map), their
  inverse, the map from G per-tile values to the scales' layout, and G."""
  axis = fmt.axis % len(shape)
  moved = shape[:axis] + shape[axis + 1:] + (shape[axis],)
  matrix = (math.prod(moved[:-1]), shape[axis])
  counts = tuple(-(-s // b) for s, b in zip(matrix, fmt.block))

  def to_rows(a: jax.Array):
    return group_rows(jnp.moveaxis(a, axis, -1).reshape(matrix), fmt.block)

  def from_rows(rows: jax.Array, ungroup: Callable) -> jax.Array:
    return jnp.moveaxis(ungroup(rows).reshape(moved), -1, axis)

  def scales(per_tile: jax.Array) -> jax.Array:
    grid = per_tile.reshape(counts)
    if fmt.block == (1, 16):
      return jnp.moveaxis(grid.reshape(moved[:-1] + (counts[1],)), -1, axis)
    if len(shape) == 1:
      return grid.reshape(counts[1])
    return grid.T if len(shape) == 2 and axis == 0 else grid  # ndim > 2: the matrix view

  return to_rows, from_rows, scales, math.prod(counts)


def prepare(x: jax.Array, fmt: NVFP4Format, rbits: jax.Array | None):
  """(rows, rbit rows, scalars, restore) of float32 x: the tile rows (uint32 (G, P)), the draws
  laid out alike (or None), the per-tensor scalars (`tensor_scalars` of the amax of the
  transformed rows with rht) and the map from (G, P) result rows back to x's shape."""
  to_rows, from_rows, _, _ = layout(x.shape, fmt)
  rows, ungroup = to_rows(to_bits(x))
  r = None
  if fmt.rounding == "stochastic":
    r = to_rows(jnp.asarray(rbits, jnp.uint32))[0]
  amax = amax_bits(_materialized(rht_bits(rows), True) if fmt.rht else rows)
  return rows, r, tensor_scalars(amax, fmt), lambda out: from_rows(out, ungroup)


# -- the XLA path: hardware float operations where they give the same bits ---------------------

# Below these magnitudes (nonzero inputs with rht; the amax) the exact integer path runs.
_RHT_MIN_INPUT = float_bits(2.0 ** -90)
_FLOAT_OPS_MIN_AMAX = float_bits(2.0 ** -60)


def _butterfly_float(z: jax.Array) -> jax.Array:
  """`_butterfly` along axis 2 (16 long) of the 4-D float32 `z`, with the hardware's float32
  additions (exact where no sum is subnormal)."""
  a_, t_, _, b_ = z.shape
  for _ in range(4):
    a, b = z[:, :, :8], z[:, :, 8:]
    z = jnp.stack([a + b, a - b], axis=3).reshape(a_, t_, 16, b_)
  return z


def _tiles_view(shape: tuple[int, ...], fmt: NVFP4Format):
  """(to_tiles, from_tiles) for the float path: x as a 4-D (A, T, P, B) array whose axis 2 runs
  along a tile. 1 x 16 tiles need no data movement: A and B are the products of the axes before
  and after fmt.axis, T the tiles along it (zero-padded to a multiple of 16). 16 x 16 tiles
  are `layout`'s rows, as (G, 1, 256, 1)."""
  if fmt.block != (1, 16):
    to_rows, from_rows, _, _ = layout(shape, fmt)

    def to_tiles(u):
      rows, ungroup = to_rows(u)
      return rows.reshape(rows.shape[0], 1, rows.shape[1], 1), ungroup

    def from_tiles(t, ungroup):
      return from_rows(t.reshape(t.shape[0], t.shape[2]), ungroup)
    return to_tiles, from_tiles
  axis = fmt.axis % len(shape)
  a, n, b = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
  tiles = -(-n // 16)

  def to_tiles(u):
    u = u.reshape(a, n, b)
    if tiles * 16 != n:
      u = jnp.pad(u, ((0, 0), (0, tiles * 16 - n), (0, 0)))
    return u.reshape(a, tiles, 16, b), None

  def from_tiles(t, _):
    return t.reshape(a, tiles * 16, b)[:, :n].reshape(shape)
  return to_tiles, from_tiles


def _tile_max(m: jax.Array) -> jax.Array:
  """max over axis 2 of the 4-D uint32 `m`, keepdims."""
  a, t, p, b = m.shape
  if b == 1:
    return max_rows(m.reshape(a * t, p)).reshape(a, t, 1, 1)
  return jnp.max(m, axis=2, keepdims=True)  # a reduction over a leading axis: vectorized


def _tile_max_and_min_nonzero(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max, smallest nonzero or 0xFFFFFFFF) over axis 2 of the 4-D magnitude bits `m`, keepdims:
  the min as the complement of the max of the complements (one pass for XLA to fuse)."""
  return _tile_max(m), ~_tile_max(jnp.where(m != 0, ~m, u32(0)))


def _float_ops(u: jax.Array, fmt: NVFP4Format,
               rbits: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(exact, bits): `quantize_rows`' result on the tiles u (`_tiles_view`: uint32 (A, T, P, B),
  axis 2 along a tile, draws alike) computed with the hardware's float32 operations, and
  whether that is `quantize_rows`' bits.

  The per-tensor and per-tile values keep the integer operations (one per tile). The element
  operations use float32 products and sums, which are IEEE operations on every backend (XLA on
  a GPU keeps subnormals and divides approximately, but nothing here divides) except that
  XLA:CPU reads subnormal operands as zero and flushes subnormal results. `exact` holds when
  none of them can meet a subnormal:
    * the amax is finite and at least 2^-60, so every nonzero decoded value,
      e2m1 * s * (amax / 2688) >= 2^-1 * 2^-9 * 2^-72, or torchao's e2m1 * (pts * s), is a
      normal float32 (and with rht every sum of the inverse transform is a nonzero multiple of
      2^-107 or zero);
    * with rht, every nonzero |x| is at least 2^-90: x / 4 and every sum of the transform are
      then zero or nonzero multiples of 2^-115;
    * every nonzero transformed element t of a tile is a normal float32 with
      t * (encode scale) >= 2^-125, checked from exponents: the exponent field of the tile's
      smallest nonzero |t| is at least 129 - (the encode scale's), and the scale is normal.
  A NaN or inf anywhere fails the first test. Otherwise the decoded values, and the codes
  (the sign rule and the draws act on the product's bits), are the same bits. Products that
  feed a sum are exact (a power of two times a normal float32), so a fused multiply-add gives
  the same sum.
  """
  if fmt.rht:
    magnitude = u & ABS
    inputs_ok = ~jnp.any((magnitude != 0) & (magnitude < _RHT_MIN_INPUT))
    signs = _sign_mask().reshape(1, 1, 16, 1)
    t = lax.optimization_barrier(_butterfly_float(from_bits(u ^ signs) * 0.25))
    tb = to_bits(t)
  else:
    inputs_ok, t, tb = jnp.bool_(True), from_bits(u), u
  vmax, vmin = lax.optimization_barrier(_tile_max_and_min_nonzero(tb & ABS))
  amax = max_all(vmax.reshape(-1, vmax.shape[-1]))
  scalars = tensor_scalars(amax, fmt)
  s, encode = lax.optimization_barrier(tile_scales(vmax, scalars, fmt))
  encode_field = (encode >> u32(23)).astype(jnp.int32)
  min_field = jnp.where((encode_field > 0) & (encode_field < 255),
                        jnp.maximum(129 - encode_field, 1), 256)  # 1: subnormal t fail
  # The tile's smallest nonzero magnitude has the smallest exponent field (all-zero tiles: 255).
  products_ok = jnp.all((vmin >> u32(23)).astype(jnp.int32) >= min_field)
  exact = inputs_ok & products_ok & (amax[0, 0] < INF) & (amax[0, 0] >= _FLOAT_OPS_MIN_AMAX)

  codes = _codes(to_bits(t * from_bits(encode)), fmt, rbits, comparisons=True)
  q = from_bits(e2m1_bits(codes))
  if fmt.compat == "torchao" and fmt.tensor_scale:
    out = q * from_bits(mul_bits(scalars[0], s))
  elif fmt.compat == "torchao":
    out = q * from_bits(s)
  else:
    out = q * from_bits(s) * from_bits(scalars[2])
  if fmt.rht:
    out = lax.optimization_barrier(out)  # else each output recomputes its 16 inputs' codes
    return exact, to_bits(_butterfly_float(out * 0.25)) ^ signs
  return exact, to_bits(out)


def nvfp4_quantize(x: jax.Array, fmt: NVFP4Format, rbits: jax.Array | None = None) -> jax.Array:
  """float32 x quantized to NVFP4 and decoded, as float32 (the XLA path of `jlp.quantize`).

  Args:
    x: float32 array; fmt.axis must be one of its axes (a multiple of 16 long with rht).
    fmt: the NVFP4 format (exact semantics in the module docstring).
    rbits: uint32 draws of x's shape, required with rounding="stochastic".

  Returns:
    float32 array of x's shape: the decoded values (mapped back by T^T with rht).
  """
  check_args(x, fmt, rbits)
  x = jnp.asarray(x, jnp.float32)
  if x.size == 0:
    return x
  to_tiles, from_tiles = _tiles_view(x.shape, fmt)
  tiles, ungroup = to_tiles(to_bits(x))
  r = to_tiles(jnp.asarray(rbits, jnp.uint32))[0] if fmt.rounding == "stochastic" else None
  exact, float_bits_ = _float_ops(tiles, fmt, r)

  # XLA:CPU runs a fused loop inside a conditional on one thread, and copies a branch's result
  # that is an operand, so the float operations stay outside and select the integer path's
  # result only when they are not exact (an all-zero stand-in otherwise).
  def integer_ops(x: jax.Array, rbits: jax.Array | None) -> jax.Array:
    rows, r, scalars, restore = prepare(x, fmt, rbits)
    return restore(quantize_rows(rows, scalars, fmt, r, materialize=True))
  fallback = lax.cond(exact, lambda x, _: jnp.zeros(x.shape, jnp.uint32), integer_ops, x, rbits)
  return from_bits(jnp.where(exact, from_tiles(float_bits_, ungroup), fallback))


def nvfp4_encode(x: jax.Array, fmt: NVFP4Format, *, key: jax.Array | None = None,
                 index_offset=0, rng: str = "pairs") -> tuple[jax.Array, jax.Array, jax.Array]:
  """NVFP4 encoding of float32 x: (codes, scales, amax), bit for bit the peer's.

  Args:
    x: float32 array; fmt.axis must be one of its axes (a multiple of 16 long with rht).
    fmt: the NVFP4 format.
    key: PRNG key, required with rounding="stochastic": the draws are `jlp.quantize`'s
      (`random_bits(key, x.shape, index_offset=index_offset, rng=rng)`), so these codes decode to
      what `jlp.quantize(x, fmt, key=key)` returns.
    index_offset, rng: as in `jlp.quantize`.

  Returns:
    codes: uint8, x's shape, 0..15 (E2M1 with the sign in bit 3), of the transformed tensor with
      rht. scales: float8_e4m3fn, one per tile: x's shape with the axis divided by 16 (rounded up)
      for 1 x 16 tiles; for 16 x 16 tiles of a 2-D x, both axes divided by 16 (of a 1-D x, the
      axis), of an x with more axes the matrix view (rows / 16, axis / 16). amax: float32 scalar,
      max |x| (of the transformed tensor with rht).
  """
  check_args(x, fmt, draws=False)
  rbits = None
  if fmt.rounding == "stochastic":
    if key is None:
      raise ValueError(f"key=None is not allowed with fmt={fmt!r}: stochastic rounding needs a "
                       "PRNG key (e.g. jax.random.key(0)).")
    rb.check_rng(rng)
    rb.check_offset(index_offset, math.prod(jnp.shape(x)))
    rbits = rb.random_bits(key, jnp.shape(x), index_offset=index_offset, rng=rng)
  return encode(x, fmt, rbits)


def encode(x: jax.Array, fmt: NVFP4Format,
           rbits: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`nvfp4_encode` with the stochastic-rounding draws given as an array (uint32, x's shape)."""
  check_args(x, fmt, rbits)
  x = jnp.asarray(x, jnp.float32)
  _, _, scales, num_scales = layout(x.shape, fmt)
  if x.size == 0:
    scale = scales(jnp.zeros((num_scales,), jnp.float32)).astype(jnp.float8_e4m3fn)
    return jnp.zeros(x.shape, jnp.uint8), scale, jnp.zeros((), jnp.float32)
  rows, r, scalars, restore = prepare(x, fmt, rbits)
  t = _materialized(rht_bits(rows), True) if fmt.rht else rows
  codes, s = encode_rows(t, scalars, fmt, r, materialize=True)
  scale = scales(from_bits(s)).astype(jnp.float8_e4m3fn)
  return restore(codes).astype(jnp.uint8), scale, from_bits(amax_bits(t)).reshape(())
