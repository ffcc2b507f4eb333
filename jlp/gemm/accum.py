"""Matrix multiplication with a custom-precision (FloatFormat) accumulator.

Semantics (CPD's `quant_gemm`, Han, Demmel, You, "Auto-Precision Scaling for
Distributed Deep Learning", arXiv:1911.08907; cpd.md §2.1). `matmul(a, b,
accum=fmt)` computes every output element c[i, j] with one sequential
accumulator, k strictly increasing from 0 to K-1 (no tree, no split-K), where
q is `jlp.numerics.float_cast.float_cast(., fmt)` (the bit-exact cast of
`jlp.quantize`) and every arithmetic operation is one float32 IEEE operation
(round to nearest even, never fused into an FMA):

  chunk = 1 (exact per-add mode, CPD):
    s = +0; c = +0
    for k in 0..K-1:
      p = q(fl32(a[i,k] * b[k,j]))
      plain:  s = q(fl32(s + p))
      kahan:  y = q(fl32(p - c)); t = q(fl32(s + y))
              c = q(fl32(q(fl32(t - s)) - y)); s = t
    c[i, j] = s   (already in fmt; no final cast)

  chunk = n > 1 (a model of hardware with wider float32 partial sums): k is
  split into consecutive chunks [0, n), [n, 2n), ... (the last one shorter when
  n does not divide K). In each chunk the raw float32 products are summed in
  float32, in k order, starting from the first product:
      P = fl32(...fl32(fl32(a[i,k0]*b[k0,j]) + fl32(a[i,k0+1]*b[k0+1,j])) + ...)
  (each product rounded to float32 on its own, then added: no FMA), and the
  chunk sum then enters the accumulator exactly as one product does above:
  p = q(P), followed by the plain or the Kahan step. So only the chunk
  additions (and the chunk sum itself) are quantized; chunk = 1 is the exact
  mode, and chunk >= K is one float32 dot product per element cast once.

The XLA path (`impl="xla"`) is a `lax.scan` over the chunks carrying (s, c) of
shape (M, N): each step builds the chunk's partial sums from rank-1 updates
a[:, k] ⊗ b[k, :] and applies the casts in a few fused loops per step (with
Kahan, p and y are materialised so that XLA does not recompute them). The
Pallas kernel (`pallas_kernels/accum_matmul.py`, `impl="pallas"`) tiles M and N
and runs the same per-element sequence over k inside the kernel; the two agree
bit for bit.

Float32 subnormals: the cast q is exact on bits (integer ops), but the float32
products and sums are computed by the backend, and XLA:CPU flushes float32
subnormal results (and operands) of float arithmetic to zero. With an accum
format whose values include float32 subnormals (exp = 8 with subnormals) or
inputs whose products fall below 2^-126, the CPU result can therefore differ
from strict IEEE float32 arithmetic (and from CPD's, which also flushes only in
the cast, cpd.md §1.2 step 2). Every other case is bit-exact.

Fused multiply-add: XLA:CPU (and Triton) contract `x * y + z` into an FMA.
Where a raw product feeds an addition (chunk > 1), the product's bits are
OR-ed with an opaque zero (a runtime value the compiler cannot see through), so
the product is rounded to float32 first, as the semantics above require.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import FloatFormat, as_format
from jlp.numerics.float_cast import float_cast

IMPLS = ("auto", "xla", "pallas")

# Unrolled k steps per scan iteration in the exact mode (one fused loop each).
_EXACT_UNROLL = 1
# Chunks up to this size are summed with an unrolled expression; longer ones
# with an inner fori_loop.
_MAX_UNROLLED_CHUNK = 64


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def opaque_zero() -> jax.Array:
  """A uint32 zero that the compiler cannot constant-fold (blocks FMA contraction)."""
  return lax.optimization_barrier(jnp.zeros((), jnp.uint32))


def rounded_product(x: jax.Array, y: jax.Array, zero: jax.Array) -> jax.Array:
  """fl32(x * y), forced to be rounded to float32 before any later addition.

  `zero` is an opaque uint32 zero (`opaque_zero()`, or one loaded from memory
  inside a kernel): OR-ing it into the product's bits keeps the compiler from
  fusing the multiply into a following add (an FMA rounds only once).
  """
  p = lax.bitcast_convert_type(x * y, jnp.uint32) | zero
  return lax.bitcast_convert_type(p, jnp.float32)


def accumulate(s: jax.Array, c: jax.Array | None, p: jax.Array, fmt: FloatFormat,
               barrier: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """One accumulator step with the (already cast) addend p: plain or Kahan (c not None).

  Plain: s = q(s + p). Kahan (cpd.md §2.1): y = q(p - c), t = q(s + y),
  c = q(q(t - s) - y), s = t. `barrier` materialises p and y (XLA would otherwise
  recompute them inside each of the Kahan step's fused consumers); values are unchanged.
  """
  if c is None:
    return float_cast(s + p, fmt), None
  if barrier:
    p = lax.optimization_barrier(p)
  y = float_cast(p - c, fmt)
  if barrier:
    y = lax.optimization_barrier(y)
  t = float_cast(s + y, fmt)
  c = float_cast(float_cast(t - s, fmt) - y, fmt)
  return t, c


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


def _matmul_xla(a: jax.Array, b: jax.Array, fmt: FloatFormat, kahan: bool, chunk: int
                ) -> jax.Array:
  m, k = a.shape
  n = b.shape[1]
  s0 = jnp.zeros((m, n), jnp.float32)
  c0 = jnp.zeros((m, n), jnp.float32) if kahan else None
  if k == 0:
    return s0
  chunk = min(chunk, k)
  at = a.T  # (K, M): row k is the column a[:, k]

  if chunk == 1:
    def step(carry, xs):
      s, c = carry
      a_k, b_k = xs
      p = float_cast(a_k[:, None] * b_k[None, :], fmt)
      return accumulate(s, c, p, fmt, barrier=True), None

    (s, _), _ = lax.scan(step, (s0, c0), (at, b), unroll=min(_EXACT_UNROLL, k))
    return s

  num_chunks = -(-k // chunk)
  pad = num_chunks * chunk - k  # zero products in the last chunk: P + (±0) = P exactly
  at = jnp.pad(at, ((0, pad), (0, 0))).reshape(num_chunks, chunk, m)
  bp = jnp.pad(b, ((0, pad), (0, 0))).reshape(num_chunks, chunk, n)
  zero = opaque_zero()

  def step(carry, xs):
    s, c = carry
    a_c, b_c = xs  # (chunk, M), (chunk, N)
    term = lambda j: rounded_product(a_c[j][:, None], b_c[j][None, :], zero)
    if chunk <= _MAX_UNROLLED_CHUNK:
      partial = term(0)
      for j in range(1, chunk):
        partial = partial + term(j)
    else:
      partial = lax.fori_loop(1, chunk, lambda j, acc: acc + term(j), term(0), unroll=8)
    return accumulate(s, c, float_cast(partial, fmt), fmt, barrier=True), None

  (s, _), _ = lax.scan(step, (s0, c0), (at, bp))
  return s


def matmul(a: jax.Array, b: jax.Array, *, accum: FloatFormat | str, kahan: bool = False,
           chunk: int = 1, impl: str = "auto") -> jax.Array:
  """a @ b with every addition of the accumulation rounded to `accum` (CPD's quant_gemm).

  See the module docstring for the exact per-element semantics (Han, Demmel,
  You, arXiv:1911.08907; cpd.md §2.1). The inputs are not quantized.

  Args:
    a: float32 (M, K). Batch dimensions: use `jax.vmap`.
    b: float32 (K, N).
    accum: the accumulator's FloatFormat (or a name such as "e5m2"), rounding
      "nearest" or "truncate" (stochastic accumulators are not supported).
    kahan: Kahan-compensated accumulation (CPD's hard-wired choice) instead of
      the plain s = q(s + p).
    chunk: products summed in float32 before each quantized addition; 1 is the
      exact per-add mode.
    impl: "xla" (lax.scan over k), "pallas" (the Pallas kernel; interpreted on a
      CPU) or "auto" (pallas on GPU, xla elsewhere).

  Returns:
    float32 (M, N), every element a value of `accum`.

  Raises:
    ValueError: on bad shapes, dtypes, accum, chunk, kahan or impl (before any compute).
  """
  fmt = check_accum(accum)
  if not isinstance(kahan, bool):
    raise _invalid("kahan", kahan, "True or False")
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise _invalid("chunk", chunk, "an int >= 1")
  if impl not in IMPLS:
    raise _invalid("impl", impl, "one of " + ", ".join(repr(i) for i in IMPLS))
  a, b = check_operands(a, b)
  if impl == "auto":
    impl = "pallas" if jax.default_backend() == "gpu" else "xla"
  if impl == "pallas":
    from pallas_kernels import accum_matmul  # pylint: disable=g-import-not-at-top
    return accum_matmul.accum_matmul(a, b, fmt, kahan=kahan, chunk=chunk,
                                     interpret=jax.default_backend() != "gpu")
  return _matmul_xla(a, b, fmt, kahan, chunk)
