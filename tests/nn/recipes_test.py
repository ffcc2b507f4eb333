"""jlp.nn.recipes: low-precision training recipes by name, on the zoo's small models."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jlp import models
from jlp.formats import TENSOR_BLOCK, BlockScaledFormat, FloatFormat, MXFormat, NVFP4Format
from jlp.gemm.accum import matmul as accum_matmul
from jlp.gemm.config import ROLES, GemmQuant
from jlp.gemm.fp8_delayed import DelayedScaling
from jlp.gemm.qdot import qdot_general
from jlp.nn import (RECIPES, QuantRule, gemm_call_order, quantize_model, recipe_gemm,
                    recipe_rules)
from jlp.nn.recipes import UNSUPPORTED
from jlp.quantize import quantize_f32
from tiny_models import build

HI = lax.Precision.HIGHEST
E2M1 = "float4_e2m1fn"
E2M1_SR = FloatFormat.from_name(E2M1, rounding="stochastic")
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"

# The formats each recipe is meant to give each role (the module docstring's tables), written out
# independently of jlp.nn.recipes.
EXPECTED = {
    "nvfp4": dict(
        x=NVFP4Format((1, 16), axis=-1),
        w=NVFP4Format((16, 16), axis=-2),
        dgrad_dy=NVFP4Format((1, 16), axis=-1, rounding="stochastic"),
        dgrad_w=NVFP4Format((16, 16), axis=-1),
        wgrad_x=NVFP4Format((1, 16), axis=-2, rht=True),
        wgrad_dy=NVFP4Format((1, 16), axis=-2, rounding="stochastic", rht=True),
        bwd_from_fwd=False),
    "mxfp8": dict(
        **{r: MXFormat(E4M3, 32, axis=a, scale_mode="rceil") for r, a in (
            ("x", -1), ("w", -2), ("dgrad_dy", -1), ("dgrad_w", -1), ("wgrad_x", -2),
            ("wgrad_dy", -2))},
        bwd_from_fwd=False),
    "mxfp4": dict(
        x=MXFormat(E2M1, 32, axis=-1), w=MXFormat(E2M1, 32, axis=-2),
        dgrad_dy=MXFormat(E2M1_SR, 32, axis=-1, prescale=0.75),
        dgrad_w=MXFormat(E2M1_SR, 32, axis=-1, prescale=0.75),
        wgrad_x=MXFormat(E2M1_SR, 32, axis=-2, prescale=0.75),
        wgrad_dy=MXFormat(E2M1_SR, 32, axis=-2, prescale=0.75),
        bwd_from_fwd=False),
    "deepseek_fp8": dict(
        x=BlockScaledFormat(E4M3, (1, 128), axis=-1),
        w=BlockScaledFormat(E4M3, (128, 128), axis=-2),
        dgrad_dy=BlockScaledFormat(E4M3, (1, 128), axis=-1),
        dgrad_w=BlockScaledFormat(E4M3, (128, 128), axis=-1),
        wgrad_x=BlockScaledFormat(E4M3, (1, 128), axis=-2),
        wgrad_dy=BlockScaledFormat(E4M3, (1, 128), axis=-2),
        accum=FloatFormat(8, 13, rounding="truncate"), promote_every=128, bwd_from_fwd=False),
    "fp8_current": dict(
        x=BlockScaledFormat(E4M3, TENSOR_BLOCK, scale_rule="reciprocal"),
        w=BlockScaledFormat(E4M3, TENSOR_BLOCK, scale_rule="reciprocal"),
        dgrad_dy=BlockScaledFormat(E5M2, TENSOR_BLOCK, scale_rule="reciprocal"),
        wgrad_dy=BlockScaledFormat(E5M2, TENSOR_BLOCK, scale_rule="reciprocal"),
        bwd_from_fwd=True),
}


#: Recipes whose GemmQuant is stateless (qdot_general computes their GEMMs); "fp8_delayed" keeps
#: per-layer amax histories (tests/nn/fp8_delayed_test.py checks its GEMMs).
STATELESS = tuple(r for r in RECIPES if r != "fp8_delayed")


def expected_cfg(name):
  if name == "fp8_delayed":
    return DelayedScaling()  # TE's defaults: HYBRID, history 1024, "max", margin 0
  return GemmQuant(**EXPECTED[name], matrix_view=True)


# The models are built with numpy-drawn parameters (tiny_models.build): a real construction
# compiles every initializer draw of a new shape (11 s for the ResNet-50 below), and what these
# tests check (layer paths, call order, rules) does not depend on the initializer.
def small_cnn():
  return build("small_cnn", dict(num_classes=10, width=8))


def mlp():
  return build("mlp", dict(num_classes=10, in_features=64, hidden=(32, 32, 32)))


def test_the_recipes_are_the_issue_s_list():
  assert RECIPES == ("nvfp4", "mxfp8", "mxfp4", "deepseek_fp8", "fp8_current", "fp8_delayed")
  assert not UNSUPPORTED


@pytest.mark.parametrize("name", RECIPES)
def test_each_role_gets_the_intended_format(name):
  assert recipe_gemm(name) == expected_cfg(name)


@pytest.mark.parametrize("name", RECIPES)
def test_rules_on_small_cnn_pick_the_recipe_per_layer(name):
  model = small_cnn()
  report = quantize_model(model, recipe_rules(name, model, jnp.zeros((2, 8, 8, 1))),
                          rngs=nnx.Rngs(quant=0))
  cfg = expected_cfg(name)
  assert report.kinds == {"conv1": "conv", "conv2": "conv", "linear": "linear"}
  if name == "nvfp4":  # the first and the last layer stay float32
    assert dict(report) == {"conv2": cfg}
    assert report.unchanged == ["conv1", "linear"]
  else:
    assert dict(report) == {"conv1": cfg, "conv2": cfg, "linear": cfg}
  assert not report.unused_rules


def test_nvfp4_keeps_the_first_and_last_layer_of_an_mlp_in_float32():
  model = mlp()
  rules = recipe_rules("nvfp4", model, jnp.zeros((3, 8, 8, 1)))
  assert [(r.path, r.cfg, r.name) for r in rules[:2]] == [
      ("fc/0", None, "nvfp4: first GEMM layer, float32"),
      ("head", None, "nvfp4: last GEMM layer, float32")]
  report = quantize_model(model, rules, rngs=nnx.Rngs(quant=0))
  assert list(report) == ["fc/1", "fc/2"]
  assert report.unchanged == ["fc/0", "head"]


def test_first_and_last_follow_the_call_order_not_the_module_order():
  """torchvision's ResNet-50 lists `fc` second among its modules (sorted attribute names) but
  calls it last: the traced order decides."""
  model = build("resnet50", dict(num_classes=10, width=4, num_blocks=(1, 1, 1, 1)))
  x = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)
  modules = list(models.gemm_modules(model))
  order = gemm_call_order(model, x)
  assert modules[:2] == ["conv1", "fc"]
  assert order[0] == "conv1" and order[-1] == "fc" and sorted(order) == sorted(modules)
  assert order.index("layer1/0/downsample/0") < order.index("layer2/0/conv1")
  rules = recipe_rules("nvfp4", model, x)
  assert [r.path for r in rules[:2]] == ["conv1", "fc"]


def test_gemm_call_order_leaves_the_model_unchanged():
  model = small_cnn()
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))
  quantize_model(model, [(".*", GemmQuant(x=FloatFormat(4, 3)))])
  model.eval()
  fwd = nnx.jit(lambda m, x: m(x))  # eager, the quantized forward compiled op by op
  before = fwd(model, x)
  state = nnx.state(model)
  assert gemm_call_order(model, x) == ["conv1", "conv2", "linear"]
  np.testing.assert_array_equal(fwd(model, x), before)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model), state)
  assert type(model.conv1.conv_general_dilated).__name__ == "QConv"


def test_a_layer_the_call_does_not_reach_is_not_first_or_last():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(4, 4, rngs=rngs)
      self.b = nnx.Linear(4, 4, rngs=rngs)
      self.unused = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.a(self.b(x))  # b first

  model = Net(nnx.Rngs(jax.random.key(0, impl="rbg")))  # rbg: cheaper init compiles, any values do
  assert gemm_call_order(model, jnp.zeros((2, 4))) == ["b", "a"]
  rules = recipe_rules("nvfp4", model, jnp.zeros((2, 4)))
  report = quantize_model(model, rules, rngs=nnx.Rngs(quant=0))
  assert list(report) == ["unused"]


def test_linear_general_with_a_multi_axis_kernel_stays_float32():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.heads = nnx.LinearGeneral(8, (2, 4), rngs=rngs)
      self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.out(self.heads(x).reshape(x.shape[0], 8))

  model = Net(nnx.Rngs(jax.random.key(0, impl="rbg")))  # rbg: cheaper init compiles, any values do
  rules = recipe_rules("mxfp8", model)
  assert rules[0] == QuantRule("heads", None, "mxfp8: LinearGeneral kernel of rank 3, float32")
  report = quantize_model(model, rules)
  assert list(report) == ["out"] and report.unchanged == ["heads"]


def test_einsum_layers_are_not_matched():
  rule = recipe_rules("deepseek_fp8")[-1]
  assert rule.matches("any/path", "linear") and rule.matches("any/path", "conv")
  assert not rule.matches("any/path", "einsum")


def test_without_the_accumulator_model():
  """accumulator=False: deepseek_fp8's formats with float32 GEMMs; the recipes without an
  accumulator model are unchanged."""
  for name in RECIPES:
    full, formats_only = recipe_gemm(name), recipe_gemm(name, accumulator=False)
    if name == "deepseek_fp8":
      assert full.accum is not None and full.promote_every == 128
      assert formats_only == dataclasses.replace(full, accum=None, promote_every=None)
    else:
      assert formats_only == full
  rule = recipe_rules("deepseek_fp8", accumulator=False)[-1]
  assert rule.cfg["conv"].accum is None and rule.cfg["linear"].promote_every is None
  with pytest.raises(ValueError, match=r"^accumulator='no' is not allowed; expected True"):
    recipe_gemm("deepseek_fp8", accumulator="no")


@pytest.mark.parametrize("name, message", [
    ("fp4", r"^name='fp4' is not allowed; expected one of 'nvfp4', 'mxfp8', 'mxfp4', "
            r"'deepseek_fp8', 'fp8_current', 'fp8_delayed'\.$"),
    ("none", r"^name='none' is not allowed"),
])
def test_bad_names_are_one_line_errors(name, message):
  with pytest.raises(ValueError, match=message) as e:
    recipe_rules(name, small_cnn(), jnp.zeros((1, 8, 8, 1)))
  assert "\n" not in str(e.value)


def test_nvfp4_needs_the_model_and_an_example():
  for args in ((), (small_cnn(),)):
    with pytest.raises(ValueError, match=r"needs the model and an example input"):
      recipe_rules("nvfp4", *args)
  with pytest.raises(ValueError, match="reaches no Linear / Conv / Einsum layer"):
    recipe_rules("nvfp4", nnx.Sequential(lambda x: x), jnp.zeros((1, 2)))


# -- the GEMMs the rules produce -----------------------------------------------------------------


def _q(fmt, x, key, role):
  """Role `role`'s quantization of x as qdot_general documents it: on the (rows, last axis) view
  (matrix_view), with the role's key fold_in(key, ROLES.index(role))."""
  if fmt is None:
    return x
  rkey = jax.random.fold_in(key, ROLES.index(role)) if fmt.rounding == "stochastic" else None
  return quantize_f32(x.reshape(-1, x.shape[-1]), fmt, rkey, "xla").reshape(x.shape)


