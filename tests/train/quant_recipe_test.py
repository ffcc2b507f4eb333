"""config.quant_recipe: low-precision training recipes by name in both training loops.

References: jlp.nn.recipe_rules (the rules a recipe stands for), the float32 run of the same config
(the recipe must change the run, and on 8 devices stay within 3 points of its accuracy), the
uninterrupted run for resume.
"""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import digits
from jlp import models
from jlp.formats import FloatFormat
from jlp.gemm.config import GemmQuant
from jlp.nn import RECIPES, recipe_gemm
from jlp.train import config as config_lib, loop, recipe
from jlp.train.loop_common import QuantPlan
from jlp.train.metrics import read_metrics
from runs import final_checkpoint, small_digits, stable


def small_config(name="none", **overrides):
  return small_digits(**{"max_steps": 6, "log_every": 2, "eval_every": 6, "checkpoint_every": 3,
                         "quant_recipe": name, **overrides})


def test_the_field_defaults_to_none_and_is_documented():
  assert config_lib.base_config().quant_recipe == "none"
  doc = config_lib.__doc__
  assert "quant_recipe" in doc and all(name in doc for name in RECIPES)


@pytest.mark.parametrize("overrides, message", [
    ({"quant_recipe": "fp4"},
     r"^config.quant_recipe='fp4' is not allowed; expected one of 'none', 'nvfp4', 'mxfp8', "
     r"'mxfp4', 'deepseek_fp8', 'fp8_current', 'fp8_delayed'\.$"),
    ({"quant_recipe": "fp8_delayed", "bfp": {"preset": "FB12", "schedule": {}, "controller": "",
                                             "window": 0}},
     r"^config.bfp.preset='FB12' is not allowed; expected '' with "
     r"config.quant_recipe='fp8_delayed'"),
    ({"quant_recipe": "nvfp4", "bfp": {"preset": "FB12", "schedule": {}, "controller": "",
                                       "window": 0}},
     r"^config.bfp.preset='FB12' is not allowed; expected '' with config.quant_recipe='nvfp4'"),
    ({"quant_recipe": "mxfp8", "bfp": {"preset": "", "schedule": {"0": "FB12"}, "controller": "",
                                       "window": 0}},
     r"^config.bfp.schedule=.* is not allowed; expected \{\} with config.quant_recipe='mxfp8'"),
])
def test_bad_recipes_fail_in_one_line_before_the_model_is_built(overrides, message, monkeypatch,
                                                                 tmp_path):
  monkeypatch.setattr(recipe, "model", lambda *a, **k: pytest.fail("the model was built"))
  c = small_config()
  for k, v in overrides.items():
    c[k] = v
  with pytest.raises(ValueError, match=message) as e:
    loop.train_and_evaluate(c, str(tmp_path), progress=False)
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "checkpoints")


def test_the_accumulator_model_can_be_dropped():
  """config.quant_recipe_accumulator=False: deepseek_fp8's formats with float32 GEMMs."""
  model = lambda: models.get_model("small_cnn", num_classes=10, width=8, rngs=nnx.Rngs(0))
  for accumulator in (True, False):
    c = small_config("deepseek_fp8", quant_recipe_accumulator=accumulator)
    report = QuantPlan(c, 10).quantize(model(), None)
    assert set(report.values()) == {recipe_gemm("deepseek_fp8", accumulator=accumulator)}
  assert config_lib.base_config().quant_recipe_accumulator is True


def test_quant_rules_come_before_the_recipe():
  """config.quant_rules override the recipe for the layers they match (first match wins); the
  recipe covers the rest, nvfp4 with its first and last layer in float32."""
  c = small_config("nvfp4", quant_rules=(("conv2", {"x": "e4m3"}),))
  model = models.get_model("small_cnn", num_classes=10, width=8, rngs=nnx.Rngs(0))
  plan = QuantPlan(c, 10, example=lambda: jnp.zeros((4, 8, 8, 1)))
  report = plan.quantize(model, None)
  assert dict(report) == {"conv2": GemmQuant(x=FloatFormat(4, 3))}
  assert [report.rules[i].name for i in report.matched.values()] == [
      "nvfp4: first GEMM layer, float32", None, "nvfp4: last GEMM layer, float32"]
  c = small_config("mxfp4", quant_rules=(("conv1", {"x": "e4m3"}),))
  report = QuantPlan(c, 10).quantize(model, None)  # mxfp4 needs no example
  assert dict(report) == {"conv1": GemmQuant(x=FloatFormat(4, 3)),
                          "conv2": recipe_gemm("mxfp4"), "linear": recipe_gemm("mxfp4")}


