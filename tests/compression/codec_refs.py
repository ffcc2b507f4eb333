"""Plain-Python / numpy reference encoders of the compressors, written from hipress.md §1 and the
papers (never jlp code): each returns (HiPress's wire bytes, the new state, the decoded float64
values). Arithmetic is numpy float32 where the spec says float32, scalar by scalar; bits are
packed by Python loops; sums of float32 values are exact in float64 for most inputs the tests
use (dyadic values), so the reference computes them in float64 and rounds once, except onebit's
means, summed as jlp documents its blocked sums (`blocked_sum`), so that chains of steps on
normal values can be compared bit for bit.

Random draws are the key's (the compressors' documented sources): the sparse compressors'
sample positions are `jax.random.randint(key, (S,), 0, n)`, the stochastic quantisers' u is
`jax.random.uniform(key, (n,), float32)`. Where a float32 multiply-add may be one fused
operation in jit (XLA contracts it, as nvcc does for HiPress's kernels), the reference returns
both roundings' codes (`alt`).
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import jax
import numpy as np

f32 = np.float32


def pack(codes, bits: int, pad: int = 0) -> bytes:
  """LSB-first: code i at bit offset bits*(i mod 8/bits) of byte i // (8/bits)."""
  per = 8 // bits
  out = []
  for start in range(0, len(codes), per):
    chunk = list(codes[start:start + per]) + [pad] * (per - len(codes[start:start + per]))
    byte = 0
    for j, c in enumerate(chunk):
      byte |= (int(c) & ((1 << bits) - 1)) << (bits * j)
    out.append(byte)
  return bytes(out)


