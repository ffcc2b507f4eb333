"""APS (Auto-Precision Scaling): one power-of-two gradient scale per tensor.

Semantics (Han, Demmel, You, "Auto-Precision Scaling for Distributed Deep
Learning", arXiv:1911.08907; drcut/CPD `dist_util.py` `sum_gradients(use_APS=True)`;
docs/cpd.md#aps). For each leaf p of a gradient pytree reduced over W nodes:

  1. local exponent e_p = ceil(log2(m_p)), m_p = fl32(max|g_p| * W), the float32
     value of max|g_p · W| (rounding is monotone, so max|g|·W rounded equals the
     max of the rounded products, as CPD computes it);
  2. the exponents of all leaves are agreed in one max over the nodes
     (`lax.pmax` of an [L] vector, or a max over the virtual-node axis);
  3. shift_p = fmt.emax - e_p, factor_p = 2^shift_p (a float32);
  4. each node's g_p is replaced by q(g_p * factor_p), which is then summed;
  5. the sum is divided by factor_p in float32 (no cast afterwards).

Since |g_r| <= 2^e / W on every node, every partial sum of the scaled values
is at most 2^emax in magnitude (up to the rounding of each add), so nothing
overflows, and small gradients are lifted out of the format's underflow range.

Two exponent rules:

* aps=True (default, guarded): e_p is exact, from the float32 bits of m_p
  (frexp-style integer ops: a normal m = 2^k·(1 + f) has e = k + (f != 0); a
  float32 subnormal m = u·2^-149 has e = -149 + ceil(log2 u)). An all-zero leaf
  gets `ZERO_EXPONENT`, and the shift is clamped to [-126, 126] so that 2^shift
  and 2^-shift are float32 normals: all-zero leaves give zeros and formats with
  8 exponent bits (emax = 127) stay finite. Between the clamps the result is
  exactly equivariant to power-of-two scalings of the gradients.
* aps="cpd": CPD bit for bit, edge cases included: e_p = ceil(log2f(m_p)) in
  float32 (XLA's float32 log2 stands in for CUDA's log2f; both round
  log2(2^k·(1 + tiny)) to the integer k, so the exponent can be one below the
  exact one), shift = emax - e_p as a float, and 2^shift as a float32 scalar:
  an all-zero gradient gives e = -inf, shift = +inf, 0 · inf = NaN, and a
  shift >= 128 (max|gW| <= 2^(emax-128); for 8 exponent bits whenever
  max|gW| <= 1/2) gives factor inf and NaN/inf gradients.

The local level of CPD's node emulation (`mix.py` / `main.py`, docs/cpd.md#emulated-nodes)
uses a guarded variant of its own: max_exp = max(-100, max_v e_v) and shift 0
when max_exp stays -100 (`local_shift_factors`).
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import FloatFormat
from jlp.numerics.float_cast import ABS, FRAC, from_bits, to_bits

ApsMode = Union[bool, str]
APS_MODES = (False, True, "cpd")

# Exponent of an all-zero leaf (aps=True): far below any float32 exponent, so
# the clamped shift is the largest one and a zero leaf never raises the max.
ZERO_EXPONENT = -(2 ** 20)
# Clamp of the guarded shift: 2^shift and 2^-shift are both float32 normals.
MAX_SHIFT = 126
# CPD's emulation loop starts its running max at -100 and treats that as "no exponent".
CPD_LOCAL_FLOOR = -100.0


def exact_ceil_log2(m: jax.Array) -> jax.Array:
  """ceil(log2 m) of float32 m >= 0, exactly, as int32 (0 -> ZERO_EXPONENT; inf/NaN -> 128)."""
  u = to_bits(m) & ABS
  biased = (u >> 23).astype(jnp.int32)
  normal = biased - 127 + ((u & FRAC) != 0).astype(jnp.int32)
  # subnormal u·2^-149 (1 <= u < 2^23): ceil(log2 u) = 32 - clz(u - 1).
  sub = -149 + 32 - lax.clz(jnp.maximum(u, 1) - 1).astype(jnp.int32)
  e = jnp.where(biased == 0, sub, normal)
  e = jnp.where(biased == 255, 128, e)
  return jnp.where(u == 0, ZERO_EXPONENT, e).astype(jnp.int32)


def cpd_ceil_log2(m: jax.Array) -> jax.Array:
  """CPD's ceil(log2f(m)) in float32 (0 -> -inf)."""
  return jnp.ceil(jnp.log2(m))


def leaf_exponent(g: jax.Array, multiplier: int, mode: ApsMode, axis=None) -> jax.Array:
  """e = ceil(log2(fl32(max|g| * multiplier))): int32 (mode True) or float32 (mode "cpd").

  `axis`: the axes reduced by the max (None: all); the rest are kept (e.g. the
  virtual-node axis of a stacked leaf).
  """
  m = jnp.max(jnp.abs(g), axis=axis, initial=0.0) * jnp.float32(multiplier)
  return cpd_ceil_log2(m) if mode == "cpd" else exact_ceil_log2(m)


def pow2_float32(shift: jax.Array) -> jax.Array:
  """The float32 2^shift of an integer-valued shift (int or float, ±inf and NaN allowed).

  Built from bits (no exp2 rounding): inf for shift >= 128, a subnormal or 0
  below -126, NaN for NaN, as a float64 power of two cast to float32 would be.
  """
  shift = jnp.asarray(shift)
  is_float = jnp.issubdtype(shift.dtype, jnp.floating)
  s = jnp.where(jnp.isnan(shift), 0, shift) if is_float else shift
  s = jnp.clip(s, -200, 200).astype(jnp.int32)
  normal = (jnp.clip(s, -126, 127) + 127).astype(jnp.uint32) << 23
  sub = jnp.left_shift(jnp.uint32(1), jnp.clip(s + 149, 0, 31).astype(jnp.uint32))
  bits = jnp.where(s >= 128, jnp.uint32(0x7F800000),
                   jnp.where(s >= -126, normal, jnp.where(s >= -149, sub, jnp.uint32(0))))
  out = from_bits(bits)
  return jnp.where(jnp.isnan(shift), jnp.float32(jnp.nan), out) if is_float else out


def shift_factors(exponents: jax.Array, fmt: FloatFormat, mode: ApsMode) -> jax.Array:
  """float32 factors 2^shift, shift = fmt.emax - e, per agreed leaf exponent (step 3 above)."""
  if mode == "cpd":
    return pow2_float32(jnp.float32(fmt.emax) - exponents)
  return pow2_float32(jnp.clip(fmt.emax - exponents, -MAX_SHIFT, MAX_SHIFT))


def local_shift_factors(exponents: jax.Array, fmt: FloatFormat, mode: ApsMode) -> jax.Array:
  """Factors of the local (virtual-node) level of CPD's emulation, from max-over-nodes exponents.

  mode "cpd": max_exp = max(-100, e) (log2 exponents; -inf ignored), shift 0
  when it stays -100, else emax - max_exp (2^shift as a float32: inf past 127).
  mode True: the guarded rule of `shift_factors`. mode False: factor 1 (no scaling).
  """
  if not mode:
    return jnp.ones(exponents.shape, jnp.float32)
  if mode == "cpd":
    max_exp = jnp.maximum(jnp.float32(CPD_LOCAL_FLOOR), exponents)
    shift = jnp.where(max_exp == CPD_LOCAL_FLOOR, 0.0, jnp.float32(fmt.emax) - max_exp)
    return pow2_float32(shift.astype(jnp.float32))
  return shift_factors(exponents, fmt, mode)
