"""Tests for jlp.data.cifar on tiny pickle batches written in the seeds' layout.

References: the arrays the test writes (CHW-flattened rows built by explicit
loops), and per-element np.float32 arithmetic for the normalisation.
"""

import os
import pickle

import numpy as np
import pytest

from jlp.data import cifar as cifar_lib
from jlp.data import get_dataset


def _rows(rng, n):
  """n random images as (HWC uint8, CHW-flattened rows built by a plain loop)."""
  hwc = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
  rows = np.zeros((n, 3072), np.uint8)
  for i in range(n):
    for c in range(3):
      for y in range(32):
        for x in range(32):
          rows[i, c * 1024 + y * 32 + x] = hwc[i, y, x, c]
  return hwc, rows


def _dump(path, entry):
  with open(path, "wb") as f:
    pickle.dump(entry, f)


def write_cifar10(root, per_batch=3, test=4, seed=0):
  """Writes root/cifar-10-batches-py; returns (train images, train labels, test ...)."""
  rng = np.random.default_rng(seed)
  folder = os.path.join(root, "cifar-10-batches-py")
  os.makedirs(folder)
  train_x, train_y = [], []
  for b in range(1, 6):
    hwc, rows = _rows(rng, per_batch)
    labels = [int(v) for v in rng.integers(0, 10, per_batch)]
    _dump(os.path.join(folder, f"data_batch_{b}"),
          {b"batch_label": b"training batch", b"labels": labels, b"data": rows,
           b"filenames": [b"x.png"] * per_batch})
    train_x.append(hwc)
    train_y += labels
  hwc, rows = _rows(rng, test)
  test_y = [int(v) for v in rng.integers(0, 10, test)]
  _dump(os.path.join(folder, "test_batch"), {b"labels": test_y, b"data": rows})
  _dump(os.path.join(folder, "batches.meta"), {b"label_names": [b"airplane"] * 10})
  return np.concatenate(train_x), np.array(train_y), hwc, np.array(test_y)


def write_cifar100(root, n_train=5, n_test=3, seed=1):
  rng = np.random.default_rng(seed)
  folder = os.path.join(root, "cifar-100-python")
  os.makedirs(folder)
  out = {}
  for split, n in (("train", n_train), ("test", n_test)):
    hwc, rows = _rows(rng, n)
    fine = [int(v) for v in rng.integers(0, 100, n)]
    coarse = [int(v) for v in rng.integers(0, 20, n)]
    _dump(os.path.join(folder, split), {b"data": rows, b"fine_labels": fine,
                                        b"coarse_labels": coarse})
    out[split] = (hwc, np.array(fine), np.array(coarse))
  _dump(os.path.join(folder, "meta"), {b"fine_label_names": [], b"coarse_label_names": []})
  return out


def _normalized(hwc, mean, std):
  out = np.zeros(hwc.shape, np.float32)
  for idx in np.ndindex(hwc.shape):
    c = idx[-1]
    out[idx] = (np.float32(hwc[idx]) / np.float32(255) - np.float32(mean[c])) / np.float32(std[c])
  return out


def test_cifar10_loads_exact_values_and_labels(tmp_path):
  train_x, train_y, test_x, test_y = write_cifar10(tmp_path)
  images, labels = cifar_lib.load_cifar_arrays(tmp_path, 10, "train")
  np.testing.assert_array_equal(images, train_x)  # batches 1..5 in order, HWC
  np.testing.assert_array_equal(labels, train_y)
  images, labels = cifar_lib.load_cifar_arrays(tmp_path, 10, "test")
  np.testing.assert_array_equal(images, test_x)
  np.testing.assert_array_equal(labels, test_y)


def test_cifar10_test_split_is_normalized_with_the_cpd_constants(tmp_path):
  _, _, test_x, test_y = write_cifar10(tmp_path)
  ds = get_dataset("cifar10", root=tmp_path, split="test")
  assert (ds.size, ds.num_classes, ds.image_shape, ds.augment) == (4, 10, (32, 32, 3), False)
  batch = ds.get(np.array([2, 0]), ds.draw(np.random.default_rng(0), 2))
  mean, std = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
  np.testing.assert_array_equal(batch["image"], _normalized(test_x[[2, 0]], mean, std))
  np.testing.assert_array_equal(batch["label"], test_y[[2, 0]])
  assert batch["label"].dtype == np.int32


