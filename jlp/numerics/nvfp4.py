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
can be a float32 subnormal; checked at run time from the tensor's exponents; on XLA:CPU the
per-tensor and per-tile values too) and otherwise, chosen by `lax.cond`, with the integer
operations above (`_quantize_rows_looped` for compat=None: a loop over the steps, one division
and one product each); tiles along a non-minor axis are handled in place (no transposition).
It runs on chunks of a fixed number of tiles (`_tiles_in_chunks`, after the tensor's amax), in
one chunk program per format and tile shape, traced once and called from every cast site: XLA
compiles the calls apart from the code around them (`jlp.numerics.shared.shared_jit`), far
faster than inlined copies. The Pallas kernel always uses the integer operations
(`quantize_rows`). Both give the same bits.

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
from jlp.numerics.ieee_f32 import div_float, ieee_add
from jlp.numerics.float_cast import (ABS, INF, QNAN, SIGN, cast_bits, float_bits, from_bits,
                                     to_bits, u32)
from jlp.numerics.mx import ldexp_bits
from jlp.numerics.shared import shared_jit

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
  for _ in range(4):
    u = _butterfly_stage(u)
  return u


def _butterfly_stage(u: jax.Array) -> jax.Array:
  """One stage of `_butterfly`."""
  a, b = lax.split(u, (8, 8), axis=1)
  s = to_bits(ieee_add(from_bits(a), from_bits(b)))
  d = to_bits(ieee_add(from_bits(a), from_bits(b ^ SIGN)))
  return jnp.stack([s, d], axis=-1).reshape(u.shape[0], 16)


def _butterfly_loop(u: jax.Array) -> jax.Array:
  """`_butterfly` as a loop over its four identical stages (one stage's code; the XLA path)."""
  return lax.fori_loop(0, 4, lambda _, u: _butterfly_stage(u), u)


def rht_bits(u: jax.Array, butterfly: Callable = _butterfly) -> jax.Array:
  """Rows of 16 float32 bit patterns times T = D H16 / 4 (see the module docstring)."""
  return butterfly(_quarter(u ^ _sign_mask()))


def inverse_rht_bits(u: jax.Array, butterfly: Callable = _butterfly) -> jax.Array:
  """Rows of 16 float32 bit patterns times T^T = H16 D / 4: w = y / 4, butterfly, signs."""
  return butterfly(_quarter(u)) ^ _sign_mask()


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


def _tile_values_float(vmax: jax.Array, amax: jax.Array,
                       fmt: NVFP4Format) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
  """(`tensor_scalars`, *`tile_scales`) of the tiles' max |x| bits `vmax` and the tensor's
  `amax` (1, 1), with XLA:CPU's float32 operations: the same bits where `_float_ops` calls them
  exact (amax finite and at least 2^-60), on a backend that divides in IEEE float32 and flushes
  subnormal operands and results to zero (XLA:CPU; a GPU divides approximately).

  Why the same bits there: every per-tensor value is normal (2688 / amax <= 2^71.4, its
  reciprocal and amax / 2688 >= 2^-71.4, torchao's pts = amax / 2688 and 1 / pts alike); a
  subnormal vmax (read as 0) or a subnormal vmax * mult or vmax / 6 (flushed) is below 2^-57
  where the true value is, which E4M3 rounds to 0 (compat=None), or which the clamp raises to
  2^-6 (torchao, also after the division by pts >= 2^-71.4); a nonzero scale s is
  at least 2^-9, so s * gds lies in [2^-81, 2^126) and its reciprocal is normal, and s = 0 gives
  1 / 0 = inf, clamped to float32's max as in the integer operations."""
  a = from_bits(amax)
  sat = lambda v, limit: jnp.where(v > INF, v, jnp.minimum(v, limit))
  if fmt.compat is None:
    ges = to_bits(div_float(jnp.float32(448.0 * 6.0), a))
    ges = from_bits(jnp.where(sat(ges, _FLT_MAX) == 0, _ONE, sat(ges, _FLT_MAX)))
    gds = div_float(jnp.float32(1.0), ges)
    mult = ges * from_bits(_RECIP6)
    scalars = (to_bits(gds), to_bits(mult), to_bits(div_float(a, jnp.float32(448.0 * 6.0))))
    s = cast_bits(_min_keep_nan(to_bits(from_bits(vmax) * mult), _E4M3_MAX), E4M3)
    d = lax.optimization_barrier(from_bits(s) * gds)
    encode = _min_keep_nan(to_bits(div_float(jnp.float32(1.0), d)), _FLT_MAX)
    return scalars, s, encode
  block = div_float(from_bits(vmax), jnp.float32(6.0))
  scalars = ()
  if fmt.tensor_scale:
    pts = div_float(a, jnp.float32(448.0 * 6.0))
    ipts = div_float(jnp.float32(1.0), pts)
    scalars = (to_bits(pts), to_bits(ipts))
    block = div_float(block, pts)
  block = to_bits(block)
  s = cast_bits(jnp.where(block > INF, block, jnp.clip(block, _E4M3_EPS, _E4M3_MAX)), E4M3)
  encode = div_float(ipts if fmt.tensor_scale else jnp.float32(1.0), from_bits(s))
  return scalars, s, to_bits(encode)


def _tile_values_int(vmax: jax.Array, amax: jax.Array,
                     fmt: NVFP4Format) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
  """`_tile_values_float` in the integer operations (exact on every backend)."""
  scalars = tensor_scalars(amax, fmt)
  return (scalars, *tile_scales(vmax, scalars, fmt))


def _float_ops(u: jax.Array, fmt: NVFP4Format, rbits: jax.Array | None,
               amax: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
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
  if amax is None:  # else the amax of the whole tensor, of which u is a chunk
    amax = max_all(vmax.reshape(-1, vmax.shape[-1]))
  # The per-tensor and per-tile values: float32 operations on XLA:CPU (the same bits wherever
  # `exact` below holds), the integer operations elsewhere (a GPU divides approximately).
  scalars, s, encode = lax.optimization_barrier(lax.platform_dependent(
      vmax, amax, cpu=lambda v, a: _tile_values_float(v, a, fmt),
      default=lambda v, a: _tile_values_int(v, a, fmt)))
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


# The XLA path's integer fallback for compat=None (`_quantize_rows_looped`): registers and a
# schedule of steps, each one division and one product of registers, as `quantize_rows`
# computes them (`tensor_scalars`, `tile_scales`, `encode_rows`, `decode_rows`), in its order.
_REGS = ("zero", "amax", "vmax", "t", "global", "one", "recip6", "ges", "gds", "mult", "post", "s",
         "d", "encode", "qs", "out")
# (dividend, divisor, quotient, factor, factor, product); ("zero", "one", "zero") and ("zero",
# "zero", "zero") are no-ops (+0 into the zero register).
_SCHEDULE = (
    ("global", "amax", "ges", "zero", "zero", "zero"),   # ges = min(2688 / amax, max); 0 -> 1
    ("one", "ges", "gds", "ges", "recip6", "mult"),      # gds = 1 / ges; mult = ges * r6
    ("amax", "global", "post", "vmax", "mult", "s"),     # amax / 2688; s = e4m3(min(., 448))
    ("zero", "one", "zero", "s", "gds", "d"),            # d = s * gds
    ("one", "d", "encode", "zero", "zero", "zero"),      # encode = min(1 / d, max)
    ("zero", "one", "zero", "t", "encode", "qs"),        # codes of t * encode; qs = e2m1 * s
    ("zero", "one", "zero", "qs", "post", "out"),        # out = qs * (amax / 2688)
)
_STEP = {name: i for i, name in enumerate(_REGS)}
_TABLE = np.asarray([[_STEP[r] for r in step] for step in _SCHEDULE], np.int32)


def _quantize_rows_looped(u: jax.Array, amax: jax.Array, fmt: NVFP4Format,
                          rbits: jax.Array | None = None) -> jax.Array:
  """`quantize_rows(u, tensor_scalars(amax, fmt), fmt, rbits)` for compat=None, the same bits,
  as a loop over `_SCHEDULE` whose body holds one `div_bits` and one `mul_bits` (on the rows'
  shape, per-tensor and per-tile values broadcast) where `quantize_rows` holds four and five:
  the XLA path's fallback, small to compile, slower to run than `quantize_rows` (it runs only
  for tensors the float operations cannot take)."""
  t = _materialized(rht_bits(u, _butterfly_loop), True) if fmt.rht else u
  shape = t.shape
  full = lambda v: jnp.broadcast_to(jnp.asarray(v, jnp.uint32), shape)
  init = {"amax": full(amax), "vmax": full(jnp.max(t & ABS, axis=1, keepdims=True)), "t": t,
          "global": full(_GLOBAL), "one": full(_ONE), "recip6": full(_RECIP6)}
  regs = jnp.stack([init.get(name, full(0)) for name in _REGS])
  table = jnp.asarray(_TABLE)
  step_of = lambda name: next(i for i, st in enumerate(_SCHEDULE) if name in (st[2], st[5]))

  def body(i, regs):
    reg = lambda j: lax.dynamic_index_in_dim(regs, table[i, j], keepdims=False)
    quotient = div_bits(reg(0), reg(1))
    product = mul_bits(reg(3), reg(4))
    clamped = _min_keep_nan(quotient, _FLT_MAX)
    quotient = jnp.where(i == step_of("ges"), jnp.where(clamped == 0, _ONE, clamped),
                         jnp.where(i == step_of("encode"), clamped, quotient))
    s = cast_bits(_min_keep_nan(product, _E4M3_MAX), E4M3)
    qs = to_bits(from_bits(e2m1_bits(_codes(product, fmt, rbits))) * from_bits(regs[_STEP["s"]]))
    product = jnp.where(i == step_of("s"), s, jnp.where(i == step_of("qs"), qs, product))
    regs = lax.dynamic_update_index_in_dim(regs, quotient, table[i, 2], 0)
    return lax.dynamic_update_index_in_dim(regs, product, table[i, 5], 0)

  out = lax.fori_loop(0, len(_SCHEDULE), body, regs)[_STEP["out"]]
  return inverse_rht_bits(_materialized(out, True), _butterfly_loop) if fmt.rht else out


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
  return _quantize_xla(x, rbits, fmt=fmt)


# The XLA path quantizes its tiles this many elements at a time (at most; at least one tile row).
_TILE_CHUNK_ELEMENTS = 1 << 17


@shared_jit(static_argnames=("fmt",))
def _tiles_chunk(u: jax.Array, r: jax.Array | None, amax: jax.Array, *,
                 fmt: NVFP4Format) -> jax.Array:
  """Bits of the quantized tiles u (uint32 (C, P, B), axis 1 along a tile; draws alike) of a
  tensor with max |x| bits `amax` (1, 1): the float operations where they are exact for this
  chunk (`_float_ops`; its conditions are per tile, given the amax), else the integer ones
  (`_quantize_rows_looped`, or `quantize_rows` for torchao's formats), chosen by `lax.cond`.
  Traced once per format and chunk shape; a call in the compiled program (`shared_jit`)."""
  c, p, b = u.shape
  exact, bits = _float_ops(u.reshape(c, 1, p, b), fmt,
                           None if r is None else r.reshape(c, 1, p, b), amax)

  # XLA:CPU runs a fused loop inside a conditional on one thread, and copies a branch's result
  # that is an operand, so the float operations stay outside and select the integer path's
  # result only when they are not exact (an all-zero stand-in otherwise).
  def integer_ops(u: jax.Array, r: jax.Array | None) -> jax.Array:
    rows = lambda v: jnp.swapaxes(v, 1, 2).reshape(c * b, p)
    rr = None if r is None else rows(r)
    if fmt.compat is None:
      out = _quantize_rows_looped(rows(u), amax, fmt, rr)
    else:
      out = quantize_rows(rows(u), tensor_scalars(amax, fmt), fmt, rr, materialize=True)
    return jnp.swapaxes(out.reshape(c, b, p), 1, 2)
  fallback = lax.cond(exact, lambda u, r: jnp.zeros(u.shape, jnp.uint32), integer_ops, u, r)
  return jnp.where(exact, bits.reshape(c, p, b), fallback)


@shared_jit(static_argnames=("exact",))
def _rht_amax_chunk(u: jax.Array, *, exact: bool) -> tuple[jax.Array, jax.Array]:
  """(max |t| bits (1, 1), whether no nonzero |x| is below 2^-90) of the transform t of the
  tiles u (uint32 (C, 16, B), axis 1 along a tile): in float32 operations, or with `exact` in
  the integer ones (`rht_bits`)."""
  c, p, b = u.shape
  magnitude = u & ABS
  ok = ~jnp.any((magnitude != 0) & (magnitude < _RHT_MIN_INPUT))
  if exact:
    t = rht_bits(jnp.swapaxes(u, 1, 2).reshape(c * b, p), _butterfly_loop)
  else:
    signs = _sign_mask().reshape(1, 1, 16, 1)
    t = to_bits(_butterfly_float(from_bits(u.reshape(c, 1, p, b) ^ signs) * 0.25))
  return max_all((t & ABS).reshape(c, -1)), ok


def _tiles_in_chunks(tiles: jax.Array, r: jax.Array | None, fmt: NVFP4Format) -> jax.Array:
  """Bits of the quantized tiles (`_tiles_view`: uint32 (A, T, P, B); draws alike, or None):
  the tensor's amax, then `_tiles_chunk` as `lax.map` over chunks of a fixed number of tiles
  along A * T (zero tiles pad the last chunk; each tile is quantized on its own given the amax,
  so padding changes no other tile). Every cast of a format whose tiles have the same B (1 for
  tiles along the minor axis and for 16 x 16 tiles) runs the same chunk program, where a
  whole-tensor program differs in shape from site to site: XLA compiles the same kernels once."""
  a, t, p, b = tiles.shape
  m = a * t
  c = max(1, _TILE_CHUNK_ELEMENTS // (p * b))
  n = -(-m // c)
  chunks = lambda v: jnp.pad(v.reshape(m, p, b), ((0, n * c - m), (0, 0), (0, 0))).reshape(
      n, c, p, b)
  if fmt.rht:
    # The amax of the transformed tensor: the float transform's, which is exact when no nonzero
    # input is below 2^-90 (`_float_ops`), else the integer transform's.
    amax_f, ok = lax.map(lambda u: _rht_amax_chunk(u, exact=False), chunks(tiles))
    ok = jnp.all(ok)
    amax_i = lax.cond(ok, lambda u: jnp.zeros((n, 1, 1), jnp.uint32),
                      lambda u: lax.map(lambda v: _rht_amax_chunk(v, exact=True)[0], u),
                      chunks(tiles))
    amax = max_all(jnp.where(ok, amax_f, amax_i).reshape(1, n))
  else:
    amax = max_all((tiles & ABS).reshape(m, p * b))
  amax = jnp.where(amax > INF, QNAN, amax)
  if r is None:
    out = lax.map(lambda u: _tiles_chunk(u, None, amax, fmt=fmt), chunks(tiles))
  else:
    out = lax.map(lambda ur: _tiles_chunk(ur[0], ur[1], amax, fmt=fmt), (chunks(tiles), chunks(r)))
  return out.reshape(n * c, p, b)[:m].reshape(a, t, p, b)


@jax.jit(static_argnames=("fmt",))
def _quantize_xla(x: jax.Array, rbits: jax.Array | None, *, fmt: NVFP4Format) -> jax.Array:
  """`nvfp4_quantize` of a non-empty float32 x (jitted: the casts of one shape and format in a
  program are traced and lowered once)."""
  to_tiles, from_tiles = _tiles_view(x.shape, fmt)
  tiles, ungroup = to_tiles(to_bits(x))
  r = to_tiles(jnp.asarray(rbits, jnp.uint32))[0] if fmt.rounding == "stochastic" else None
  return from_bits(from_tiles(_tiles_in_chunks(tiles, r, fmt), ungroup))


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
