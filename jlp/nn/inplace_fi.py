"""BFPsim's in-place `fi` side effect, as an explicit opt-in (docs/bfp.md#compat-switches).

BFPsim's BFPConv2d quantizes its input with Q_fi *in place* (through an int32
view of the caller's tensor, invisible to autograd). Every other user of that
tensor therefore sees the quantized values:

  * in a ResNet block, the identity shortcut (or the float32 1x1 projection
    conv) consumes the quantized block input;
  * the ReLU that produced the tensor saved it as its output, so its backward
    mask (out > 0) is computed from the quantized values: entries the BFP
    grouping flushed to zero get no gradient.

jlp's default is functional: a quantized conv quantizes its own copy and
nothing else changes. `quantize_model(model, rules, bfpsim_inplace_fi=True)`
makes the model zoo's ResNets (ResNet18/50 and the FCN backbone) reproduce the
side effect faithfully: an activation that feeds a
conv whose GemmQuant has a BFP `x` role (BFPsim's fi) is quantized once, where
it is produced, with that conv's x format at its current (traced) width, and
the quantized tensor xq goes to all of its consumers (the stage outputs that
FCN's heads read included). Backward: straight-through, times (xq > 0) when the
producer is a ReLU (that ReLU's own mask (z > 0) then changes nothing, since xq
> 0 implies z > 0); after a max pool (the ImageNet and deep stems), whose
backward routes by position, the gradient is passed as is. The conv quantizes
xq again, which changes nothing (BFP quantization is idempotent).

Not reproduced: a tensor with two BFP consumers with fi (BFPsim would apply
the second Q_fi on top of the first, in execution order); here each conv
quantizes xq (the first conv's result) for its own use and the mask comes from
xq. BFPsim's presets have no such tensor (shortcut convs are float32).
Stochastic x roles are refused (the conv would draw other bits than the
producer).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jlp.formats import BFPFormat
from jlp.nn.rules import QConv
from jlp.numerics import bfp as bfp_numerics

__all__ = ["fi_format", "quantize_for_conv"]


def fi_format(conv: Any) -> tuple[BFPFormat, jax.Array] | None:
  """(BFP format, current mantissa width) of `conv`'s x role, or None if it has no BFP x role.

  `conv` is an `nnx.Conv` whose `conv_general_dilated` hook is a `jlp.nn.QConv`
  adapter (set by `quantize_model`); any other conv gives None.
  """
  op = getattr(conv, "conv_general_dilated", None)
  if not isinstance(op, QConv) or not isinstance(op.cfg.x, BFPFormat):
    return None
  fmt = op.cfg.x
  if fmt.rounding == "stochastic":
    raise ValueError(f"bfpsim_inplace_fi=True: layer {op.path!r} has cfg.x={fmt!r} with rounding="
                     "'stochastic', which is not allowed; expected 'truncate' or 'nearest' (the "
                     "producer and the conv would draw different bits).")
  return fmt, op._widths()["x"]  # pylint: disable=protected-access


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _quantize_in_place(x: jax.Array, width: jax.Array, fmt: BFPFormat, relu_mask: bool) -> jax.Array:
  return bfp_numerics.bfp_quantize(x, fmt, None, man=width)


def _quantize_in_place_fwd(x, width, fmt, relu_mask):
  xq = _quantize_in_place(x, width, fmt, relu_mask)
  return xq, xq


def _quantize_in_place_bwd(fmt, relu_mask, xq, g):
  del fmt
  if relu_mask:
    g = jnp.where(xq > 0, g, jnp.zeros_like(g))
  return g, None


_quantize_in_place.defvjp(_quantize_in_place_fwd, _quantize_in_place_bwd)


def quantize_for_conv(conv: Any, x: jax.Array, *, after_relu: bool) -> jax.Array:
  """x as BFPsim's in-place Q_fi of `conv` leaves it for every consumer (module docstring).

  Args:
    conv: the BFP conv that consumes x (an nnx.Conv); x is returned unchanged
      when its x role is not a BFPFormat.
    x: the activation, float32, in the layout the conv sees (NHWC).
    after_relu: x is a ReLU's output: the gradient is masked with (xq > 0).

  Returns:
    The quantized x (straight-through gradient, masked when after_relu).
  """
  found = fi_format(conv)
  if found is None:
    return x
  fmt, width = found
  return _quantize_in_place(x, width, fmt, after_relu)
