"""Every loader option is settable from the command line (issue 33 §5).

References: each builder's signature (the options and their defaults), the configs' own values as
their files write them, and ml_collections' flag parsing (what `experiments.train` runs).
"""

import glob
import importlib
import inspect
import os
import pickle

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from jlp.data import DATASETS, config_kwargs, dataset_options, get_dataset
from jlp.data import registry
from jlp.train import recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not p.endswith("__init__.py"))
#: What the configs set besides the defaults (from their files).
CONFIG_VALUES = {
    "cpd_davidnet_cifar10": {"recipe": "davidnet"},
    "cpd_fcn_cityscapes": {"crop_size": 769, "cat_max_ratio": 0.75, "photometric": True},
    "hipress_bert_small": {"max_len": 128},
    "sdpipe_bert_small": {"max_len": 128},
}


def parse(argv):
  """The config that `python -m experiments.train ARGV` gets (a fresh flag registry)."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config", flag_values=values, lock_config=True,
                                  sys_argv=["train"] + argv)
  values(["train"] + argv)
  return values.config


def test_dataset_options_are_the_builders_keyword_parameters():
  for name, info in DATASETS.items():
    options = dataset_options(name)
    assert tuple(options) == info.options
    spec = {"imagenet": "ImageFolderDataset", "cityscapes": "CityscapesDataset"}.get(name)
    fn = getattr(importlib.import_module(info.builder.__module__), spec) if spec else info.builder
    params = {p.name: p.default for p in inspect.signature(fn).parameters.values()
              if p.kind == p.KEYWORD_ONLY and p.name != "name"}
    assert options == params, name
  assert dataset_options("imagenet")["num_workers"] == 8
  assert dataset_options("imagenet")["crop_size"] == 224
  assert set(dataset_options("cifar10")) == {"augment", "recipe", "mean", "std", "crop", "padding",
                                             "pad_mode", "flip", "cutout"}
  with pytest.raises(ValueError, match="name='mnist'"):
    dataset_options("mnist")
  with pytest.raises(ValueError, match="crop_size=3 is not allowed for 'cifar10'"):
    config_kwargs("cifar10", crop_size=3)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_holds_every_option_of_its_data_set(name):
  c = importlib.import_module(f"configs.{name}").get_config()
  expected = {**dataset_options(c.dataset.name), **CONFIG_VALUES.get(name, {})}
  assert dict(c.dataset.kwargs) == expected


def _flag_value(value, kind):
  """A command-line value of type `kind`, different from `value` where that is easy."""
  if kind is bool:
    return "False" if value else "True"
  if kind is int:
    return str((value or 0) + 1)
  if kind is float:
    return str((value or 0.0) + 0.25)
  if kind is tuple:
    return repr(tuple(value) if value else (0.5, 0.5, 0.5))
  return value or "x"


@pytest.mark.parametrize("name", CONFIGS)
def test_every_option_is_settable_from_the_command_line(name):
  path = os.path.join(ROOT, "configs", f"{name}.py")
  base = importlib.import_module(f"configs.{name}").get_config()
  kinds = registry.option_types(base.dataset.name)
  argv, expected = [f"--config={path}"], {}
  for option, value in dict(base.dataset.kwargs).items():
    kind = type(value) if value is not None else kinds[option]
    flag = _flag_value(value, kind)
    argv.append(f"--config.dataset.kwargs.{option}={flag}")
    literal = kind in (tuple, int, float, bool)
    expected[option] = eval(flag) if literal else flag  # pylint: disable=eval-used
  c = parse(argv)
  assert dict(c.dataset.kwargs) == expected


def test_the_issues_command_line_parses(tmp_path, monkeypatch):
  path = os.path.join(ROOT, "configs", "cpd_resnet50_imagenet.py")
  c = parse([f"--config={path}", "--config.dataset.kwargs.num_workers=32",
             "--config.dataset.kwargs.crop_size=192", "--config.dataset.kwargs.augment=False"])
  assert (c.dataset.kwargs.num_workers, c.dataset.kwargs.crop_size) == (32, 192)
  assert c.dataset.kwargs.augment is False and c.dataset.kwargs.resize_size == 256
  monkeypatch.setenv(registry.DATA_DIR_ENV, str(tmp_path))
  with pytest.raises(FileNotFoundError, match="no imagenet data"):  # the data's error, not a flag's
    recipe.datasets(c)


def test_all_options_at_their_defaults_build_what_no_options_build():
  c = importlib.import_module("configs.digits").get_config()
  train, evaluation = recipe.datasets(c)
  assert train.augment is False and evaluation.augment is False and evaluation.split == "test"
  for name in ("digits", "digits_segmentation", "digits_tokens"):
    ds = get_dataset(name, split="train", **dataset_options(name))
    plain = get_dataset(name, split="train")
    assert (ds.size, ds.image_shape, ds.augment) == (plain.size, plain.image_shape, plain.augment)


def test_cifar_options_left_at_none_keep_the_recipes_values(tmp_path):
  folder = tmp_path / "cifar-10-batches-py"
  folder.mkdir()
  for name in [f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]:
    with open(folder / name, "wb") as f:
      pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, f)
  ds = get_dataset("cifar10", tmp_path, split="train", **dataset_options("cifar10"))
  plain = get_dataset("cifar10", tmp_path, split="train")
  assert (ds.crop_flip, ds.normalization) == (plain.crop_flip, plain.normalization)
  dav = get_dataset("cifar10", tmp_path, split="train",
                    **{**dataset_options("cifar10"), "recipe": "davidnet", "padding": 2})
  assert (dav.crop_flip.pad_mode, dav.crop_flip.cutout, dav.crop_flip.padding) == (
      "reflect", 8, 2)


def test_docs_data_page_lists_every_option():
  with open(os.path.join(ROOT, "docs", "data.md"), encoding="utf-8") as f:
    page = f.read()
  missing = [f"{name}.{option}" for name in DATASETS for option in dataset_options(name)
             if f"`{option}`" not in page]
  assert not missing, f"options not in docs/data.md: {missing}"
