"""The digits CNN stage rule (small_cnn).

Units: conv1, bn1+ReLU, conv2, bn2+ReLU, head (pool + linear); its three natural layers are too
few for S=4, so BatchNorm is a unit of its own.

Defaults: S=1 (5), S=2 (2, 3) [conv layer 1 | conv layer 2 + head], S=3 (2, 2, 1),
S=4 (2, 1, 1, 1) [conv1+bn1 | conv2 | bn2 | head], S=5 all ones.
"""

from __future__ import annotations

import functools

import jax

from jlp.models.small_cnn import SmallCNN
from jlp.pipeline.stages.base import StageRule, Unit, _pool_linear


def _call(mods, x, *, path: str, relu: bool = False):
  y = mods[path](x)
  return jax.nn.relu(y) if relu else y


def _small_cnn_units(model: SmallCNN) -> list[Unit]:
  del model
  return [
      Unit("conv1", ("conv1",), functools.partial(_call, path="conv1")),
      Unit("bn1", ("bn1",), functools.partial(_call, path="bn1", relu=True)),
      Unit("conv2", ("conv2",), functools.partial(_call, path="conv2")),
      Unit("bn2", ("bn2",), functools.partial(_call, path="bn2", relu=True)),
      Unit("head", ("linear",), functools.partial(_pool_linear, path="linear")),
  ]


_SMALL_CNN_DEFAULTS = {1: (5,), 2: (2, 3), 3: (2, 2, 1), 4: (2, 1, 1, 1), 5: (1, 1, 1, 1, 1)}


def _small_cnn_default(model, num_units, num_stages):
  del model, num_units
  return _SMALL_CNN_DEFAULTS[num_stages]


RULE = StageRule(SmallCNN, ("small_cnn",), _small_cnn_units, _small_cnn_default,
                 "conv1, bn1, conv2, bn2, head; S=2 (2, 3), S=4 (2, 1, 1, 1)")
