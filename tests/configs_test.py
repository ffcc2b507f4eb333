"""Every experiment config: defaults pass the checks, and its `:local` variant trains a few steps."""

import glob
import importlib
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jlp.train import config as config_lib
from jlp.train import loop, recipe
from jlp.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not p.endswith("__init__.py"))


def test_the_seed_recipes_are_all_there():
  assert set(CONFIGS) >= {"digits", "cpd_resnet18_cifar10", "cpd_davidnet_cifar10",
                          "cpd_resnet50_imagenet", "cpd_fcn_cityscapes", "bfp_resnet18_cifar100"}


@pytest.mark.parametrize("name", CONFIGS)
def test_full_config_is_valid(name):
  c = importlib.import_module(f"configs.{name}").get_config()
  config_lib.validate(c)
  for field in ("max_steps", "log_every", "eval_every", "checkpoint_every", "seed"):
    assert field in c


HIPRESS_CONFIGS = ("hipress_vgg19", "hipress_resnet50", "hipress_bert_small")
# The compressor fields HiPress ran with, written out from hipress.md §1.1-§1.5 (the reference).
HIPRESS_FIELDS = {
    "none": {},
    "onebit": {"scale_mode": "two_means"},                                # §1.5 (Seide, two means)
    "tbq": {"threshold": 1.0},                                            # §1.1 MXNet op default
    "terngrad": {"bitwidth": 2, "stochastic": False},                     # §1.2 scripts
    "dgc": {"density": 0.001, "sample_rate": 0.001, "momentum": 0.9},     # §1.3
    "graddrop": {"drop_ratio": 0.999, "sample_rate": 0.001},              # §1.4
}


#: The :local variants compress gradients of more than this many floats.
LOCAL_MIN_SIZE = {"hipress_vgg19": 1024, "hipress_resnet50": 1024, "hipress_bert_small": 0}


def param_floats(c):
  """The number of float32 parameters of the config's model (built abstractly)."""
  train, _ = recipe.datasets(c)
  model = nnx.eval_shape(lambda: recipe.model(c, train))
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_the_hipress_configs_are_there():
  assert set(CONFIGS) >= set(HIPRESS_CONFIGS)


@pytest.mark.parametrize("name", HIPRESS_CONFIGS)
@pytest.mark.parametrize("compressor", sorted(HIPRESS_FIELDS))
def test_hipress_config_selects_each_compressor_with_hipress_fields(name, compressor):
  module = importlib.import_module(f"configs.{name}")
  for topology in ("ps", "ring"):
    for local in ("", ",local"):
      c = module.get_config(f"compressor={compressor},topology={topology}{local}")
      config_lib.validate(c)
      codec = config_lib.compressor(c)
      if compressor == "none":  # the float32 baseline: the compression fields keep their defaults
        assert c.compression.to_dict() == config_lib.base_config().compression.to_dict()
        assert codec is None
        continue
      assert (c.compression.name, c.compression.topology) == (compressor, topology)
      assert c.compression.min_size == (LOCAL_MIN_SIZE[name] if local else 262144)  # §2.1
      assert dict(c.compression.kwargs) == HIPRESS_FIELDS[compressor]
      assert codec.name == compressor
      for field, value in HIPRESS_FIELDS[compressor].items():
        assert getattr(codec, field) == value


def test_hipress_defaults_and_bad_arguments():
  defaults = {name: importlib.import_module(f"configs.{name}").get_config()
              for name in HIPRESS_CONFIGS}
  assert {n: (c.compression.name, c.compression.topology) for n, c in defaults.items()} == {
      "hipress_vgg19": ("onebit", "ps"), "hipress_bert_small": ("onebit", "ps"),
      "hipress_resnet50": ("dgc", "ring")}  # hipress.md §4.2: the headline runs
  c = importlib.import_module("configs.hipress_vgg19").get_config("compressor=bogus")
  with pytest.raises(ValueError, match="compression.name='bogus' is not allowed"):
    config_lib.validate(c)
  c = importlib.import_module("configs.hipress_vgg19").get_config("topology=tree")
  with pytest.raises(ValueError, match="compression.topology='tree' is not allowed"):
    config_lib.validate(c)


