"""Low-precision training recipes by name: `recipe_rules(name, model, *example)` -> [QuantRule].

Each recipe is one `GemmQuant` (jlp/gemm/config.py) for every `nnx.Linear` and `nnx.Conv` layer
(a per-kind rule: `nnx.Einsum` layers are not matched and stay float32), built from the formats
of `jlp.formats`. Roles not listed below are None: the GEMM outputs (y, wgrad_out, dgrad_out) stay
float32 (the emulation keeps float32 where TransformerEngine (TE) writes BF16), and every GEMM
accumulates in float32 unless `accum` says otherwise.

Block axes. Hardware block scaling runs along each GEMM's contraction (K) axis, and
TransformerEngine quantizes every tensor as a 2-D matrix, its leading axes flattened into rows.
So every block-scaled recipe sets `GemmQuant.matrix_view` (each operand is quantized on its
(prod(leading axes), last axis) view: (B, F), (B*T, F), (N*H*W, C) activations and gradients;
(in, out) and (H*W*I, O) kernels) and gives each operand role its block along the axis its GEMM
contracts:

  x, dgrad_dy   axis -1: the features (channels) of the layer input / of the output gradient
                (TE's rowwise blocks);
  w             axis -2: the kernel's input side: `in` of a dense kernel, the flattened
                (kh, kw, i) of a conv kernel (the K order of the im2col GEMM, i fastest);
  dgrad_w       axis -1: the kernel's output features (out; O);
  wgrad_x, wgrad_dy
                axis -2: the flattened rows (batch, tokens, positions), over which the
                weight-gradient GEMM contracts (TE's columnwise blocks, bit for bit the same
                grouping).

For a conv layer jlp quantizes the input tensor x, not its im2col patches, so x's blocks run
along C. The same GemmQuant therefore serves dense and conv layers. `nnx.LinearGeneral` layers
whose kernel is not 2-D have no such axis: with a `model`, `recipe_rules` keeps them float32 with
a rule of their own. Block lengths need not divide the axes (partial blocks are zero-padded),
except that the Hadamard transform of "nvfp4" needs the rows of the weight-gradient operands
(per-device batch x positions) to be a multiple of 16, as TE requires.

Operands of the backward GEMMs are quantized from the float32 tensors (bwd_from_fwd=False), as TE
quantizes a tensor's rowwise and columnwise copies from the high-precision input ("to avoid
double quantization errors", TE's recipe docs), except for "fp8_current" and "fp8_delayed", whose
per-tensor scales make the transposed FP8 tensor the same values, so the backward GEMMs reuse the
forward ones (bwd_from_fwd=True, dgrad_w = wgrad_x = None; no block axes, so no matrix_view).

Recipes (`RECIPES`):

  "nvfp4": TE's NVFP4BlockScaling (arXiv:2509.25149; TE recipe `NVFP4BlockScaling` defaults):
  (all with matrix_view=True)
      x         NVFP4Format(block=(1, 16), axis=-1)                    nearest
      w         NVFP4Format(block=(16, 16), axis=-2)                   nearest, 2-D tiles
      dgrad_dy  NVFP4Format(block=(1, 16), axis=-1, rounding="stochastic")
      dgrad_w   NVFP4Format(block=(16, 16), axis=-1)                   (the same values as w)
      wgrad_x   NVFP4Format(block=(1, 16), axis=-2, rht=True)          RHT on the wgrad operands
      wgrad_dy  NVFP4Format(block=(1, 16), axis=-2, rounding="stochastic", rht=True)
    and the first and the last GEMM layer stay float32. First and last are the first and the
    last Linear / Conv / Einsum layer *called* when the model runs on the example input
    (`gemm_call_order`, traced abstractly: no FLOPs), not the module order, which sorts
    attribute names (torchvision-style ResNets list `fc` before `layer1`).
  "mxfp8": TE's MXFP8BlockScaling (default fp8_format E4M3): every operand role
      MXFormat("float8_e4m3fn", block=32, axis=<K>, scale_mode="rceil")
    (E8M0 scales rounded up, TE's `float_to_e8m0(amax * max_norm_rcp)`, cuBLAS's rule; TE
    multiplies by fl32(1 / 448) where "rceil" divides by 448, and for E4M3 and E5M2, whose max is
    1.75 · 2^e, the two give the same power of two for every normal amax).
  "mxfp4": MXFP4 with Tseng et al.'s stochastic rounding (arXiv:2502.20586):
      x, w      MXFormat("float4_e2m1fn", block=32, axis=<K>)          OCP scale, nearest
      dgrad_dy, dgrad_w, wgrad_x, wgrad_dy
                MXFormat(E2M1 with rounding="stochastic", block=32, axis=<K>, prescale=0.75)
    Both operands of both backward GEMMs are rounded stochastically after the 3/4 scaling, as
    their reference code quantizes every backward operand (so that the gradient GEMMs are
    unbiased and no element is clipped); the forward is OCP MXFP4 with nearest rounding (Tseng
    et al. keep the forward in BF16 or FP8: here every GEMM is MXFP4, as the recipe's name says).
  "deepseek_fp8": DeepSeek-V3's fine-grained FP8 (arXiv:2412.19437 §3.3):
      x, dgrad_dy, wgrad_x, wgrad_dy
                BlockScaledFormat("float8_e4m3fn", block=(1, 128), axis=<K>)
      w, dgrad_w
                BlockScaledFormat("float8_e4m3fn", block=(128, 128), axis=<K>)
      accum     FloatFormat(8, 13, rounding="truncate"), promote_every=128
    The accumulator models Hopper's FP8 tensor cores, which keep about 14 significant bits
    (§3.3.2: "limited to retaining around 14 bits"): 13 stored mantissa bits with the exponent
    range of float32, truncating each addition (the products are exact in float32); every 128
    products (N_C = 128, §3.3.2) the partial sum is promoted to a float32 accumulator
    (`jlp.gemm.accum`, in all three GEMMs).
    The accumulator model computes every product on its own (`jlp.gemm.accum.matmul`), which
    makes a ResNet18 step about 9 times slower on a CPU; `accumulator=False` keeps the recipe's
    formats with float32 GEMMs (the operands quantized alike), to study the formats alone.
  "fp8_current": TE's Float8CurrentScaling (default HYBRID: E4M3 forward, E5M2 backward):
      x, w      BlockScaledFormat("float8_e4m3fn", block=TENSOR_BLOCK, scale_rule="reciprocal")
      dgrad_dy, wgrad_dy
                BlockScaledFormat("float8_e5m2", block=TENSOR_BLOCK, scale_rule="reciprocal")
      bwd_from_fwd=True
    One scale per tensor from the tensor's own amax: TE's multiplier fp8_max / amax, the FP8
    value of x · multiplier, dequantized by 1 / multiplier (`jlp.numerics.block_scaled`,
    scale_rule "reciprocal"; the "divide" rule of DeepSeek's blocks rounds once where TE rounds
    twice, so the two can differ in a value's last bit). In a data-parallel step every device
    scales its own shard of the activations and gradients. TE fprop's fast accumulation on
    Hopper (use_split_accumulator=False) is not modelled.

  "fp8_delayed": TE's DelayedScaling (defaults: fp8_format HYBRID, amax_history_len 1024,
  amax_compute_algo "max", margin 0; Micikevicius et al., arXiv:2209.05433):
      DelayedScaling()   (`jlp.gemm.fp8_delayed`; reported as x, w e4m3fn, dgrad_dy, wgrad_dy e5m2)
    One scale per tensor (x, w and the output gradient dy), from an amax history that is state of
    the model (`Fp8Meta` variables of each layer's adapter, `jlp.nn.fp8_delayed`): the tensor is
    quantized with the scale of the history *before* this step (q = fp8(clip(t · s)), saturating,
    dequantized by 1 / s), s = fp8_max / max(history) / 2^margin (the old s kept where that amax
    is 0 or not finite; first step s = 1, history 0), E4M3 for x and w, E5M2 for dy; then the
    step's amax is rolled into the history (h' = roll(h, -1), h'[0] = amax) and s recomputed. The
    backward GEMMs use the forward's FP8 x and w (per-tensor scales: the transposed copies are the
    same values). dy's amax is known in the backward pass only: the new histories are the
    "gradients" of the meta variables (Flax's OVERWRITE_WITH_GRADIENT), which
    `jlp.train.TrainStep` writes back (never through the optimizer) after taking the max of the
    histories over the data-parallel devices, as TE all-reduces its amaxes; every device keeps
    the same state. A layer not called in a step keeps its state; one called twice in a step
    (shared weights) is refused. Data-parallel runs only: the pipelined loop refuses it.

References:
  NVIDIA TransformerEngine, transformer_engine/common/recipe/__init__.py (NVFP4BlockScaling,
    MXFP8BlockScaling, Float8CurrentScaling, DelayedScaling), common/recipe/delayed_scaling.cu
    and the low-precision training pages of its user guide.
  Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433, 2022.
  NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, 2025.
  Tseng, Yu, Park, "Training LLMs with MXFP4", arXiv:2502.20586, 2025.
  DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024, §3.3.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from flax import nnx

from jlp.formats import (TENSOR_BLOCK, BlockScaledFormat, FloatFormat, MXFormat, NVFP4Format)
from jlp.gemm.config import GemmQuant
from jlp.gemm.fp8_delayed import DelayedScaling
from jlp.nn.rules import QuantRule, _QuantOp, _hook, _path_str, layer_kind

__all__ = ["RECIPES", "STATEFUL", "UNSUPPORTED", "check_recipe", "gemm_call_order", "recipe_gemm",
           "recipe_rules"]

#: The recipes `recipe_rules` builds (module docstring).
RECIPES = ("nvfp4", "mxfp8", "mxfp4", "deepseek_fp8", "fp8_current", "fp8_delayed")
#: Recipes that are named but not built yet, with the reason (none at present).
UNSUPPORTED: dict[str, str] = {}
#: Recipes whose layers keep state updated by the train step (data-parallel runs only).
STATEFUL = ("fp8_delayed",)
#: Recipes that keep the first and the last GEMM layer in float32 (they need the model and an
#: example input).
FIRST_LAST_FLOAT32 = ("nvfp4",)

# The contraction axis of each operand role (module docstring).
_AXES = {"x": -1, "w": -2, "dgrad_dy": -1, "dgrad_w": -1, "wgrad_x": -2, "wgrad_dy": -2}
_E2M1 = "float4_e2m1fn"


def check_recipe(name: Any, field: str = "name") -> str:
  """`name` if it is a recipe `recipe_rules` builds, else a one-line ValueError naming `field`."""
  if name in UNSUPPORTED:
    raise ValueError(f"{field}={name!r} is not supported yet: {UNSUPPORTED[name]}; expected one of "
                     f"{', '.join(repr(r) for r in RECIPES)}.")
  if name not in RECIPES:
    raise ValueError(f"{field}={name!r} is not allowed; expected one of "
                     f"{', '.join(repr(r) for r in RECIPES)}.")
  return name


def recipe_gemm(name: str, *, accumulator: bool = True) -> GemmQuant:
  """The GemmQuant a recipe gives each quantized Linear / Conv layer (module docstring);
  `accumulator=False` drops the accumulator model ("deepseek_fp8"'s; the other recipes have
  none), leaving float32 GEMMs of the quantized operands."""
  check_recipe(name)
  if not isinstance(accumulator, bool):
    raise ValueError(f"accumulator={accumulator!r} is not allowed; expected True (the recipe's "
                     "accumulator model) or False (float32 GEMMs).")
  if not accumulator:
    cfg = recipe_gemm(name)
    if isinstance(cfg, GemmQuant) and cfg.accum is not None:
      return dataclasses.replace(cfg, accum=None, promote_every=None)
    return cfg
  a = _AXES
  if name == "nvfp4":
    return GemmQuant(
        x=NVFP4Format((1, 16), axis=a["x"]),
        w=NVFP4Format((16, 16), axis=a["w"]),
        dgrad_dy=NVFP4Format((1, 16), axis=a["dgrad_dy"], rounding="stochastic"),
        dgrad_w=NVFP4Format((16, 16), axis=a["dgrad_w"]),
        wgrad_x=NVFP4Format((1, 16), axis=a["wgrad_x"], rht=True),
        wgrad_dy=NVFP4Format((1, 16), axis=a["wgrad_dy"], rounding="stochastic", rht=True),
        bwd_from_fwd=False, matrix_view=True)
  if name == "mxfp8":
    return GemmQuant(**{r: MXFormat("float8_e4m3fn", 32, axis=ax, scale_mode="rceil")
                        for r, ax in a.items()}, bwd_from_fwd=False, matrix_view=True)
  if name == "mxfp4":
    sr = FloatFormat.from_name(_E2M1, rounding="stochastic")
    fwd = {r: MXFormat(_E2M1, 32, axis=a[r]) for r in ("x", "w")}
    bwd = {r: MXFormat(sr, 32, axis=a[r], prescale=0.75)
           for r in ("dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")}
    return GemmQuant(**fwd, **bwd, bwd_from_fwd=False, matrix_view=True)
  if name == "deepseek_fp8":
    tiles = {r: (128, 128) if r in ("w", "dgrad_w") else (1, 128) for r in a}
    return GemmQuant(**{r: BlockScaledFormat("float8_e4m3fn", tiles[r], axis=ax)
                        for r, ax in a.items()},
                     accum=FloatFormat(8, 13, rounding="truncate"), promote_every=128,
                     bwd_from_fwd=False, matrix_view=True)
  if name == "fp8_delayed":
    return DelayedScaling()
  # fp8_current
  fwd = BlockScaledFormat("float8_e4m3fn", TENSOR_BLOCK, scale_rule="reciprocal")
  bwd = BlockScaledFormat("float8_e5m2", TENSOR_BLOCK, scale_rule="reciprocal")
  return GemmQuant(x=fwd, w=fwd, dgrad_dy=bwd, wgrad_dy=bwd, bwd_from_fwd=True, matrix_view=True)


class _Recorder:
  """A layer's op that notes the layer's path at its first call, then runs the op."""

  def __init__(self, op: Any, path: str, calls: list[str]):
    self.op, self.path, self.calls = op, path, calls

  def __call__(self, *args, **kwargs):
    if self.path not in self.calls:
      self.calls.append(self.path)
    return self.op(*args, **kwargs)


def gemm_call_order(model: nnx.Module, *args: Any, **kwargs: Any) -> list[str]:
  """Paths of the model's Linear / LinearGeneral / Conv / Einsum layers in the order of their
  first call by `model(*args, **kwargs)`.

  The call is traced with `nnx.eval_shape` (arrays or `jax.ShapeDtypeStruct`s; nothing is
  computed and the model's state does not change): each layer's op hook is wrapped for the
  trace and restored after it, quantized layers (`quantize_model`) included. Layers the call
  does not reach are absent.
  """
  if not isinstance(model, nnx.Module):
    raise ValueError(f"model={type(model).__name__} is not allowed; expected an nnx.Module.")
  calls: list[str] = []
  saved = []
  for p, m in nnx.iter_modules(model):
    if layer_kind(m) is None:
      continue
    _, attr, _ = _hook(m)
    op = getattr(m, attr)
    plain = op.original if isinstance(op, _QuantOp) else op
    saved.append((m, attr, op))
    setattr(m, attr, nnx.static(_Recorder(plain, _path_str(p), calls)))
  try:
    nnx.eval_shape(lambda m, a, k: m(*a, **k), model, args, kwargs)
  finally:
    for m, attr, op in saved:
      setattr(m, attr, nnx.data(op) if isinstance(op, _QuantOp) else nnx.static(op))
  return calls


def recipe_rules(name: str, model: nnx.Module | None = None, *example: Any,
                 accumulator: bool = True) -> list[QuantRule]:
  """The jlp.nn quantization rules of a recipe (module docstring), for `quantize_model`.

  Args:
    name: one of `RECIPES`.
    model: the model the rules are for. Needed by "nvfp4" (with `example`) to find its first and
      last GEMM layers; with any recipe it keeps `nnx.LinearGeneral` layers whose kernel is not
      2-D in float32 (their contraction axis is not the recipe's). Without it the rules assume
      2-D (in, out) dense kernels.
    *example: the model's positional inputs for one call (arrays or `jax.ShapeDtypeStruct`s), to
      trace the order of its GEMM layers (`gemm_call_order`).
    accumulator: False drops the recipe's accumulator model (`recipe_gemm`).

  Returns:
    [QuantRule], first match wins: float32 rules for the layers the recipe keeps in float32
    (named "<recipe>: ..."), then QuantRule(".*", {"linear": cfg, "conv": cfg}, name=<recipe>)
    with cfg = `recipe_gemm(name)`.

  Raises:
    ValueError: an unknown or unsupported name (one line, before anything is traced); "nvfp4"
      without a model and an example input; a model call that reaches no GEMM layer.
  """
  check_recipe(name)
  cfg = recipe_gemm(name, accumulator=accumulator)
  rules: list[QuantRule] = []
  if name in FIRST_LAST_FLOAT32:
    if model is None or not example:
      raise ValueError(f"recipe_rules({name!r}) needs the model and an example input (e.g. "
                       f"recipe_rules({name!r}, model, x)): the recipe keeps the first and the "
                       "last GEMM layer in float32, found by tracing one call.")
    order = gemm_call_order(model, *example)
    if not order:
      raise ValueError(f"recipe {name!r}: the model's call reaches no Linear / Conv / Einsum "
                       "layer, so it has no first and last GEMM layer to keep in float32.")
    rules.append(QuantRule(re.escape(order[0]), None, name=f"{name}: first GEMM layer, float32"))
    if order[-1] != order[0]:
      rules.append(QuantRule(re.escape(order[-1]), None, name=f"{name}: last GEMM layer, float32"))
  if model is not None:
    for p, m in nnx.iter_modules(model):
      kernel = getattr(m, "kernel", None)
      if isinstance(m, nnx.LinearGeneral) and kernel is not None and len(kernel.shape) != 2:
        rules.append(QuantRule(re.escape(_path_str(p)), None,
                               name=f"{name}: LinearGeneral kernel of rank {len(kernel.shape)}, "
                                    "float32"))
  rules.append(QuantRule(".*", {"linear": cfg, "conv": cfg}, name=name))
  return rules
