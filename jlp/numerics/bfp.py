"""Block floating point (BFPsim / FlexBlock) on float32 bit patterns.

A BFP group is an axis-aligned box of the array (the last box along an axis may
be smaller). Every element of a group is put on the grid
Δ = 2^(M - 127 - man + 1), M the largest raw float32 exponent field in the
group, as sign · n · Δ with 0 <= n < 2^man.

`bfp_bits` quantizes element-wise given each element's group maximum, so the same
function serves two layouts: the XLA path (`bfp_quantize`) keeps the groups in
place (maxima reduced over reshapes of whole groups, broadcast back, sliced; no
per-element division), and `group_rows` turns the groups into the rows of a 2-D
array for `bfp_rows_bits` (one max-reduction along the rows), which the Pallas
kernel runs on row tiles. Working on bit patterns keeps the results independent of
XLA:CPU flushing float32 subnormals.

Rounding modes:
  "truncate": BFPsim's `make_groups_*d_internal` bit for bit (docs/bfp.md#the-bfp-format): a
    group with M == 0 (only zeros and subnormals) is unchanged; otherwise with
    k = man - 1 - (M - e) an element keeps its sign, exponent and top k stored
    fraction bits when k >= 0 and becomes +0.0 when k < 0. Inf/NaN follow the same
    bit rule (M = 255 flushes the group's small finite elements; a NaN whose payload
    lies only in dropped bits becomes an infinity).
  "nearest": the same grid, ties to even, on the values (a float32 subnormal is
    2^-149 times its fraction field). A magnitude that would round to n = 2^man
    (past the largest grid point) is clamped to n = 2^man - 1, so the group keeps
    its exponent. Results of magnitude 0 are +0.0 (as BFPsim's flushed elements).
    Groups with M == 0 are unchanged; groups holding inf or NaN (M == 255) keep
    ±inf, turn NaN into a quiet NaN of the same sign and finite elements into +0.0.
  "stochastic": as "nearest" but rounding away from zero iff
    rbits < floor(p · 2^32), p the fraction of a grid step dropped
    (`jlp.numerics.float_cast` convention; one uint32 draw per element), with the
    same clamp at n = 2^man - 1.

Traced widths: `bfp_quantize` and `bfp_bits` take an optional `man` overriding
fmt.man. An int32 array (possibly traced) serves every width from one compiled
function, for all three roundings (the dynamic precision controller,
`jlp.nn.controller`); man=None or an int leaves the static ops unchanged.

References:
  Noh et al., "FlexBlock: A Flexible DNN Training Accelerator With Multi-Mode
    Block Floating Point Support", IEEE Trans. Computers 72(9), 2023
    (arXiv:2203.06673); simulator github.com/IDSLab-KU/BFPsim, `bfp/internal.py`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.formats import BFPFormat
from jlp.numerics.float_cast import (ABS, FRAC, HIDDEN, INF, QNAN, SIGN, from_bits,
                                     round_up_decision, to_bits, u32)

EXPONENT_MAX_FIELD = 255  # raw exponent field of inf and NaN


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def group_rows(x: jax.Array, block: tuple[int, ...]) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """Lays out the BFP groups of `x` as the rows of a (G, P) array.

  Group g (row-major over the grid of groups) becomes row g: its box, zero-padded
  to the full block shape, in row-major order, then zeros up to P. Each axis is
  zero-padded to a multiple of its block (zeros never raise a group's
  exponent, so ragged last groups quantize as if padded). A block entry larger
  than its axis is taken as the axis length (the same groups, narrower rows).

  Args:
    x: an array of any dtype (float32 values or their uint32 bit patterns).
    block: the group shape, one entry per axis of x.

  Returns:
    rows: (G, P) array of x's dtype, G = prod(ceil(S_a / d_a)), P the product of
      the (effective) block entries rounded up to a power of two.
    ungroup: maps a (G, P) array (any dtype) back to x's shape, dropping padding.
  """
  shape = tuple(x.shape)
  if len(block) != len(shape):
    raise ValueError(f"block={tuple(block)!r} has {len(block)} entries but x has ndim={len(shape)}.")
  rank = len(shape)
  dims = tuple(max(1, min(int(d), s)) for d, s in zip(block, shape))
  counts = tuple(-(-s // d) for s, d in zip(shape, dims))
  padded_shape = tuple(n * d for n, d in zip(counts, dims))
  split_shape = tuple(v for nd in zip(counts, dims) for v in nd)
  to_rows = tuple(range(0, 2 * rank, 2)) + tuple(range(1, 2 * rank, 2))
  from_rows = tuple(int(i) for i in np.argsort(to_rows))
  num_groups, group_size = math.prod(counts), math.prod(dims)
  width = _next_power_of_two(group_size)

  padded = jnp.pad(x, [(0, p - s) for p, s in zip(padded_shape, shape)])
  rows = padded.reshape(split_shape).transpose(to_rows).reshape(num_groups, group_size)
  rows = jnp.pad(rows, ((0, 0), (0, width - group_size)))

  def ungroup(grouped: jax.Array) -> jax.Array:
    boxes = grouped[:, :group_size].reshape(counts + dims)
    full = boxes.transpose(from_rows).reshape(padded_shape)
    return full[tuple(slice(0, s) for s in shape)]

  return rows, ungroup


Man = "int | jax.Array"  # a static width, or an int32 array (traced: no recompilation per width)


def _truncate_bits(u: jax.Array, e: jax.Array, group_max: jax.Array, man: Man) -> jax.Array:
  """BFPsim's bit rule (the module docstring's "truncate")."""
  kept_fraction_bits = (man - 1) - (group_max - e).astype(jnp.int32)
  dropped = jnp.clip(23 - kept_fraction_bits, 0, 31).astype(jnp.uint32)
  mask = u32(0xFFFFFFFF) << dropped
  return jnp.where(kept_fraction_bits >= 0, u & mask, u32(0))


def _grid_step_bits(group_max: jax.Array, man: Man) -> jax.Array:
  """Bits of Δ = 2^(M - 127 - man + 1) (a float32 subnormal when M - man + 1 < 1)."""
  field = group_max.astype(jnp.int32) - (man - 1)
  subnormal_pos = jnp.clip(field + 22, 0, 22).astype(jnp.uint32)  # Δ = 2^-149 · 2^(field + 22)
  normal = (jnp.maximum(field, 1).astype(jnp.uint32)) << 23
  return jnp.where(field >= 1, normal, u32(1) << subnormal_pos)


def _round_bits(u: jax.Array, e: jax.Array, group_max: jax.Array, man: Man, rounding: str,
                rbits: jax.Array | None) -> jax.Array:
  """Magnitudes rounded to the group grid (nearest or stochastic), signs put back."""
  sign = u & SIGN
  a = u & ABS
  is_normal = e > 0
  # Δ in units of a's last place: a float32 with field e has ulp 2^(max(e, 1) - 150).
  shift = group_max.astype(jnp.int32) - jnp.maximum(e, u32(1)).astype(jnp.int32) + (24 - man)
  shift = jnp.clip(shift, 0, 63).astype(jnp.uint32)  # negative only in M == 0 groups

  # shift <= 23: round the bits of `a` at `shift`; a carry moves into the exponent.
  s = jnp.minimum(shift, u32(23))
  one = u32(1)
  mask = (one << s) - one
  rem = a & mask
  kept = a & ~mask
  half = jnp.where(s > 0, one << (jnp.maximum(s, one) - one), u32(0))
  # Parity of n = kept / Δ: bit s of `a`, except at s == 23 where n is a normal's hidden bit.
  lsb = ((a >> s) & one) | jnp.where((s == 23) & is_normal, one, u32(0))
  threshold = None
  if rounding == "stochastic":
    threshold = jnp.where(s > 0, rem << (u32(32) - jnp.maximum(s, one)), u32(0))
  up = round_up_decision(rem, half, lsb, rounding, threshold, rbits)
  q = kept + jnp.where(up, one << s, u32(0))

  # shift >= 24: |x| < Δ, so n = 0 and p = significand / 2^shift.
  significand = (a & FRAC) | jnp.where(is_normal, HIDDEN, u32(0))
  if rounding == "nearest":
    up_low = (shift == 24) & (significand > HIDDEN)
  else:
    left = significand << (u32(32) - jnp.clip(shift, 24, 32))
    right_shift = jnp.clip(shift, 32, 63) - u32(32)
    right = jnp.where(right_shift < 24, significand >> jnp.minimum(right_shift, u32(31)), u32(0))
    up_low = rbits < jnp.where(shift <= 32, left, right)
  q = jnp.where(shift >= 24, jnp.where(up_low, _grid_step_bits(group_max, man), u32(0)), q)

  # n = 2^man - 1: exponent M with the top man - 1 stored fraction bits set.
  if isinstance(man, int):
    top_fraction = u32((0x7FFFFF << (24 - man)) & 0x7FFFFF)
  else:
    top_fraction = (u32(0x7FFFFF) << (24 - man).astype(jnp.uint32)) & u32(0x7FFFFF)
  q = jnp.minimum(q, (group_max << 23) | top_fraction)
  out = jnp.where(q == 0, u32(0), sign | q)

  special = jnp.where(a > INF, sign | QNAN, jnp.where(a == INF, u, u32(0)))
  return jnp.where(group_max == EXPONENT_MAX_FIELD, special, out)


def _resolve_man(fmt: BFPFormat, man) -> Man:
  """fmt.man, or the override `man`: a Python/NumPy int is checked and used as a
  static width; an array (traced or not) becomes int32 clipped to 1..24."""
  if man is None:
    return fmt.man
  if isinstance(man, (int, np.integer)) and not isinstance(man, bool):
    return BFPFormat(int(man), fmt.block, fmt.rounding).man  # validates 1..24
  man = jnp.asarray(man)
  if not jnp.issubdtype(man.dtype, jnp.integer):
    raise ValueError(f"man must be an integer array (int32), got dtype {man.dtype}")
  return jnp.clip(man.astype(jnp.int32), 1, 24)


def bfp_bits(u: jax.Array, group_max: jax.Array, fmt: BFPFormat,
             rbits: jax.Array | None = None, man: jax.Array | int | None = None) -> jax.Array:
  """Quantizes float32 bit patterns `u` given their group's largest exponent field.

  Element-wise (`group_max` broadcasts against `u`), so it serves both the row
  layout of the kernel and the XLA path's broadcast group maxima.

  `man` (optional) overrides `fmt.man`: an int32 array (a scalar, or anything
  broadcasting against `u`) may be a traced value, so one compiled function
  serves every width (the dynamic precision controller, docs/bfp.md#simple-controller).
  Array widths are clipped to 1..24. With man=None the ops are those of the
  static width `fmt.man`.
  """
  if fmt.rounding == "stochastic" and rbits is None:
    raise ValueError("stochastic rounding needs rbits (uint32, one per element)")
  man = _resolve_man(fmt, man)
  e = (u >> 23) & u32(0xFF)
  if fmt.rounding == "truncate":
    q = _truncate_bits(u, e, group_max, man)
  else:
    q = _round_bits(u, e, group_max, man, fmt.rounding, rbits)
  return jnp.where(group_max == 0, u, q)


def bfp_rows_bits(u: jax.Array, fmt: BFPFormat, rbits: jax.Array | None = None) -> jax.Array:
  """Quantizes each row of float32 bit patterns as one BFP group.

  Only element-wise ops and a max-reduction along axis 1, so that it also runs on
  (TG, P) row tiles inside a kernel. Zero padding in a row never changes the result
  of the other elements.

  Args:
    u: uint32 (G, P) float32 bit patterns, one group per row (see `group_rows`).
    fmt: the BFP format (its `man` and `rounding`; `block` is already applied).
    rbits: uint32 (G, P) uniform draws, required for rounding="stochastic".

  Returns:
    uint32 (G, P) bit patterns of the quantized values.
  """
  group_max = jnp.max((u >> 23) & u32(0xFF), axis=1, keepdims=True)
  return bfp_bits(u, group_max, fmt, rbits)


# Exponent fields (uint32) per 256-bit vector; see `_maxima_along_last_axis`.
_LANES = 8
# Up to this many runs of _LANES per group are combined with element-wise maxima.
_MAX_RUNS = 32


def _maxima_along_last_axis(e: jax.Array, d: int) -> jax.Array:
  """Maxima of runs of `d` consecutive elements along the last axis, the last run shorter.

  Whole groups and the ragged tail are reduced separately (no padding inside the loop).
  A whole group is viewed as (runs, lanes), lanes = gcd(d, 8): the runs are combined by
  element-wise maxima of contiguous slices and only the final reduction over `lanes` is
  horizontal. XLA:CPU (2 cores, 128M float32) unrolls a reduction over up to a few dozen
  consecutive elements but runs longer ones as a scalar loop: d = 64 takes 19 ms this
  way against 247 ms as one reduction over 64 elements (d = 24: about equal).
  """
  *lead, n = e.shape
  whole = n // d * d
  parts = []
  if whole:
    lanes = math.gcd(d, _LANES)
    runs = d // lanes
    if 1 < runs <= _MAX_RUNS:
      groups = e[..., :whole].reshape(*lead, whole // d, runs, lanes)
      widest = groups[..., 0, :]
      for r in range(1, runs):
        widest = jnp.maximum(widest, groups[..., r, :])
      parts.append(jnp.max(widest, axis=-1))
    else:  # one reduction over the last axis (a reduction over two axes is several times slower)
      parts.append(jnp.max(e[..., :whole].reshape(*lead, whole // d, d), axis=-1))
  if whole < n:
    parts.append(jnp.max(e[..., whole:], axis=-1, keepdims=True))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _maxima_of_boxes(e: jax.Array, dims: tuple[int, ...]) -> jax.Array:
  """Maxima of the boxes `dims` of `e`: zero-padded to whole boxes (zeros never raise a
  maximum), viewed as (c0, d0, c1, d1, ...) and reduced over the d axes."""
  shape = e.shape
  counts = tuple(-(-n // d) for n, d in zip(shape, dims))
  padded_shape = tuple(c * d for c, d in zip(counts, dims))
  if padded_shape != shape:
    e = jnp.pad(e, [(0, p - n) for p, n in zip(padded_shape, shape)])
  split = tuple(v for cd in zip(counts, dims) for v in cd)
  return jnp.max(e.reshape(split), axis=tuple(range(1, 2 * len(shape), 2)))


def group_exponent_maxima(exponents: jax.Array, dims: tuple[int, ...]) -> jax.Array:
  """The largest exponent field of every group, shape (ceil(S_a / d_a), ...).

  Groups are the boxes `dims` (each entry <= its axis, the last box along an axis
  smaller) of `exponents` (uint32 fields 0..255); no element's group is found by
  division. With a last block entry of at least 8: first the runs along the last axis
  (`_maxima_along_last_axis`, the pass that reads the whole array, kept as uint8), then
  the boxes of the other axes on that d_last times smaller array (`_maxima_of_boxes`);
  the result is uint8. With a shorter last entry: one reduction over whole boxes, uint32
  (on XLA:CPU faster there than materializing a first stage of 1/d_last of the array).
  """
  if dims[-1] < _LANES:
    return _maxima_of_boxes(exponents, dims)
  maxima = _maxima_along_last_axis(exponents, dims[-1]).astype(jnp.uint8)
  outer = tuple(dims[:-1]) + (1,)
  if all(d == 1 for d in outer):
    return maxima
  # Materialized: XLA:CPU would otherwise fuse both reductions into one scalar loop.
  return _maxima_of_boxes(lax.optimization_barrier(maxima), outer)


def bfp_quantize(x: jax.Array, fmt: BFPFormat, rbits: jax.Array | None = None,
                 man: jax.Array | int | None = None) -> jax.Array:
  """float32 `x` quantized to `fmt`, as float32 (the XLA path of `jlp.quantize`).

  The groups stay in place and no element's group is found by division: the exponent
  maxima of whole groups are reduced with reshapes (`group_exponent_maxima`, which reads
  x once), then broadcast back over x's layout zero-padded to whole groups, viewed as
  (n0, d0, n1, d1, ...), and sliced to x's shape, inside the element-wise pass that reads
  x again and can write in place (XLA:CPU computes the group index once per vector of
  8 elements there when 8 divides the last block entry).

  Args:
    x: float32 array with ndim == len(fmt.block).
    fmt: the BFP format.
    rbits: uint32 draws of x's shape, required for rounding="stochastic".
    man: optional mantissa width overriding fmt.man: an int32 scalar array (may be
      traced: changing it does not recompile; clipped to 1..24) or an int.

  Returns:
    float32 array of x's shape.
  """
  fmt.check_rank(x.ndim)
  if fmt.rounding == "stochastic" and rbits is None:
    raise ValueError("stochastic rounding needs rbits (uint32, x.shape)")
  x = jnp.asarray(x, jnp.float32)
  if x.size == 0:
    return x
  shape = tuple(x.shape)
  dims = tuple(max(1, min(int(d), n)) for d, n in zip(fmt.block, shape))
  u = to_bits(x)
  maxima = group_exponent_maxima((u >> 23) & u32(0xFF), dims)
  # Materialized: a fused concatenate or pad would be evaluated per element of x.
  maxima = lax.optimization_barrier(maxima)
  counts = maxima.shape
  padded_shape = tuple(c * d for c, d in zip(counts, dims))
  split = tuple(v for cd in zip(counts, dims) for v in cd)
  singleton_groups = maxima.reshape(tuple(v for c in counts for v in (c, 1)))
  group_max = jnp.broadcast_to(singleton_groups, split).reshape(padded_shape)
  if padded_shape != shape:
    group_max = group_max[tuple(slice(0, n) for n in shape)]
  r = None if fmt.rounding != "stochastic" else jnp.asarray(rbits, jnp.uint32)
  return from_bits(bfp_bits(u, group_max.astype(jnp.uint32), fmt, r, man))
