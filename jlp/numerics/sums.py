"""Sums in index order with every intermediate rounded to a format (CPD, docs/cpd.md).

`sequential_sum`: s = q(s + x_i) for i = 0, 1, ...; `kahan_sum`: Kahan's
compensated sum with each float32 operation rounded,
    y = q(x_i - c), t = q(s + y), c = q(q(t - s) - y), s = t,
which is how CPD reduces gradients across ranks (drcut/CPD `dist_util.py`,
`normal_sum_gradients` / `kahan_sum_gradients`). Both start from s = c = 0, so
the first step gives q(x_0).

With fmt=None the operations are plain float32 (on XLA:CPU float32 subnormal
results are flushed to zero, as for any float32 arithmetic there).

Reference: W. Kahan, "Further remarks on reducing truncation errors",
  Comm. ACM 8(1), 1965.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jlp.formats import FloatFormat, as_format
from jlp.numerics.float_cast import float_cast


def _rounder(fmt: FloatFormat | None, key: jax.Array | None):
  """q(value, step, slot): rounding of one intermediate; stochastic keys fold (step, slot)."""
  if fmt is None:
    return lambda v, step, slot: v
  if fmt.rounding != "stochastic":
    return lambda v, step, slot: float_cast(v, fmt)

  def q(v, step, slot):
    k = jax.random.fold_in(jax.random.fold_in(key, step), slot)
    return float_cast(v, fmt, key=k)
  return q


def kahan_step(s: jax.Array, c: jax.Array, x: jax.Array,
               rnd: Callable[[jax.Array, int], jax.Array]) -> tuple[jax.Array, jax.Array]:
  """One step of Kahan's compensated sum, each float32 operation rounded by rnd(value, slot):

      y = rnd(x - c, 0),  t = rnd(s + y, 1),  c = rnd(rnd(t - s, 2) - y, 3);  returns (t, c).

  The one definition of the step that `kahan_sum`, the all-reduce's folds and rings
  (`jlp.collectives`) and the Kahan GEMM accumulator (`jlp.gemm.accum`) share.
  """
  y = rnd(x - c, 0)
  t = rnd(s + y, 1)
  return t, rnd(rnd(t - s, 2) - y, 3)


def _zeros(xs: jax.Array) -> jax.Array:
  """The zero carry of a fold over xs's leading axis. `zeros_like` keeps xs's varying mesh axes,
  so the folds also run inside `jax.shard_map` (check_vma) on gathered values. The barrier keeps
  XLA from folding 0 + y into y, which is wrong for y = -0 (IEEE: +0 + -0 = +0): a one-step
  Kahan fold would otherwise return -0 where the sum is +0."""
  return lax.optimization_barrier(jnp.zeros_like(xs, shape=xs.shape[1:]))


def _prepare(x, axis, fmt, key):
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise ValueError(f"x.dtype={x.dtype} is not allowed; expected float32.")
  if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis!r} is out of range for an array with ndim={x.ndim}.")
  if fmt is not None:
    fmt = as_format(fmt)
    if not isinstance(fmt, FloatFormat):
      raise ValueError(f"fmt={fmt!r} is not allowed; expected a FloatFormat or None.")
    if fmt.rounding == "stochastic" and key is None:
      raise ValueError(f"key=None is not allowed with fmt={fmt!r}: stochastic rounding needs a key.")
  return jnp.moveaxis(x, axis, 0), fmt


def sequential_sum(x: jax.Array, axis: int = 0, *, fmt: FloatFormat | str | None = None,
                   key: jax.Array | None = None) -> jax.Array:
  """Sum over `axis` in index order, rounding the running sum after every add.

  Args:
    x: float32 array.
    axis: the axis summed over, in increasing index order.
    fmt: the format of every intermediate (None: float32).
    key: PRNG key for a stochastic `fmt`; step i, operation j rounds with the draws of
      fold_in(fold_in(key, i), j) (`jlp.numerics.random_bits`, "pairs" stream, generated
      inside the cast).
  """
  xs, fmt = _prepare(x, axis, fmt, key)
  q = _rounder(fmt, key)

  def step(s, ix):
    i, xi = ix
    return q(s + xi, i, 0), None

  s, _ = lax.scan(step, _zeros(xs), (jnp.arange(xs.shape[0]), xs))
  return s


def kahan_sum(x: jax.Array, axis: int = 0, *, fmt: FloatFormat | str | None = None,
              key: jax.Array | None = None) -> jax.Array:
  """Kahan-compensated sum over `axis` in index order, every operation rounded to `fmt`.

  Same arguments as `sequential_sum`.
  """
  xs, fmt = _prepare(x, axis, fmt, key)
  q = _rounder(fmt, key)

  def step(carry, ix):
    i, xi = ix
    return kahan_step(*carry, xi, lambda v, slot: q(v, i, slot)), None

  (s, _), _ = lax.scan(step, (_zeros(xs), _zeros(xs)), (jnp.arange(xs.shape[0]), xs))
  return s
