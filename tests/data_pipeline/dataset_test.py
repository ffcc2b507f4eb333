"""Tests for jlp.data.dataset: config validation, ArrayDataset shapes, layout messages.

References: the documented field constraints and the arrays written in the test.
"""

import numpy as np
import pytest

from jlp.data.dataset import ArrayDataset, CropFlip, Normalization, layout_message, require_dir


def test_configs_are_hashable_and_validated():
  assert hash(CropFlip(32, 4)) == hash(CropFlip(32, 4))
  assert hash(Normalization((0.5,), (0.2,))) == hash(Normalization((0.5,), (0.2,)))
  with pytest.raises(ValueError, match="pad_mode='edge'"):
    CropFlip(32, 4, "edge")
  with pytest.raises(ValueError, match="padding=-1"):
    CropFlip(32, -1)
  with pytest.raises(ValueError, match="std=\\(0.0,\\)"):
    Normalization((0.5,), (0.0,))
  with pytest.raises(ValueError, match="std=\\(1.0,\\)"):
    Normalization((0.5, 0.5), (1.0,))


def test_array_dataset_checks_its_arrays():
  norm = Normalization((0.5,), (0.5,))
  images = np.zeros((4, 5, 5, 1), np.uint8)
  with pytest.raises(ValueError, match="uint8"):
    ArrayDataset("t", "train", images.astype(np.float32), np.zeros(4), 2, norm)
  with pytest.raises(ValueError, match="labels.shape"):
    ArrayDataset("t", "train", images, np.zeros(3), 2, norm)
  with pytest.raises(ValueError, match="crop=10"):
    ArrayDataset("t", "train", images, np.zeros(4), 2, norm, CropFlip(10, 2))
  with pytest.raises(ValueError, match="normalization.mean"):
    ArrayDataset("t", "train", images, np.zeros(4), 2, Normalization((0.5,) * 3, (0.5,) * 3))


def test_array_dataset_without_augmentation_returns_the_normalised_rows():
  images = np.arange(2 * 3 * 3 * 1, dtype=np.uint8).reshape(2, 3, 3, 1) * 10
  ds = ArrayDataset("t", "test", images, np.array([1, 0]), 2, Normalization((0.0,), (1.0,), 10.0),
                    None)
  assert ds.draw(np.random.default_rng(0), 2) == {}
  out = ds.get(np.array([1, 1, 0]), {})
  np.testing.assert_array_equal(out["image"][:, :, :, 0],
                                images[[1, 1, 0], :, :, 0].astype(np.float32) / 10)
  np.testing.assert_array_equal(out["label"], [0, 0, 1])
  assert (ds.size, ds.image_shape, ds.augment) == (2, (3, 3, 1), False)


def test_layout_message_and_require_dir(tmp_path):
  msg = layout_message("X", tmp_path, "missing", "a/\n└── b\n")
  assert msg.splitlines() == ["X: missing", f"Expected layout under {str(tmp_path)!r}:",
                              "  a/", "  └── b"]
  (tmp_path / "f").write_text("")
  with pytest.raises(FileNotFoundError, match="is not a directory"):
    require_dir(tmp_path / "f", "X", tmp_path, "a/")
  assert require_dir(tmp_path, "X", tmp_path, "a/") == str(tmp_path)
