"""quantize_model(..., bfpsim_inplace_fi=True): BFPsim's in-place fi side effect (bfp.md §2.3).

Reference: a tiny ResNet18's stem and first BasicBlock written by hand from bfp.md §2.3 with
`jlp.quantize` and lax convolutions, reusing only the model's float32 BatchNorms (eval mode: affine)
and kernels. BFPsim's Q_fi overwrites the block input x in place, so the quantized xq feeds conv1 and
the identity shortcut, and the stem ReLU's backward mask is (xq > 0); likewise the block's inner
ReLU output feeds conv2 quantized and gets the mask (hq > 0). The input gradient is chained by hand
(jax.vjp of the float32 pieces, the masks written out). With the switch off the reference is the
functional one: the shortcut gets x and the masks are the ReLUs' own.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jlp
from jlp.formats import BFPFormat
from jlp.gemm.config import GemmQuant
from jlp.nn import QuantRule, quantize_model, unquantize_model
from tiny_models import build

pytestmark = pytest.mark.usefixtures("fast_compile")

FI1 = BFPFormat(2, (1, 2, 2, 4))  # conv1's x role: NHWC boxes of 2x2 pixels x 4 channels
FI2 = BFPFormat(3, (1, 1, 2, 4))  # conv2's x role
TINY = dict(num_classes=10, width=4, num_blocks=(1, 1, 1, 1))


def _model(inplace: bool):
  model = build("resnet18", TINY, seed=3)
  model.eval()
  report = quantize_model(model, [QuantRule("layer1/0/conv1", GemmQuant(x=FI1)),
                                  QuantRule("layer1/0/conv2", GemmQuant(x=FI2))],
                          bfpsim_inplace_fi=inplace)
  return model, report


def _conv(x, kernel):
  return lax.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)),
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                  precision=lax.Precision.HIGHEST)


def _reference(model, img, ct, inplace: bool):
  """(layer1/0 output, d<output * ct>/d img, xq, x) by hand (module docstring)."""
  block = model.layer1[0]
  w1, w2 = block.conv1.kernel[...], block.conv2.kernel[...]
  stem = lambda v: model.bn1(_conv(v, model.conv1.kernel[...]))
  branch1 = lambda v: block.bn1(_conv(jlp.quantize(v, FI1), w1))  # conv1 quantizes its input
  branch2 = lambda v: block.bn2(_conv(jlp.quantize(v, FI2), w2))

  z0, stem_vjp = jax.vjp(stem, img)
  x = jax.nn.relu(z0)
  xq = jlp.quantize(x, FI1)
  a1, branch1_vjp = jax.vjp(branch1, xq if inplace else x)
  h = jax.nn.relu(a1)
  hq = jlp.quantize(h, FI2)
  a2, branch2_vjp = jax.vjp(branch2, hq if inplace else h)
  pre = a2 + (xq if inplace else x)
  out = jax.nn.relu(pre)

  g_pre = jnp.where(pre > 0, ct, 0.0)
  (g_h,) = branch2_vjp(g_pre)
  g_a1 = jnp.where((hq if inplace else a1) > 0, g_h, 0.0)
  (g_x,) = branch1_vjp(g_a1)
  g_x = g_x + g_pre  # the shortcut
  g_z0 = jnp.where((xq if inplace else z0) > 0, g_x, 0.0)
  (g_img,) = stem_vjp(g_z0)
  return out, g_img, xq, x


def _model_output_and_grad(model, img, ct):
  f = lambda v: model.features(v)[0]
  out = f(img)
  g = jax.grad(lambda v: jnp.sum(f(v) * ct))(img)
  return out, g


# The model and its reference in one jitted program (eagerly, their quantizers and convolutions
# compiled op by op); module-level, so a model structure compiles once for all the tests.
@functools.partial(nnx.jit, static_argnums=3)
def _model_and_reference(model, img, ct, inplace: bool):
  return _model_output_and_grad(model, img, ct), _reference(model, img, ct, inplace)


@pytest.fixture(scope="module")
def inputs():
  ki, kc = jax.random.split(jax.random.key(7))
  return jax.random.normal(ki, (2, 8, 8, 3)), jax.random.normal(kc, (2, 8, 8, 4))


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "functional"])
def test_block_output_and_input_gradient_match_reference(inplace, inputs):
  img, ct = inputs
  model, report = _model(inplace)
  assert report.bfpsim_inplace_fi is inplace
  assert model.bfpsim_inplace_fi is inplace and model.layer1[0].bfpsim_inplace_fi is inplace
  (got_out, got_g), (want_out, want_g, xq, x) = _model_and_reference(model, img, ct, inplace)
  # The data exercise the side effect: BFP flushes some positive activations to zero.
  assert np.any((np.asarray(x) > 0) & (np.asarray(xq) == 0))
  np.testing.assert_array_equal(got_out, want_out)
  np.testing.assert_array_equal(got_g, want_g)


def test_switch_changes_shortcut_and_gradient(inputs):
  img, ct = inputs
  on, off = _model(True)[0], _model(False)[0]
  out_on, g_on = _model_and_reference(on, img, ct, True)[0]  # compiled in the test above
  out_off, g_off = _model_and_reference(off, img, ct, False)[0]
  assert not np.allclose(out_on, out_off)
  assert not np.allclose(g_on, g_off)
  unquantize_model(on)
  assert not on.bfpsim_inplace_fi and not on.layer1[0].bfpsim_inplace_fi


def test_default_off_leaves_model_unchanged(inputs):
  img, _ = inputs
  plain = build("resnet18", TINY, seed=3)
  plain.eval()
  model = build("resnet18", TINY, seed=3)
  model.eval()
  report = quantize_model(model, [])
  assert not report.bfpsim_inplace_fi and not model.layer1[0].bfpsim_inplace_fi
  fwd = nnx.jit(lambda m, x: m(x))
  np.testing.assert_array_equal(fwd(model, img), fwd(plain, img))


def test_bad_input():
  with pytest.raises(ValueError, match="bfpsim_inplace_fi=1"):
    quantize_model(build("resnet18", TINY), [], bfpsim_inplace_fi=1)
  with pytest.raises(ValueError, match="bfpsim_inplace_fi=True is not allowed for VGG"):
    quantize_model(build("vgg19", dict(num_classes=10, width=4)), [], bfpsim_inplace_fi=True)
  model = build("resnet18", TINY)
  quantize_model(model, [("layer1/0/conv1", GemmQuant(x=BFPFormat(2, (1, 2, 2, 4), "stochastic")))],
                 rngs=nnx.Rngs(0), bfpsim_inplace_fi=True)
  with pytest.raises(ValueError, match="layer1/0/conv1.*stochastic"):  # raised while tracing
    nnx.jit(lambda m, x: m(x))(model, jnp.zeros((2, 8, 8, 3)))


def test_stage_output_seen_quantized_resnet50():
  """Bottleneck ResNet (ImageNet stem): with only layer2/0/conv1's x BFP, the layer1 output that
  `features` returns (what FCN's heads read) is the quantized tensor, jlp.quantize of the
  functional model's layer1 output."""
  fmt = BFPFormat(2, (1, 1, 1, 16))
  kwargs = dict(num_classes=7, width=4, num_blocks=(1, 1, 1, 1))
  img = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
  models = {}
  for inplace in (False, True):
    model = build("resnet50", kwargs, seed=5)
    model.eval()
    quantize_model(model, [("layer2/0/conv1", GemmQuant(x=fmt))], bfpsim_inplace_fi=inplace)
    models[inplace] = model

  @nnx.jit  # both models and the reference in one program (eagerly, hundreds of tiny compiles)
  def run(functional, inplace, x):
    out = functional.features(x)[0]
    return {False: out, True: inplace.features(x)[0]}, jlp.quantize(out, fmt)

  outs, want = run(models[False], models[True], img)
  np.testing.assert_array_equal(outs[True], want)
  assert not np.array_equal(outs[True], outs[False])
