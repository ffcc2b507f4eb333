"""Block-scaled quantization with a float32 scale per block (DeepSeek-V3's fine-grained FP8,
TransformerEngine's Float8BlockScaling), on float32 bit patterns.

Layout: x is viewed as a matrix, `fmt.axis` moved last and the other axes flattened (row-major)
into rows; a block covers r consecutive rows and c consecutive columns, (r, c) = fmt.block, each
entry capped at the matrix's extent. Edge blocks are partial and use their own amax (computing
it over a zero-padded block gives the same value).

Semantics, per block, with A = max |x| over the block, M = elem.max and fl32 IEEE 754 binary32
rounding to nearest even with gradual underflow:

  s = fl32(A / M)                   one float32 division; s = 1 for an all-zero block (A = 0);
                                    s = 2^-149 (the smallest positive float32) where A / M rounds
                                    to zero (A > 0, A <= M · 2^-150);
  s = 2^ceil(log2 s)                with pow2_scale=True: the smallest power of two >= that s,
                                    read exactly from its bits (a subnormal s gives a subnormal
                                    power of two; 2^127 at most, reached only for M < 2);
  y = fl32(x / s)                   one float32 division per element (subnormal y exact);
  q = elem(y)                       round to nearest even onto elem's grid, saturating to ±M;
  value = fl32(q · s)               one float32 multiply (subnormal results exact; a product past
                                    float32's range is ±inf as IEEE gives: it needs A within
                                    about an ulp of float32's max, or, with pow2_scale, within
                                    one element grid step of 2^128).

scale_rule="reciprocal" (TransformerEngine's `compute_scale_from_amax`,
transformer_engine/common/recipe/recipe_common.cuh, epsilon 0, the rule of Float8CurrentScaling
and Float8BlockScaling), per block:

  m = fl32(M / A)                   one float32 division (`__fdiv_rn`); m = 1 for A = 0; float32's
                                    largest finite value where the quotient overflows;
  m = m & 0xFF800000                with pow2_scale (TE's force_pow_2_scales: m rounded down to a
                                    power of two, so the scale 1 / m is rounded up);
  q = elem(fl32(x · m))             one float32 multiply, then the saturating cast (TE's satfinite
                                    FP8 conversion);
  value = fl32(q · fl32(1 / m))     the value TE's scale_inv = 1 / m gives the element.

TE's GEMM applies scale_inv to the accumulated products rather than to each element; the
element-wise value above is the quantized operand that the emulated GEMM then multiplies. For a
block holding inf, TE's multiplier is 1 (an infinite amax) and the saturating cast maps the
infinities to ±M, where a non-finite block is all NaN here (below).

Signed zeros are kept (an all-zero block is returned unchanged, elements rounding to zero keep
their sign). A block holding inf or NaN becomes all NaN (0x7FC00000): its scale would be inf or
NaN, and TransformerEngine's reference then dequantizes every element to NaN as well.

Exactness: in `block_scaled_bits`, x / s and q · s are `jlp.numerics.ieee_f32.div_bits` /
`mul_bits` (integer ops), so tiny-amax blocks, whose scales and results are float32 subnormals,
are exact on XLA:CPU (which reads subnormal operands as 0 and flushes subnormal results) and in
the Pallas kernel (`pallas_kernels.block_scaled`), which runs the same `block_scaled_bits` on
tiles of blocks: both paths agree bit for bit. The XLA path uses the float32 division (rule
"divide", on a CPU only: a GPU's float division is approximate) or multiplication (rule
"reciprocal", on any backend) and the float32 multiply when they give the same bits
(`_float_ops`, several times faster on XLA:CPU; otherwise `lax.cond` runs the integer ops):
every block is all zero, non-finite or has s >= 2^-100 (m <= 2^100), and elem's smallest
positive value is at least 2^-24. Then a quotient or product flushed to ±0 (below 2^-126), or a
subnormal x read as ±0 (|x / s| < 2^-26), would round to that zero in elem anyway, q · s is 0
or a normal float32, and XLA:CPU divides by an elementwise divisor array with one IEEE rounding
(it multiplies by a reciprocal only for a scalar divisor, as measured on this project's
machines), which the tests check against numpy at the element grid's ties. The Pallas kernel
always uses the integer ops (`jlp.quantize`'s impl="auto" takes the XLA path, on GPU too).
On XLA:CPU the float path computes the per-block values with float32 divisions too (the same
bits where it is taken: a normal amax), and the XLA path is jitted with the format static, so
the casts of one shape and format in a program are traced and lowered once (issue 38).

Peers:
  DeepSeek-V3 (inference/kernel.py, `act_quant` / `weight_quant` / `weight_dequant`):
    s = amax / 448, y = x / s cast to float8_e4m3fn (Triton's saturating cast), value = y · s --
    this rule, except that an all-zero block gets s = 0 there (NaN). Later revisions of that
    file clamp amax below at 1e-4 (so blocks with amax < 1e-4 differ from this rule) and add
    scale_fmt="ue8m0": s = exp2(ceil(log2(s))) in float arithmetic, which pow2_scale computes
    exactly from s's bits (float log2 can miss the ceiling for s just above a power of two).
  TransformerEngine (tests/pytorch/references/quantize_scale_calc.py, `scale_from_amax_tensor`,
    and blockwise_quantizer_reference.py, `BlockwiseQuantizerReference`): the quantization
    scale is the reciprocal, scale = fl32(M / max(A, eps)) (eps = 0 by default; scale = the
    input dtype's max where M / A overflows, 1 for A = 0), elements are fl32(x · scale) clamped and
    cast, and dequantization multiplies by scale_inv = fl32(1 / scale). That rounds twice where
    this rule rounds once (x · fl32(M / A) vs x / fl32(A / M), and q · fl32(1 / fl32(M / A))
    vs q · fl32(A / M)), so values can differ in the last bit. With pow2_scale its scale is
    2^floor(log2 fl32(M / A)), equal to this module's 1 / 2^ceil(log2 fl32(A / M)) except when
    the two quotients round across a power of two differently. Its 1x128 and 128x128 tilings
    zero-pad partial blocks, which leaves each block's amax unchanged, as here.

References:
  DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024, §3.3.
  NVIDIA TransformerEngine, Float8BlockScaling recipe and its blockwise quantizer reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import BlockScaledFormat
from jlp.numerics.bit_max import fold_rows, max_rows
from jlp.numerics.float_cast import (ABS, FRAC, INF, QNAN, cast_bits, float_bits, from_bits,
                                     to_bits, u32)
from jlp.numerics.ieee_f32 import div_bits, div_float, mul_bits
from jlp.numerics.shared import shared_jit

_ONE = float_bits(1.0)
_FLT_MAX = float_bits(float(jnp.finfo(jnp.float32).max))
_MAX_POW2 = float_bits(2.0 ** 127)
_FLOAT_OPS_MIN_SCALE = float_bits(2.0 ** -100)
_FLOAT_OPS_MAX_MULTIPLIER = float_bits(2.0 ** 100)
_MIN_NORMAL = float_bits(2.0 ** -126)


def _div_float_bits(a: jax.Array, b: jax.Array) -> jax.Array:
  """Bits of a / b (float32 bit patterns) by one float32 division (`div_float`)."""
  return to_bits(div_float(from_bits(a), from_bits(b)))


def scale_bits(amax: jax.Array, fmt: BlockScaledFormat, div=div_bits) -> jax.Array:
  """uint32 bits of each block's scale s (module docstring) from the bits of its finite `amax`
  (`div`: the division of bit patterns; `_float_ops` passes the float one)."""
  s = div(amax, jnp.full_like(amax, float_bits(fmt.elem.max)))
  s = jnp.maximum(s, u32(1))  # a quotient that rounds to zero: 2^-149
  if fmt.pow2_scale:
    field = s >> u32(23)
    fraction = s & FRAC
    normal = jnp.minimum((field + (fraction != 0).astype(jnp.uint32)) << u32(23), _MAX_POW2)
    # Subnormal s = m · 2^-149 (1 <= m < 2^23): the power of two 2^ceil(log2 m) is
    # 1 << (32 - clz(m - 1)) (m = 1: clz(0) = 32, 1 << 0), at most 2^23 (2^-126's bits).
    m = jnp.where(field > 0, u32(1), fraction)  # keeps the shift below 32 for normal s
    up = 32 - lax.clz((m - u32(1)).astype(jnp.int32))
    s = jnp.where(field > 0, normal, u32(1) << up.astype(jnp.uint32))
  return jnp.where(amax == 0, _ONE, s)


def multiplier_bits(amax: jax.Array, fmt: BlockScaledFormat, div=div_bits) -> jax.Array:
  """uint32 bits of each block's multiplier m under scale_rule="reciprocal" (TransformerEngine's
  `compute_scale_from_amax` with epsilon 0: elem.max / amax, float32's max where that overflows,
  rounded down to a power of two with pow2_scale, 1 for amax = 0) from the bits of its finite
  `amax`."""
  m = div(jnp.full_like(amax, float_bits(fmt.elem.max)), jnp.where(amax == 0, _ONE, amax))
  m = jnp.where(m >= INF, _FLT_MAX, m)
  if fmt.pow2_scale:
    m = m & u32(0xFF800000)  # m is a normal float32: elem.max / amax >= elem.max / FLT_MAX
  return jnp.where(amax == 0, _ONE, m)


def block_values(amax: jax.Array, fmt: BlockScaledFormat, div=div_bits) -> tuple[jax.Array, ...]:
  """(finite, a, b) of blocks with the max |x| bits `amax` (>= INF: the block holds inf or NaN):
  whether the block is finite, and the bits of the element operations' operands: rule "divide"
  (s, s): q = elem(x / s), value = q · s; rule "reciprocal" (m, 1 / m): q = elem(x · m),
  value = q · (1 / m). `div` divides bit patterns (default: the exact integer division)."""
  finite = amax < INF
  amax = jnp.where(finite, amax, u32(0))
  if fmt.scale_rule == "reciprocal":
    m = multiplier_bits(amax, fmt, div)
    return finite, m, div(jnp.full_like(m, _ONE), m)
  s = scale_bits(amax, fmt, div)
  return finite, s, s


def apply_block_values(u: jax.Array, finite: jax.Array, a: jax.Array, b: jax.Array,
                       fmt: BlockScaledFormat) -> jax.Array:
  """The element operations on float32 bit patterns `u` with their blocks' `block_values`
  (broadcast against u), in integer operations."""
  u = jnp.where((u & ABS) < INF, u, u32(0))  # elements of NaN blocks: any finite stand-in
  elem = dataclasses.replace(fmt.elem, overflow="saturate")
  scaled = mul_bits(u, a) if fmt.scale_rule == "reciprocal" else div_bits(u, a)
  return jnp.where(finite, mul_bits(cast_bits(scaled, elem), b), QNAN)


def block_scaled_bits(u: jax.Array, amax: jax.Array, fmt: BlockScaledFormat) -> jax.Array:
  """Element-wise block-scaled quantization of float32 bit patterns `u` whose blocks have the
  max |x| bits `amax` (broadcast against u; >= INF: the block holds inf or NaN)."""
  return apply_block_values(u, *block_values(amax, fmt), fmt)


def block_scaled_rows_bits(u: jax.Array, fmt: BlockScaledFormat) -> jax.Array:
  """Quantizes each row of the uint32 (R, P) float32 bit patterns `u` as one block (the kernel
  body: zero padding in a row leaves its amax, and so its other elements, unchanged)."""
  return block_scaled_bits(u, jnp.max(u & ABS, axis=1, keepdims=True), fmt)


def check_arguments(x, fmt) -> None:
  """Raises for a format that is not a BlockScaledFormat, a non-float32 x or a bad axis."""
  if not isinstance(fmt, BlockScaledFormat):
    raise TypeError(f"fmt={fmt!r} is not allowed; expected a BlockScaledFormat.")
  dtype = jnp.result_type(x)
  if dtype != jnp.float32:
    raise ValueError(f"x.dtype={dtype} is not allowed; expected float32.")
  fmt.check_rank(jnp.ndim(x))


def as_matrix(x: jax.Array, axis: int) -> tuple[jax.Array, tuple[int, ...]]:
  """x with `axis` moved last and the other axes flattened into rows, and the moved shape."""
  moved = jnp.moveaxis(x, axis, -1)
  return moved.reshape(-1, moved.shape[-1]), moved.shape


def from_matrix(m: jax.Array, moved_shape: tuple[int, ...], axis: int) -> jax.Array:
  return jnp.moveaxis(m.reshape(moved_shape), -1, axis)


def _block_amax(u: jax.Array, rows: int, cols: int) -> jax.Array:
  """max |x| bits of every (rows, cols) block of the (R, C) bit patterns `u`, as an
  (R/r, 1, C/c, 1) array: the matrix is zero-padded to whole blocks, split and reduced (16 rows
  at a time, then along each block's row: `jlp.numerics.bit_max`)."""
  num_r, num_c = -(-u.shape[0] // rows), -(-u.shape[1] // cols)
  a = jnp.pad(u & ABS, ((0, num_r * rows - u.shape[0]), (0, num_c * cols - u.shape[1])))
  a = jnp.max(fold_rows(a.reshape(num_r, rows, num_c * cols)), axis=1)  # (num_r, num_c * cols)
  return max_rows(a.reshape(num_r * num_c, cols)).reshape(num_r, 1, num_c, 1)


def _broadcast_blocks(per_block: jax.Array, shape: tuple[int, int], rows: int,
                      cols: int) -> jax.Array:
  """(R/r, 1, C/c, 1) values of the (rows, cols) blocks broadcast back to the (R, C) matrix."""
  num_r, _, num_c, _ = per_block.shape
  full = jnp.broadcast_to(per_block, (num_r, rows, num_c, cols))
  return full.reshape(num_r * rows, num_c * cols)[:shape[0], :shape[1]]


def _float_ops(m: jax.Array, amax: jax.Array, fmt: BlockScaledFormat, rows: int,
               cols: int) -> tuple[jax.Array, jax.Array]:
  """(exact, bits): `block_scaled_bits` of the float32 matrix `m` (blocks of (rows, cols) with
  the max |x| bits `amax`, per block) computed with float32 products and (rule "divide")
  quotients, and whether those give its bits on a backend that reads subnormal operands as 0
  and flushes subnormal results (XLA:CPU; module docstring).

  exact holds when elem's smallest positive value is at least 2^-24 and every block is all
  zero, non-finite, or (rule "divide") has s >= 2^-100 or (rule "reciprocal") m <= 2^100: then
  a quotient or product flushed to ±0, or a subnormal x read as ±0, is below 2^-26 and rounds to
  that zero in elem anyway, and q · s (or q · (1 / m)) is 0 or a normal float32. The per-block
  values keep the integer operations (one per block).
  """
  elem = fmt.elem
  # The per-block values: on XLA:CPU one float32 division each (IEEE; the same bits as the
  # integer division wherever `exact` below holds: a normal amax, a normal quotient, and with
  # rule "reciprocal" an overflow to inf either way), elsewhere the integer division (a GPU
  # divides approximately).
  finite, a, b = lax.optimization_barrier(lax.platform_dependent(
      amax, cpu=lambda amax: block_values(amax, fmt, _div_float_bits),
      default=lambda amax: block_values(amax, fmt)))
  if fmt.scale_rule == "reciprocal":
    safe = a <= _FLOAT_OPS_MAX_MULTIPLIER
  else:
    safe = a >= _FLOAT_OPS_MIN_SCALE
  # A nonzero finite amax below 2^-126 (read as 0 by the float division) takes the integer ops.
  exact = jnp.all((amax == 0) | ~finite | (safe & (amax >= _MIN_NORMAL)))
  if (elem.emin - elem.man if elem.subnormals else elem.emin) < -24:
    exact = jnp.bool_(False)
  broadcast = lambda v: lax.bitcast_convert_type(_broadcast_blocks(v, m.shape, rows, cols),
                                                 jnp.float32)
  finite_full = _broadcast_blocks(finite, m.shape, rows, cols)
  x = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)  # elements of NaN blocks: any finite stand-in
  sat = dataclasses.replace(elem, overflow="saturate")
  if fmt.scale_rule == "reciprocal":
    scaled = x * broadcast(a)
  else:
    # XLA rewrites a division by a broadcast as a product with the broadcast reciprocal (two
    # roundings, even through an OR with an opaque zero): the divisor is materialised.
    scaled = x / lax.optimization_barrier(broadcast(a))
  out = lax.bitcast_convert_type(cast_bits(to_bits(scaled), sat), jnp.float32) * broadcast(b)
  return exact, jnp.where(finite_full, to_bits(out), QNAN)


def block_scaled_quantize(x: jax.Array, fmt: BlockScaledFormat) -> jax.Array:
  """float32 `x` quantized to `fmt` (module docstring), as float32 (the XLA path of
  `jlp.quantize` for a BlockScaledFormat).

  Args:
    x: float32 array with at least one axis; `fmt.axis` must be one of them.
    fmt: the block-scaled format.

  Returns:
    float32 array of x's shape.

  Raises:
    TypeError: fmt is not a BlockScaledFormat.
    ValueError: x is not float32, or fmt.axis is out of range, before any computation.
  """
  check_arguments(x, fmt)
  x = jnp.asarray(x)
  if x.size == 0:
    return x
  return _quantize_xla(x, fmt=fmt)


# The integer fallback runs on chunks of about this many elements (whole blocks, at least one).
_FALLBACK_CHUNK_ELEMENTS = 1 << 17


@shared_jit(static_argnames=("fmt",))
def _blocks_chunk(u: jax.Array, amax: jax.Array, *, fmt: BlockScaledFormat) -> jax.Array:
  """`block_scaled_bits` of K blocks, one per row of the bit patterns u (K, B), with their max
  |x| bits `amax` (K, 1): the integer operations (exact on every backend). Traced once per format
  and chunk shape; a call in the compiled program (`shared_jit`)."""
  per_block = lax.optimization_barrier(block_values(amax, fmt))  # once per block, not element
  return apply_block_values(u, *per_block, fmt)


def _integer_ops(m: jax.Array, amax: jax.Array, fmt: BlockScaledFormat, rows: int,
                 cols: int) -> jax.Array:
  """Bits of the cast of the matrix m (float32, blocks of rows x cols, zero-padded to whole
  blocks) with the blocks' max |x| bits `amax` (R/r, 1, C/c, 1), in the integer operations: the
  float path's fallback. The blocks are laid out one per row and cast in chunks of a fixed number
  of blocks (`lax.map` over `_blocks_chunk`; padding blocks have amax 0 and are dropped), so every
  cast of a format with this block shape calls the same chunk program."""
  num_r, _, num_c, _ = amax.shape
  size = rows * cols
  u = jnp.pad(to_bits(m), ((0, num_r * rows - m.shape[0]), (0, num_c * cols - m.shape[1])))
  blocks = u.reshape(num_r, rows, num_c, cols).transpose(0, 2, 1, 3).reshape(-1, size)
  per_chunk = max(1, _FALLBACK_CHUNK_ELEMENTS // size)
  count = -(-blocks.shape[0] // per_chunk)
  extra = count * per_chunk - blocks.shape[0]
  blocks = jnp.pad(blocks, ((0, extra), (0, 0))).reshape(count, per_chunk, size)
  maxima = jnp.pad(amax.reshape(-1, 1), ((0, extra), (0, 0))).reshape(count, per_chunk, 1)
  out = lax.map(lambda b: _blocks_chunk(b[0], b[1], fmt=fmt), (blocks, maxima))
  out = out.reshape(-1, size)[:num_r * num_c].reshape(num_r, num_c, rows, cols)
  return out.transpose(0, 2, 1, 3).reshape(num_r * rows, num_c * cols)[:m.shape[0], :m.shape[1]]


@jax.jit(static_argnames=("fmt",))
def _quantize_xla(x: jax.Array, *, fmt: BlockScaledFormat) -> jax.Array:
  """`block_scaled_quantize` of a non-empty x (jitted: the casts of one shape and format in a
  program are traced and lowered once)."""
  m, moved_shape = as_matrix(x, fmt.axis)
  rows, cols = min(fmt.block[0], m.shape[0]), min(fmt.block[1], m.shape[1])
  amax = lax.optimization_barrier(_block_amax(to_bits(m), rows, cols))

  # The branches take m, not its bits (a bitcast outside lax.cond can make XLA:CPU copy).
  def integer_ops(m: jax.Array, amax: jax.Array) -> jax.Array:
    return _integer_ops(m, amax, fmt, rows, cols)

  def float_ops(m: jax.Array, amax: jax.Array) -> jax.Array:
    # XLA:CPU runs a fused loop inside a conditional on one thread, and copies a branch's
    # result that is an operand: the float operations stay outside, and the conditional gives
    # the integer path's result only where they are not exact (an all-zero stand-in otherwise).
    exact, bits = _float_ops(m, amax, fmt, rows, cols)
    fallback = lax.cond(exact, lambda m, amax: jnp.zeros(m.shape, jnp.uint32), integer_ops,
                        m, amax)
    return jnp.where(exact, bits, fallback)

  # A GPU's float32 division is approximate (XLA uses PTX div.full.f32), so only the CPU
  # divides in float; the "reciprocal" rule only multiplies.
  if fmt.scale_rule == "reciprocal":
    out = float_ops(m, amax)
  else:
    out = lax.platform_dependent(m, amax, cpu=float_ops, default=integer_ops)
  return from_matrix(lax.bitcast_convert_type(out, jnp.float32), moved_shape, fmt.axis)
