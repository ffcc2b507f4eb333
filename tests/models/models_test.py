"""Model zoo tests: tiny configs (forward under nnx.jit in train/eval mode, jitted gradients over all
params), full-size parameter counts via nnx.eval_shape (no memory, no compute), module paths, and
that every parameter GEMM is a Linear/Conv/Einsum call."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jlp.models as zoo
from tiny_models import BATCH as B
from tiny_models import build, classification_loss, images, token_ids


pytestmark = pytest.mark.usefixtures("fast_compile")


# name -> (builder kwargs, input maker, expected output shape)
TINY = {
    # one BasicBlock per stage: layer1's is the stride-1 identity block, layers 2-4 the projection
    # ones, so every block path runs at half the ops of (2, 2, 2, 2) (full depth: eval_shape tests)
    "resnet18": (dict(num_classes=10, width=4, num_blocks=(1, 1, 1, 1)), images(8), (B, 10)),
    "resnet50": (dict(num_classes=7, width=4, num_blocks=(1, 1, 1, 1)), images(32), (B, 7)),
    "davidnet": (dict(num_classes=10, width=4), images(16), (B, 10)),
    "vgg19": (dict(num_classes=10, width=4), images(32), (B, 10)),
    "fcn": (
        dict(num_classes=5,
             block="basic",
             num_blocks=(1, 1, 1, 1),
             width=4,
             channels=8,
             aux_channels=4),
        images(16),
        (B, 16, 16, 5),
    ),
    "bert_small": (
        dict(vocab=50, max_len=16, hidden=16, num_layers=2, heads=2, num_classes=3),
        token_ids(8, 50),
        (B, 3),
    ),
    "mlp": (dict(num_classes=10, hidden=(8, 6)), images(8, 1), (B, 10)),
}


def _build(name):
  return build(name, TINY[name][0])


def _inputs(name):
  return TINY[name][1](jax.random.key(3))


def _batch_stats(model):
  return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.BatchStat))]


# ResNet-50, VGG19 and FCN run in the slow tier: ResNet18 and DavidNet (its own ConvBN blocks)
# keep the BatchNorm models' train / eval switch (both build their BatchNorms with
# resnet.batch_norm, as ResNet-50, VGG19 and FCN do), BERT dropout's, the MLP neither; each
# model's own forward runs in the default tier in train mode in
# test_gradients_finite_for_every_param and in eval mode (traced, FCN without its auxiliary
# head) in test_full_size_output_shapes.
FORWARD_SLOW = ("resnet50", "vgg19", "fcn")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in FORWARD_SLOW
                                  else n for n in sorted(TINY)])
def test_forward_train_and_eval(name):
  model = _build(name)
  x = _inputs(name)
  shape = TINY[name][2]
  fwd = nnx.jit(lambda m, x: m(x))

  stats0 = _batch_stats(model)
  model.train()
  y_train = fwd(model, x)
  assert y_train.shape == shape and y_train.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(y_train)))
  stats1 = _batch_stats(model)
  if stats0:  # train mode updates the BatchNorm running statistics
    assert any(not np.array_equal(a, b) for a, b in zip(stats0, stats1, strict=True))

  model.eval()
  y_eval = fwd(model, x)
  assert y_eval.shape == shape and bool(jnp.all(jnp.isfinite(y_eval)))
  np.testing.assert_array_equal(np.asarray(fwd(model, x)), np.asarray(y_eval))  # deterministic
  # eval mode leaves the statistics alone
  for a, b in zip(stats1, _batch_stats(model), strict=True):
    np.testing.assert_array_equal(a, b)
  if name == "mlp":  # neither BatchNorm nor dropout: both modes compute the same
    np.testing.assert_array_equal(np.asarray(y_train), np.asarray(y_eval))
  else:
    assert not np.allclose(np.asarray(y_train), np.asarray(y_eval))  # BN batch stats / dropout

  for p in jax.tree.leaves(nnx.state(model, nnx.Param)):
    assert p.dtype == jnp.float32


_loss = classification_loss


@pytest.mark.parametrize("name", sorted(TINY))
def test_gradients_finite_for_every_param(name):
  model = _build(name)
  model.train()
  x = _inputs(name)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def value_and_grad(params, rest, x):

    def loss_fn(p):
      m = nnx.merge(graphdef, p, rest, copy=True)  # copy=True: toolchain.md Gotcha 4
      return _loss(name, m, x)

    return jax.value_and_grad(loss_fn)(params)

  loss, grads = value_and_grad(params, rest, x)
  assert np.isfinite(float(loss))
  flat_p = dict(nnx.to_flat_state(params))
  flat_g = dict(nnx.to_flat_state(grads))
  assert flat_g.keys() == flat_p.keys()
  for path, g in flat_g.items():
    g = np.asarray(g.get_value() if hasattr(g, "get_value") else g.value)
    assert g.shape == flat_p[path].shape and np.all(np.isfinite(g)), path
  # every GEMM kernel receives gradient (all layers are on the loss path)
  for path, mod in zoo.gemm_modules(model).items():
    key = tuple(int(p) if p.isdigit() else p for p in path.split("/")) + ("kernel",)
    g = np.asarray(flat_g[key].get_value())
    assert np.any(g != 0), path


def _param_count(build):
  abstract = nnx.eval_shape(build)
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    "name,kwargs,expected",
    [
        ("resnet18", {}, 11_173_962),  # kuangliu CIFAR ResNet18, 10 classes
        ("resnet50", {}, 25_557_032),  # torchvision resnet50, 1000 classes
        ("resnet18", dict(num_classes=1000, stem="imagenet"), 11_689_512),  # torchvision resnet18
        ("vgg19", {}, 20_040_522),  # kuangliu VGG19-BN, 10 classes
        ("davidnet", {}, 6_573_120),
        ("mlp", {}, 64 * 1536 + 1536 + 2 * (1536 * 1536 + 1536) + 1536 * 10 + 10),  # 4,836,874
    ],
)
def test_full_size_param_counts(name, kwargs, expected):
  assert _param_count(lambda: zoo.get_model(name, **kwargs)) == expected


def test_resnet18_paths_match_bfpsim_names():
  model = nnx.eval_shape(lambda: zoo.resnet18())
  raw = [p for p, _ in nnx.iter_modules(model)]
  assert ("layer1", 0, "conv1") in raw  # flax 0.12: tuple paths, int list indices
  gemms = zoo.gemm_modules(model)
  expected = {"conv1", "linear"}
  for layer in range(1, 5):
    for blk in range(2):
      expected |= {f"layer{layer}/{blk}/conv1", f"layer{layer}/{blk}/conv2"}
    if layer > 1:
      expected.add(f"layer{layer}/0/shortcut/0")
  assert set(gemms) == expected and len(expected) == 21
  assert isinstance(gemms["layer1/0/conv1"], nnx.Conv)
  assert isinstance(gemms["linear"], nnx.Linear)
  mods = zoo.named_modules(model)
  assert isinstance(mods["layer2/0/shortcut/1"], nnx.BatchNorm)
  assert isinstance(mods["layer3/1/bn2"], nnx.BatchNorm)
  # BFPsim preset keys (bfp.md §2.6) -> paths
  for key in [
      "net.conv1", "net.layer1.0.conv1", "net.layer4.1.conv2", "net.layer2.0.shortcut.0",
      "net.linear"
  ]:
    assert zoo.bfpsim_to_path(key) in gemms, key
  # torchvision naming for ResNet50
  r50 = zoo.gemm_modules(nnx.eval_shape(lambda: zoo.resnet50()))
  assert {"conv1", "fc", "layer1/0/downsample/0", "layer4/2/conv3"} <= set(r50)
  assert len(r50) == 54  # 53 convs + fc


def test_registry():
  assert set(zoo.MODELS) == {"resnet18", "resnet50", "davidnet", "vgg19", "fcn", "bert_small", "small_cnn",
                             "mlp"}
  with pytest.raises(ValueError, match="nope"):
    zoo.get_model("nope")


def _count_gemm_eqns(jaxpr):
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      n += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _count_gemm_eqns(sub)
  return n


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_param_gemm_is_a_layer(name):
  """The traced forward has exactly one GEMM per Linear/Conv/Einsum layer, plus the known
    activation-side products: BERT's q·kᵀ and probs·v, FCN's bilinear resizes."""
  model = nnx.eval_shape(lambda: zoo.get_model(name, **TINY[name][0]))
  model.eval()
  x = jax.eval_shape(lambda: _inputs(name))
  # Route every layer's GEMM through a recording wrapper, as quantization rules do.
  called = []
  for path, mod in zoo.gemm_modules(model).items():
    attr = {
        nnx.Linear: "dot_general",
        nnx.Conv: "conv_general_dilated",
        nnx.Einsum: "einsum_op"
    }[type(mod)]
    orig = getattr(mod, attr)

    def wrapped(*args, _orig=orig, _path=path, **kw):
      called.append(_path)
      return _orig(*args, **kw)

    setattr(mod, attr, wrapped)
  graphdef, state = nnx.split(model)

  def fwd(state, x):
    m = nnx.merge(graphdef, state, copy=True)
    return m(x, return_aux=True) if name == "fcn" else m(x)

  n = _count_gemm_eqns(jax.make_jaxpr(fwd)(state, x).jaxpr)
  extra = 0
  if name == "bert_small":
    extra = 2 * TINY[name][0]["num_layers"]
  if name == "fcn":
    resize = jax.make_jaxpr(lambda a: jax.image.resize(a, (B, 16, 16, 5), "bilinear"))(
        jax.ShapeDtypeStruct((B, 2, 2, 5), jnp.float32))
    extra = 2 * _count_gemm_eqns(resize.jaxpr)
  assert n == len(zoo.gemm_modules(model)) + extra
  assert sorted(called) == sorted(zoo.gemm_modules(model))  # each layer used once, via its op


def test_real_init():
  """One real (jitted) construction: PyTorch-default init bounds, BN gamma 1, float32."""
  key = jax.random.key(0, impl="rbg")  # threefry init compiles ~1 s per distinct shape on CPU
  # one block per stage: fewer draws to compile; the checked layers are all there
  model = nnx.jit(lambda: zoo.resnet18(width=4, num_blocks=(1, 1, 1, 1), rngs=nnx.Rngs(key)))()
  k = np.asarray(model.layer1[0].conv1.kernel.get_value())
  assert k.shape == (3, 3, 4, 4) and k.dtype == np.float32
  assert np.abs(k).max() <= 1 / np.sqrt(36) and k.std() > 0.05
  np.testing.assert_array_equal(np.asarray(model.bn1.scale.get_value()), np.ones(4, np.float32))
  b = np.asarray(model.linear.bias.get_value())
  assert np.abs(b).max() <= 1 / np.sqrt(32) and np.any(b != 0)
  assert model.layer1[0].bn1.momentum == 0.9 and model.layer1[0].bn1.epsilon == 1e-5


@pytest.mark.parametrize(
    "name,shape,expected",
    [
        ("resnet18", (1, 32, 32, 3), (1, 10)),
        ("resnet50", (1, 224, 224, 3), (1, 1000)),
        ("davidnet", (1, 32, 32, 3), (1, 10)),
        ("vgg19", (1, 32, 32, 3), (1, 10)),
        ("fcn", (1, 97, 65, 3), (1, 97, 65, 19)),  # odd sizes: logits resized to the input
        ("bert_small", (1, 128), (1, 2)),
    ],
)
def test_full_size_output_shapes(name, shape, expected):
  """Default (paper-size) models, traced only (nnx.eval_shape: no memory, no compute)."""
  dtype = jnp.int32 if name == "bert_small" else jnp.float32

  def fwd():
    model = zoo.get_model(name)
    model.eval()
    return model(jnp.zeros(shape, dtype))

  out = nnx.eval_shape(fwd)
  assert out.shape == expected and out.dtype == jnp.float32


def test_bert_pad_id_masks_padding_out_of_attention():
  """pad_id=0 without an attention_mask: the logits of [ids, PAD, PAD] are those of the ids alone
  (references: the same model on the truncated sequence, and with the explicit mask)."""
  model = build("bert_small", dict(TINY["bert_small"][0], pad_id=0))
  model.eval()
  ids = jax.random.randint(jax.random.key(4), (B, 6), 1, 50)
  padded = jnp.concatenate([ids, jnp.zeros((B, 2), ids.dtype)], axis=1)
  mask = jnp.concatenate([jnp.ones((B, 6), bool), jnp.zeros((B, 2), bool)], axis=1)
  unmasked = build("bert_small", TINY["bert_small"][0])  # same parameters, no pad_id
  unmasked.eval()
  # the four forwards in one jitted program: one compile (eagerly, hundreds of tiny ones)
  y_padded, y_ids, y_masked, y_unmasked = nnx.jit(lambda m, u, ids, padded, mask: (
      m(padded), m(ids), m(padded, attention_mask=mask), u(padded)))(
          model, unmasked, ids, padded, mask)
  np.testing.assert_allclose(y_padded, y_ids, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(y_padded, y_masked)
  assert not np.allclose(y_unmasked, y_padded, atol=1e-4)  # padding is attended there
