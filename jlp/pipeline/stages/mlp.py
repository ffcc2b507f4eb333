"""The MLP stage rule (mlp).

Units: fc/0 (flatten + Linear + ReLU), fc/1, ..., head; one per GEMM layer. Defaults: the units
split evenly (`_even`), e.g. the default three hidden layers at S=2 (2, 2), at S=4 all ones.
"""

from __future__ import annotations

import functools

import jax

from jlp.models.mlp import MLP
from jlp.pipeline.stages.base import StageRule, Unit, _even


def _hidden(mods, x, *, path: str, flatten: bool):
  if flatten:
    x = x.reshape(x.shape[0], -1)
  return jax.nn.relu(mods[path](x))


def _head(mods, x):
  return mods["head"](x)


def _mlp_units(model: MLP) -> list[Unit]:
  units = [Unit(f"fc/{i}", (f"fc/{i}",), functools.partial(_hidden, path=f"fc/{i}",
                                                           flatten=i == 0))
           for i in range(len(model.fc))]
  if not units:
    return [Unit("head", ("head",), lambda mods, x: _head(mods, x.reshape(x.shape[0], -1)))]
  return units + [Unit("head", ("head",), _head)]


def _mlp_default(model, num_units, num_stages):
  del model
  return tuple(_even(num_units, num_stages))


RULE = StageRule(MLP, ("mlp",), _mlp_units, _mlp_default,
                 "fc/0, ..., fc/{n-1}, head; units split evenly")
