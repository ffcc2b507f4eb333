"""A small CNN for digits-sized inputs (scikit-learn's 8x8x1 digits, 10 classes), Flax NNX, NHWC.

    conv1  3x3 conv (in_channels -> w, padding 1, no bias) + BatchNorm + ReLU      8x8
    conv2  3x3 conv (w -> 2w, stride 2, padding 1, no bias) + BatchNorm + ReLU     4x4
    global average pooling, flatten
    linear Linear(2w -> classes, bias)

w = `width` (16 by default: 5,178 parameters for 10 classes). Layers are built with the zoo's
PyTorch-style helpers (`jlp.models.resnet`: PyTorch default init, BatchNorm momentum 0.1 in
PyTorch terms, eps 1e-5), so quantization rules reach both convs and the classifier; module paths
are "conv1", "bn1", "conv2", "bn2", "linear". Spatial size is not fixed: any HxW works (global
pooling), so the same net also takes CIFAR-sized images in quick experiments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlp.models.resnet import batch_norm, conv2d, linear

__all__ = ["SmallCNN", "small_cnn"]


class SmallCNN(nnx.Module):
  """Two conv-BN-ReLU layers, global average pooling and a linear classifier."""

  def __init__(
      self,
      num_classes: int = 10,
      *,
      width: int = 16,
      in_channels: int = 1,
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    ura = use_running_average
    self.conv1 = conv2d(in_channels, width, 3, 1, init="torch", rngs=rngs)
    self.bn1 = batch_norm(width, use_running_average=ura, rngs=rngs)
    self.conv2 = conv2d(width, 2 * width, 3, 2, init="torch", rngs=rngs)
    self.bn2 = batch_norm(2 * width, use_running_average=ura, rngs=rngs)
    self.linear = linear(2 * width, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.bn1(self.conv1(x)))
    x = jax.nn.relu(self.bn2(self.conv2(x)))
    return self.linear(jnp.mean(x, axis=(1, 2)))


def small_cnn(num_classes: int = 10,
              *,
              width: int = 16,
              rngs: nnx.Rngs | None = None,
              **kwargs) -> SmallCNN:
  """The small digits CNN; 5,178 parameters at width 16, 10 classes (1 input channel)."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return SmallCNN(num_classes, width=width, rngs=rngs, **kwargs)
