"""DavidNet: the DAWNBench CIFAR-10 ResNet-9 by Myrtle (David Page), as in CPD's example/DavidNet
(docs/cpd.md#recipes), in Flax NNX (NHWC).

    prep   conv_bn(3 -> w)
    layer1 conv_bn(w -> 2w), maxpool 2, residual(res1 = conv_bn(2w), res2 = conv_bn(2w))
    layer2 conv_bn(2w -> 4w), maxpool 2
    layer3 conv_bn(4w -> 8w), maxpool 2, residual(res1, res2)
    pool   MaxPool(4) (global max pooling here, identical for 32x32 inputs), flatten
    linear Linear(8w -> classes, no bias), x 0.125 ("classifier": Mul(weight))

conv_bn = 3x3 conv (padding 1, no bias) + BatchNorm (gamma init 1, PyTorch momentum 0.1, eps 1e-5)
+ ReLU. Module paths mirror the PyTorch names: "prep/conv", "layer1/conv", "layer1/bn",
"layer1/residual/res1/conv", ..., "linear". w = `width` (64 in the paper).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlp.models.resnet import MaxPool, batch_norm, conv2d, linear

__all__ = ["ConvBN", "DavidLayer", "DavidNet", "Residual", "davidnet"]


class ConvBN(nnx.Module):
  """3x3 conv (no bias) + BatchNorm + ReLU."""

  def __init__(self, c_in, c_out, *, bn_weight_init=1.0, use_running_average=False, rngs):
    self.conv = conv2d(c_in, c_out, 3, 1, init="torch", rngs=rngs)
    self.bn = batch_norm(c_out,
                         use_running_average=use_running_average,
                         scale_init=bn_weight_init,
                         rngs=rngs)

  def __call__(self, x):
    return jax.nn.relu(self.bn(self.conv(x)))


class Residual(nnx.Module):
  """x + res2(res1(x))."""

  def __init__(self, c, *, use_running_average=False, rngs):
    self.res1 = ConvBN(c, c, use_running_average=use_running_average, rngs=rngs)
    self.res2 = ConvBN(c, c, use_running_average=use_running_average, rngs=rngs)

  def __call__(self, x):
    return x + self.res2(self.res1(x))


class DavidLayer(nnx.Module):
  """conv_bn, 2x2 max pool, optional residual."""

  def __init__(self, c_in, c_out, *, residual: bool, use_running_average=False, rngs):
    self.conv = conv2d(c_in, c_out, 3, 1, init="torch", rngs=rngs)
    self.bn = batch_norm(c_out, use_running_average=use_running_average, rngs=rngs)
    self.pool = MaxPool(2)
    self.residual = (Residual(c_out, use_running_average=use_running_average, rngs=rngs)
                     if residual else None)

  def __call__(self, x):
    x = self.pool(jax.nn.relu(self.bn(self.conv(x))))
    if self.residual is not None:
      x = self.residual(x)
    return x


class DavidNet(nnx.Module):
  """Myrtle's ResNet-9 ("DavidNet"). Knobs: `width` (prep channels; 64), `num_classes` (10),
    `weight` (the final logit scale, 0.125), `in_channels` (3)."""

  def __init__(
      self,
      num_classes: int = 10,
      *,
      width: int = 64,
      weight: float = 0.125,
      in_channels: int = 3,
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    ura = use_running_average
    c = {"prep": width, "layer1": 2 * width, "layer2": 4 * width, "layer3": 8 * width}
    self.prep = ConvBN(in_channels, c["prep"], use_running_average=ura, rngs=rngs)
    self.layer1 = DavidLayer(c["prep"],
                             c["layer1"],
                             residual=True,
                             use_running_average=ura,
                             rngs=rngs)
    self.layer2 = DavidLayer(c["layer1"],
                             c["layer2"],
                             residual=False,
                             use_running_average=ura,
                             rngs=rngs)
    self.layer3 = DavidLayer(c["layer2"],
                             c["layer3"],
                             residual=True,
                             use_running_average=ura,
                             rngs=rngs)
    self.linear = linear(c["layer3"], num_classes, bias=False, rngs=rngs)
    self.weight = weight

  def __call__(self, x):
    x = self.layer3(self.layer2(self.layer1(self.prep(x))))
    x = jnp.max(x, axis=(1, 2))  # MaxPool(4) on the 4x4 map + flatten
    return self.linear(x) * self.weight


def davidnet(num_classes: int = 10,
             *,
             width: int = 64,
             rngs: nnx.Rngs | None = None,
             **kwargs) -> DavidNet:
  """DavidNet (DAWNBench ResNet-9); 6,573,120 parameters at width 64, 10 classes."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return DavidNet(num_classes, width=width, rngs=rngs, **kwargs)
