"""VGG with BatchNorm for CIFAR (kuangliu's pytorch-cifar `VGG('VGG19')`), Flax NNX, NHWC.

features: for each entry of the config, a number c -> Conv3x3(c, padding 1, bias) + BatchNorm + ReLU,
"M" -> MaxPool 2; then kuangliu's AvgPool2d(1, 1) (a no-op, omitted), flatten and
classifier = Linear(last channels -> classes). `features` is a list holding the parameter-free ReLU
and MaxPool modules too, so the indices equal PyTorch's nn.Sequential indices: "features/0" is the
first conv, "features/1" its BatchNorm, "features/2" the ReLU, ..., "classifier" the head.
With 5 poolings the spatial size must be a multiple of 32 (32x32 CIFAR -> 1x1); any other
remainder is averaged (global average pooling) before the classifier.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from jlp.models.resnet import MaxPool, ReLU, batch_norm, conv2d, linear, run_sequence

__all__ = ["CFG", "VGG", "vgg19"]

CFG = {
    "VGG11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "VGG13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "VGG16": [
        64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"
    ],
    "VGG19": [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        512,
        "M",
    ],
}  # fmt: skip


class VGG(nnx.Module):
  """VGG-BN. `cfg`: a name of CFG or a list; `width`: channels of the first conv (64 = paper;
    every conv is scaled by width/64, at least 1 channel)."""

  def __init__(
      self,
      cfg: str | Sequence = "VGG19",
      num_classes: int = 10,
      *,
      width: int = 64,
      in_channels: int = 3,
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    if isinstance(cfg, str):
      if cfg not in CFG:
        raise ValueError(f"unknown VGG config {cfg!r}; expected one of {sorted(CFG)}")
      cfg = CFG[cfg]
    layers = []
    c_in = in_channels
    for v in cfg:
      if v == "M":
        layers.append(MaxPool(2))
      else:
        c = max(int(v) * width // 64, 1)
        layers.append(conv2d(c_in, c, 3, 1, bias=True, init="torch", rngs=rngs))
        layers.append(batch_norm(c, use_running_average=use_running_average, rngs=rngs))
        layers.append(ReLU())
        c_in = c
    self.features = nnx.List(layers)
    self.classifier = linear(c_in, num_classes, rngs=rngs)

  def __call__(self, x):
    x = run_sequence(self.features, x)
    x = jnp.mean(x, axis=(1, 2))  # 1x1 for 32x32 inputs: a flatten
    return self.classifier(x)


def vgg19(num_classes: int = 10, *, width: int = 64, rngs: nnx.Rngs | None = None, **kwargs) -> VGG:
  """VGG19-BN for CIFAR (kuangliu); 20,040,522 parameters at width 64, 10 classes."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return VGG("VGG19", num_classes, width=width, rngs=rngs, **kwargs)
