"""Tests for jlp.data.registry (get_dataset): names, splits, options, default root.

References: the registry's documented table (names, split names, reported
shapes), checked on the always-available digits data and on missing folders.
"""

import os

import pytest

from jlp.data import DATASETS, get_dataset
from jlp.data import registry


def test_registry_names():
  assert sorted(DATASETS) == ["cifar10", "cifar100", "cityscapes", "digits", "digits_segmentation",
                              "digits_tokens", "glue_tsv", "imagenet"]


def test_eval_alias_and_reported_properties():
  ds = get_dataset("digits", split="eval")
  assert (ds.split, ds.size, ds.num_classes, ds.image_shape, ds.label_shape) == (
      "test", 360, 10, (8, 8, 1), ())
  assert len(ds) == 360 and "digits" in repr(ds)


def test_unknown_name_split_and_option_are_value_errors(tmp_path):
  with pytest.raises(ValueError, match="name='mnist'.*cifar10"):
    get_dataset("mnist")
  with pytest.raises(ValueError, match="split='validation'"):
    get_dataset("imagenet", root=tmp_path, split="validation")
  with pytest.raises(ValueError, match="crop_size=32 is not allowed for 'cifar10'"):
    get_dataset("cifar10", root=tmp_path, crop_size=32)
  with pytest.raises(ValueError, match="label="):
    get_dataset("cifar10", root=tmp_path, label="coarse")


@pytest.mark.parametrize("name,expected", [
    ("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"),
    ("imagenet", "train/"), ("cityscapes", "leftImg8bit/")])
def test_missing_root_from_the_environment_names_the_layout(tmp_path, monkeypatch, name, expected):
  monkeypatch.setenv(registry.DATA_DIR_ENV, str(tmp_path / "absent"))
  with pytest.raises(FileNotFoundError) as e:
    get_dataset(name)
  assert expected in str(e.value) and str(tmp_path / "absent") in str(e.value)


def test_default_root_is_the_data_sets_folder_under_the_data_dir(monkeypatch, tmp_path):
  monkeypatch.delenv(registry.DATA_DIR_ENV, raising=False)
  assert registry.default_root("cifar10") == os.path.join("data", "cifar10")
  monkeypatch.setenv(registry.DATA_DIR_ENV, str(tmp_path))
  assert registry.default_root("imagenet") == str(tmp_path / "imagenet")
  assert registry.default_root("glue_tsv") == str(tmp_path / "SST-2")
