"""`split_model` and what it builds: the `STAGE_RULES` registry, `Stage`, `StageSplit`.

`STAGE_RULES` gathers the family rules (`resnet`, `bert`, `small_cnn`, `vgg`, `mlp`); `split_model`
looks the model's class up there, cuts its units into stages, and gives every stage its own NNX
graph with its variables as flat dicts (`_slots`, `_to_flat`, `_from_flat`; the contract is in
the `jlp.pipeline.stages` docstring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlp.pipeline.stages import bert, mlp, resnet, small_cnn, vgg
from jlp.pipeline.stages.base import StageRule, Unit

#: Model class name -> its split rule (the family modules).
STAGE_RULES: dict[str, StageRule] = {
    rule.model_type.__name__: rule
    for rule in (resnet.RULE, bert.RULE, small_cnn.RULE, vgg.RULE, mlp.RULE)
}


# --------------------------------------------------------------------------------------------------
# Flat variable dicts
# --------------------------------------------------------------------------------------------------


def _is_key(value: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(value), jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True, eq=False)
class _Slot:
  """One variable: its path in the stage graph, its flat key, a template Variable (type and
  metadata) and the PRNG implementation when it holds a typed key."""
  graph_path: tuple
  key: str
  template: nnx.Variable
  key_impl: Any = None


def _slots(state: nnx.State, key_of: Callable[[tuple], str]) -> list[_Slot]:
  """The variables of `state`; templates hold only shapes (no reference to the values)."""
  out = []
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    impl = jax.random.key_impl(value) if _is_key(value) else None
    template = var.replace(value=jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value)))
    out.append(_Slot(tuple(path), key_of(tuple(path)), template, impl))
  return out


def _to_flat(slots: Sequence[_Slot], state: nnx.State) -> dict[str, jax.Array]:
  """State -> {key: plain array} (typed keys as key data), in the order of `slots`."""
  by_path = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}
  out = {}
  for slot in slots:
    value = by_path[slot.graph_path]
    out[slot.key] = jax.random.key_data(value) if slot.key_impl is not None else value
  return out


def _from_flat(slots: Sequence[_Slot], values: Mapping[str, Any], what: str) -> nnx.State:
  """{key: plain array} -> State (typed keys re-wrapped)."""
  missing = [s.key for s in slots if s.key not in values]
  if missing:
    raise ValueError(f"{what} misses {missing[:3]!r}{' ...' if len(missing) > 3 else ''}; "
                     "expected the keys of StageSplit.params / StageSplit.state.")
  flat = []
  for slot in slots:
    value = values[slot.key]
    if slot.key_impl is not None:
      value = jax.random.wrap_key_data(value, impl=slot.key_impl)
    flat.append((slot.graph_path, slot.template.replace(value=value)))
  return nnx.from_flat_state(flat)


def _path_str(path: Sequence[Any]) -> str:
  return "/".join(str(p) for p in path)


def _submodule(model: nnx.Module, path: str) -> nnx.Module:
  node = model
  for part in path.split("/"):
    node = node[int(part)] if part.isdigit() else getattr(node, part)
  return node


# --------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------


class _StageModules(nnx.Module):
  """The submodules one stage owns, as one NNX graph (sharing inside the stage is kept)."""

  def __init__(self, modules: list[nnx.Module]):
    self.modules = nnx.List(modules)


class Stage:
  """stage(params, x, state) -> (y, new_state): one pipeline stage (package docstring)."""

  def __init__(self, index: int, units: Sequence[Unit], graphdef: nnx.GraphDef,
               param_slots: list[_Slot], state_slots: list[_Slot]):
    self.index = index
    self.units = tuple(units)
    self.module_paths = tuple(p for u in self.units for p in u.modules)
    self._graphdef = graphdef
    self._param_slots = param_slots
    self._state_slots = state_slots

  @classmethod
  def build(cls, index: int, units: Sequence[Unit], model: nnx.Module
            ) -> tuple[Stage, dict[str, jax.Array], dict[str, jax.Array]]:
    """(the stage running `units` of `model`, its initial params, its initial state)."""
    paths = tuple(p for u in units for p in u.modules)
    container = _StageModules([_submodule(model, p) for p in paths])
    graphdef, params, state = nnx.split(container, nnx.Param, ...)
    # Container path ('modules', k, *rest) -> "<module path k>/<rest>".
    key_of = lambda path: _path_str((paths[path[1]],) + tuple(path[2:]))
    param_slots, state_slots = _slots(params, key_of), _slots(state, key_of)
    stage = cls(index, units, graphdef, param_slots, state_slots)
    return stage, _to_flat(param_slots, params), _to_flat(state_slots, state)

  @property
  def unit_names(self) -> tuple[str, ...]:
    return tuple(u.name for u in self.units)

  def __call__(self, params: Mapping[str, jax.Array], x: Any,
               state: Mapping[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
    container = nnx.merge(self._graphdef,
                          _from_flat(self._param_slots, params, f"stage {self.index} params"),
                          _from_flat(self._state_slots, state, f"stage {self.index} state"))
    mods = dict(zip(self.module_paths, container.modules))
    for unit in self.units:
      x = unit.apply(mods, x)
    _, _, new_state = nnx.split(container, nnx.Param, ...)
    return x, _to_flat(self._state_slots, new_state)

  def __repr__(self) -> str:
    return f"Stage({self.index}, units={list(self.unit_names)})"


@dataclasses.dataclass(frozen=True, eq=False)
class StageSplit:
  """A model cut into S stages (package docstring).

  Attributes:
    stages: S `Stage`s, stage_s(params_s, x, state_s) -> (y, new_state_s).
    params: S flat dicts {"<module path>/<variable>": float32 array}: the nnx.Param values.
    state: S flat dicts of every other variable (typed PRNG keys as uint32 key data).
    boundaries: units per stage.
    unit_names: every unit, in forward order.
    stage_units: the unit names of each stage.
    stage_modules: the module paths each stage owns.
    model_type: the model's class name (a `STAGE_RULES` key).
  """
  stages: tuple[Stage, ...]
  params: list
  state: list
  boundaries: tuple[int, ...]
  unit_names: tuple[str, ...]
  stage_units: tuple[tuple[str, ...], ...]
  stage_modules: tuple[tuple[str, ...], ...]
  model_type: str
  _graphdef: Any = dataclasses.field(repr=False)
  _param_slots: list = dataclasses.field(repr=False)
  _state_slots: list = dataclasses.field(repr=False)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  @property
  def param_counts(self) -> tuple[int, ...]:
    """Parameters (scalars) per stage."""
    return tuple(sum(int(np.prod(np.shape(v))) for v in p.values()) for p in self.params)

  def merge(self, params: Sequence[Mapping[str, jax.Array]],
            state: Sequence[Mapping[str, jax.Array]]) -> nnx.Module:
    """The whole model with these stage values (train mode; `.eval()` for evaluation)."""
    for field, given in (("params", params), ("state", state)):
      if len(given) != self.num_stages:
        raise ValueError(f"{field} with {len(given)} stages is not allowed; expected "
                         f"{self.num_stages}.")
    flat_params = {k: v for p in params for k, v in p.items()}
    flat_state = {k: v for s in state for k, v in s.items()}
    return nnx.merge(self._graphdef, _from_flat(self._param_slots, flat_params, "params"),
                     _from_flat(self._state_slots, flat_state, "state"))


# --------------------------------------------------------------------------------------------------
# split_model
# --------------------------------------------------------------------------------------------------


def _supported() -> str:
  return ", ".join(f"{name} ({', '.join(r.zoo_names)})" for name, r in STAGE_RULES.items())


def _check_boundaries(boundaries: Any, num_stages: int, units: Sequence[Unit],
                      model_type: str) -> tuple[int, ...]:
  allowed = (f"{num_stages} integers >= 1 summing to the {len(units)} units of {model_type} "
             f"({', '.join(u.name for u in units)})")
  if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence):
    raise ValueError(f"boundaries={boundaries!r} is not allowed; expected {allowed}.")
  ok = all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1
           for b in boundaries)
  if not ok or len(boundaries) != num_stages or sum(boundaries) != len(units):
    raise ValueError(f"boundaries={tuple(boundaries)!r} is not allowed; expected {allowed}.")
  return tuple(int(b) for b in boundaries)


def split_model(model: nnx.Module, num_stages: int, *,
                boundaries: Sequence[int] | None = None) -> StageSplit:
  """Cut `model` into `num_stages` pure stage functions (package docstring).

  Args:
    model: a `jlp.models` network whose class has a rule in `STAGE_RULES` (quantized or not);
      not modified.
    num_stages: S, from 1 to the model's unit count.
    boundaries: units per stage (S integers >= 1 summing to the unit count); None: the rule's
      default.

  Returns:
    A `StageSplit` with the stage functions, the initial stage params and state, and `merge`.
  """
  model_type = type(model).__name__
  rule = STAGE_RULES.get(model_type)
  if rule is None or type(model) is not rule.model_type:
    raise ValueError(f"model={model_type} is not allowed; expected one of the supported models: "
                     f"{_supported()}.")
  model = nnx.clone(model)
  model.train()
  units = rule.units(model)
  if (isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer))
      or not 1 <= num_stages <= len(units)):
    raise ValueError(f"num_stages={num_stages!r} is not allowed; expected an integer from 1 to "
                     f"{len(units)} (the units of {model_type}: "
                     f"{', '.join(u.name for u in units)}).")
  num_stages = int(num_stages)
  if boundaries is None:
    boundaries = rule.default_boundaries(model, len(units), num_stages)
  boundaries = _check_boundaries(boundaries, num_stages, units, model_type)

  starts = np.cumsum((0,) + boundaries)
  groups = [units[starts[s]:starts[s + 1]] for s in range(num_stages)]
  built = [Stage.build(s, g, model) for s, g in enumerate(groups)]
  stages = tuple(stage for stage, _, _ in built)
  stage_params = [params for _, params, _ in built]
  stage_state = [state for _, _, state in built]

  graphdef, params, state = nnx.split(model, nnx.Param, ...)
  param_slots = _slots(params, _path_str)
  state_slots = _slots(state, _path_str)
  # Every model variable in exactly one stage: catches rule gaps and cross-stage sharing.
  expected = sorted(s.key for s in param_slots + state_slots)
  got = sorted(k for values in stage_params + stage_state for k in values)
  if got != expected:
    extra = sorted(set(got) - set(expected)) or [k for k in got if got.count(k) > 1]
    missing = sorted(set(expected) - set(got))
    raise ValueError(f"{model_type} cannot be split with boundaries={boundaries}: the stages "
                     f"hold {extra[:3]!r} more and {missing[:3]!r} less than the model's "
                     "variables; expected every variable in exactly one stage (a variable "
                     "shared between stages cannot be split).")
  return StageSplit(
      stages=stages,
      params=stage_params,
      state=stage_state,
      boundaries=boundaries,
      unit_names=tuple(u.name for u in units),
      stage_units=tuple(st.unit_names for st in stages),
      stage_modules=tuple(st.module_paths for st in stages),
      model_type=model_type,
      _graphdef=graphdef,
      _param_slots=param_slots,
      _state_slots=state_slots,
  )
