"""`jlp.quantize`: a differentiable cast to any jlp format.

The forward pass rounds x to the format; the backward pass is straight-through
or, with `bwd`, rounds the cotangent to a second format (CPD's `Quantizer`,
which casts activations forward and their gradients backward).

References:
  Han, Demmel, You, "Auto-Precision Scaling for Distributed Deep Learning",
    arXiv:1911.08907 (CPD).
  Zhang et al., "QPyTorch: A Low-Precision Arithmetic Simulation Framework",
    arXiv:1910.04540 (straight-through quantizers with separate backward formats).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jlp.formats import Format, FloatFormat, as_format
from jlp.numerics import random_bits as rb
# The undifferentiated cast lives below this module and jlp.gemm (both use it); re-exported here.
from jlp.numerics.quantize_core import _use_pallas, is_stochastic, quantize_f32, random_bits

IMPLS = ("auto", "xla", "pallas")
_NATIVE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _apply(x: jax.Array, fmt: Format, key: jax.Array | None, impl: str, index_offset,
           rng: str) -> jax.Array:
  if x.dtype == jnp.float32:
    return quantize_f32(x, fmt, key, impl, index_offset=index_offset, rng=rng)
  return quantize_f32(x.astype(jnp.float32), fmt, key, impl, index_offset=index_offset,
                      rng=rng).astype(x.dtype)


def backward_key(key: jax.Array) -> jax.Array:
  """The key of the cotangent's stochastic rounding: `fold_in(key, 1)`."""
  return jax.random.fold_in(key, 1)


# index_offset travels as `traced_offset` (an array argument, None for a static offset) or as
# the static int `static_offset` (a nondiff argument, so the "pairs" layout sees its parity).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _quantize(x, key, traced_offset, fmt, bwd, impl, rng, static_offset):
  offset = static_offset if traced_offset is None else traced_offset
  return _apply(x, fmt, key, impl, offset, rng)


def _quantize_fwd(x, key, traced_offset, fmt, bwd, impl, rng, static_offset):
  offset = static_offset if traced_offset is None else traced_offset
  return _apply(x, fmt, key, impl, offset, rng), (key, traced_offset)


def _quantize_bwd(fmt, bwd, impl, rng, static_offset, residuals, g):
  del fmt
  key, traced_offset = residuals
  if bwd is None:
    return g, None, None
  offset = static_offset if traced_offset is None else traced_offset
  bkey = backward_key(key) if is_stochastic(bwd) else None
  return _apply(g, bwd, bkey, impl, offset, rng), None, None


_quantize.defvjp(_quantize_fwd, _quantize_bwd)


def _check_dtype(x: Any, fmt: Format, field: str) -> None:
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{field}.dtype={dtype} is not allowed; expected float32, bfloat16 or float16.")
  if dtype not in _NATIVE_DTYPES:
    raise ValueError(f"{field}.dtype={dtype} is not allowed; expected float32, bfloat16 or float16 "
                     "(a float64 input would be rounded twice; cast it to float32 first).")
  if dtype != jnp.float32 and not fmt.representable_in(dtype):
    raise ValueError(f"{field}.dtype={dtype} cannot hold every value of {fmt!r}; "
                     "pass float32 input or a format that fits the dtype.")


def _check_shape(shape: tuple[int, ...], fmt: Format) -> None:
  if not isinstance(fmt, FloatFormat):
    fmt.check_rank(len(shape))


def quantize(x: jax.Array, fmt: Format | str, *, bwd: Format | str | None = None,
             key: jax.Array | None = None, impl: str = "auto", index_offset=0,
             rng: str = "pairs") -> jax.Array:
  """Rounds `x` to `fmt`; differentiable (straight-through, or `bwd` on the cotangent).

  Args:
    x: float32 array (bfloat16 / float16 arrays are computed in float32 and
      returned in their dtype, which must hold every value of `fmt`).
    fmt: a FloatFormat, BFPFormat, MXFormat, NVFP4Format, BlockScaledFormat or a FloatFormat
      name ("e4m3", "float8_e4m3fn", ...). NVFP4Format and BlockScaledFormat take float32 x
      only (their values need float32).
    bwd: None (straight-through gradient) or the format the cotangent is rounded to.
    key: PRNG key (threefry2x32, the default), required when `fmt` or `bwd` rounds
      stochastically. An element rounds away from zero iff its uint32 draw is below
      (dropped fraction) * 2^32. The draws are a counter-based hash (Threefry-2x32-20) of the
      key and the element's global flat index, generated inside the cast
      (`jlp.numerics.random_bits`): the forward pass hashes with `key`, the backward pass
      with `jax.random.fold_in(key, 1)`.
    impl: "xla" (fused integer bit manipulation), "pallas" (the kernels in
      `pallas_kernels/`, run with `interpret=True` when there is no GPU) or "auto"
      (pallas on GPU, xla elsewhere; xla for NVFP4Format and BlockScaledFormat, faster on
      GPU too). Both agree bit for bit, forward and backward.
    index_offset: the global flat index of x's first element (a non-negative int, or an
      int32 / uint32 scalar): inside `jax.shard_map` over x's leading axis,
      `lax.axis_index(axis) * x.size` gives each element the draw it gets unsharded.
    rng: "pairs" (one hash serves two neighbouring elements) or "jax" (the draws are
      `jax.random.bits(key, x.shape, uint32)` at index_offset=0, one hash per element).

  Returns:
    An array of x's shape and dtype holding values exactly representable in `fmt`.

  Raises:
    ValueError: an invalid format, dtype, impl, block rank, rng, index_offset or a missing
      key, before any computation.
  """
  fmt = as_format(fmt, "fmt")
  bwd = None if bwd is None else as_format(bwd, "bwd")
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not allowed; expected one of {IMPLS}.")
  _check_dtype(x, fmt, "x")
  if bwd is not None:
    _check_dtype(x, bwd, "x (cotangent, for bwd)")
  shape = jnp.shape(x)
  _check_shape(shape, fmt)
  if bwd is not None:
    _check_shape(shape, bwd)
  for name, f in (("fmt", fmt), ("bwd", bwd)):
    if is_stochastic(f) and key is None:
      raise ValueError(f"key=None is not allowed with {name}={f!r}: stochastic rounding "
                       "needs a PRNG key (e.g. jax.random.key(0)).")
  rb.check_rng(rng)
  if is_stochastic(fmt) or is_stochastic(bwd):
    rb.check_offset(index_offset, math.prod(shape))
    rb.key_words(key)
  x = jnp.asarray(x)
  if isinstance(index_offset, (int, np.integer)):
    return _quantize(x, key, None, fmt, bwd, impl, rng, int(index_offset))
  return _quantize(x, key, index_offset, fmt, bwd, impl, rng, 0)
