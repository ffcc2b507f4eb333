"""The rounding of float32 to any jlp format, without autodiff or validation: `quantize_f32`.

The shared core of `jlp.quantize.quantize` (which adds the custom_vjp and the checks) and of the
quantized GEMMs (`jlp.gemm.qdot`), which cast their operands with it. It sits below both, so the
GEMMs do not import the public layer above them; `jlp.quantize` re-exports every name. It
dispatches to the XLA path (`jlp.numerics`) or to the Pallas kernels (`pallas_kernels/`).

The kernels are imported when a call first asks for one, as `jlp.quantize` always did: no kernel
module imports this one (no cycle), but `pallas_kernels/tiling.py` imports `jlp.numerics`, which
runs `jlp/__init__`, which imports this module, so kernel imports here at module level would make
`import pallas_kernels.tiling` in a fresh process fail on the half-initialised `tiling`.
"""

from __future__ import annotations

import jax

from jlp.formats import BFPFormat, BlockScaledFormat, Format, FloatFormat, NVFP4Format
from jlp.numerics import bfp as bfp_numerics
from jlp.numerics import block_scaled as block_scaled_numerics
from jlp.numerics import float_cast as float_numerics
from jlp.numerics import mx as mx_numerics
from jlp.numerics import nvfp4 as nvfp4_numerics
from jlp.numerics import random_bits as rb


def is_stochastic(fmt: Format | None) -> bool:
  return fmt is not None and fmt.rounding == "stochastic"


def random_bits(key: jax.Array, shape: tuple[int, ...], *, index_offset=0,
                rng: str = "pairs") -> jax.Array:
  """The uint32 draws of stochastic rounding, one per element: a counter-based hash of `key` and
  the element's global flat index (`jlp.numerics.random_bits`)."""
  return rb.random_bits(key, shape, index_offset=index_offset, rng=rng)


def _use_pallas(impl: str) -> bool:
  return impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu")


def quantize_f32(x: jax.Array, fmt: Format, key: jax.Array | None = None,
                 impl: str = "xla", *, index_offset=0, rng: str = "pairs") -> jax.Array:
  """float32 x rounded to `fmt` (no custom_vjp, no validation): the shared core.

  A FloatFormat generates its draws inside the cast (XLA fusion or kernel tile); the block
  formats take them as an array from `random_bits`. impl="auto" runs NVFP4Format and
  BlockScaledFormat on the XLA path everywhere: on a GPU it is faster than their kernels (it
  uses the hardware's float operations where they give the same bits; BENCHMARKS.md).
  """
  pallas = _use_pallas(impl) and not (impl == "auto"
                                      and isinstance(fmt, (NVFP4Format, BlockScaledFormat)))
  interpret = jax.default_backend() != "gpu"
  if isinstance(fmt, FloatFormat):
    if pallas:
      from pallas_kernels import float_cast as float_kernel  # pylint: disable=g-import-not-at-top
      return float_kernel.float_cast(x, fmt, key=key, index_offset=index_offset, rng=rng,
                                     interpret=interpret)
    return float_numerics.float_cast(x, fmt, key=key, index_offset=index_offset, rng=rng)
  rbits = None
  if is_stochastic(fmt):
    rbits = random_bits(key, x.shape, index_offset=index_offset, rng=rng)
  if isinstance(fmt, BFPFormat):
    if pallas:
      from pallas_kernels import bfp as bfp_kernel  # pylint: disable=g-import-not-at-top
      return bfp_kernel.bfp_quantize(x, fmt, rbits, interpret=interpret)
    return bfp_numerics.bfp_quantize(x, fmt, rbits)
  if isinstance(fmt, NVFP4Format):
    if pallas:
      from pallas_kernels import nvfp4 as nvfp4_kernel  # pylint: disable=g-import-not-at-top
      return nvfp4_kernel.nvfp4_quantize(x, fmt, rbits, interpret=interpret)
    return nvfp4_numerics.nvfp4_quantize(x, fmt, rbits)
  if isinstance(fmt, BlockScaledFormat):
    if pallas:
      from pallas_kernels import block_scaled as block_scaled_kernel  # pylint: disable=g-import-not-at-top
      return block_scaled_kernel.block_scaled_quantize(x, fmt, interpret=interpret)
    return block_scaled_numerics.block_scaled_quantize(x, fmt)
  if pallas:
    from pallas_kernels import mx as mx_kernel  # pylint: disable=g-import-not-at-top
    return mx_kernel.mx_quantize(x, fmt, rbits, interpret=interpret)
  return mx_numerics.mx_quantize(x, fmt, rbits)
