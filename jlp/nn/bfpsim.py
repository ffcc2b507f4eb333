"""BFPsim layer configs (JSON presets) as jlp quantization rules (docs/bfp.md#presets).

A BFPsim config maps PyTorch module paths prefixed with "net." to BFPConf
entries, plus an optional "default" entry:

  {"name": "ResNet18_FB12",
   "default":   {"fw_bit": 4, "fw_dim": [1, 24, 3, 3], "fi_bit": 4, ...},
   "net.conv1": {"type": "default"}, ...}

BFPsim replaces every torch Conv2d / Linear: a path that is a key with "type"
"default", "torch.nn.Conv2d" or "torch.nn.Linear" keeps the float32 layer; a
path that is a key otherwise becomes BFP with that entry; any other layer uses
"default" if present, else stays float32. `load_bfpsim_preset` turns this into
an ordered `QuantRule` list for `jlp.nn.quantize_model`:

  1. one rule per path key, in file order, whose regex is the escaped jlp path
     ("net." dropped, "." -> "/": "net.layer2.0.shortcut.0" ->
     "layer2/0/shortcut/0", the format of `jlp.models.module_path`; PyTorch
     Sequential indices are the NNX list indices);
  2. a catch-all ".*" rule from "default".

BFP entries become per-kind rules {"conv": GemmQuant.from_bfpsim(e, kind="conv"),
"linear": GemmQuant.from_bfpsim(e, kind="linear")} (OIHW/NCHW group shapes
permuted to HWIO/NHWC, (out, in)/(B, F) to (in, out)/(B, F)), so they apply to
nnx.Conv and nnx.Linear / LinearGeneral layers only, as BFPsim applies to Conv2d
and Linear; nnx.Einsum layers are left alone. A kind the entry cannot express
(e.g. 2-D dims on a conv) is left out of that rule.

Extra top-level keys whose value is not a dict ("name", ...) are ignored.
Unknown keys inside an entry, and dict-valued top-level keys that are neither
"default" nor "net.<path>", are a ValueError naming them. String dims (old
BFPsim configs) are not supported (ValueError from GemmQuant.from_bfpsim).

`PRESETS` holds the presets of BFPsim's conf_net/ at HEAD (docs/bfp.md#presets) as
Python data; `load_bfpsim_preset("ResNet18_FB12")` loads one by name.

Reference: Noh et al., "FlexBlock: A Flexible DNN Training Accelerator with
Multi-Mode Block Floating Point Support", IEEE Trans. Computers 72(9), 2023;
BFPsim (IDSLab-KU/BFPsim) bfp/functions.py, conf_net/*.json.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any, Mapping

from jlp.gemm.config import BFPSIM_ROLES, GemmQuant
from jlp.nn.rules import QuantRule

__all__ = ["FP32_TYPES", "PRESETS", "bfpsim_to_path", "load_bfpsim_preset"]

#: An entry with one of these "type"s keeps the float32 layer.
FP32_TYPES = ("default", "torch.nn.Conv2d", "torch.nn.Linear")

_ENTRY_KEYS = frozenset({"type"}) | frozenset(
    k + s for k in BFPSIM_ROLES for s in ("", "_bit", "_dim"))


def bfpsim_to_path(key: str) -> str:
  """BFPsim key -> jlp layer path: "net.layer1.0.conv1" -> "layer1/0/conv1"."""
  if key.startswith("net."):
    key = key[len("net."):]
  return key.replace(".", "/")


def _check_entry(name: str, entry: Any) -> None:
  if not isinstance(entry, Mapping):
    raise ValueError(f"BFPsim preset entry {name!r}={entry!r} is not allowed; expected a dict.")
  unknown = sorted(str(k) for k in entry if k not in _ENTRY_KEYS)
  if unknown:
    raise ValueError(f"BFPsim preset entry {name!r} has unknown key {unknown[0]!r}; expected keys "
                     f"among {', '.join(sorted(_ENTRY_KEYS))}.")


def _entry_rule(name: str, regex: str, entry: Mapping[str, Any], rounding: str) -> QuantRule:
  _check_entry(name, entry)
  if entry.get("type") in FP32_TYPES:
    return QuantRule(regex, None, name=name)
  cfgs, errors = {}, []
  for kind in ("conv", "linear"):
    try:
      cfgs[kind] = GemmQuant.from_bfpsim(entry, kind=kind, rounding=rounding)
    except ValueError as e:
      errors.append(f"{kind}: {e}")
  if not cfgs:
    raise ValueError(f"BFPsim preset entry {name!r} fits neither a conv nor a linear layer: "
                     + "; ".join(errors))
  return QuantRule(regex, cfgs, name=name)


def load_bfpsim_preset(path_or_dict: str | os.PathLike | Mapping[str, Any], *,
                       rounding: str = "truncate") -> list[QuantRule]:
  """BFPsim config -> ordered QuantRules (exact paths first, then "default" as ".*").

  Args:
    path_or_dict: a config dict, the name of a built-in preset (`PRESETS`), or
      the path of a BFPsim JSON file.
    rounding: the BFPFormat rounding ("truncate" is BFPsim's).

  Returns:
    Rules for `jlp.nn.quantize_model`; each rule's `name` is the BFPsim key.

  Raises:
    ValueError: an unknown key in an entry, an unknown dict-valued top-level key,
      an entry that translates to no layer kind, a config that is not a dict.
  """
  if isinstance(path_or_dict, Mapping):
    conf = path_or_dict
  elif isinstance(path_or_dict, str) and path_or_dict in PRESETS:
    conf = PRESETS[path_or_dict]
  else:
    with open(path_or_dict) as f:
      conf = json.load(f)
  if not isinstance(conf, Mapping):
    raise ValueError(f"BFPsim preset {type(conf).__name__} is not allowed; expected a JSON object.")
  rules = []
  for key, entry in conf.items():
    if key == "default":
      continue
    if not isinstance(entry, Mapping):
      continue  # metadata such as "name"
    if not (isinstance(key, str) and key.startswith("net.")):
      raise ValueError(f"BFPsim preset has unknown key {key!r}; expected 'default', 'net.<module "
                       "path>' or non-dict metadata such as 'name'.")
    rules.append(_entry_rule(key, re.escape(bfpsim_to_path(key)), entry, rounding))
  if "default" in conf:
    rules.append(_entry_rule("default", ".*", conf["default"], rounding))
  return rules


# ----------------------------------------------------------------------------- presets


def _modes(fwd: tuple[int, list[int]], wg: tuple[int, list[int]], lg: tuple[int, list[int]],
           bio_dim: list[int] | None = None) -> dict[str, Any]:
  """The six operand keys BFPsim's presets set: fw/fi, bwo/bwi (WG), biw/bio (LG)."""
  e = {}
  for keys, (bit, dim) in ((("fw", "fi"), fwd), (("bwo", "bwi"), wg), (("biw", "bio"), lg)):
    for k in keys:
      e[f"{k}_bit"] = bit
      e[f"{k}_dim"] = list(dim)
  if bio_dim is not None:
    e["bio_dim"] = list(bio_dim)
  return e


_FB12 = (4, [1, 24, 3, 3])
_FB16 = (8, [1, 12, 3, 3])
_FB24 = (16, [1, 6, 3, 3])

# ResNet18_* exclusions: stem, shortcut / downsample 1x1 convs of layer{2,3,4} block 0, classifier.
_RESNET18_FP32 = ["net.conv1"]
for _n in (2, 3, 4):
  _RESNET18_FP32 += [f"net.layer{_n}.0.downsample", f"net.layer{_n}.0.downsample.0",
                     f"net.layer{_n}.0.shortcut.0"]
_RESNET18_FP32 += ["net.linear", "net.fc"]


def _resnet18(name: str, default: dict[str, Any]) -> dict[str, Any]:
  conf: dict[str, Any] = {"name": name, "default": default}
  for k in _RESNET18_FP32:
    conf[k] = {"type": "default"}
  return conf


def _default(name: str, default: dict[str, Any]) -> dict[str, Any]:
  return {"name": name, "default": default}


_PRESET_DATA = {
    "ResNet18_FB12": _resnet18("ResNet18_FB12", _modes(_FB12, _FB12, _FB12)),
    "ResNet18_FB12LG16": _resnet18("ResNet18_FB12LG16", _modes(_FB12, _FB12, _FB16)),
    "ResNet18_FB12LG24": _resnet18("ResNet18_FB12LG24", _modes(_FB12, _FB12, _FB24)),
    "ResNet18_FB16": _resnet18("ResNet18_FB16", _modes(_FB16, _FB16, _FB16)),
    "ResNet18_FB16LG24": _resnet18("ResNet18_FB16LG24", _modes(_FB16, _FB16, _FB24)),
    "ResNet18_FB24": _resnet18("ResNet18_FB24", _modes(_FB24, _FB24, _FB24)),
    "test": _resnet18("test", _modes(_FB24, _FB24, _FB24)),
    "default_FB12": _default("default_FB12", _modes(_FB12, _FB12, _FB12)),
    "default_FB12LG16": _default("default_FB12LG16", _modes(_FB12, _FB12, _FB16)),
    "default_FB12LG24": _default("default_FB12LG24", _modes(_FB12, _FB12, _FB24)),
    "default_FB16": _default("default_FB16", _modes(_FB16, _FB16, _FB16)),
    # BFPsim's default_FB24 has the bio_dim typo [1,612,3,3] (= the whole channel axis); kept verbatim.
    "default_FB24": _default("default_FB24", _modes(_FB24, _FB24, _FB24, bio_dim=[1, 612, 3, 3])),
}


class _Presets(dict):
  """name -> BFPsim config dict; every lookup returns a fresh deep copy."""

  def __getitem__(self, name):
    return copy.deepcopy(dict.__getitem__(self, name))

  def get(self, name, default=None):
    return self[name] if name in self else default

  def values(self):
    return [self[k] for k in self]

  def items(self):
    return [(k, self[k]) for k in self]


#: BFPsim conf_net/ presets at HEAD (docs/bfp.md#presets) as config dicts.
PRESETS: Mapping[str, dict[str, Any]] = _Presets(_PRESET_DATA)
