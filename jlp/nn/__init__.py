"""Flax NNX integration: per-layer quantization rules and BFPsim presets.

  quantize_model(model, rules, rngs=None) -> QuantReport   (jlp.nn.rules)
  load_bfpsim_preset(path_or_dict_or_name) -> [QuantRule]   (jlp.nn.bfpsim)

BFP training controls live in `jlp.nn.zse` and `jlp.nn.controller`.
"""

from jlp.nn.bfpsim import PRESETS, bfpsim_to_path, load_bfpsim_preset
from jlp.nn.rules import (KINDS, QConv, QDotGeneral, QEinsum, QuantReport, QuantRule, layer_kind,
                          quantize_model, unquantize_model)

__all__ = [
    "KINDS",
    "PRESETS",
    "QConv",
    "QDotGeneral",
    "QEinsum",
    "QuantReport",
    "QuantRule",
    "bfpsim_to_path",
    "layer_kind",
    "load_bfpsim_preset",
    "quantize_model",
    "unquantize_model",
]