def unpack(data: bytes, bits: int, n: int) -> list[int]:
  per = 8 // bits
  return [(data[i // per] >> (bits * (i % per))) & ((1 << bits) - 1) for i in range(n)]


def floats(*values) -> bytes:
  return struct.pack(f"<{len(values)}f", *[float(f32(v)) for v in values])


# -- TBQ (§1.1) ------------------------------------------------------------------------------------
def tbq(x, residual, tau):
  """HiPress's zgc: bytes start at 0x55 (all codes 1); code 2 by XOR 3<<2k, code 0 by XOR 1<<2k;
  the residual r updated in place (r += x, then -= τ or += τ where sent). Returns (bytes, the
  state {"v": x + r before the update} whose tbq_residual is r', decoded, r')."""
  tau = f32(tau)
  n = len(x)
  out = bytearray([0x55] * (-(-n // 4)))
  r = np.array(residual, f32)
  v = np.zeros(n, f32)
  decoded = np.zeros(n)
  for i in range(n):
    r[i] = f32(r[i] + f32(x[i]))
    v[i] = r[i]
    k = i % 4
    if r[i] >= tau:
      out[i // 4] ^= 3 << (2 * k)
      r[i] = f32(r[i] - tau)
      decoded[i] = float(tau)
    elif r[i] <= -tau:
      out[i // 4] ^= 1 << (2 * k)
      r[i] = f32(r[i] + tau)
      decoded[i] = -float(tau)
  return bytes(out), {"v": v}, decoded, r


def tbq_residual(state, tau):
  """The error-feedback residual r = v - decode(v's code) that TBQ's state {"v": the last
  encoded value} stands for (v = 0: r = +0), element by element in float32."""
  tau = f32(tau)
  r = np.array(state["v"], f32)
  for i in range(r.size):
    if r[i] >= tau:
      r[i] = f32(r[i] - tau)
    elif r[i] <= -tau:
      r[i] = f32(r[i] + tau)
  return r


# -- onebit (§1.5) ---------------------------------------------------------------------------------
def blocked_sum(values, block: int = 1024):
  """float32 sum in blocks of `block`: each block summed left to right (one float32 rounding per
  add), then the block sums the same way until one value is left (jlp.compression.ops.block_sums
  as XLA:CPU runs it; ints are summed exactly)."""
  values = list(values)
  if values and isinstance(values[0], (int, bool, np.integer, np.bool_)):
    return int(sum(int(v) for v in values))

  def row(chunk):
    acc = f32(0)
    for v in chunk:
      acc = f32(acc + f32(v))
    return acc

  while len(values) > block:
    values = [row(values[i:i + block]) for i in range(0, len(values), block)]
  return row(values)


def onebit_levels(v, scales, scale_mode):
  """The decode of v's sign bits (bit 1: v < 0) with the given scales, float32."""
  if scale_mode == "two_means":
    return np.asarray([scales[0] if float(a) < 0 else scales[1] for a in v], f32)
  return np.asarray([-scales[0] if float(a) < 0 else scales[0] for a in v], f32)


def onebit_residual(state, scale_mode):
  """The error-feedback residual r = v - decode(v's signs, scales) that onebit's state {"v": the
  last encoded value, "scales": its scales} stands for (v = 0, scales = 0: r = +0)."""
  v = np.asarray(state["v"], f32)
  scales = [f32(s) for s in np.asarray(state["scales"], f32)]
  return (v - onebit_levels(v, scales, scale_mode)).astype(f32)


def onebit(x, residual, scale_mode, scales=None):
  """Seide's onebit with error feedback as two passes: v = x + r; the sign bits and the scales of
  v; r' = v - decode. Returns (bytes, the state {"v", "scales"} whose onebit_residual is r',
  decoded). `scales` given: those instead of the blocked sums' (where the order of a sum is
  not the reference's)."""
  v = np.asarray(x, f32) + np.asarray(residual, f32)          # float32 sums, elementwise
  negative = [float(a) < 0 for a in v]
  if scales is not None:
    scales = [f32(s) for s in scales]
  elif scale_mode == "two_means":
    neg = [a for a, s in zip(v, negative) if s]
    pos = [a for a, s in zip(v, negative) if not s]
    mean_neg = f32(blocked_sum([a if s else f32(0) for a, s in zip(v, negative)])
                   / f32(max(len(neg), 1)))
    mean_pos = f32(blocked_sum([f32(0) if s else a for a, s in zip(v, negative)])
                   / f32(max(len(pos), 1)))
    scales = [mean_neg, mean_pos]
  else:
    scales = [f32(blocked_sum([abs(a) for a in v]) / f32(len(v)))]
  levels = onebit_levels(v, scales, scale_mode)
  data = pack([int(s) for s in negative], 1) + floats(*scales)
  return data, {"v": v.astype(f32), "scales": np.asarray(scales, f32)}, levels.astype(np.float64)


def efsignsgd(x, residual):
  """Karimireddy et al. 2019, Algorithm 1: p = x + e; delta = (|p|_1 / d) sign(p); e = p - delta
  (sign bit 1 for p >= 0)."""
  v = np.asarray(x, f32) + np.asarray(residual, f32)
  scale = f32(f32(sum(abs(float(a)) for a in v)) / f32(len(v)))
  positive = [float(a) >= 0 for a in v]
  levels = np.asarray([scale if s else -scale for s in positive], f32)
  data = pack([int(s) for s in positive], 1) + floats(scale)
  return data, {"residual": (v - levels).astype(f32)}, levels.astype(np.float64)


# -- TernGrad, HiPress's min/max quantiser (§1.2) ----------------------------------------------------
def terngrad(x, bits, stochastic, key=None, compat=None):
  """(bytes, {}, decoded, alt codes): float32 scalar arithmetic as §1.2. compat="hipress":
  inv = 1/(gap + 1e-8) as HiPress; None: inv = 1/gap where gap is a normal float32, else 0."""
  x = np.asarray(x, f32)
  n = len(x)
  top = 2 ** bits - 1
  mn, mx = f32(min(x)), f32(max(x))
  gap = f32(f32(mx - mn) / f32(top))
  if compat == "hipress":
    inv = f32(f32(1.0) / f32(gap + f32(1e-8)))
  else:
    inv = f32(f32(1.0) / gap) if gap >= np.finfo(f32).tiny else f32(0)
  u = np.asarray(jax.random.uniform(key, (n,), np.float32)) if stochastic else None
  codes, alt = [], []
  for i in range(n):
    scaled = f32(f32(x[i] - mn) * inv)
    if stochastic:
      c = math.floor(f32(scaled + u[i]))
      exact = float(f32(x[i] - mn)) * float(inv)               # exact product (24 x 24 bits)
      a = math.floor(f32(exact + float(u[i])))                 # one rounding: a fused multiply-add
    else:
      c = a = round(float(scaled))                             # Python's round: half to even
    codes.append(min(max(c, 0), top))
    alt.append(min(max(a, 0), top))
  per = 8 // bits
  tail = 0 if n % per == 0 else per - n % per
  data = struct.pack("<BBff", bits, tail, float(mn), float(mx)) + pack(codes, bits)
  decoded = np.array([float(mx) if c == top else float(f32(f32(c) * gap) + mn) for c in codes])
  return data, {}, decoded, alt


def qsgd(x, levels, key):
  """Alistarh et al. 2017, Q_s: |x_i| s / |x|_2 + u rounded down; code level*sign + s (8/4/2 bits)."""
  x = np.asarray(x, f32)
  n = len(x)
  norm = f32(math.sqrt(sum(float(a) ** 2 for a in x)))           # exact sum for the test inputs
  ratio = f32(f32(levels) / (norm if norm > 0 else f32(1)))
  u = np.asarray(jax.random.uniform(key, (n,), np.float32))
  codes, alt = [], []
  for i in range(n):
    scaled = f32(f32(abs(x[i])) * ratio)
    fused = f32(float(abs(x[i])) * float(ratio) + float(u[i]))
    for out, value in ((codes, f32(scaled + u[i])), (alt, fused)):
      level = min(math.floor(value), levels)
      out.append((-level if x[i] < 0 else level) + levels)
  bits = next(b for b in (2, 4, 8) if 2 * levels < 2 ** b)
  data = floats(norm) + pack(codes, bits, pad=levels)
  decoded = np.array([(c - levels) * float(f32(norm / f32(levels))) for c in codes])
  return data, {}, decoded, alt


# -- sparse: DGC (§1.3), GradDrop (§1.4) -------------------------------------------------------------
def capacity(n: int, density) -> int:
  return max(1, math.ceil(n * Fraction(str(density))))


def select(acc, key, sample_rate, density, k):
  """HiPress's sampled threshold and capped selection: S = ceil(n*sample_rate) positions drawn
  with replacement, thr = the sampled |acc| at position floor(S*density) of the descending
  order; every i with |acc_i| > thr (ascending); if more than k, the k largest |acc| (ties: the
  lower index), ascending. Where n*density < 1 (less than one element expected), thr = 0: the
  largest non-zero |acc| is sent (k = 1), so that no partition starves."""
  acc = np.asarray(acc, f32)
  n = len(acc)
  if n * Fraction(str(density)) < 1:
    thr = 0.0
  else:
    s = max(1, math.ceil(n * Fraction(str(sample_rate))))
    pos = min(s - 1, math.floor(s * Fraction(str(density))))
    sample = np.asarray(jax.random.randint(key, (s,), 0, n))
    thr = sorted((abs(float(acc[i])) for i in sample), reverse=True)[pos]
  chosen = [i for i in range(n) if abs(float(acc[i])) > thr]
  if len(chosen) > k:
    chosen = sorted(sorted(chosen, key=lambda i: (-abs(float(acc[i])), i))[:k])
  return chosen


def sparse_bytes(indices, values) -> bytes:
  c = len(indices)
  return (struct.pack("<i", 4 + 8 * c) + struct.pack(f"<{c}i", *indices)
          + struct.pack(f"<{c}f", *[float(v) for v in values]))


def dgc(x, state, key, density, sample_rate, momentum):
  """Momentum correction, sampled threshold, top-k cap, masking. momentum * u rounded first
  (the tests use momenta whose products are exact, so a fused multiply-add gives the same)."""
  x = np.asarray(x, f32)
  u = (f32(momentum) * np.asarray(state["u"], f32)).astype(f32) + x
  v = np.asarray(state["v"], f32) + u
  idx = select(v, key, sample_rate, density, capacity(len(x), density))
  data = sparse_bytes(idx, v[idx])
  decoded = np.zeros(len(x))
  decoded[idx] = v[idx]
  u, v = u.copy(), v.copy()
  u[idx] = 0
  v[idx] = 0
  return data, {"u": u, "v": v}, decoded


def graddrop(x, state, key, drop_ratio, sample_rate):
  density = 1 - Fraction(str(drop_ratio))
  r = np.asarray(state["residual"], f32) + np.asarray(x, f32)
  idx = select(r, key, sample_rate, density, max(1, math.ceil(len(x) * density)))
  data = sparse_bytes(idx, r[idx])
  decoded = np.zeros(len(x))
  decoded[idx] = r[idx]
  r = r.copy()
  r[idx] = 0
  return data, {"residual": r}, decoded


def dgc_server(x, density, num_ranks):
  """Every non-zero (ascending), capped at min(n, num_ranks*k) by the largest |x|."""
  x = np.asarray(x, f32)
  k = min(len(x), num_ranks * capacity(len(x), density))
  chosen = [i for i in range(len(x)) if x[i] != 0]
  if len(chosen) > k:
    chosen = sorted(sorted(chosen, key=lambda i: (-abs(float(x[i])), i))[:k])
  decoded = np.zeros(len(x))
  decoded[chosen] = x[chosen]
  return sparse_bytes(chosen, x[chosen]), {}, decoded
