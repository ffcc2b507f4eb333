"""Flax NNX integration: per-layer quantization rules and BFPsim presets.

  quantize_model(model, rules, rngs=None) -> QuantReport   (jlp.nn.rules)
  load_bfpsim_preset(path_or_dict_or_name) -> [QuantRule]   (jlp.nn.bfpsim)
  recipe_rules(name, model, *example) -> [QuantRule]         (jlp.nn.recipes: TE's NVFP4 and
                                                               MXFP8, MXFP4, DeepSeek-V3 FP8,
                                                               TE's per-tensor current and
                                                               delayed scaling)

BFPsim compatibility: quantize_model(..., bfpsim_inplace_fi=True) reproduces the side effect of
BFPsim's in-place input quantization on the zoo's ResNets (jlp.nn.inplace_fi).

BFP training controls: traced per-layer widths (set_widths / get_widths), per-layer
zero-setting errors as metrics (bfp_zse_metrics), and `jlp.nn.zse` / `jlp.nn.controller`.

FP8 delayed scaling ("fp8_delayed"): per-layer amax histories and scales as `Fp8Meta` model state,
written back from their gradients by `overwrite_fp8_meta` (jlp.nn.fp8_delayed; `jlp.train.TrainStep`
does it itself).
"""

from jlp.nn.bfpsim import PRESETS, bfpsim_to_path, load_bfpsim_preset
from jlp.nn.fp8_delayed import Fp8Meta, overwrite_fp8_meta
from jlp.nn.recipes import RECIPES, gemm_call_order, recipe_gemm, recipe_rules
from jlp.nn.rules import (KINDS, BFPWidths, QConv, QDotGeneral, QEinsum, QuantReport, QuantRule,
                          ZSEProbe, bfp_zse_metrics, get_widths, layer_kind, quantize_model,
                          set_widths, unquantize_model)

__all__ = [
    "BFPWidths",
    "Fp8Meta",
    "KINDS",
    "PRESETS",
    "RECIPES",
    "QConv",
    "QDotGeneral",
    "QEinsum",
    "QuantReport",
    "QuantRule",
    "ZSEProbe",
    "bfp_zse_metrics",
    "bfpsim_to_path",
    "gemm_call_order",
    "get_widths",
    "layer_kind",
    "load_bfpsim_preset",
    "overwrite_fp8_meta",
    "quantize_model",
    "recipe_gemm",
    "recipe_rules",
    "set_widths",
    "unquantize_model",
]
