"""Plain-Python/numpy references for jlp.collectives, written from cpd.md §3.1, §3.2 and §4.

Float32 arithmetic is numpy float32 (one IEEE operation each, RNE, no flushing;
the tests keep clear of float32 subnormals). The per-element cast q is
`references.round_to_format` (float64 grid rounding written from the format
definition, not jlp code). Node/rank loops are Python loops in the order the
spec gives.
"""

import math

import numpy as np

import references as ref

F32 = np.float32


def quantizer(fmt):
  if fmt is None:
    return lambda v: np.asarray(v, F32)
  return lambda v: ref.round_to_format(np.asarray(v, F32), fmt)


def fold(values, fmt, kahan):
  """cpd.md §3.1: s = q(s + g_r) in order (Kahan: y, t, c as the spec), from s = c = 0."""
  q = quantizer(fmt)
  s = np.zeros(np.shape(values[0]), F32)
  c = np.zeros_like(s)
  for g in values:
    g = np.asarray(g, F32)
    if kahan:
      y = q(g - c)
      t = q(s + y)
      c = q(q(t - s) - y)
      s = t
    else:
      s = q(s + g)
  return s


def ring(values, fmt, kahan):
  """The ring of the allreduce docstring: chunk k folded over ranks k+1, k+2, ..., k (mod W)."""
  w = len(values)
  shape = np.shape(values[0])
  flat = [np.ravel(np.asarray(g, F32)) for g in values]
  size = flat[0].size
  c = -(-size // w) if size else 1
  flat = [np.concatenate([f, np.zeros(w * c - size, F32)]) for f in flat]
  out = np.zeros(w * c, F32)
  for k in range(w):
    order = [(k + 1 + t) % w for t in range(w)]
    out[k * c:(k + 1) * c] = fold([flat[r][k * c:(k + 1) * c] for r in order], fmt, kahan)
  return out[:size].reshape(shape)


def exact_exponent(m: float) -> int | None:
  """ceil(log2 m) exactly, via math.frexp (None for m = 0)."""
  if m == 0:
    return None
  mant, e = math.frexp(float(m))  # m = mant * 2^e, 0.5 <= mant < 1
  return e - 1 if mant == 0.5 else e


def cpd_exponent(m: float) -> float:
  """ceil of the correctly rounded float32 log2 (CPD's ceil(log2f)); -inf for 0."""
  if m == 0:
    return -math.inf
  return float(math.ceil(F32(math.log2(float(m)))))


def factor_from_shift(shift: float) -> F32:
  """2^shift as a float32 (inf past 127)."""
  if math.isinf(shift) or shift >= 128:
    return F32(math.inf)
  return F32(2.0 ** shift)


def aps_factors(leaves_per_rank, fmt, mode, multiplier):
  """cpd.md §4 steps 1-3 for each leaf, the max over ranks; mode True clamps to [-126, 126]."""
  factors = []
  for i in range(len(leaves_per_rank[0])):
    ms = [F32(F32(np.max(np.abs(r[i]), initial=0.0)) * F32(multiplier)) for r in leaves_per_rank]
    if mode == "cpd":
      e = max(cpd_exponent(m) for m in ms)
      factors.append(factor_from_shift(fmt.emax - e))
    else:
      es = [exact_exponent(m) for m in ms if m != 0]
      shift = 126 if not es else min(max(fmt.emax - max(es), -126), 126)
      factors.append(factor_from_shift(shift))
  return factors


def allreduce(leaves_per_rank, fmt=None, algorithm="sequential", kahan=False, aps=False,
              mean=False):
  """Expected result of jlp.collectives.allreduce over len(leaves_per_rank) ranks.

  leaves_per_rank[r][i]: rank r's leaf i (numpy float32).
  """
  w = len(leaves_per_rank)
  q = quantizer(fmt)
  factors = aps_factors(leaves_per_rank, fmt, aps, w) if aps else None
  out = []
  for i in range(len(leaves_per_rank[0])):
    with np.errstate(invalid="ignore", over="ignore"):
      vals = [q(r[i] * factors[i]) if aps else np.asarray(r[i], F32) for r in leaves_per_rank]
      s = (fold if algorithm == "sequential" else ring)(vals, fmt, kahan)
      if aps:
        s = (s / factors[i]).astype(F32)
    if mean:
      s = (s / F32(w)).astype(F32)
    out.append(s)
  return out


def cpd_two_level(nodes, fmt, aps, kahan, cast_single, mean=False, algorithm="sequential"):
  """cpd.md §3.2: nodes[d][v][i] is device d's virtual node v's leaf i.

  Local level per device and leaf (mix.py / main.py): N == 1 skip unless
  cast_single; max_exp = max(-100, max_v ceil(log2 max|g_v·N|)) for aps="cpd"
  (shift 0 when it stays -100), the guarded exact rule for aps=True; g_v <- q(g_v ·
  2^shift); the plain fold; / 2^shift. Then `allreduce` over the devices.
  """
  q = quantizer(fmt)
  n = len(nodes[0])
  per_device = []
  for dev in nodes:
    leaves = []
    for i in range(len(dev[0])):
      gs = [np.asarray(node[i], F32) for node in dev]
      if n == 1 and not cast_single:
        leaves.append(gs[0])
        continue
      factor = F32(1.0)
      if aps:
        ms = [F32(F32(np.max(np.abs(g))) * F32(n)) for g in gs]
        if aps == "cpd":
          max_exp = -100.0
          for m in ms:
            max_exp = max(max_exp, cpd_exponent(m))
          factor = F32(1.0) if max_exp == -100.0 else factor_from_shift(fmt.emax - max_exp)
        else:
          es = [exact_exponent(m) for m in ms if m != 0]
          shift = 126 if not es else min(max(fmt.emax - max(es), -126), 126)
          factor = factor_from_shift(shift)
      with np.errstate(invalid="ignore", over="ignore"):
        res = fold([q(g * factor) for g in gs], fmt, kahan=False)
        leaves.append((res / factor).astype(F32))
    per_device.append(leaves)
  out = allreduce(per_device, fmt, algorithm, kahan, aps) if len(nodes) > 1 else per_device[0]
  if mean:
    out = [(s / F32(len(nodes) * n)).astype(F32) for s in out]
  return out