def test_parse_arg():
  assert config_lib.parse_arg("local,n=3", local=False, n=1).to_dict() == {"local": True, "n": 3}
  with pytest.raises(ValueError, match="config argument 'bogus' is not allowed"):
    config_lib.parse_arg("bogus", local=False)


def test_grad_format_follows_grad_exp_and_grad_man():
  c = importlib.import_module("configs.cpd_resnet18_cifar10").get_config()
  c.grad_exp, c.grad_man = 3, 0
  assert c.grad_format == "e3m0"
  assert config_lib.grad_format(c).name == "e3m0"
  c.grad_exp, c.grad_man = 8, 23
  assert config_lib.grad_format(c) is None  # float32: CPD's plain all-reduce


# The HiPress ResNet50 and BERT local runs take 40-190 s here (their compressed syncs compile a
# codec per leaf shape); they run in the slow tier, and the compressed VGG19 and digits runs,
# BERT on TSV files and the compressed-step tests cover the same code in the default one. The
# pipelined ResNet-50 (45 s) and BERT (20-40 s) are slow too; tests/train/pipeline_loop_test.py
# covers the pipelined runner in the default tier. CPD's ResNet50 / ImageNet (35-70 s) and
# HiPress's VGG19 (15-25 s) are slow: BFPsim's ResNet18, CPD's FCN and HiPress's compressed
# digits runs cover the same loop.
# configs/digits.py:local trains in the default tier through the entry point
# (tests/train/first_hour_test.py) and in runner_data_test's non-finite loss run. CPD's DavidNet
# (5 s) and ResNet18 (6-9 s) are slow: CPD's FCN runs the same recipe loop in the default tier
# (CPD's low-precision gradient all-reduce, e4m3 without APS, on the local digits), BFPsim's
# ResNet18 trains a ResNet18 through it, tests/train/loop_test.py the all-reduce with APS,
# tests/models/models_test.py DavidNet's and ResNet18's forward and gradients,
# tests/train/optim_test.py Nesterov SGD and cpd_resnet18_lr, and the two schedule tests below
# each config's schedule as recipe.schedule builds it.
SLOW_LOCAL = ("hipress_resnet50", "hipress_bert_small", "sdpipe_resnet50", "sdpipe_bert_small",
              "cpd_resnet50_imagenet", "hipress_vgg19", "digits", "cpd_davidnet_cifar10",
              "cpd_resnet18_cifar10")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LOCAL
                                  else n for n in CONFIGS])
def test_local_variant_trains(name, tmp_path, fast_compile):
  c = importlib.import_module(f"configs.{name}").get_config("local")
  c.max_steps = min(c.max_steps, 2)  # bfp: one controller window (2 steps)
  c.log_every = 1
  c.eval_every = c.max_steps
  c.checkpoint_every = 0
  result = loop.train_and_evaluate(c, str(tmp_path), progress=False)
  rows = read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == list(range(1, c.max_steps + 1))
  assert all(np.isfinite(r["train_loss"]) for r in rows)
  assert np.isfinite(result["eval_accuracy"])
  if c.task == "segmentation":
    assert 0 <= result["eval_miou"] <= 1
  if name == "bfp_resnet18_cifar100":  # ZSE metrics of the preset; the controller logs widths
    assert "zse_fw" in rows[-1] and "bits_w" in rows[-1]
  if name in HIPRESS_CONFIGS:  # every gradient compressed: fewer bytes than a float32 ring
    w = jax.device_count()
    assert 0 < rows[-1]["wire_bytes"] < 2 * (w - 1) / w * 4 * param_floats(c) / 4


SDPIPE_CONFIGS = ("sdpipe_resnet50", "sdpipe_bert_small")


