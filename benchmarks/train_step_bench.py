"""ResNet18/CIFAR train step: float32 against quantized rule sets, timed alternately.

Run: python -m benchmarks.train_step_bench [--batch=128] [--steps=5] [--width=64]
         [--candidates=ResNet18_FB12,fp8_stochastic,nvfp4,deepseek_fp8]

One SGD step (momentum 0.9, optax) of softmax cross-entropy on a random batch of
--batch 32x32x3 images, BatchNorm in train mode (running statistics updated),
jitted with the parameters, the rest of the model state and the optimizer state
donated (NNX functional style: nnx.split once, nnx.merge(copy=True) inside the
jitted step). Each candidate is the same model (same initial parameters) after
`quantize_model` with its rules, on the 16 residual-block 3x3 convs (stem, shortcuts
and classifier stay float32):

  ResNet18_FB12 (or any BFPsim preset name): `load_bfpsim_preset(name)`, BFP m4
    groups of 24 channels x 3 x 3 on the forward operands and on both backward
    GEMMs' operands.
  fp8_stochastic: activations E4M3 and output gradients E5M2 with stochastic
    rounding (x, dgrad_dy, wgrad_dy; the backward GEMMs take the forward-quantized
    activations), weights E4M3 rounded to nearest; keys from the model's "quant"
    RNG stream, advanced every step.
  nvfp4, mxfp8, mxfp4, deepseek_fp8, fp8_current: the low-precision training recipe of that
    name (`jlp.nn.recipe_rules`), on every conv and dense layer the recipe quantizes
    ("nvfp4" keeps the stem conv and the classifier float32; the others quantize every layer),
    stochastic rounding keyed from the model's "quant" stream. "<recipe>:no_accumulator" is
    the recipe with float32 GEMMs of its quantized operands (`accumulator=False`: for
    "deepseek_fp8", its formats without the model of the tensor cores' accumulator).

Each step is first traced and lowered, then compiled ahead of time (`jax.jit(...).lower(...)
.compile()`, both timed: the compile time is XLA's, apart from the first step), then run once
and --warmup times more; the steps then run in turn (float32 first) --steps times; reported:
median step time, img/s, the trace + lower and compile seconds, and candidate/float32 as the
ratio of the medians and the median of the per-pair ratios (target <= 1.3; BFPsim reports
about 2x for FB12 on GPU).
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

import jlp.models as zoo
from jlp import FloatFormat, GemmQuant
from jlp.nn import QuantRule, load_bfpsim_preset, quantize_model, recipes
from jlp.nn.bfpsim import PRESETS

_BATCH = flags.DEFINE_integer("batch", 128, "images per step.")
_STEPS = flags.DEFINE_integer(
    "steps", 5, "timed rounds (one step of float32 and of each candidate) after warm-up.")
_WARMUP = flags.DEFINE_integer("warmup", 1, "untimed steps per model after the compile.")
_WIDTH = flags.DEFINE_integer("width", 64, "ResNet18 base width (64 = full size).")
_CANDIDATES = flags.DEFINE_list(
    "candidates", ["ResNet18_FB12", "fp8_stochastic"],
    "rule sets timed against float32: BFPsim preset names, fp8_stochastic or a recipe name "
    "(jlp.nn.recipes.RECIPES; <recipe>:no_accumulator drops its accumulator model).")

RESIDUAL_CONVS = r"layer\d/\d+/conv\d"
FP8_STOCHASTIC = GemmQuant(x=FloatFormat(4, 3, rounding="stochastic"), w=FloatFormat(4, 3),
                           dgrad_dy=FloatFormat(5, 2, rounding="stochastic"),
                           wgrad_dy=FloatFormat(5, 2, rounding="stochastic"))


def quantize_candidate(model: nnx.Module, name: str, example: jax.Array | None = None):
  """Applies the rule set `name` to `model` in place; returns the QuantReport. `example`: one
  input batch (the "nvfp4" recipe traces the model on it to find its first and last layers)."""
  if name == "fp8_stochastic":
    return quantize_model(model, [QuantRule(RESIDUAL_CONVS, FP8_STOCHASTIC)],
                          rngs=nnx.Rngs(quant=1))
  recipe, _, variant = name.partition(":")
  if recipe in recipes.RECIPES:
    rules = recipes.recipe_rules(recipe, model, example, accumulator=variant != "no_accumulator")
    return quantize_model(model, rules, rngs=nnx.Rngs(quant=1))
  return quantize_model(model, load_bfpsim_preset(name))


def build(width: int, seed: int = 0) -> nnx.Module:
  """ResNet18 with numpy-drawn parameters (skips compiling a threefry draw per shape)."""
  abstract = nnx.eval_shape(lambda: zoo.resnet18(num_classes=10, width=width))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)
  flat = []
  for path, var in nnx.to_flat_state(state):
    sds = var.get_value()
    if path[-1] in ("scale", "var"):
      value = np.ones(sds.shape, sds.dtype)
    elif path[-1] in ("mean", "bias"):
      value = np.zeros(sds.shape, sds.dtype)
    else:  # kernels: He-normal-ish
      fan_in = int(np.prod(sds.shape[:-1]))
      value = (rng.standard_normal(sds.shape) * np.sqrt(2.0 / fan_in)).astype(sds.dtype)
    flat.append((path, var.replace(value=jnp.asarray(value))))
  model = nnx.merge(graphdef, nnx.from_flat_state(flat))
  model.train()
  return model


def make_step(model: nnx.Module, tx: optax.GradientTransformation):
  """(jitted donated step, params, rest, opt_state) for `model`."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt_state = tx.init(params)

  def step(params, rest, opt_state, x, y):
    def loss_fn(p):
      m = nnx.merge(graphdef, p, rest, copy=True)
      logits = m(x)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, nnx.split(m, nnx.Param, ...)[2]

    (loss, new_rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_rest, opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2)), params, rest, opt_state


