"""What a stage rule is made of: `Unit`, `StageRule`, and the helpers the family rules share.

A family module (`resnet`, `bert`, `small_cnn`, `vgg`) cuts its model into `Unit`s and picks the
default boundaries with `_body_split`; `jlp.pipeline.stages.split` registers its `StageRule` in
`STAGE_RULES` and builds the stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

#: unit.apply(modules, x) -> y, with modules = {module path: the stage's merged module}.
UnitFn = Callable[[Mapping[str, nnx.Module], Any], Any]


@dataclasses.dataclass(frozen=True)
class Unit:
  """The smallest piece a stage boundary can fall around.

  Attributes:
    name: e.g. "stem", "layer1/0", "head".
    modules: paths of the submodules the unit owns (its variables travel with its stage).
    apply: (modules by path, x) -> y; the unit's part of the model's forward.
  """
  name: str
  modules: tuple[str, ...]
  apply: UnitFn = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class StageRule:
  """How one model class splits (package docstring; the family module's docstring).

  Attributes:
    model_type: the `jlp.models` class (matched exactly, not subclasses).
    zoo_names: the `jlp.models.MODELS` names that build it.
    units: model -> its units, in forward order.
    default_boundaries: (model, num_units, num_stages) -> units per stage.
    description: one line for error messages and docs.
  """
  model_type: type
  zoo_names: tuple[str, ...]
  units: Callable[[nnx.Module], list[Unit]] = dataclasses.field(repr=False)
  default_boundaries: Callable[[nnx.Module, int, int], tuple[int, ...]] = dataclasses.field(
      repr=False)
  description: str = ""


# --------------------------------------------------------------------------------------------------
# Default partitions
# --------------------------------------------------------------------------------------------------


def _even(count: int, parts: int) -> list[int]:
  """count split into `parts` sizes differing by at most 1; the remainder goes to parts 1, 2, ...
  (part 0 and the last part also carry the stem / head units)."""
  base, extra = divmod(count, parts)
  sizes = [base] * parts
  for i in range(extra):
    sizes[1 + i] += 1
  return sizes


def _body_split(num_units: int, num_stages: int, body: Sequence[int] | None = None,
                lead: int = 1, tail: int = 1) -> tuple[int, ...]:
  """`lead` units + body units + `tail` units: the body split by `body` (or evenly), lead joined to
  stage 0 and tail to the last stage; all units evenly when there are fewer body units than
  stages."""
  count = num_units - lead - tail
  if count < num_stages:
    return tuple(_even(num_units, num_stages))
  sizes = list(body) if body is not None else _even(count, num_stages)
  sizes[0] += lead
  sizes[-1] += tail
  return tuple(sizes)


# --------------------------------------------------------------------------------------------------
# Unit functions shared by families
# --------------------------------------------------------------------------------------------------


def _pool_linear(mods, x, *, path: str):
  """Global average pool over H, W, then the linear layer at `path` (small_cnn, vgg heads)."""
  return mods[path](jnp.mean(x, axis=(1, 2)))
