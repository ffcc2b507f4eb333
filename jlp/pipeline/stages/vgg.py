"""The VGG stage rule (vgg19).

Units: every conv+BN+ReLU group of `features` (a max pool joins the group before it), head
(pool + classifier).

Default: the conv groups evenly, head with stage S-1.
"""

from __future__ import annotations

import functools

from flax import nnx

from jlp.models.vgg import VGG
from jlp.pipeline.stages.base import StageRule, Unit, _body_split, _pool_linear


def _run_paths(mods, x, *, paths: tuple[str, ...]):
  for path in paths:
    x = mods[path](x)
  return x


def _vgg_units(model: VGG) -> list[Unit]:
  groups: list[list[str]] = []
  for i, layer in enumerate(model.features):
    if isinstance(layer, nnx.Conv) or not groups:
      groups.append([])
    groups[-1].append(f"features/{i}")
  units = [Unit(f"features/{g[0].split('/')[1]}", tuple(g),
                functools.partial(_run_paths, paths=tuple(g))) for g in groups]
  units.append(Unit("head", ("classifier",), functools.partial(_pool_linear, path="classifier")))
  return units


def _vgg_default(model, num_units, num_stages):
  del model
  return _body_split(num_units, num_stages, lead=0)


RULE = StageRule(VGG, ("vgg19",), _vgg_units, _vgg_default,
                 "every conv+BN+ReLU(+pool) group, head; groups evenly")
