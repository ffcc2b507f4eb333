"""The dataset interface shared by every loader, in-memory datasets, and layout errors.

A `Dataset` is one split of one data set together with its transform (the
training augmentation or the evaluation preprocessing). It is indexed in two
steps so that the input pipeline (`jlp.data.pipeline`) can make every batch a
pure function of (seed, step) and split it across processes:

  params = dataset.draw(rng, n)        # the randomness of n examples (a dict of arrays
                                       # with leading dimension n; {} without augmentation)
  batch = dataset.get(indices, params) # {"image": float32 NHWC, "label": int32 ...}

`draw` only consumes random numbers (it never looks at the data), so the
pipeline draws for the whole global batch and hands each process the rows of
its own examples: the union over processes is the single-process batch.

`ArrayDataset` holds uint8 NHWC images in memory (CIFAR, digits) and applies
the CIFAR-style augmentation (`jlp.data.augment`): random crop from a padded
image, horizontal flip, normalisation, optional Cutout, in that order.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Any

import numpy as np

from jlp.data import augment

Batch = dict[str, np.ndarray]


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


class DataFileError(ValueError):
  """A file of a data set that cannot be used (truncated, not an image, oversized, labels out of
  range, ...): the message names the file and what is wrong with it; `path` is the file."""

  def __init__(self, path: str | os.PathLike, problem: str):
    self.path = os.fspath(path)
    self.problem = problem
    super().__init__(f"{self.path}: {problem}")

  def __reduce__(self):  # picklable across worker processes
    return (type(self), (self.path, self.problem))


def layout_message(what: str, root: str | os.PathLike, problem: str, tree: str) -> str:
  """An error message: the problem, then the expected directory tree under `root`."""
  lines = [f"{what}: {problem}", f"Expected layout under {os.fspath(root)!r}:"]
  lines += ["  " + line for line in tree.strip("\n").splitlines()]
  return "\n".join(lines)


def require_dir(path: str | os.PathLike, what: str, root: str | os.PathLike, tree: str) -> str:
  """`path` as a string if it is a directory, else FileNotFoundError showing `tree`."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    problem = (f"{path!r} is not a directory" if os.path.exists(path)
               else f"directory {path!r} does not exist")
    raise FileNotFoundError(layout_message(what, root, problem, tree))
  return path


