"""Pallas kernel for a matmul with a custom-precision (FloatFormat) accumulator.

Semantics: `accum_matmul(a, b, fmt, kahan=..., chunk=...)` equals the XLA path of
`jlp.gemm.accum.matmul` bit for bit (CPD's quant_gemm, Han, Demmel, You,
arXiv:1911.08907; cpd.md §2.1): for every output element, k strictly
increasing, p = q(fl32(a[i,k] * b[k,j])) (chunk = 1) or p = q(float32 sum of
`chunk` consecutive raw float32 products, in k order; the last chunk shorter),
then the plain step s = q(s + p) or the Kahan step y = q(p - c), t = q(s + y),
c = q(q(t - s) - y), s = t; the result is s. q is `cast_bits` on the float32
bit patterns (the same integer code as `jlp.quantize`). See
`jlp.gemm.accum` for the full statement and the float32-subnormal caveat.

Layout: the grid is (M / tm, N / tn) with power-of-two tiles (Triton); each
program holds an A tile (tm, Kp) and a B tile (Kp, tn) and loops over k
sequentially (`fori_loop`), loading a column of the A tile and a row of the B
tile for a rank-1 update of the (tm, tn) accumulators (s, c), which stay in
registers. M and N are zero-padded to the tiles (padded rows/columns are
sliced off). K is zero-padded to a power of two Kp for the block shape, but the
loop runs over the real K only: the padding is never accumulated. (That
matters: with Kahan, a zero product is not a no-op, since y = q(0 - c) folds
the compensation into s.) In chunked mode the last chunk's missing products
are padding zeros added to the float32 partial sum, P + (±0) = P exactly (a
zero's sign never reaches s: s is never -0). A uint32 zero operand (opaque to
the compiler) is OR-ed into raw products before they are added, so that no FMA
replaces the separately rounded multiply and add.

`interpret=True` runs the kernel with the Pallas interpreter (any backend);
`interpret=False` needs a GPU (Triton).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlp.formats import FloatFormat
from jlp.gemm.accum import accumulate, check_accum, check_operands, opaque_zero, rounded_product
from jlp.numerics.float_cast import float_cast
from pallas_kernels.tiling import is_power_of_two, next_power_of_two, num_warps

# 32 x 32 accumulators (two float32 arrays with Kahan) per program: registers,
# with 4 warps; the A and B tiles stream through L1/L2 one column/row per k.
DEFAULT_TILE = 32


def _kernel(zero_ref, a_ref, b_ref, o_ref, *, fmt: FloatFormat, kahan: bool, chunk: int, k: int):
  tm, tn = o_ref.shape
  zero = zero_ref[...]  # (1, 1) uint32 zero, loaded at run time
  s0 = jnp.zeros((tm, tn), jnp.float32)
  c0 = jnp.zeros((tm, tn), jnp.float32) if kahan else None

  def product(kk):
    a_col = a_ref[:, pl.ds(kk, 1)]  # (tm, 1)
    b_row = b_ref[pl.ds(kk, 1), :]  # (1, tn)
    return a_col, b_row

  if chunk == 1:
    def body(kk, carry):
      s, c = carry
      a_col, b_row = product(kk)
      return accumulate(s, c, float_cast(a_col * b_row, fmt), fmt)
    num_steps = k
  else:
    def body(ci, carry):
      s, c = carry
      k0 = ci * chunk
      a_col, b_row = product(k0)
      partial0 = rounded_product(a_col, b_row, zero)

      def add(j, partial):
        a_col, b_row = product(k0 + j)
        return partial + rounded_product(a_col, b_row, zero)

      partial = lax.fori_loop(1, chunk, add, partial0)
      return accumulate(s, c, float_cast(partial, fmt), fmt)
    num_steps = -(-k // chunk)

  s, _ = lax.fori_loop(0, num_steps, body, (s0, c0))
  o_ref[...] = s


def accum_matmul(a: jax.Array, b: jax.Array, fmt: FloatFormat, *, kahan: bool = False,
                 chunk: int = 1, interpret: bool = False, tile_m: int = DEFAULT_TILE,
                 tile_n: int = DEFAULT_TILE) -> jax.Array:
  """a (M, K) @ b (K, N) with the accumulator rounded to `fmt` after every float32 op.

  Args:
    a: float32 (M, K).
    b: float32 (K, N).
    fmt: the accumulator format (rounding "nearest" or "truncate").
    kahan: Kahan-compensated accumulation.
    chunk: products summed in float32 before each quantized addition (>= 1).
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    tile_m, tile_n: output tile per program, powers of two (capped at the
      padded M, N).

  Returns:
    float32 (M, N), bit-identical to `jlp.gemm.accum.matmul(..., impl="xla")`.
  """
  fmt = check_accum(fmt)
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk={chunk!r} is not allowed; expected an int >= 1.")
  for name, t in (("tile_m", tile_m), ("tile_n", tile_n)):
    if not is_power_of_two(t):
      raise ValueError(f"{name}={t!r} is not allowed; expected a power of two >= 1.")
  a, b = check_operands(a, b)
  m, k = a.shape
  n = b.shape[1]
  if k == 0 or m == 0 or n == 0:
    return jnp.zeros((m, n), jnp.float32)
  chunk = min(chunk, k)
  tm = min(tile_m, next_power_of_two(m))
  tn = min(tile_n, next_power_of_two(n))
  mp, np_ = -(-m // tm) * tm, -(-n // tn) * tn
  kp = next_power_of_two(-(-k // chunk) * chunk)
  a_p = jnp.pad(a, ((0, mp - m), (0, kp - k)))
  b_p = jnp.pad(b, ((0, kp - k), (0, np_ - n)))
  zero = jnp.broadcast_to(opaque_zero(), (1, 1))
  kernel = functools.partial(_kernel, fmt=fmt, kahan=kahan, chunk=chunk, k=k)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
      grid=(mp // tm, np_ // tn),
      in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
                pl.BlockSpec((tm, kp), lambda i, j: (i, 0)),
                pl.BlockSpec((kp, tn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(tm * tn * 4)),
      name=f"accum_matmul_{fmt.name}" + ("_kahan" if kahan else "") + f"_chunk{chunk}",
  )(zero, a_p, b_p)
  return out[:m, :n]