@pytest.mark.parametrize("name", SDPIPE_CONFIGS)
@pytest.mark.parametrize("sync", config_lib.PIPELINE_SYNCS)
def test_sdpipe_config_selects_each_sync_mode(name, sync):
  """SD-PIPE's runs (sdpipe.md §0, §5): 1F1B over 4 stages, 64 rows per pipeline, 4 pipelines
  (the seed's pipe_4_4) or 2 for :local on the 8 test devices; the seed's optimizers."""
  module = importlib.import_module(f"configs.{name}")
  for arg, pipelines in (("", 4), (",pipelines=2", 2), (",local", 2)):
    c = module.get_config(f"sync={sync},hetero=0.1{arg}")
    config_lib.validate(c)
    p = c.pipeline
    assert (p.schedule, p.stages, p.sync, p.hetero, p.pipelines) == ("1f1b", 4, sync, 0.1,
                                                                      pipelines)
    assert p.barrier == (name == "sdpipe_bert_small")  # the seed's BERT run: bsp=0 (§3.2)
    if arg != ",local":
      assert c.batch_size == 64 * pipelines
      assert (c.optimizer, c.lr, c.weight_decay) == (
          ("sgd", 1e-2, 1e-4) if name == "sdpipe_resnet50" else ("adamw", 1e-5, 0.01))
    if arg:
      assert config_lib.pipeline_size(c, 8) == (2, 4)
  c = module.get_config()
  assert c.pipeline.sync == "preduce" and c.pipeline.hetero == 0.0
  c.pipeline.pipelines = 0  # every device: S = 4 must divide the device count
  with pytest.raises(ValueError, match="pipeline.stages=4 is not allowed; expected a divisor"):
    config_lib.pipeline_size(c, 6)


