"""The accumulator's building blocks, shared by both paths of `jlp.gemm.accum.matmul`.

`cast` and `accumulate` are the per-element step (the plain or Kahan update of the semantics in
`jlp.gemm.accum`), and `check_*` validate the arguments. The XLA path (`jlp.gemm.accum`) and the
Pallas kernel (`pallas_kernels/accum_matmul.py`) both import them from here, so neither imports
the other's module for them; `jlp.gemm.accum` re-exports every name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import FloatFormat, as_format
from jlp.numerics.float_cast import float_cast
from jlp.numerics.sums import kahan_step


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def cast(x: jax.Array, fmt: FloatFormat) -> jax.Array:
  """float_cast(x, fmt); a complex64 x has its real and imaginary parts cast separately."""
  if x.dtype == jnp.complex64:
    return lax.complex(float_cast(jnp.real(x), fmt), float_cast(jnp.imag(x), fmt))
  return float_cast(x, fmt)


def accumulate(s: jax.Array, c: jax.Array | None, p: jax.Array, fmt: FloatFormat,
               barrier: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """One accumulator step with the (already cast) addend p: plain or Kahan (c not None).

  Plain: s = q(s + p). Kahan (CPD's quant_gemm): y = q(p - c), t = q(s + y),
  c = q(q(t - s) - y), s = t. `barrier` materialises p and y (XLA would otherwise
  recompute them inside each of the Kahan step's fused consumers); values are unchanged.
  complex64 operands hold two independent accumulators (complex addition and
  subtraction are the float32 operations on the parts).
  """
  if c is None:
    return cast(s + p, fmt), None
  if barrier:
    p = lax.optimization_barrier(p)

  def rnd(v, slot):
    v = cast(v, fmt)
    return lax.optimization_barrier(v) if barrier and slot == 0 else v  # slot 0 is y
  return kahan_step(s, c, p, rnd)


def check_accum(accum: Any) -> FloatFormat:
  """The accumulator format (a FloatFormat or a name such as "e5m2"), validated."""
  fmt = accum
  if isinstance(accum, str):
    try:
      fmt = as_format(accum)
    except ValueError as e:
      raise _invalid("accum", accum, "a FloatFormat or a float format name such as 'e5m2'") from e
  if not isinstance(fmt, FloatFormat):
    raise _invalid("accum", accum, "a FloatFormat (BFP / MX formats cannot be accumulators)")
  if fmt.rounding == "stochastic":
    raise _invalid("accum.rounding", fmt.rounding,
                   "'nearest' or 'truncate' (stochastic accumulators are not supported)")
  return fmt


def check_operands(a: Any, b: Any) -> tuple[jax.Array, jax.Array]:
  """a (M, K) and b (K, N) float32, validated (batch dims go through jax.vmap)."""
  a, b = jnp.asarray(a), jnp.asarray(b)
  for name, x in (("a", a), ("b", b)):
    if x.ndim != 2:
      raise _invalid(f"{name}.shape", x.shape, "rank 2 (use jax.vmap for batch dimensions)")
    if x.dtype != jnp.float32:
      raise _invalid(f"{name}.dtype", str(x.dtype), "float32")
  if a.shape[1] != b.shape[0]:
    raise _invalid("b.shape", b.shape, f"({a.shape[1]}, N) to match a.shape={a.shape}")
  return a, b


def check_promote_every(promote_every: Any, *, kahan: bool, chunk: int) -> int | None:
  """promote_every validated: None, or an int >= 1 with kahan=False and chunk=1."""
  if promote_every is None:
    return None
  if isinstance(promote_every, bool) or not isinstance(promote_every, int) or promote_every < 1:
    raise _invalid("promote_every", promote_every,
                   "None or an int >= 1 (products accumulated in accum before each float32 addition)")
  if kahan:
    raise _invalid("kahan", kahan, f"False with promote_every={promote_every} (a run is a plain "
                   "accumulation, as in a tensor core)")
  if chunk != 1:
    raise _invalid("chunk", chunk, f"1 with promote_every={promote_every} (every product of a run "
                   "is added in accum)")
  return promote_every
