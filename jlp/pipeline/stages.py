"""Split a `jlp.models` NNX network into S pipeline stages, pure functions (sdpipe.md §0, §1).

A model is cut into a sequence of *units* (per-model rules, `STAGE_RULES`); stage s runs a
contiguous group of `boundaries[s]` units. Each stage is a pure, jittable function

    stage_s(params_s, x, state_s) -> (y, new_state_s)

over the variables of the modules its units own:

  params_s  {"<module path>/<variable>": float32 array} of the stage's `nnx.Param`s, e.g.
            "layer1/0/conv1/kernel" (paths as `jlp.models.module_path`, list indices in decimal);
  state_s   the same for every other variable of those modules: BatchNorm running stats,
            Dropout / stochastic-rounding RNG streams (typed PRNG keys as their uint32
            `jax.random.key_data`, re-wrapped inside the stage), RNG counters, BFP widths, ZSE
            probes; {} for a stage without any.

The stage merges its own modules (one NNX graph per stage, so quantized layers keep their
`jlp.nn` adapters and their state), runs its units in train mode (BatchNorm normalises with batch
statistics and updates its running stats; Dropout draws from the stage's RNG streams) and returns
the updated state. Stage 0 takes what the model takes (NHWC float32 images; BERT: below); stage
S-1 returns the logits; in between the values are float32 arrays or tuples of them. Composing the
stages is the model's own train-mode forward, op for op: the same ops in the same order on the same
values, so eager composition equals `model(x)` bit for bit, and the new state equals the model's
(tests/pipeline/stages_test.py). `StageSplit.merge(params, state)` rebuilds the whole model.

Units and default boundaries (`boundaries` counts units, stem and head included):

  ResNet (resnet18, resnet50; any stem)  units: stem (conv1+bn1+ReLU [+max pool], or the deep
        stem), every residual block ("layer1/0", ...), head (global average pool + fc/linear).
        Default: the blocks split evenly over the stages (a remainder to stages 1, 2, ...), stem
        with stage 0, head with stage S-1. ResNet-50 at S=4: blocks [4, 4, 4, 4], the seed's
        `get_resnet_partition` (sdpipe.md §0), i.e. boundaries (5, 4, 4, 5).
        With `bfpsim_inplace_fi` (jlp.nn.inplace_fi) the quantization of a block's input for its
        conv1 runs at the start of that block's unit (the model runs it at the end of the
        producer; the value and its gradient are the same, and the conv it reads belongs to the
        consuming stage).
  Bert (bert_small)  units: embeddings, every encoder layer ("layers/0", ...), head (pooler +
        dropout + classifier). Default: 12 layers at S=4 -> layers [2, 4, 4, 2] (the seed's
        BERT-base partition, `train_bert.py`); otherwise the layers split evenly as for ResNet
        (bert_small's 4 layers: [2, 2] for S=2, [1, 1, 1, 1] for S=4).
        Stage 0 takes the token ids as `jlp.data.text` batches hold them (batch["image"], int
        (B, T); what the train step's `model(batch["image"])` passes), or a mapping with
        "input_ids" (or "image") and optional "token_type_ids" and "attention_mask". Between
        stages: (hidden (B, T, H) float32, attention mask (B, T) float32: 1 = attend). The mask
        is `attention_mask`, else `input_ids != pad_id` when the model has a pad_id (as
        `Bert.encode`), else all ones (where(1, s, min) = s: the same scores as no mask).
  SmallCNN (small_cnn)  units: conv1, bn1+ReLU, conv2, bn2+ReLU, head (pool + linear); its three
        natural layers are too few for S=4, so BatchNorm is a unit of its own. Defaults:
        S=1 (5), S=2 (2, 3) [conv layer 1 | conv layer 2 + head], S=3 (2, 2, 1),
        S=4 (2, 1, 1, 1) [conv1+bn1 | conv2 | bn2 | head], S=5 all ones.
  VGG (vgg19)  units: every conv+BN+ReLU group of `features` (a max pool joins the group before
        it), head (pool + classifier). Default: the conv groups evenly, head with stage S-1.

Errors (ValueError): a model type without a rule (lists the supported ones), num_stages not an
integer from 1 to the unit count, boundaries not num_stages integers >= 1 summing to the unit
count, a variable shared between modules of different stages.

Quantize before splitting (`jlp.nn.quantize_model(model, rules)`, then `split_model`): the split
works on a copy of the model (`nnx.clone`, switched to train mode), so later changes to `model`
do not reach the stages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlp.models.bert import Bert
from jlp.models.resnet import ReLU, ResNet
from jlp.models.small_cnn import SmallCNN
from jlp.models.vgg import VGG
from jlp.nn.inplace_fi import quantize_for_conv

__all__ = ["STAGE_RULES", "Stage", "StageRule", "StageSplit", "Unit", "split_model"]

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
  """How one model class splits (module docstring).

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
# ResNet
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# BERT
# --------------------------------------------------------------------------------------------------