# mxfp8 runs in the slow tier: mxfp4 keeps MX formats through qdot_general's matrix view (with
# stochastic rounding besides), and tests/numerics/mx_test.py the "rceil" scale mode.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mxfp8" else n
                                  for n in STATELESS])
def test_a_dense_layer_on_tokens_computes_the_recipe_s_three_gemms(name, fast_compile):
  """y, dx and dw of a (B, T, F) x (F, O) layer equal float32 GEMMs of the operands quantized as
  the recipe's table says, on TE's 2-D views: the weight-gradient operands are blocked along
  the flattened B*T rows (TE's columnwise blocks)."""
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (2, 16, 64)) * jnp.exp(jax.random.normal(kx, (2, 16, 64)))
  w = jax.random.normal(kw, (64, 48)) * 0.1
  g = jax.random.normal(kg, (2, 16, 48))
  key = jax.random.key(7)
  dn = (((2,), (0,)), ((), ()))

  def layer(x, w, g):
    y, vjp = jax.vjp(lambda a, b: qdot_general(a, b, dn, recipe_gemm(name), key=key), x, w)
    return (y, *vjp(g))

  # The layer and its reference in one jitted program: one compile (~40% less than two here).
  (y, dx, dw), (y_ref, dx_ref, dw_ref) = jax.jit(
      lambda x, w, g: (layer(x, w, g), _reference(name, x, w, g, key)))(x, w, g)
  for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):  # up to the summation order
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))
  # and the recipe does quantize: each GEMM differs from float32
  for got, exact in ((y, x @ w), (dx, g @ w.T), (dw, jnp.einsum("btf,bto->fo", x, g))):
    assert not np.allclose(got, exact, rtol=1e-4, atol=1e-4)