def test_cifar10_train_split_is_augmented_with_pad4_crop_and_flip(tmp_path):
  train_x, _, _, _ = write_cifar10(tmp_path)
  ds = get_dataset("cifar10", root=tmp_path)
  assert ds.augment and ds.size == 15
  idx = np.arange(15)
  params = ds.draw(np.random.default_rng(0), 15)
  assert set(params) == {"crop_top", "crop_left", "flip"}
  out = ds.get(idx, params)["image"]
  mean, std = cifar_lib.CIFAR10_MEAN, cifar_lib.CIFAR10_STD
  for i in idx:
    padded = np.pad(train_x[i], ((4, 4), (4, 4), (0, 0)))
    t, l = params["crop_top"][i], params["crop_left"][i]
    window = padded[t:t + 32, l:l + 32]
    if params["flip"][i]:
      window = window[:, ::-1]
    np.testing.assert_array_equal(out[i], _normalized(window[None], mean, std)[0])


def test_davidnet_recipe_uses_its_std_reflect_padding_and_cutout(tmp_path):
  write_cifar10(tmp_path)
  ds = get_dataset("cifar10", root=tmp_path, recipe="davidnet")
  assert ds.normalization.std == cifar_lib.CIFAR10_STD_DAVIDNET
  assert ds.crop_flip.pad_mode == "reflect" and ds.crop_flip.cutout == 8
  params = ds.draw(np.random.default_rng(0), 3)
  out = ds.get(np.arange(3), params)["image"]
  for i in range(3):
    t, l = params["cutout_top"][i], params["cutout_left"][i]
    assert np.all(out[i, t:t + 8, l:l + 8] == 0)
  assert get_dataset("cifar10", root=tmp_path, recipe="davidnet", cutout=0).crop_flip.cutout == 0


def test_cifar100_fine_and_coarse_labels_and_bfpsim_constants(tmp_path):
  written = write_cifar100(tmp_path)
  ds = get_dataset("cifar100", root=tmp_path, split="test")
  hwc, fine, coarse = written["test"]
  assert (ds.num_classes, ds.size, ds.augment) == (100, 3, False)  # no test-time augmentation
  batch = ds.get(np.arange(3), {})
  np.testing.assert_array_equal(batch["label"], fine)
  np.testing.assert_array_equal(batch["image"],
                                _normalized(hwc, (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)))
  ds = get_dataset("cifar100", root=tmp_path, split="train", label="coarse")
  assert ds.num_classes == 20
  np.testing.assert_array_equal(ds.labels, written["train"][2])


def test_missing_cifar_folder_shows_the_expected_layout(tmp_path):
  with pytest.raises(FileNotFoundError) as e:
    get_dataset("cifar10", root=tmp_path)
  msg = str(e.value)
  assert "cifar-10-batches-py" in msg and "data_batch_1" in msg and "test_batch" in msg
  assert "Expected layout" in msg and str(tmp_path) in msg
  with pytest.raises(FileNotFoundError, match=r"cifar-100-python/(.|\n)*train"):
    get_dataset("cifar100", root=tmp_path / "nowhere")


def test_missing_batch_file_is_named(tmp_path):
  write_cifar10(tmp_path)
  os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
  with pytest.raises(FileNotFoundError, match="data_batch_3"):
    get_dataset("cifar10", root=tmp_path)
  get_dataset("cifar10", root=tmp_path, split="test")  # the test batch alone still loads


@pytest.mark.parametrize("entry,problem", [
    ({b"data": np.zeros((2, 3072), np.uint8)}, "labels"),
    ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, "3072"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "labels"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "0..9"),
    ([1, 2, 3], "dict"),
])
def test_malformed_batch_raises_value_error_with_layout(tmp_path, entry, problem):
  folder = tmp_path / "cifar-10-batches-py"
  folder.mkdir()
  _dump(folder / "test_batch", entry)
  with pytest.raises(ValueError, match=problem) as e:
    get_dataset("cifar10", root=tmp_path, split="test")
  assert "Expected layout" in str(e.value)


def test_garbage_file_is_a_value_error(tmp_path):
  folder = tmp_path / "cifar-10-batches-py"
  folder.mkdir()
  (folder / "test_batch").write_bytes(b"not a pickle at all")
  with pytest.raises(ValueError, match="readable pickle"):
    get_dataset("cifar10", root=tmp_path, split="test")


def test_bad_options_are_rejected_before_loading(tmp_path):
  with pytest.raises(ValueError, match="recipe='kuangliu'"):
    get_dataset("cifar10", root=tmp_path, recipe="kuangliu")
  with pytest.raises(ValueError, match="split='val'"):
    get_dataset("cifar10", root=tmp_path, split="val")