class Runner:
  def __init__(self, name, model, tx):
    self.name = name
    self.step, self.params, self.rest, self.opt_state = make_step(model, tx)
    self.times: list[float] = []
    self.loss = float("nan")
    self.lower_s = self.compile_s = self.compile_cpu_s = self.first_step_s = float("nan")

  def compile(self, x, y) -> None:
    """Traces, lowers and compiles the step ahead of time (timed apart from the first step)."""
    t0 = time.perf_counter()
    lowered = self.step.lower(self.params, self.rest, self.opt_state, x, y)
    t1, c1 = time.perf_counter(), time.process_time()
    self.step = lowered.compile()
    self.lower_s, self.compile_s = t1 - t0, time.perf_counter() - t1
    self.compile_cpu_s = time.process_time() - c1  # less sensitive to a shared machine's load

  def run(self, x, y) -> float:
    t0 = time.perf_counter()
    self.params, self.rest, self.opt_state, loss = self.step(self.params, self.rest, self.opt_state, x, y)
    jax.block_until_ready((self.params, self.rest, self.opt_state, loss))
    dt = time.perf_counter() - t0
    self.loss = float(loss)
    return dt


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  b, w = _BATCH.value, _WIDTH.value
  for name in _CANDIDATES.value:
    recipe, colon, variant = name.partition(":")
    if colon and (recipe not in recipes.RECIPES or variant != "no_accumulator"):
      raise app.UsageError(f"--candidates entry {name!r} is not allowed; expected "
                           "<recipe>:no_accumulator with a recipe of jlp.nn.recipes.RECIPES.")
    if (name != "fp8_stochastic" and recipe not in recipes.RECIPES and name not in PRESETS
        and not os.path.isfile(name)):
      raise app.UsageError(f"--candidates entry {name!r} is not allowed; expected fp8_stochastic, "
                           f"a recipe ({', '.join(recipes.RECIPES)}, optionally "
                           "<recipe>:no_accumulator), a BFPsim preset "
                           f"({', '.join(PRESETS)}) or a BFPsim JSON file.")
  key_x, key_y = jax.random.split(jax.random.key(0))
  x = jax.random.normal(key_x, (b, 32, 32, 3), jnp.float32)
  y = jax.random.randint(key_y, (b,), 0, 10)
  tx = optax.sgd(0.01, momentum=0.9)

  print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device); ResNet18 width {w}, "
        f"batch {b} x 32x32x3, SGD momentum 0.9, BatchNorm train mode, donated jit")
  runners = [Runner("float32", build(w), tx)]
  for name in _CANDIDATES.value:
    cand = build(w)
    report = quantize_candidate(cand, name, x)
    cfg = next(iter(report.values()))
    print(f"{name}: {len(report)} of {len(report.kinds)} GEMM layers quantized (x {cfg.x}, "
          f"dgrad_dy {cfg.dgrad_dy})")
    runners.append(Runner(name, cand, tx))
  print()
  for r in runners:
    r.compile(x, y)
    r.first_step_s = r.run(x, y)
    for _ in range(_WARMUP.value):
      r.run(x, y)
    print(f"{r.name:14s} trace + lower {r.lower_s:6.2f} s, compile {r.compile_s:7.2f} s "
          f"({r.compile_cpu_s:.2f} s CPU), first step {r.first_step_s:7.2f} s", flush=True)

  for i in range(_STEPS.value):
    for r in runners:
      r.times.append(r.run(x, y))
    print(f"  pair {i}: " + "  ".join(f"{r.name} {r.times[-1]:.3f} s" for r in runners), flush=True)

  print()
  header = (f"{'model':14s} {'median s/step':>13s} {'min s/step':>10s} {'img/s':>8s} {'loss':>8s} "
            f"{'lower s':>8s} {'compile s':>9s}")
  print(header)
  print("-" * len(header))
  for r in runners:
    med = statistics.median(r.times)
    print(f"{r.name:14s} {med:13.3f} {min(r.times):10.3f} {b / med:8.1f} {r.loss:8.4f} "
          f"{r.lower_s:8.2f} {r.compile_s:9.2f}")
  print()
  base_t = runners[0].times
  for r in runners[1:]:
    ratio_med = statistics.median(r.times) / statistics.median(base_t)
    ratio_pair = statistics.median(c / f for c, f in zip(r.times, base_t, strict=True))
    print(f"{r.name}/float32: {ratio_med:.2f}x (ratio of medians), {ratio_pair:.2f}x (median of "
          f"per-pair ratios); target <= 1.3x")


if __name__ == "__main__":
  app.run(main)
