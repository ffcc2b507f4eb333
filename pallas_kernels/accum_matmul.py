"""Pallas kernel for a matmul with a custom-precision (FloatFormat) accumulator.

Semantics: `accum_matmul(a, b, fmt, kahan=..., chunk=...)` equals the XLA path of
`jlp.gemm.accum.matmul` bit for bit (CPD's quant_gemm, Han, Demmel, You,
arXiv:1911.08907; docs/cpd.md#accumulating-gemm): for every output element, k strictly
increasing, p = q(fl32(a[i,k] * b[k,j])) (chunk = 1) or p = q(float32 sum of
`chunk` consecutive raw float32 products, in k order, starting from the first
product; the last chunk completed with zero products), then the plain step
s = q(s + p) or the Kahan step y = q(p - c), t = q(s + y), c = q(q(t - s) - y),
s = t; the result is s. q is `cast_bits` on the float32 bit patterns (the same
integer code as `jlp.quantize`). See `jlp.gemm.accum` for the full statement
and the float32-subnormal caveat.

Layout: the grid is (M / tm, N / tn) with power-of-two output tiles (Triton).
Each program keeps its (tm, tn) accumulators (s, c, and the chunk's partial
sum) in registers and walks K in blocks of tk (a power of two): a `fori_loop`
over the K blocks loads an A block (tm, tk) and a B block (tk, tn), splits them
into columns and rows (`lax.split`, lowered to Triton reshapes and splits)
and runs the tk rank-1 steps of the sequence above, unrolled. K is not a grid
axis: Triton runs the programs of a grid in parallel, and the order over k must
stay sequential (no split-K), so it lives inside one program. M and N are
zero-padded to the tiles (padded rows and columns are sliced off); K is
zero-padded only to a multiple of tk (nothing when tk divides K), and the
steps run over the real K only: the last, partial block runs its K mod tk
steps and the padding is never accumulated. (That matters: with Kahan, a zero
product is not a no-op, since y = q(0 - c) folds the compensation into s.)

Chunked mode: a chunk starts and ends at positions k = 0 (mod chunk) and
k = chunk - 1 (mod chunk). Where tk is a multiple of chunk those positions are
the same in every block and known when tracing; where chunk is a multiple of
tk, only the block index is tested (once per block); otherwise every step tests
its k. At a start the partial sum is the product itself, elsewhere partial +
product; at an end the partial sum enters the accumulator (a branch, so that
non-ending steps cost one float32 add). If chunk does not divide K, the XLA
path adds zero products to complete the last chunk: P + (+0) + ... + (+0) =
P + (+0) (P unchanged, except -0 becomes +0), so one addition of an opaque +0
does the same. A uint32 zero operand (opaque to the compiler, loaded at run
time) is OR-ed into raw products before they are added, so that no FMA
replaces the separately rounded multiply and add, and gives that +0.

Promotion (`promote_every` = n_c; DeepSeek-V3, arXiv:2412.19437 §3.3.2): the
plain chunk = 1 step accumulates s, and at each run end (k = n_c - 1 mod n_c,
found as the chunk ends above) a float32 accumulator takes acc = fl32(acc + s)
(`jlp.numerics.ieee_f32.ieee_add`, integer-op handling of float32 subnormals,
so the GPU and the interpreter on XLA:CPU give the same bits) and s restarts at
+0. A last, shorter run (n_c not dividing K) is added after the K loop. The
result is acc.

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
from jlp.gemm.accum_step import accumulate, check_accum, check_operands, check_promote_every
from jlp.numerics.ieee_f32 import ieee_add
from jlp.numerics.opaque import opaque_zero, rounded_product
from jlp.numerics.float_cast import float_cast
# The module, not its names: jlp.gemm.accum imports this module at its top, so a fresh
# `import pallas_kernels.tiling` (which imports jlp) reaches here while tiling is half-initialised.
from pallas_kernels import tiling

# 32 x 32 accumulators (s, and c with Kahan, and the chunk's partial sum) per program, in
# registers (num_warps from tiling: 8).
DEFAULT_TILE = 32
# K steps per loaded block: A (32, 16) and B (16, 32) tiles, 16 unrolled rank-1 steps per
# loop iteration.
DEFAULT_TILE_K = 16


def _at_position(kb, j: int, r: int, tk: int, chunk: int):
  """Whether k = kb * tk + j has k mod chunk == r: a Python bool, or a traced bool.

  kb is the K block index (a Python int or a traced int32), j the static step in the block.
  """
  if isinstance(kb, int):
    return (kb * tk + j) % chunk == r
  if tk % chunk == 0:
    return j % chunk == r
  if chunk % tk == 0:  # kb * tk mod chunk is a multiple of tk, j < tk
    if j != r % tk:
      return False
    return True if chunk == tk else lax.rem(kb, chunk // tk) == r // tk
  return lax.rem(kb * tk + j, chunk) == r  # k >= 0: lax.rem is the modulus (jnp's % is not lowered)


def _kernel(zero_ref, a_ref, b_ref, o_ref, *, fmt: FloatFormat, kahan: bool, chunk: int,
            promote: int | None, k: int, tk: int):
  tm, tn = o_ref.shape
  zero = zero_ref[...]  # (1, 1) uint32 zero, loaded at run time
  zeros = lambda: jnp.zeros((tm, tn), jnp.float32)
  carry = (zeros(), zeros() if kahan else None, zeros() if chunk > 1 else None,
           zeros() if promote else None)

  def add_to_accumulator(s, c, partial):
    return accumulate(s, c, float_cast(partial, fmt), fmt)

  def promote_run(s, acc):
    return zeros(), ieee_add(acc, s)

  def step(carry, kb, j, a_col, b_row):
    s, c, partial, acc = carry
    if promote:
      s, _ = accumulate(s, None, float_cast(a_col * b_row, fmt), fmt)
      end = _at_position(kb, j, promote - 1, tk, promote)
      if end is True:
        s, acc = promote_run(s, acc)
      elif end is not False:
        s, acc = lax.cond(end, promote_run, lambda s, acc: (s, acc), s, acc)
      return s, None, None, acc
    if chunk == 1:
      return (*accumulate(s, c, float_cast(a_col * b_row, fmt), fmt), None, None)
    term = rounded_product(a_col, b_row, zero)
    start = _at_position(kb, j, 0, tk, chunk)
    if start is True:
      partial = term
    elif start is False:
      partial = partial + term
    else:
      partial = jnp.where(start, term, partial + term)
    end = _at_position(kb, j, chunk - 1, tk, chunk)
    if end is True:
      s, c = add_to_accumulator(s, c, partial)
    elif end is not False:
      s, c = lax.cond(end, add_to_accumulator, lambda s, c, _: (s, c), s, c, partial)
    return s, c, partial, None

  def block(kb, carry, steps: int):
    """The first `steps` k steps of K block kb (kb * tk .. kb * tk + steps - 1)."""
    k0 = kb * tk if isinstance(kb, int) else pl.multiple_of(kb * tk, tk)
    a_cols = lax.split(a_ref[:, pl.ds(k0, tk)], (1,) * tk, axis=1)  # tk x (tm, 1)
    b_rows = lax.split(b_ref[pl.ds(k0, tk), :], (1,) * tk, axis=0)  # tk x (1, tn)
    for j in range(steps):
      carry = step(carry, kb, j, a_cols[j], b_rows[j])
    return carry

  full_blocks, rest = divmod(k, tk)
  if full_blocks:
    carry = lax.fori_loop(0, full_blocks, lambda kb, carry: block(kb, carry, tk), carry)
  if rest:
    carry = block(full_blocks, carry, rest)
  s, c, partial, acc = carry
  if promote:
    if k % promote:
      _, acc = promote_run(s, acc)
    o_ref[...] = acc
    return
  if chunk > 1 and k % chunk:
    s, _ = add_to_accumulator(s, c, partial + lax.bitcast_convert_type(zero, jnp.float32))
  o_ref[...] = s


def accum_matmul(a: jax.Array, b: jax.Array, fmt: FloatFormat, *, kahan: bool = False,
                 chunk: int = 1, promote_every: int | None = None, interpret: bool = False,
                 tile_m: int = DEFAULT_TILE, tile_n: int = DEFAULT_TILE,
                 tile_k: int = DEFAULT_TILE_K) -> jax.Array:
  """a (M, K) @ b (K, N) with the accumulator rounded to `fmt` after every float32 op.

  Args:
    a: float32 (M, K).
    b: float32 (K, N).
    fmt: the accumulator format (rounding "nearest" or "truncate").
    kahan: Kahan-compensated accumulation.
    chunk: products summed in float32 before each quantized addition (>= 1).
    promote_every: None, or n_c >= 1 (with kahan=False, chunk=1): runs of n_c
      products accumulated in fmt, each then added to a float32 accumulator
      (`jlp.gemm.accum.matmul`; DeepSeek-V3, arXiv:2412.19437 §3.3.2).
    interpret: run with the Pallas interpreter instead of compiling for the GPU.
    tile_m, tile_n: output tile per program, powers of two (capped at the
      padded M, N).
    tile_k: K steps per loaded A / B block, a power of two (capped at the
      padded K); K is zero-padded to a multiple of it.

  Returns:
    float32 (M, N), bit-identical to `jlp.gemm.accum.matmul(..., impl="xla")`.
  """
  fmt = check_accum(fmt)
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk={chunk!r} is not allowed; expected an int >= 1.")
  promote_every = check_promote_every(promote_every, kahan=kahan, chunk=chunk)
  for name, t in (("tile_m", tile_m), ("tile_n", tile_n), ("tile_k", tile_k)):
    if not tiling.is_power_of_two(t):
      raise ValueError(f"{name}={t!r} is not allowed; expected a power of two >= 1.")
  a, b = check_operands(a, b)
  m, k = a.shape
  n = b.shape[1]
  if k == 0 or m == 0 or n == 0:
    return jnp.zeros((m, n), jnp.float32)
  chunk = min(chunk, k)
  promote = None if promote_every is None else min(promote_every, k)
  tm = min(tile_m, tiling.next_power_of_two(m))
  tn = min(tile_n, tiling.next_power_of_two(n))
  tk = min(tile_k, tiling.next_power_of_two(k))
  mp, np_, kp = -(-m // tm) * tm, -(-n // tn) * tn, -(-k // tk) * tk
  a_p = jnp.pad(a, ((0, mp - m), (0, kp - k))) if (mp, kp) != (m, k) else a
  b_p = jnp.pad(b, ((0, kp - k), (0, np_ - n))) if (kp, np_) != (k, n) else b
  zero = jnp.broadcast_to(opaque_zero(), (1, 1))
  kernel = functools.partial(_kernel, fmt=fmt, kahan=kahan, chunk=chunk, promote=promote, k=k,
                             tk=tk)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
      grid=(mp // tm, np_ // tn),
      in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
                pl.BlockSpec((tm, kp), lambda i, j: (i, 0)),
                pl.BlockSpec((kp, tn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps(tm * tn * 4)),
      name=f"accum_matmul_{fmt.name}" + ("_kahan" if kahan else "") + f"_chunk{chunk}"
      + (f"_promote{promote}" if promote else ""),
  )(zero, a_p, b_p)
  return out[:m, :n]