_BERT_KEYS = ("input_ids", "image")


def _bert_embeddings(mods, x, *, pad_id: int | None):
  token_type_ids = attention_mask = None
  if isinstance(x, Mapping):
    key = next((k for k in _BERT_KEYS if k in x), None)
    if key is None:
      raise ValueError(f"BERT stage 0 input keys={sorted(x)!r} are not allowed; expected "
                       f"'input_ids' (or 'image') and optionally 'token_type_ids', "
                       f"'attention_mask'.")
    ids = x[key]
    token_type_ids, attention_mask = x.get("token_type_ids"), x.get("attention_mask")
  else:
    ids = x
  if attention_mask is None and pad_id is not None:
    attention_mask = ids != pad_id
  if attention_mask is None:
    mask = jnp.ones(ids.shape, jnp.float32)
  else:
    mask = jnp.asarray(attention_mask).astype(jnp.float32)
  return mods["embeddings"](ids, token_type_ids), mask


def _bert_layer(mods, x, *, path: str):
  hidden, mask = x
  return mods[path](hidden, mask), mask


def _bert_head(mods, x):
  hidden, _ = x
  pooled = jnp.tanh(mods["pooler"](hidden[:, 0]))
  return mods["classifier"](mods["dropout"](pooled))


def _bert_units(model: Bert) -> list[Unit]:
  units = [Unit("embeddings", ("embeddings",),
                functools.partial(_bert_embeddings, pad_id=model.pad_id))]
  for i in range(len(model.layers)):
    path = f"layers/{i}"
    units.append(Unit(path, (path,), functools.partial(_bert_layer, path=path)))
  units.append(Unit("head", ("pooler", "dropout", "classifier"), _bert_head))
  return units


def _bert_default(model, num_units, num_stages):
  body = (2, 4, 4, 2) if len(model.layers) == 12 and num_stages == 4 else None
  return _body_split(num_units, num_stages, body)


# --------------------------------------------------------------------------------------------------
# Small CNN and VGG
# --------------------------------------------------------------------------------------------------


def _call(mods, x, *, path: str, relu: bool = False):
  y = mods[path](x)
  return jax.nn.relu(y) if relu else y


def _pool_linear(mods, x, *, path: str):
  return mods[path](jnp.mean(x, axis=(1, 2)))


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


#: Model class name -> its split rule (module docstring).
STAGE_RULES: dict[str, StageRule] = {
    "ResNet": StageRule(ResNet, ("resnet18", "resnet50"), _resnet_units, _resnet_default,
                        "stem, every residual block, head; blocks evenly (ResNet-50 S=4: "
                        "[4, 4, 4, 4])"),
    "Bert": StageRule(Bert, ("bert_small",), _bert_units, _bert_default,
                      "embeddings, every encoder layer, head; 12 layers at S=4: [2, 4, 4, 2], "
                      "else layers evenly"),
    "SmallCNN": StageRule(SmallCNN, ("small_cnn",), _small_cnn_units, _small_cnn_default,
                          "conv1, bn1, conv2, bn2, head; S=2 (2, 3), S=4 (2, 1, 1, 1)"),
    "VGG": StageRule(VGG, ("vgg19",), _vgg_units, _vgg_default,
                     "every conv+BN+ReLU(+pool) group, head; groups evenly"),
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
  """stage(params, x, state) -> (y, new_state): one pipeline stage (module docstring)."""

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
  """A model cut into S stages (module docstring).

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
  """Cut `model` into `num_stages` pure stage functions (module docstring).

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
