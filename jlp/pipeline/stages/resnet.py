"""The ResNet stage rule (resnet18, resnet50; any stem).

Units: stem (conv1+bn1+ReLU [+max pool], or the deep stem), every residual block ("layer1/0",
...), head (global average pool + fc/linear).

Default: the blocks split evenly over the stages (a remainder to stages 1, 2, ...), stem with
stage 0, head with stage S-1. ResNet-50 at S=4: blocks [4, 4, 4, 4], the seed's
`get_resnet_partition`, i.e. boundaries (5, 4, 4, 5).

With `bfpsim_inplace_fi` (jlp.nn.inplace_fi) the quantization of a block's input for its conv1
runs at the start of that block's unit (the model runs it at the end of the producer; the value
and its gradient are the same, and the conv it reads belongs to the consuming stage).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jlp.models.resnet import ReLU, ResNet
from jlp.nn.inplace_fi import quantize_for_conv
from jlp.pipeline.stages.base import StageRule, Unit, _body_split


def _resnet_stem(mods, x, *, stem_type: str, inplace: bool):
  if stem_type == "deep":
    prev = None
    for layer in mods["stem"]:
      if inplace and isinstance(layer, nnx.Conv) and prev is not None:
        x = quantize_for_conv(layer, x, after_relu=isinstance(prev, ReLU))
      x = layer(x)
      prev = layer
    return mods["maxpool"](x)
  x = jax.nn.relu(mods["bn1"](mods["conv1"](x)))
  return mods["maxpool"](x) if stem_type == "imagenet" else x


def _resnet_block(mods, x, *, path: str, inplace: bool, after_relu: bool):
  block = mods[path]
  if inplace:
    x = quantize_for_conv(block.conv1, x, after_relu=after_relu)
  return block(x)


def _resnet_head(mods, x, *, name: str | None):
  if name is None:  # headless backbone: the model returns the last stage's map
    return x
  return mods[name](jnp.mean(x, axis=(1, 2)))


def _resnet_units(model: ResNet) -> list[Unit]:
  stem_type, inplace = model.stem_type, bool(model.bfpsim_inplace_fi)
  stem = {"cifar": ("conv1", "bn1"), "imagenet": ("conv1", "bn1", "maxpool"),
          "deep": ("stem", "maxpool")}[stem_type]
  units = [Unit("stem", stem, functools.partial(_resnet_stem, stem_type=stem_type,
                                                inplace=inplace))]
  for i in range(1, 5):
    for j in range(len(getattr(model, f"layer{i}"))):
      path = f"layer{i}/{j}"
      # The model quantizes the first block's input after the stem's ReLU (cifar) or max pool.
      after_relu = len(units) > 1 or stem_type == "cifar"
      units.append(Unit(path, (path,), functools.partial(_resnet_block, path=path,
                                                         inplace=inplace, after_relu=after_relu)))
  name = model.classifier_name if getattr(model, model.classifier_name) is not None else None
  units.append(Unit("head", () if name is None else (name,),
                    functools.partial(_resnet_head, name=name)))
  return units


def _resnet_default(model, num_units, num_stages):
  del model
  return _body_split(num_units, num_stages)


RULE = StageRule(ResNet, ("resnet18", "resnet50"), _resnet_units, _resnet_default,
                 "stem, every residual block, head; blocks evenly (ResNet-50 S=4: [4, 4, 4, 4])")
