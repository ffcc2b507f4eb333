"""Every experiment config: defaults pass the checks, and its `:local` variant trains a few steps."""

import glob
import importlib
import os

import jax
import numpy as np
import pytest

from jlp.train import config as config_lib
from jlp.train import loop
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


@pytest.mark.parametrize("name", CONFIGS)
def test_local_variant_trains(name, tmp_path, fast_compile):
  c = importlib.import_module(f"configs.{name}").get_config("local")
  c.max_steps = min(c.max_steps, 3 if name != "bfp_resnet18_cifar100" else 6)
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
  if name == "bfp_resnet18_cifar100":  # the schedule switches presets; the controller logs widths
    assert "zse_fw" in rows[-1] and "bits_w" in rows[-1]
