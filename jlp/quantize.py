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
from typing import Any

import jax
import jax.numpy as jnp

from jlp.formats import BFPFormat, Format, FloatFormat, MXFormat, as_format
from jlp.numerics import bfp as bfp_numerics
from jlp.numerics import float_cast as float_numerics
from jlp.numerics import mx as mx_numerics

IMPLS = ("auto", "xla", "pallas")
_NATIVE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def is_stochastic(fmt: Format | None) -> bool:
  return fmt is not None and fmt.rounding == "stochastic"


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The uint32 draws of stochastic rounding: one per element, from `key` alone."""
  return jax.random.bits(key, shape, jnp.uint32)


def _use_pallas(impl: str) -> bool:
  return impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu")


def quantize_f32(x: jax.Array, fmt: Format, key: jax.Array | None = None,
                 impl: str = "xla") -> jax.Array:
  """float32 x rounded to `fmt` (no custom_vjp, no validation): the shared core."""
  rbits = random_bits(key, x.shape) if is_stochastic(fmt) else None
  pallas = _use_pallas(impl) and not isinstance(fmt, MXFormat)
  interpret = jax.default_backend() != "gpu"
  if isinstance(fmt, FloatFormat):
    if pallas:
      from pallas_kernels import float_cast as kernel  # pylint: disable=g-import-not-at-top
      return kernel.float_cast(x, fmt, rbits, interpret=interpret)
    return float_numerics.float_cast(x, fmt, rbits)
  if isinstance(fmt, BFPFormat):
    if pallas:
      from pallas_kernels import bfp as kernel  # pylint: disable=g-import-not-at-top
      return kernel.bfp_quantize(x, fmt, rbits, interpret=interpret)
    return bfp_numerics.bfp_quantize(x, fmt, rbits)
  return mx_numerics.mx_quantize(x, fmt, rbits)


def _apply(x: jax.Array, fmt: Format, key: jax.Array | None, impl: str) -> jax.Array:
  if x.dtype == jnp.float32:
    return quantize_f32(x, fmt, key, impl)
  return quantize_f32(x.astype(jnp.float32), fmt, key, impl).astype(x.dtype)


def backward_key(key: jax.Array) -> jax.Array:
  """The key of the cotangent's stochastic rounding: `fold_in(key, 1)`."""
  return jax.random.fold_in(key, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _quantize(x, key, fmt, bwd, impl):
  return _apply(x, fmt, key, impl)


def _quantize_fwd(x, key, fmt, bwd, impl):
  return _apply(x, fmt, key, impl), key


def _quantize_bwd(fmt, bwd, impl, key, g):
  del fmt
  if bwd is None:
    return g, None
  bkey = backward_key(key) if is_stochastic(bwd) else None
  return _apply(g, bwd, bkey, impl), None


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
  if isinstance(fmt, (BFPFormat, MXFormat)):
    fmt.check_rank(len(shape))


def quantize(x: jax.Array, fmt: Format | str, *, bwd: Format | str | None = None,
             key: jax.Array | None = None, impl: str = "auto") -> jax.Array:
  """Rounds `x` to `fmt`; differentiable (straight-through, or `bwd` on the cotangent).

  Args:
    x: float32 array (bfloat16 / float16 arrays are computed in float32 and
      returned in their dtype, which must hold every value of `fmt`).
    fmt: a FloatFormat, BFPFormat, MXFormat or a FloatFormat name ("e4m3",
      "float8_e4m3fn", ...).
    bwd: None (straight-through gradient) or the format the cotangent is rounded to.
    key: PRNG key, required when `fmt` or `bwd` rounds stochastically. The
      forward pass draws `jax.random.bits(key, x.shape, uint32)`, the backward
      pass the same from `jax.random.fold_in(key, 1)`; an element rounds away
      from zero iff its draw is below (dropped fraction) * 2^32.
    impl: "xla" (fused integer bit manipulation), "pallas" (the kernels in
      `pallas_kernels/`, run with `interpret=True` when there is no GPU; MXFormat
      has no kernel) or "auto" (pallas on GPU, xla elsewhere). Both agree bit for bit.

  Returns:
    An array of x's shape and dtype holding values exactly representable in `fmt`.

  Raises:
    ValueError: an invalid format, dtype, impl, block rank or a missing key,
      before any computation.
  """
  fmt = as_format(fmt, "fmt")
  bwd = None if bwd is None else as_format(bwd, "bwd")
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not allowed; expected one of {IMPLS}.")
  if impl == "pallas" and isinstance(fmt, MXFormat):
    raise ValueError(f"impl='pallas' is not available for {fmt!r}; use impl='xla' or 'auto'.")
  _check_dtype(x, fmt, "x")
  if bwd is not None:
    if impl == "pallas" and isinstance(bwd, MXFormat):
      raise ValueError(f"impl='pallas' is not available for bwd={bwd!r}; use impl='xla' or 'auto'.")
    _check_dtype(x, bwd, "x (cotangent, for bwd)")
  shape = jnp.shape(x)
  _check_shape(shape, fmt)
  if bwd is not None:
    _check_shape(shape, bwd)
  for name, f in (("fmt", fmt), ("bwd", bwd)):
    if is_stochastic(f) and key is None:
      raise ValueError(f"key=None is not allowed with {name}={f!r}: stochastic rounding "
                       "needs a PRNG key (e.g. jax.random.key(0)).")
  x = jnp.asarray(x)
  return _quantize(x, key, fmt, bwd, impl)
