"""scikit-learn's bundled handwritten digits: the data set that always works offline.

`sklearn.datasets.load_digits()`: 1797 8x8 grey images with integer values
0..16 and labels 0..9 (the UCI optical digits test set), shipped with
scikit-learn, no download.

Split (fixed forever): perm = np.random.RandomState(0).permutation(1797)
(numpy's legacy generator, whose stream is frozen); "test" is perm[:360]
(20%), "train" is perm[360:] (1437 images), in permutation order.

Variants:
  "8x8x1" (default): the images as they are, (8, 8, 1), for a small CNN.
  "32x32x3": each pixel repeated 4x4 (nearest-neighbour upsampling) and the
    grey channel copied to three, (32, 32, 3), for the CIFAR-shaped models.
Values are normalised as (x / 16 - 0.30526) / 0.37605, the mean and standard
deviation of x / 16 over all 1797 images. No augmentation by default; pass
`augment=True` with crop / padding / flip to add the CropFlip steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jlp.data.dataset import ArrayDataset, CropFlip, Dataset, Normalization, check_split

DIGITS_SIZE = 1797
DIGITS_TEST_SIZE = 360
DIGITS_SPLIT_SEED = 0
DIGITS_MEAN = 0.30526
DIGITS_STD = 0.37605
VARIANTS = ("8x8x1", "32x32x3")


def digits_split_indices(split: str) -> np.ndarray:
  """Indices into load_digits() of the fixed split (see the module docstring)."""
  check_split(split, ("train", "test"))
  perm = np.random.RandomState(DIGITS_SPLIT_SEED).permutation(DIGITS_SIZE)
  return perm[:DIGITS_TEST_SIZE] if split == "test" else perm[DIGITS_TEST_SIZE:]


def load_digits_arrays(split: str = "train", variant: str = "8x8x1"
                       ) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 NHWC with values 0..16, labels int64) of one split and variant."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r} is not allowed; expected one of {VARIANTS}.")
  idx = digits_split_indices(split)
  bunch = load_digits()
  images = bunch.images[idx].astype(np.uint8)[..., None]  # (N, 8, 8, 1)
  if variant == "32x32x3":
    images = np.repeat(np.repeat(images, 4, axis=1), 4, axis=2)
    images = np.repeat(images, 3, axis=3)
  return np.ascontiguousarray(images), bunch.target[idx].astype(np.int64)


def digits(root: Any = None, split: str = "train", *, variant: str = "8x8x1",
           augment: bool | None = None, crop: int | None = None, padding: int = 0,
           pad_mode: str = "constant", flip: bool = False) -> ArrayDataset:
  """The digits split as an ArrayDataset (`root` is ignored: the data ships with scikit-learn).

  augment: apply CropFlip(crop, padding, pad_mode, flip) (default: False, as
    the default CropFlip settings change nothing).
  """
  del root
  images, labels = load_digits_arrays(split, variant)
  channels = images.shape[-1]
  normalization = Normalization((DIGITS_MEAN,) * channels, (DIGITS_STD,) * channels, scale=16.0)
  crop_flip = CropFlip(crop, padding, pad_mode, flip) if augment else None
  return ArrayDataset("digits", split, images, labels, 10, normalization, crop_flip)


#: Pixels brighter than this (of 16) belong to the digit in `digits_segmentation`.
SEGMENTATION_THRESHOLD = 4


class DigitsSegmentation(Dataset):
  """The digits as a segmentation task: every pixel brighter than SEGMENTATION_THRESHOLD / 16 is
  labelled with its image's digit (0..9), every other pixel with the background class 10.

  A small real-data stand-in for Cityscapes-style training (11 classes, label shape (H, W)); no
  augmentation. Variants as `digits` (the 32x32x3 labels are the 8x8 ones repeated 4x4).
  """

  in_memory = True

  def __init__(self, split: str = "train", variant: str = "8x8x1"):
    images, labels = load_digits_arrays(split, variant)
    self.name, self.split = "digits_segmentation", split
    self.num_classes = 11
    self.augment = False
    self.images = images
    self.masks = np.where(images[..., 0] > SEGMENTATION_THRESHOLD,
                          labels[:, None, None], 10).astype(np.int32)
    channels = images.shape[-1]
    self.normalization = Normalization((DIGITS_MEAN,) * channels, (DIGITS_STD,) * channels,
                                       scale=16.0)

  @property
  def size(self) -> int:
    return self.images.shape[0]

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return tuple(self.images.shape[1:])

  @property
  def label_shape(self) -> tuple[int, int]:
    return tuple(self.masks.shape[1:])

  def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    del rng, n
    return {}

  def get(self, indices: np.ndarray, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    del params
    return {"image": self.normalization(self.images[indices]), "label": self.masks[indices]}


def digits_segmentation(root: Any = None, split: str = "train", *,
                        variant: str = "8x8x1") -> DigitsSegmentation:
  """The digits segmentation split (`root` is ignored; see DigitsSegmentation)."""
  del root
  check_split(split, ("train", "test"))
  return DigitsSegmentation(split, variant)
