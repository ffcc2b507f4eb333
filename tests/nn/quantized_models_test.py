"""Every zoo model, quantized with catch-all rules, forward and backward under jit.

One test per model (tiny configs, parameters drawn with numpy as in tests/models/models_test.py):
the float32 model and the same model quantized with

  * a catch-all fp8 rule (e4m3 operands, e5m2 gradients) on every Linear / Conv / Einsum, and
  * on the conv models, a catch-all per-kind BFP rule (m4, truncate; NHWC activation groups
    (1, 3, 3, 8) on x and both gradients dy, HWIO kernel groups (3, 3, 8, 1) on w; dense layers
    (1, 8) / (8, 1)),

each give a jitted loss and gradient over all parameters (nnx.split / nnx.merge(copy=True) +
jax.value_and_grad) that are finite, with every GEMM kernel receiving gradient, and that differ
from the float32 model's; the QuantReport covers every GEMM layer and leaves no rule unused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jlp.models as zoo
from jlp.formats import BFPFormat, FloatFormat
from jlp.gemm.config import GemmQuant
from jlp.nn import QuantRule, quantize_model
from tiny_models import build, classification_loss, images, token_ids


pytestmark = pytest.mark.usefixtures("fast_compile")

TINY = {
    "resnet18": (dict(num_classes=10, width=4, num_blocks=(1, 1, 1, 1)), images(8)),
    "resnet50": (dict(num_classes=7, width=4, num_blocks=(1, 1, 1, 1)), images(32)),
    "davidnet": (dict(num_classes=10, width=4), images(16)),
    "vgg19": (dict(num_classes=10, width=4), images(32)),
    "fcn": (dict(num_classes=5, block="basic", num_blocks=(1, 1, 1, 1), width=4, channels=8, aux_channels=4),
            images(16)),
    "bert_small": (dict(vocab=50, max_len=16, hidden=16, num_layers=2, heads=2, num_classes=3), token_ids(8, 50)),
    "small_cnn": (dict(num_classes=10, width=4), images(8, 1)),
    "mlp": (dict(num_classes=10, hidden=(8, 6)), images(8, 1)),
}
CONV_MODELS = {"resnet18", "resnet50", "davidnet", "vgg19", "fcn", "small_cnn"}

E4M3, E5M2 = FloatFormat(4, 3), FloatFormat(5, 2)
FP8 = [QuantRule(".*", GemmQuant(x=E4M3, w=E4M3, dgrad_dy=E5M2, wgrad_dy=E5M2), name="fp8")]




def _bfp_cfg(act_block, weight_block):
  # wgrad_x / dgrad_w left None: with bwd_from_fwd the backward GEMMs already take the BFP x̃, w̃.
  act, weight = BFPFormat(4, act_block), BFPFormat(4, weight_block)
  return GemmQuant(x=act, w=weight, wgrad_dy=act, dgrad_dy=act)


BFP = [QuantRule(".*", {"conv": _bfp_cfg((1, 3, 3, 8), (3, 3, 8, 1)),
                        "linear": _bfp_cfg((1, 8), (8, 1))}, name="bfp")]


def test_model_list_is_covered():
  assert set(TINY) == set(zoo.MODELS)


def _build(name, seed=0):
  """The same values for the same seed, so the float32 and quantized copies start identical."""
  model = build(name, TINY[name][0], seed)
  model.train()
  return model


_loss = classification_loss


def _kernel_key(path):
  return tuple(int(p) if p.isdigit() else p for p in path.split("/")) + ("kernel",)


def _loss_and_grads(name, models, x):
  """Loss and gradient over every Param of each model, all in one jitted program (one compile
  instead of one per model); returns [(loss, {path: grad ndarray})] in the models' order."""
  graphdefs, params, rests = zip(*(nnx.split(m, nnx.Param, ...) for m in models))

  @jax.jit
  def value_and_grad(params, rests, x):
    def one(graphdef, p, rest):
      return jax.value_and_grad(
          lambda p: _loss(name, nnx.merge(graphdef, p, rest, copy=True), x))(p)

    return [one(*args) for args in zip(graphdefs, params, rests, strict=True)]

  out = []
  for (loss, grads), p in zip(value_and_grad(params, rests, x), params, strict=True):
    flat = {path: np.asarray(g.get_value()) for path, g in nnx.to_flat_state(grads)}
    assert flat.keys() == {path for path, _ in nnx.to_flat_state(p)}
    out.append((float(loss), flat))
  return out


# FCN and VGG19 (25-35 s each here), ResNet18/50 and DavidNet (6-14 s) run in the slow tier: the
# small CNN covers the quantized conv (fp8, and BFP's ragged NHWC / HWIO groups) and dense layers
# in the default one, BERT the Einsum layers and nested module paths, the MLP dense layers alone.
# A quantized conv's backward is the vjp of the lax op for every stride, padding and kernel size
# (jlp.gemm.qdot), so the conv models add no quantization path; every model's own float32
# forward and backward stays in the default tier in
# tests/models/models_test.py::test_gradients_finite_for_every_param (and ResNet18 quantized by
# rules in tests/nn/inplace_fi_test.py).
SLOW = ("fcn", "vgg19", "resnet18", "resnet50", "davidnet")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW
                                  else n for n in sorted(TINY)])
def test_quantized_forward_and_backward_under_jit(name):
  x = TINY[name][1](jax.random.key(3))
  variants = {"fp8": FP8, "bfp": BFP} if name in CONV_MODELS else {"fp8": FP8}
  models = {}
  for label, rules in variants.items():
    model = _build(name)
    gemms = zoo.gemm_modules(model)
    report = quantize_model(model, rules)
    assert set(report.kinds) == set(gemms), label
    assert set(report.layers) == set(gemms), label  # every GEMM layer quantized
    assert not report.unchanged and not report.unused_rules, label
    models[label] = model

  (ref_loss, ref_grads), *quantized = _loss_and_grads(name, [_build(name), *models.values()], x)
  assert np.isfinite(ref_loss)
  for label, (loss, grads) in zip(models, quantized, strict=True):
    assert np.isfinite(loss), label
    assert loss != ref_loss, label
    for path, g in grads.items():
      assert g.shape == ref_grads[path].shape and np.all(np.isfinite(g)), (label, path)
    for path in gemms:
      g, ref = grads[_kernel_key(path)], ref_grads[_kernel_key(path)]
      assert np.any(g != 0), (label, path)
      assert not np.array_equal(g, ref), (label, path)  # the quantized backward reaches every layer
