"""jlp.train.recipe's data sets: config.dataset.kwargs' augmentation acts on the training split
only (issue 32 §5).

Reference: the digits test and train images normalised here from scikit-learn's arrays,
(x / 16 - 0.30526) / 0.37605 (jlp.data.digits' documented constants), without any jlp.data
dataset object.
"""

import numpy as np
import pytest

from jlp import data as jdata
from jlp.data.digits import load_digits_arrays
from jlp.train import config as config_lib
from jlp.train import recipe

AUGMENT = {"augment": True, "crop": 8, "padding": 2, "flip": True}


def _plain(split):
  images, labels = load_digits_arrays(split, "8x8x1")
  return (images.astype(np.float64) / 16 - 0.30526) / 0.37605, labels


def _config(**kwargs):
  c = config_lib.base_config()  # digits, small_cnn
  c.dataset.kwargs = kwargs
  c.batch_size, c.eval_batch_size = 64, 360  # the whole test split in one evaluation batch
  config_lib.validate(c)
  return c


def test_the_eval_split_is_not_augmented_whatever_dataset_kwargs_say():
  train, evaluation = recipe.datasets(_config(**AUGMENT))
  assert train.augment and not evaluation.augment
  # The evaluation pipeline's batch: every test image as it is, in order.
  _, eval_pipe = recipe.pipelines(_config(**AUGMENT), train, evaluation)
  batch = eval_pipe.batch(0)
  want, labels = _plain("test")
  assert batch["mask"].all() and len(batch["mask"]) == len(want)
  np.testing.assert_allclose(batch["image"], want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(batch["label"], labels)
  # The training split is still augmented: crops and flips move its images.
  idx = np.arange(256)
  got = train.get(idx, train.draw(np.random.default_rng(0), len(idx)))["image"]
  plain_train, _ = _plain("train")
  assert got.shape == plain_train[idx].shape
  assert not np.allclose(got, plain_train[idx], atol=1e-3)


def test_eval_kwargs_turn_augmentation_off_for_every_dataset_that_takes_it():
  takes = {name for name, info in jdata.DATASETS.items() if "augment" in info.options}
  assert takes == {"digits", "cifar10", "cifar100", "imagenet", "cityscapes"}
  for name in jdata.DATASETS:
    got = recipe.eval_kwargs(name, {"augment": True, "crop_size": 4} if name in takes else {})
    assert got == ({"augment": False, "crop_size": 4} if name in takes else {})


def test_a_crop_that_changes_the_image_size_is_refused():
  """Not augmented, the evaluation images keep their size: a crop smaller than the image would
  train and evaluate the model on different shapes."""
  with pytest.raises(ValueError, match=r"config.dataset.kwargs=.* is not allowed; expected options "
                                       r"that give training and evaluation images one shape "
                                       r"\(training \(6, 6, 1\), evaluation \(8, 8, 1\)"):
    recipe.datasets(_config(augment=True, crop=6))
