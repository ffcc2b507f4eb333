"""`shared_jit`: `jax.jit` for a computation that one program calls at many sites.

A jitted function called inside another jitted program becomes a call that XLA inlines by
default: each call site's copy is then optimized together with the code around it, and a training
step with dozens of NVFP4 casts spent most of its compile time on the casts' integer fallbacks.
`jax.Inline.XLA_LATE` (jax's `inline=` option of `jax.jit`) keeps the calls in the program XLA
compiles. XLA:CPU still compiles one computation per call site (its call-graph flattening clones
them), but each on its own, and that is far faster (16 NVFP4 casts of different shapes in one
program: 2.4 s inlined, 1.3 s as calls; the ResNet18 nvfp4 step in about a third of the time,
with the same bits: BENCHMARKS.md, "Casts behind calls").

Use it only where the call's boundary cannot change what XLA computes around it: a call is a
fusion boundary, and XLA:CPU sums a float32 reduction in an order that depends on what it fuses
with. The functions behind it here are integer bit operations (`ieee_f32`), run as the body of a
loop over chunks, a boundary already (`nvfp4`'s chunk programs and `block_scaled`'s integer
fallback, itself inside a `lax.cond` branch), or run inside a `lax.cond` branch (`mx`'s general
rounding). A whole cast called from a model is not: with `block_scaled`'s whole cast behind a
call, a ResNet18 step's BatchNorm gradients came out in other bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["shared_jit"]


def shared_jit(fun: Callable | None = None, **jit_kwargs: Any) -> Any:
  """`jax.jit(fun, inline=jax.Inline.XLA_LATE, **jit_kwargs)`; with `fun` omitted, a decorator
  (`@shared_jit(static_argnames=...)`)."""
  if fun is None:
    return functools.partial(shared_jit, **jit_kwargs)
  return jax.jit(fun, inline=jax.Inline.XLA_LATE, **jit_kwargs)
