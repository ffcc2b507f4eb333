"""jlp.nn.bfpsim: BFPsim JSON presets as quantization rules (bfp.md §1.5, §2.6, §4)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jlp.formats import BFPFormat
from jlp.gemm.config import GemmQuant
from jlp.nn import PRESETS, QuantRule, bfpsim_to_path, load_bfpsim_preset, quantize_model
from jlp.quantize import quantize


@pytest.fixture(scope="module")
def resnet18_shapes():
  """A real-width CIFAR ResNet18, abstract (no parameter memory, no compute)."""
  from jlp.models import get_model
  return lambda: nnx.eval_shape(lambda: get_model("resnet18", num_classes=10, rngs=nnx.Rngs(0)))


RESIDUAL_CONVS = sorted(f"layer{s}/{b}/conv{c}" for s in (1, 2, 3, 4) for b in (0, 1) for c in (1, 2))
FP32_LAYERS = ["conv1", "layer2/0/shortcut/0", "layer3/0/shortcut/0", "layer4/0/shortcut/0", "linear"]


def test_preset_rules_order_and_translation():
  rules = load_bfpsim_preset("ResNet18_FB12")
  assert all(isinstance(r, QuantRule) for r in rules)
  assert rules[0].name == "net.conv1" and rules[0].cfg is None and rules[0].matches("conv1")
  assert not rules[0].matches("layer1/0/conv1")
  sc = next(r for r in rules if r.name == "net.layer2.0.shortcut.0")
  assert sc.matches("layer2/0/shortcut/0") and not sc.matches("layer2/0/shortcutX0")
  last = rules[-1]
  assert last.name == "default" and last.path == ".*" and set(last.cfg) == {"conv", "linear"}
  conv = last.cfg["conv"]
  b = BFPFormat(4, (1, 3, 3, 24))       # NCHW [1,24,3,3] -> NHWC
  wb = BFPFormat(4, (3, 3, 24, 1))      # OIHW [1,24,3,3] -> HWIO
  assert conv == GemmQuant(x=b, w=wb, wgrad_dy=b, wgrad_x=b, dgrad_dy=b, dgrad_w=wb)
  # a Linear takes the first two dims ((out, in) -> (in, out)), as BFPsim's 2-D kernel
  assert last.cfg["linear"].w == BFPFormat(4, (24, 1)) and last.cfg["linear"].x == BFPFormat(4, (1, 24))
  # FB12LG24: local-gradient GEMM operands (bio -> dgrad_dy, biw -> dgrad_w) in FB24 mode
  lg = load_bfpsim_preset("ResNet18_FB12LG24")[-1].cfg["conv"]
  assert lg.x == b and lg.wgrad_x == b and lg.wgrad_dy == b
  assert lg.dgrad_dy == BFPFormat(16, (1, 3, 3, 6)) and lg.dgrad_w == BFPFormat(16, (3, 3, 6, 1))
  # default_FB24 keeps BFPsim's bio_dim typo [1,612,3,3]
  assert load_bfpsim_preset("default_FB24")[-1].cfg["conv"].dgrad_dy.block == (1, 3, 3, 612)
  assert [r.name for r in load_bfpsim_preset("default_FB12")] == ["default"]
  assert {"ResNet18_FB12", "ResNet18_FB16", "ResNet18_FB24", "ResNet18_FB12LG24",
          "default_FB12"} <= set(PRESETS)
  PRESETS["ResNet18_FB12"]["default"]["fw_bit"] = 99  # lookups are copies
  assert PRESETS["ResNet18_FB12"]["default"]["fw_bit"] == 4


def test_paths_agree_with_model_zoo():
  import jlp.models
  for k in ["net.conv1", "net.layer1.0.conv1", "net.layer2.0.shortcut.0", "net.linear", "fc"]:
    assert bfpsim_to_path(k) == jlp.models.bfpsim_to_path(k)


def test_resnet18_fb12_quantizes_exactly_the_residual_convs(resnet18_shapes):
  model = resnet18_shapes()
  rep = quantize_model(model, load_bfpsim_preset("ResNet18_FB12"))
  assert sorted(rep) == RESIDUAL_CONVS
  assert sorted(rep.unchanged) == FP32_LAYERS
  assert all(rep.rules[rep.matched[p]].name == "net." + p.replace("/", ".") for p in FP32_LAYERS)
  # the torchvision-style keys and net.fc match nothing on the CIFAR ResNet18
  assert sorted(r.name for r in rep.unused_rules) == sorted(
      [f"net.layer{n}.0.downsample{s}" for n in (2, 3, 4) for s in ("", ".0")] + ["net.fc"])
  # default_FB12 puts BFP on every Conv and the Linear, like BFPsim's "default"-only presets
  rep = quantize_model(resnet18_shapes(), load_bfpsim_preset("default_FB12"))
  assert sorted(rep) == sorted(RESIDUAL_CONVS + FP32_LAYERS)
  assert rep["linear"].w == BFPFormat(4, (24, 1))


def _groups(shape, block):
  return [math.ceil(s / d) for s, d in zip(shape, block)]


# bfp.md §1.5: channel splits (full groups, remainder) per mode
SPLITS = {"ResNet18_FB12": {64: (2, 16), 128: (5, 8), 256: (10, 16), 512: (21, 8)},
          "ResNet18_FB16": {64: (5, 4), 128: (10, 8), 256: (21, 4), 512: (42, 8)},
          "ResNet18_FB24": {64: (10, 4), 128: (21, 2), 256: (42, 4), 512: (85, 2)}}
# bfp.md §1.5: 3x3 spatial tiles of a CIFAR feature map: (full tiles, last tile)
TILES = {32: (10, 2), 16: (5, 1), 8: (2, 2), 4: (1, 1)}


@pytest.mark.parametrize("preset", sorted(SPLITS))
def test_group_counts_match_spec(resnet18_shapes, preset):
  model = resnet18_shapes()
  rep = quantize_model(model, load_bfpsim_preset(preset))
  convs = {p: m for p, m in ((p, m) for p, m in _named(model)) if p in rep}
  assert len(convs) == 16
  for path, conv in convs.items():
    cfg = rep[path]
    kh, kw, cin, cout = conv.kernel.shape
    stage, block, idx = int(path[5]), int(path.split("/")[1]), path[-1]
    # weights: one group = 1 output channel x d input channels x the whole 3x3 kernel
    for role in ("w", "dgrad_w"):
      blk = getattr(cfg, role).block
      g = _groups(conv.kernel.shape, blk)
      assert g == [1, 1, math.ceil(cin / blk[2]), cout]
      assert (cin // blk[2], cin % blk[2]) == SPLITS[preset][cin]
    # activations (x role): NHWC input map of this conv on 32x32 CIFAR images
    hw = 32 >> (stage - 1)
    if block == 0 and idx == "1" and stage > 1:
      hw *= 2  # the strided first conv of a stage sees the previous stage's map
    blk = cfg.x.block
    n, h, w, c = _groups((2, hw, hw, cin), blk)
    assert (n, h, w) == (2, math.ceil(hw / 3), math.ceil(hw / 3))
    assert (hw // blk[1], hw % blk[1] or blk[1]) == TILES[hw]
    assert (cin // blk[3], cin % blk[3]) == SPLITS[preset][cin]
    # gradients w.r.t. the output (dgrad_dy, wgrad_dy): the output map, cout channels
    assert (cout // cfg.dgrad_dy.block[3], cout % cfg.dgrad_dy.block[3]) == SPLITS[preset][cout]


def _named(model):
  return [("/".join(map(str, p)), m) for p, m in nnx.iter_modules(model)]


def test_preset_forward_on_a_conv_matches_reference():
  # rbg key: a cheaper init compile than threefry; the kernel values do not matter here
  conv = nnx.Conv(30, 2, (3, 3), use_bias=False, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
  rep = quantize_model(conv, load_bfpsim_preset("default_FB12"))
  assert list(rep) == [""]
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 4, 30)), jnp.float32)
  ref = jax.jit(lambda x, k: lax.conv_general_dilated(  # jitted: one compile, not op by op
      quantize(x, BFPFormat(4, (1, 3, 3, 24))), quantize(k, BFPFormat(4, (3, 3, 24, 1))),
      (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      precision=lax.Precision.HIGHEST))(x, conv.kernel[...])
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(conv, x), ref, rtol=1e-6, atol=1e-6)


def test_entries_and_files(tmp_path):
  conf = {"name": "mine", "comment": "ignored",
          "net.layer1.0.conv1": {"type": "torch.nn.Conv2d"},
          "net.fc": {"fw_bit": 8, "fw_dim": [4, 2], "fi": False},
          "default": {"fw_bit": 4, "fw_dim": [1, 8, 3, 3], "fi_dim": [1, 8, 3, 3]}}
  f = tmp_path / "mine.json"
  f.write_text(json.dumps(conf))
  for src in (conf, str(f), f):
    rules = load_bfpsim_preset(src)
    assert [r.name for r in rules] == ["net.layer1.0.conv1", "net.fc", "default"]
    assert rules[0].cfg is None and rules[0].path == "layer1/0/conv1"
    # 2-D dims fit a Linear only: the rule applies to linear layers alone
    assert set(rules[1].cfg) == {"linear"} and rules[1].cfg["linear"].x is None
    assert rules[1].cfg["linear"].w == BFPFormat(8, (2, 4))
  with pytest.raises(ValueError, match="'net.layer1.0.conv1' has unknown key 'fw_dims'"):
    load_bfpsim_preset({"net.layer1.0.conv1": {"fw_bit": 4, "fw_dims": [1, 24, 3, 3]}})
  with pytest.raises(ValueError, match="'default' has unknown key 'bwg_boost'"):
    load_bfpsim_preset({"default": {"bwg_boost": 2.0}})
  with pytest.raises(ValueError, match="unknown key 'layer1.0.conv1'"):
    load_bfpsim_preset({"layer1.0.conv1": {"type": "default"}})
  with pytest.raises(ValueError, match="'net.conv1' fits neither"):
    load_bfpsim_preset({"net.conv1": {"fw_dim": [24]}})
  assert load_bfpsim_preset("ResNet18_FB16", rounding="nearest")[-1].cfg["conv"].w.rounding == "nearest"
