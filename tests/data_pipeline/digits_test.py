"""Tests for jlp.data.digits.

References: sklearn.datasets.load_digits itself (the values), the legacy
RandomState(0) permutation written out here (the split), and per-element
float64 arithmetic for the normalisation.
"""

import numpy as np
import pytest
from sklearn.datasets import load_digits

from jlp.data import digits as digits_lib
from jlp.data import get_dataset


@pytest.fixture(scope="module")
def bunch():
  return load_digits()


def test_split_is_fixed_disjoint_and_complete():
  train = digits_lib.digits_split_indices("train")
  test = digits_lib.digits_split_indices("test")
  assert (train.size, test.size) == (1437, 360)
  np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(1797))
  perm = np.random.RandomState(0).permutation(1797)
  np.testing.assert_array_equal(test, perm[:360])
  # Frozen values (the legacy stream never changes): a regression guard.
  np.testing.assert_array_equal(test[:5], [1081, 1707, 927, 713, 262])


def test_digits_loads_the_sklearn_values(bunch):
  ds = get_dataset("digits", split="test")
  assert (ds.name, ds.size, ds.image_shape, ds.num_classes) == ("digits", 360, (8, 8, 1), 10)
  idx = digits_lib.digits_split_indices("test")
  np.testing.assert_array_equal(ds.images[..., 0], bunch.images[idx])
  np.testing.assert_array_equal(ds.labels, bunch.target[idx])
  batch = ds.get(np.array([0, 7]), {})
  for r, i in enumerate((0, 7)):
    for y in range(8):
      for x in range(8):
        v = bunch.images[idx[i], y, x]
        expect = (v / 16 - 0.30526) / 0.37605
        assert abs(batch["image"][r, y, x, 0] - expect) < 1e-6


def test_normalisation_constants_are_the_data_statistics(bunch):
  x = bunch.data / 16
  assert abs(x.mean() - digits_lib.DIGITS_MEAN) < 1e-5
  assert abs(x.std() - digits_lib.DIGITS_STD) < 1e-5


def test_32x32x3_variant_is_a_4x_nearest_upsample_in_three_channels(bunch):
  ds = get_dataset("digits", split="train", variant="32x32x3")
  assert ds.image_shape == (32, 32, 3) and ds.size == 1437
  idx = digits_lib.digits_split_indices("train")
  for i in (0, 100):
    for y in range(32):
      for x in range(32):
        assert list(ds.images[i, y, x]) == [bunch.images[idx[i], y // 4, x // 4]] * 3


def test_digits_optional_augmentation_and_errors():
  ds = get_dataset("digits", augment=True, crop=8, padding=1, flip=True)
  assert ds.augment and ds.image_shape == (8, 8, 1)
  assert set(ds.draw(np.random.default_rng(0), 4)) == {"crop_top", "crop_left", "flip"}
  with pytest.raises(ValueError, match="variant='28x28x1'"):
    get_dataset("digits", variant="28x28x1")


def test_segmentation_labels_each_bright_pixel_with_its_digit(bunch):
  ds = get_dataset("digits_segmentation", split="test")
  idx = digits_lib.digits_split_indices("test")
  assert (ds.num_classes, ds.image_shape, ds.label_shape, ds.size) == (11, (8, 8, 1), (8, 8), 360)
  batch = ds.get(np.arange(5), ds.draw(np.random.default_rng(0), 5))
  for i in range(5):
    raw, digit = bunch.images[idx[i]], bunch.target[idx[i]]
    want = [[digit if raw[r, c] > 4 else 10 for c in range(8)] for r in range(8)]
    np.testing.assert_array_equal(batch["label"][i], want)
  np.testing.assert_array_equal(batch["image"], get_dataset("digits", split="test").get(
      np.arange(5), {})["image"])
  big = get_dataset("digits_segmentation", split="test", variant="32x32x3").get(np.arange(2), {})
  np.testing.assert_array_equal(big["label"], np.repeat(np.repeat(batch["label"][:2], 4, 1), 4, 2))