def require_file(path: str | os.PathLike, what: str, root: str | os.PathLike, tree: str) -> str:
  """`path` as a string if it is a file, else FileNotFoundError showing `tree`."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(layout_message(what, root, f"file {path!r} does not exist", tree))
  return path


def check_split(split: str, allowed: tuple[str, ...]) -> str:
  if split not in allowed:
    raise _invalid("split", split, " or ".join(repr(s) for s in allowed))
  return split


@dataclasses.dataclass(frozen=True)
class Normalization:
  """out = (x / scale - mean[c]) / std[c], as torchvision's ToTensor + Normalize.

  Every operation is one float32 IEEE operation in that order
  (float32(x) / float32(scale), then - float32(mean[c]), then / float32(std[c])),
  so values match torchvision's float32 results bit for bit.
  """
  mean: tuple[float, ...]
  std: tuple[float, ...]
  scale: float = 255.0

  def __post_init__(self):
    if len(self.mean) != len(self.std) or not self.mean:
      raise _invalid("std", self.std, f"{len(self.mean)} values, one per channel like mean")
    if any(not s > 0 for s in self.std):
      raise _invalid("std", self.std, "positive values")
    if not self.scale > 0:
      raise _invalid("scale", self.scale, "a positive number")

  def __call__(self, images: np.ndarray) -> np.ndarray:
    return augment.normalize(images, self.mean, self.std, self.scale)


@dataclasses.dataclass(frozen=True)
class CropFlip:
  """The CIFAR-style training augmentation (None / 0 / False switch a step off).

  crop: output side of the random crop taken from the image padded by `padding`
    on every side (`pad_mode` "constant": zeros before normalisation, as
    torchvision's RandomCrop(padding=4); "reflect": as DavidNet's pad).
  flip: random horizontal flip with probability 1/2.
  cutout: side of a square set to 0 after normalisation (DavidNet's Cutout),
    placed uniformly so that it lies inside the image.
  """
  crop: int | None = None
  padding: int = 0
  pad_mode: str = "constant"
  flip: bool = True
  cutout: int = 0

  def __post_init__(self):
    if self.crop is not None and (not isinstance(self.crop, int) or self.crop < 1):
      raise _invalid("crop", self.crop, "None or a positive int")
    if not isinstance(self.padding, int) or self.padding < 0:
      raise _invalid("padding", self.padding, "an int >= 0")
    if self.pad_mode not in augment.PAD_MODES:
      raise _invalid("pad_mode", self.pad_mode, " or ".join(map(repr, augment.PAD_MODES)))
    if not isinstance(self.cutout, int) or self.cutout < 0:
      raise _invalid("cutout", self.cutout, "an int >= 0")


class Dataset(abc.ABC):
  """One split of a data set with its transform; see the module docstring."""

  name: str
  split: str
  num_classes: int
  augment: bool
  #: Whether the examples are held in memory (no files to read: the pipeline starts no worker
  #: processes for them).
  in_memory: bool = False

  @property
  @abc.abstractmethod
  def size(self) -> int:
    """Number of examples."""

  @property
  @abc.abstractmethod
  def image_shape(self) -> tuple[int, int, int]:
    """(H, W, C) of the transformed images that `get` returns."""

  @property
  def label_shape(self) -> tuple[int, ...]:
    """Shape of one label: () for classification, (H, W) for segmentation."""
    return ()

  def __len__(self) -> int:
    return self.size

  @abc.abstractmethod
  def draw(self, rng: np.random.Generator, n: int) -> Batch:
    """The augmentation randomness of n examples (arrays with leading dim n)."""

  @abc.abstractmethod
  def get(self, indices: np.ndarray, params: Batch) -> Batch:
    """Transformed examples `indices` with their rows of `draw`'s params."""

  def verify(self) -> list[DataFileError]:
    """Every file of the split that cannot be used, each as a DataFileError (decoding every
    file; [] for data held in memory)."""
    return []

  def manifest(self) -> list[str] | None:
    """The files behind the split in index order, relative to its root (what a resume checks
    has not changed); None for data held in memory or shipped with a package."""
    return None

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(name={self.name!r}, split={self.split!r}, size={self.size}, "
            f"image_shape={self.image_shape}, num_classes={self.num_classes}, "
            f"augment={self.augment})")


class ArrayDataset(Dataset):
  """uint8 NHWC images and int labels in memory, with CropFlip augmentation."""

  in_memory = True

  def __init__(self, name: str, split: str, images: np.ndarray, labels: np.ndarray,
               num_classes: int, normalization: Normalization,
               crop_flip: CropFlip | None = None):
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 4 or images.dtype != np.uint8:
      raise _invalid("images", f"{images.dtype}{images.shape}", "uint8 (N, H, W, C)")
    if labels.shape != images.shape[:1]:
      raise _invalid("labels.shape", labels.shape, f"({images.shape[0]},) to match the images")
    if images.shape[-1] != len(normalization.mean):
      raise _invalid("normalization.mean", normalization.mean,
                     f"{images.shape[-1]} values (one per channel)")
    if crop_flip is not None and crop_flip.crop is not None:
      h, w = images.shape[1:3]
      if crop_flip.crop > min(h, w) + 2 * crop_flip.padding:
        raise _invalid("crop", crop_flip.crop,
                       f"at most {min(h, w) + 2 * crop_flip.padding} (image {h}x{w}, "
                       f"padding {crop_flip.padding})")
    if crop_flip is not None and crop_flip.cutout > min(images.shape[1:3]):
      raise _invalid("cutout", crop_flip.cutout, f"at most {min(images.shape[1:3])}")
    self.name, self.split = name, split
    self.images, self.labels = images, labels.astype(np.int32)
    self.num_classes = num_classes
    self.normalization = normalization
    self.crop_flip = crop_flip
    self.augment = crop_flip is not None

  @property
  def size(self) -> int:
    return self.images.shape[0]

  @property
  def image_shape(self) -> tuple[int, int, int]:
    h, w, c = self.images.shape[1:]
    if self.crop_flip is not None and self.crop_flip.crop is not None:
      h = w = self.crop_flip.crop
    return (h, w, c)

  def draw(self, rng: np.random.Generator, n: int) -> Batch:
    cf = self.crop_flip
    if cf is None:
      return {}
    h, w, _ = self.images.shape[1:]
    params = {}
    if cf.crop is not None:
      params["crop_top"], params["crop_left"] = augment.draw_crop_offsets(
          rng, n, (h + 2 * cf.padding, w + 2 * cf.padding), (cf.crop, cf.crop))
    if cf.flip:
      params["flip"] = augment.draw_flips(rng, n)
    if cf.cutout:
      oh, ow, _ = self.image_shape
      params["cutout_top"], params["cutout_left"] = augment.draw_crop_offsets(
          rng, n, (oh, ow), (cf.cutout, cf.cutout))
    return params

  def get(self, indices: np.ndarray, params: Batch) -> Batch:
    x = self.images[indices]
    cf = self.crop_flip
    if cf is not None:
      if cf.crop is not None:
        x = augment.pad_crop(x, params["crop_top"], params["crop_left"], cf.crop, cf.padding,
                             cf.pad_mode)
      if cf.flip:
        x = augment.flip(x, params["flip"])
    x = self.normalization(x)
    if cf is not None and cf.cutout:
      x = augment.cutout(x, params["cutout_top"], params["cutout_left"], cf.cutout)
    return {"image": x, "label": self.labels[indices]}
