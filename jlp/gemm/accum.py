"""Matrix multiplication with a custom-precision (FloatFormat) accumulator.

Semantics (CPD's `quant_gemm`, Han, Demmel, You, "Auto-Precision Scaling for
Distributed Deep Learning", arXiv:1911.08907; docs/cpd.md#accumulating-gemm). `matmul(a, b,
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
  split into consecutive chunks [0, n), [n, 2n), ... (when n does not divide K
  the last one is padded with +0 products, which can turn a -0 chunk sum into
  +0: the XLA path and the kernel both do exactly this). In each chunk the raw
  float32 products are summed in
  float32, in k order, starting from the first product:
      P = fl32(...fl32(fl32(a[i,k0]*b[k0,j]) + fl32(a[i,k0+1]*b[k0+1,j])) + ...)
  (each product rounded to float32 on its own, then added: no FMA), and the
  chunk sum then enters the accumulator exactly as one product does above:
  p = q(P), followed by the plain or the Kahan step. So only the chunk
  additions (and the chunk sum itself) are quantized; chunk = 1 is the exact
  mode, and chunk >= K is one float32 dot product per element cast once.

  promote_every = n_c (accumulation with promotion; a model of Hopper's FP8
  tensor cores, whose accumulator keeps about 14 bits, e.g.
  FloatFormat(8, 13, rounding="truncate"), and of DeepSeek-V3's fix, which
  copies the partial sums to float32 registers every N_C = 128 products:
  DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, §3.3.2,
  "Increasing Accumulation Precision"). k is split into consecutive runs
  [0, n_c), [n_c, 2 n_c), ...; when n_c does not divide K the last run is
  shorter (K mod n_c products; no padding). Each run is accumulated exactly as
  chunk = 1 (plain) above, starting again from s = +0, and at its end its sum
  is added to a float32 accumulator with one IEEE float32 addition (round to
  nearest even, float32 subnormals exact on every backend:
  `jlp.numerics.ieee_f32.ieee_add`):
    acc = +0
    for each run R (k in R increasing):
      s = +0
      for k in R: s = q(fl32(s + q(fl32(a[i,k] * b[k,j]))))
      acc = fl32(acc + s)
    c[i, j] = acc   (a float32 value, not cast to fmt)
  n_c >= K is one run: c = fl32(+0 + s), s itself except that -0 becomes +0.
  Only with chunk = 1 and kahan = False (a run is a tensor core's plain
  accumulation; a compensated or chunked run has no hardware counterpart and
  no agreed rule for the compensation at a promotion).

The XLA path (`impl="xla"`), chunk = 1, is a `lax.scan` over k carrying
(s, c) of shape (M, N), with a few fused loops per step (with Kahan, p and y
are materialised so that XLA does not recompute them). chunk > 1 is a
`fori_loop` over pairs of chunks (single chunks when chunk > 32), one fused
loop per step; the two chunk sums are independent, so the CPU overlaps their
addition chains. Rows i and i + ceil(M/2) travel as the real and imaginary
parts of one complex64 array: complex addition and subtraction are exactly the
float32 operations on the parts, so each loop iteration runs two more
independent addition chains, sharing the b loads (XLA:CPU's fused loop would
otherwise be bound by the latency of one chain of float32 adds per output
vector). When N is a multiple of 64, the b rows of each step get 64 bytes of
padding so that they do not all map to the same few L1 cache sets. None of
this changes any operation or its order. With promote_every, an outer
`lax.scan` over the full runs wraps the chunk = 1 scan over the products of
one run (the shorter last run follows it). The Pallas kernel
(`pallas_kernels/accum_matmul.py`, `impl="pallas"`) tiles M and N and runs the
same per-element sequence over k inside the kernel; the two agree bit for bit.

Float32 subnormals: the cast q is exact on bits (integer ops), but the float32
products and sums are computed by the backend, and XLA:CPU flushes float32
subnormal results (and operands) of float arithmetic to zero (the promotion
additions of promote_every excepted: `ieee_add` is exact). With an accum
format whose values include float32 subnormals (exp = 8 with subnormals) or
inputs whose products fall below 2^-126, the CPU result can therefore differ
from strict IEEE float32 arithmetic (and from CPD's, which also flushes only in
the cast: docs/cpd.md#casts, quirk C). Every other case is bit-exact.

Fused multiply-add: XLA:CPU (and Triton) contract `x * y + z` into an FMA.
Where a raw product feeds an addition (chunk > 1), the product's bits are
OR-ed with an opaque zero (a runtime value the compiler cannot see through), so
the product is rounded to float32 first, as the semantics above require.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import FloatFormat
# The per-element step and the checks, shared with the Pallas kernel, live below both; re-exported.
from jlp.gemm.accum_step import (_invalid, accumulate, cast, check_accum, check_operands,
                                 check_promote_every)
from jlp.numerics.float_cast import float_cast
from jlp.numerics.ieee_f32 import ieee_add
from jlp.numerics.opaque import opaque_zero, rounded_product
from pallas_kernels import accum_matmul as accum_kernel

IMPLS = ("auto", "xla", "pallas")

# Unrolled k steps per scan iteration in the exact mode (one fused loop each).
_EXACT_UNROLL = 1
# Chunks up to this size are summed with an unrolled expression; longer ones
# with an inner fori_loop.
_MAX_UNROLLED_CHUNK = 64
# Chunked mode: chunks per loop step (one fused loop; their partial sums are
# independent, so the CPU overlaps their addition chains).
_MAX_CHUNKS_PER_STEP = 2
# Extra float32 per row of the chunked mode's b slices (see _matmul_xla_chunked).
_B_ROW_PAD = 16


def _exact_sum(at: jax.Array, b: jax.Array, fmt: FloatFormat, kahan: bool) -> jax.Array:
  """chunk = 1 over all rows of at (K, M) and b (K, N), in k order, from s = c = +0."""
  k, m = at.shape
  n = b.shape[1]

  def step(carry, xs):
    s, c = carry
    a_k, b_k = xs
    p = float_cast(a_k[:, None] * b_k[None, :], fmt)
    return accumulate(s, c, p, fmt, barrier=True), None

  s0 = jnp.zeros((m, n), jnp.float32)
  c0 = jnp.zeros((m, n), jnp.float32) if kahan else None
  (s, _), _ = lax.scan(step, (s0, c0), (at, b), unroll=min(_EXACT_UNROLL, k))
  return s


# One compiled program per (shapes, format, options) for an eager call as well (op by op, an eager
# call compiled every scan, slice and cast apart: 10-40 programs); inlined under an outer jit.
@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _matmul_xla(a: jax.Array, b: jax.Array, fmt: FloatFormat, kahan: bool, chunk: int,
                promote_every: int | None = None) -> jax.Array:
  m, k = a.shape
  n = b.shape[1]
  if k == 0:
    return jnp.zeros((m, n), jnp.float32)
  if promote_every is not None:
    return _matmul_xla_promoted(a, b, fmt, min(promote_every, k))
  chunk = min(chunk, k)
  if chunk > 1:
    return _matmul_xla_chunked(a, b, fmt, kahan, chunk)
  return _exact_sum(a.T, b, fmt, kahan)  # a.T: row k is the column a[:, k]


def _matmul_xla_promoted(a: jax.Array, b: jax.Array, fmt: FloatFormat, run: int) -> jax.Array:
  """promote_every = run (module docstring): chunk = 1 sums of runs, added in float32."""
  m, k = a.shape
  n = b.shape[1]
  full, rest = divmod(k, run)
  at = a.T
  acc = jnp.zeros((m, n), jnp.float32)
  if full:
    def promote(acc, xs):
      return ieee_add(acc, _exact_sum(*xs, fmt, False)), None
    runs = (at[:full * run].reshape(full, run, m), b[:full * run].reshape(full, run, n))
    acc, _ = lax.scan(promote, acc, runs)
  if rest:
    acc = ieee_add(acc, _exact_sum(at[full * run:], b[full * run:], fmt, False))
  return acc


def _matmul_xla_chunked(a: jax.Array, b: jax.Array, fmt: FloatFormat, kahan: bool, chunk: int
                        ) -> jax.Array:
  """chunk > 1 (module docstring): rows i and i + ceil(M/2) as one complex64 array."""
  m, k = a.shape
  n = b.shape[1]
  num_chunks = -(-k // chunk)
  pad_k = num_chunks * chunk - k  # zero products in the last chunk: P + (±0) = P exactly
  half = -(-m // 2)
  a = jnp.pad(a, ((0, 2 * half - m), (0, pad_k)))  # an odd M gets one zero row, sliced off
  b = jnp.pad(b, ((0, pad_k), (0, 0)))
  # b rows 256 B-multiples apart map to a few L1 sets; 64 B more per row spreads them.
  b_row = n + _B_ROW_PAD if n % 64 == 0 else n
  zero = opaque_zero()
  per_step = max(1, min(_MAX_CHUNKS_PER_STEP, _MAX_UNROLLED_CHUNK // chunk))

  def chunk_sum(a_s, b_s, k0):
    def term(kk):
      b_k = b_s[kk, :n][None, :]
      return lax.complex(rounded_product(a_s[:half, kk][:, None], b_k, zero),
                         rounded_product(a_s[half:, kk][:, None], b_k, zero))
    if chunk <= _MAX_UNROLLED_CHUNK:
      partial = term(k0)
      for j in range(1, chunk):
        partial = partial + term(k0 + j)
      return partial
    return lax.fori_loop(1, chunk, lambda j, acc: acc + term(k0 + j), term(k0), unroll=8)

  def chunks(carry, a_s, b_s, count):
    b_s = jnp.pad(b_s, ((0, 0), (0, b_row - n)))
    a_s, b_s = lax.optimization_barrier((a_s, b_s))  # fused slices would not be vectorised
    for g in range(count):
      carry = accumulate(*carry, cast(chunk_sum(a_s, b_s, g * chunk), fmt), fmt, barrier=kahan)
    return carry

  width = per_step * chunk
  num_steps = num_chunks // per_step

  def step(i, carry):
    a_s = lax.dynamic_slice_in_dim(a, i * width, width, 1)
    b_s = lax.dynamic_slice_in_dim(b, i * width, width, 0)
    return chunks(carry, a_s, b_s, per_step)

  # Opaque: with a constant +0 start XLA folds `+0 + p` to p under jit, keeping a -0 chunk sum.
  s0 = lax.optimization_barrier(jnp.zeros((half, n), jnp.complex64))
  carry = (s0, s0 if kahan else None)
  if num_steps:
    carry = lax.fori_loop(0, num_steps, step, carry)
  if num_chunks % per_step:
    done = num_steps * width
    carry = chunks(carry, a[:, done:], b[done:], num_chunks % per_step)
  s = lax.optimization_barrier(carry[0])  # a fused concatenate would not be vectorised
  return jnp.concatenate([jnp.real(s), jnp.imag(s)], 0)[:m]


def matmul(a: jax.Array, b: jax.Array, *, accum: FloatFormat | str, kahan: bool = False,
           chunk: int = 1, promote_every: int | None = None, impl: str = "auto") -> jax.Array:
  """a @ b with every addition of the accumulation rounded to `accum` (CPD's quant_gemm).

  See the module docstring for the exact per-element semantics (Han, Demmel,
  You, arXiv:1911.08907; docs/cpd.md#accumulating-gemm). The inputs are not quantized.

  Args:
    a: float32 (M, K). Batch dimensions: use `jax.vmap`.
    b: float32 (K, N).
    accum: the accumulator's FloatFormat (or a name such as "e5m2"), rounding
      "nearest" or "truncate" (stochastic accumulators are not supported).
    kahan: Kahan-compensated accumulation (CPD's hard-wired choice) instead of
      the plain s = q(s + p).
    chunk: products summed in float32 before each quantized addition; 1 is the
      exact per-add mode.
    promote_every: None, or n_c >= 1: accumulation with promotion (module
      docstring; DeepSeek-V3, arXiv:2412.19437 §3.3.2, uses n_c = 128): every
      run of n_c consecutive products (the last one K mod n_c long when n_c
      does not divide K) is accumulated in `accum` as chunk = 1 does, from +0, and then
      added to a float32 accumulator (one IEEE float32 addition, subnormals
      exact); the result is that float32 accumulator. Needs chunk = 1 and
      kahan = False.
    impl: "xla" (lax.scan over k), "pallas" (the Pallas kernel; interpreted on a
      CPU) or "auto" (pallas on GPU, xla elsewhere).

  Returns:
    float32 (M, N), every element a value of `accum` (with promote_every: a
    float32 sum of such values).

  Raises:
    ValueError: on bad shapes, dtypes, accum, chunk, kahan, promote_every or
      impl (before any compute).
  """
  fmt = check_accum(accum)
  if not isinstance(kahan, bool):
    raise _invalid("kahan", kahan, "True or False")
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise _invalid("chunk", chunk, "an int >= 1")
  promote_every = check_promote_every(promote_every, kahan=kahan, chunk=chunk)
  if impl not in IMPLS:
    raise _invalid("impl", impl, "one of " + ", ".join(repr(i) for i in IMPLS))
  a, b = check_operands(a, b)
  if impl == "auto":
    impl = "pallas" if jax.default_backend() == "gpu" else "xla"
  if impl == "pallas":
    return accum_kernel.accum_matmul(a, b, fmt, kahan=kahan, chunk=chunk,
                                     promote_every=promote_every,
                                     interpret=jax.default_backend() != "gpu")
  return _matmul_xla(a, b, fmt, kahan, chunk, promote_every)