def _reference(name, x, w, g, key):
  exp = EXPECTED[name]
  qx, qw = _q(exp["x"], x, key, "x"), _q(exp["w"], w, key, "w")
  xt, wt = (qx, qw) if exp["bwd_from_fwd"] else (x, w)
  gd, wd = _q(exp.get("dgrad_dy"), g, key, "dgrad_dy"), _q(exp.get("dgrad_w"), wt, key, "dgrad_w")
  xw, gw = _q(exp.get("wgrad_x"), xt, key, "wgrad_x"), _q(exp.get("wgrad_dy"), g, key, "wgrad_dy")
  if name == "deepseek_fp8":  # 14-bit truncating accumulation promoted to float32 every 128
    mm = lambda a, b: accum_matmul(a, b, accum=exp["accum"], promote_every=128, impl="xla")
    y_ref = mm(qx.reshape(32, 64), qw).reshape(g.shape)
    dx_ref = mm(gd.reshape(32, 48), wd.T).reshape(x.shape)
    dw_ref = mm(xw.reshape(32, 64).T, gw.reshape(32, 48))
  else:
    y_ref = jnp.einsum("btf,fo->bto", qx, qw, precision=HI)
    dx_ref = jnp.einsum("bto,fo->btf", gd, wd, precision=HI)
    dw_ref = jnp.einsum("btf,bto->fo", xw, gw, precision=HI)
  return y_ref, dx_ref, dw_ref


def test_nvfp4_2d_weight_tiles_give_dgrad_the_forward_weight():
  """With 16x16 tiles the weight's rowwise and columnwise quantizations are the same values, as
  TE uses one 2-D-quantized weight for fprop and dgrad."""
  cfg = recipe_gemm("nvfp4")
  w = jax.random.normal(jax.random.key(3), (48, 80))
  # the three quantizations in one jitted program: one compile instead of three
  fwd_w, dgrad_w, columnwise_1d = jax.jit(lambda w: [quantize_f32(w, f) for f in (
      cfg.w, cfg.dgrad_w, NVFP4Format((1, 16), axis=-2))])(w)
  np.testing.assert_array_equal(fwd_w, dgrad_w)
  assert not np.array_equal(fwd_w, columnwise_1d)