def test_nvfp4_needs_the_loop_s_example_input():
  plan = QuantPlan(small_config("nvfp4"), 10)
  model = models.get_model("small_cnn", num_classes=10, width=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs an example model input"):
    plan.quantize(model, None)


@pytest.fixture(scope="module")
def float32_rows(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("float32"))
  loop.train_and_evaluate(small_config(), workdir, progress=False)
  return read_metrics(workdir)


# 25-40 s each on this machine: the slow tier. In the default tier tests/nn/recipes_test.py checks
# each recipe's GEMMs, and the resume tests below train nvfp4 and fp8_delayed.
@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_digits_on_8_devices(name, float32_rows, tmp_path):
  """A few data-parallel steps: finite losses that fall, and not the float32 run's numbers."""
  workdir = str(tmp_path)
  result = loop.train_and_evaluate(small_config(name), workdir, progress=False)
  rows = read_metrics(workdir)
  losses = [r["train_loss"] for r in rows]
  assert [r["step"] for r in rows] == [2, 4, 6] and result["step"] == 6
  assert np.isfinite(losses).all() and np.isfinite(result["eval_loss"])
  assert losses[-1] < losses[0]
  assert losses != [r["train_loss"] for r in float32_rows]


def test_a_stochastic_recipe_trains_and_resumes_bit_exact(tmp_path):
  """nvfp4 (stochastic rounding streams in the model state, first / last layers traced again on
  resume): the loss falls, and a run that lost its last checkpoint resumes from step 3 to the
  same rows and state."""
  ref_dir, workdir = str(tmp_path / "ref"), str(tmp_path / "run")
  result = loop.train_and_evaluate(small_config("nvfp4"), ref_dir, progress=False)
  losses = [r["train_loss"] for r in read_metrics(ref_dir)]
  assert np.isfinite(losses).all() and np.isfinite(result["eval_loss"])
  assert losses[-1] < losses[0]
  shutil.copytree(ref_dir, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  loop.train_and_evaluate(small_config("nvfp4"), workdir, progress=False)
  assert stable(read_metrics(workdir)) == stable(read_metrics(ref_dir))
  ref_step, ref_state = final_checkpoint(ref_dir)
  step, state = final_checkpoint(workdir)
  assert step == ref_step == 6 and state.keys() == ref_state.keys()
  assert any("rng" in k and "count" in k for k in state)  # the streams are checkpointed
  for k in ref_state:
    np.testing.assert_array_equal(state[k], ref_state[k], err_msg=k)


def test_fp8_delayed_trains_and_resumes_bit_exact(tmp_path):
  """TE's DelayedScaling on 8 data-parallel devices: the loss falls, and a run that lost its
  last checkpoint resumes from step 3 to the same rows and the same state bit for bit: the
  parameters, the optimizer state and every layer's amax histories and scales (model state,
  checkpointed)."""
  ref_dir, workdir = str(tmp_path / "ref"), str(tmp_path / "run")
  loop.train_and_evaluate(small_config("fp8_delayed"), ref_dir, progress=False)
  rows = read_metrics(ref_dir)
  losses = [r["train_loss"] for r in rows]
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  shutil.copytree(ref_dir, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  loop.train_and_evaluate(small_config("fp8_delayed"), workdir, progress=False)
  assert stable(read_metrics(workdir)) == stable(rows)
  ref_step, ref_state = final_checkpoint(ref_dir)
  step, state = final_checkpoint(workdir)
  assert step == ref_step == 6 and state.keys() == ref_state.keys()
  histories = [k for k in state if "amax_history" in k]
  scales = [k for k in state if k.endswith("_scale']") or "_scale'" in k]
  assert len(histories) == 9 and len(scales) == 9  # x, w, dy of conv1, conv2, linear
  for k in histories:  # six steps of amaxes: index 0 the newest, then the oldest five at the end
    h = ref_state[k]
    assert h.shape == (1024,) and (h[[0, -5, -4, -3, -2, -1]] > 0).all() and not h[1:-5].any()
  for k in ref_state:
    np.testing.assert_array_equal(state[k], ref_state[k], err_msg=k)


def test_fp8_delayed_is_refused_in_pipelined_runs(monkeypatch, tmp_path):
  monkeypatch.setattr(recipe, "model", lambda *a, **k: pytest.fail("the model was built"))
  c = small_config("fp8_delayed")
  c.pipeline.schedule, c.pipeline.stages, c.pipeline.microbatches = "gpipe", 2, 2
  with pytest.raises(ValueError, match=r"^config.quant_recipe='fp8_delayed' is not allowed with "
                     r"pipeline.schedule='gpipe': .*supported in data-parallel runs only") as e:
    loop.train_and_evaluate(c, str(tmp_path), progress=False)
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.slow  # 18 s; tests/pipeline covers quantized zoo models in both schedules
def test_a_recipe_trains_a_pipelined_run(tmp_path, fast_compile):
  """GPipe, 4 pipelines x 2 stages, with a stochastic recipe (mxfp4)."""
  c = small_config("mxfp4", max_steps=20, log_every=10, eval_every=20, checkpoint_every=0)
  c.schedule.name = "constant"
  c.pipeline.schedule, c.pipeline.stages, c.pipeline.microbatches = "gpipe", 2, 2
  result = loop.train_and_evaluate(c, str(tmp_path), progress=False)
  losses = [r["train_loss"] for r in read_metrics(str(tmp_path))]
  assert len(losses) == 2 and np.isfinite(losses).all() and losses[1] < losses[0]
  assert result["step"] == 20 and np.isfinite(result["eval_loss"])


@pytest.mark.slow
def test_every_recipe_trains_digits_within_3_points_of_float32(tmp_path):
  """configs/digits.py (small CNN, 300 steps, 8 data-parallel devices) with each recipe reaches an
  eval accuracy at most 3 points below the float32 run's (the issue's acceptance bar)."""
  accuracy = {}
  for name in ("none",) + RECIPES:
    c = digits.get_config()
    c.quant_recipe = name
    accuracy[name] = loop.train_and_evaluate(c, str(tmp_path / name), progress=False)[
        "eval_accuracy"]
  print("digits eval accuracy:", accuracy)
  for name in RECIPES:
    assert accuracy[name] >= accuracy["none"] - 0.03, (name, accuracy)