def test_sdpipe_resnet50_lr_schedule():
  """The seed's rule (sdpipe.md §5): epoch 0 a linear warm-up, then lr * 0.2 ** (epoch // 30)."""
  c = importlib.import_module("configs.sdpipe_resnet50").get_config()
  spe = 1281167 // 256
  lr = recipe.schedule(c, spe, 1281167)
  for epoch in (1, 29, 30, 59, 60, 89, 90, 99):
    assert float(lr(epoch * spe)) == pytest.approx(1e-2 * 0.2 ** (epoch // 30), rel=1e-6)
  assert float(lr(spe // 2)) == pytest.approx(1e-2 * (spe // 2) / spe, rel=1e-6)
  assert c.max_steps == 100 * spe and c.eval_every % c.pipeline.batches_per_call == 0


def test_cpd_davidnet_lr_schedule():
  """CPD's DavidNet rule (configs/cpd_davidnet_cifar10.py): lr 0.4 interpolated linearly over
  epochs (0, 5, 24) through scales (0, 1, 0), times (c + 1) / 62 over the first 62 updates;
  reference: the rule in float64 Python. One jitted program for all the counts."""
  c = importlib.import_module("configs.cpd_davidnet_cifar10").get_config()
  spe = 50000 // 4096  # 12 steps per epoch (drop_last)
  lr = recipe.schedule(c, spe, 50000)
  counts = np.array([0, 1, 7, 30, 59, 60, 61, 62, 100, 175, 287], np.int32)
  got = jax.jit(jax.vmap(lr))(counts)

  def want(count):
    epoch = count / spe
    scale = epoch / 5 if epoch <= 5 else max(0.0, (24 - epoch) / 19)
    return 0.4 * scale * min(1.0, (count + 1) / 62)
  # float32: the interpolation's rounding is relative to the peak 0.4 (near epoch 24 too)
  np.testing.assert_allclose(got, [want(int(n)) for n in counts], rtol=1e-5, atol=4e-7)
  assert float(got[5]) < float(got[7]) and float(got[-1]) < float(got[-2])


def test_cpd_resnet18_lr_schedule():
  """CPD ResNet18's rule (cpd.md §6.1) as configs/cpd_resnet18_cifar10.py's run builds it: batch
  4096 of 50,000 images, ipe = 13; at CPD step s = count + 1: 0.1 + 1.5 s / 65 while s <= 65,
  then 1.6, x0.1 once s > 520, x0.1 again once s > 1040; reference: the rule in float64 Python,
  rounded to float32 once."""
  c = importlib.import_module("configs.cpd_resnet18_cifar10").get_config()
  lr = recipe.schedule(c, 50000 // 4096, 50000)
  counts = np.array([0, 1, 30, 63, 64, 65, 300, 519, 520, 521, 1039, 1040, 1220], np.int32)
  got = np.asarray(jax.jit(jax.vmap(lr))(counts))

  def want(s):
    if s <= 65:
      return 0.1 + 1.5 * s / 65
    return 1.6 * (0.1 if s > 520 else 1) * (0.1 if s > 1040 else 1)
  np.testing.assert_array_equal(got, np.array([want(int(n) + 1) for n in counts], np.float32))


def test_hipress_bert_small_trains_on_glue_tsv_files(tmp_path, fast_compile):
  """The full BERT config's data path (glue_tsv: SST-2 layout, WordPiece over vocab.txt) with a
  tiny model: two steps with TBQ over CaSync-Ring on the gradients of more than 300 floats (the
  MLP's two kernels, 512 floats each: 2 of 25 leaves; each compressed leaf adds a codec and ring
  of its own to the step's program, so the 9 leaves over 100 floats compiled 1-2 s longer for the
  same code; configs/hipress_bert_small.py:local, in the slow tier, compresses every leaf)."""
  vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "good", "bad", "film", "##s", "not", "."]
  (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
  sentences = [("a good film .", 1), ("a bad film .", 0), ("not good films", 0),
               ("good , good !", 1)] * 4
  for split, rows in (("train", sentences), ("dev", sentences[:8])):
    (tmp_path / f"{split}.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"{s}\t{l}\n" for s, l in rows))
  c = importlib.import_module("configs.hipress_bert_small").get_config(
      "compressor=tbq,topology=ring")
  c.dataset.root = str(tmp_path)
  c.model.kwargs.vocab = len(vocab)
  c.model.kwargs.max_len = 8         # the dataset's max_len follows (a reference)
  c.model.kwargs.update({"hidden": 16, "num_layers": 1, "heads": 2, "mlp_dim": 32})
  c.compression.min_size = 300
  c.batch_size, c.eval_batch_size = 16, 8
  c.max_steps, c.log_every, c.eval_every, c.checkpoint_every = 2, 1, 2, 0
  train, _ = recipe.datasets(c)
  assert train.image_shape == (8,) and train.vocab_size == len(vocab)
  np.testing.assert_array_equal(train.ids[0], [2, 4, 5, 7, 10, 3, 0, 0])  # a good film .
  result = loop.train_and_evaluate(c, str(tmp_path / "run"), progress=False)
  rows = read_metrics(str(tmp_path / "run"))
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["train_loss"]) and r["wire_bytes"] > 0 for r in rows)
  assert 0 <= result["eval_accuracy"] <= 1


def test_adamw_optimizer_field():
  """config.optimizer="adamw" builds optax.adamw with the config's betas, eps and masked decay;
  reference: optax.adamw built directly."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jlp.train import recipe  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.optimizer, c.weight_decay, c.wd_exclude, c.adam_b2 = "adamw", 0.1, "bias", 0.99
  config_lib.validate(c)
  params = {"w": jnp.full((3,), 2.0), "bias": jnp.full((2,), 2.0)}
  grads = {"w": jnp.asarray([1.0, -2.0, 0.5]), "bias": jnp.asarray([0.25, 4.0])}
  opt = recipe.optimizer(c, optax.constant_schedule(0.01))
  want = optax.adamw(0.01, b2=0.99, weight_decay=0.1,
                     mask={"w": True, "bias": False})
  got, _ = opt.update(grads, opt.init(params), params)
  ref, _ = want.update(grads, want.init(params), params)
  for k in params:
    assert jnp.array_equal(got[k], ref[k]), k
  for field, value, allowed in (("optimizer", "adam", "one of ('sgd', 'adamw')"),
                                ("adam_b1", 1.0, "a value in [0, 1)"),
                                ("adam_eps", 0.0, "a value > 0")):
    bad = config_lib.base_config()
    bad.optimizer = "adamw"
    bad[field] = value
    with pytest.raises(ValueError, match=f"config.{field}=.* is not allowed; expected "
                                         f"{re.escape(allowed)}"):
      config_lib.validate(bad)
  bad = config_lib.base_config()
  bad.optimizer, bad.use_lars = "adamw", True
  with pytest.raises(ValueError, match="config.use_lars=True is not allowed"):
    config_lib.validate(bad)


def test_bert_vocab_must_cover_the_dataset():
  c = importlib.import_module("configs.hipress_bert_small").get_config("local")
  train, _ = recipe.datasets(c)
  c.model.kwargs.vocab = train.vocab_size - 1
  with pytest.raises(ValueError, match="config.model.kwargs.vocab=20 is not allowed"):
    recipe.model(c, train)
