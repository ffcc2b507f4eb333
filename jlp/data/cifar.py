"""CIFAR-10 and CIFAR-100 from the python pickle batches (the seeds' `data/` layout).

Files (Krizhevsky's "python version", extracted into `root`):
  CIFAR-10:  root/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
  CIFAR-100: root/cifar-100-python/{train, test, meta}
Each batch is a pickle (latin-1 / bytes keys) with b"data": uint8 (N, 3072),
each row the 32x32 image as R, G, B planes in row-major order (CHW flattened),
and b"labels" (CIFAR-10) or b"fine_labels" / b"coarse_labels" (CIFAR-100).
Training images are the concatenation of data_batch_1..5 in that order.

Recipes (mean, std and augmentation, applied to training splits only; test
splits get normalisation alone, not BFPsim's CIFAR100 test-time augmentation,
docs/bfp.md bug 2):
  "cpd" (CIFAR-10 default; docs/cpd.md, kuangliu): RandomCrop(32, padding=4)
      with zero padding, RandomHorizontalFlip, mean (0.4914, 0.4822, 0.4465),
      std (0.2023, 0.1994, 0.2010).
  "davidnet" (docs/cpd.md): reflect padding 4, random 32 crop, flip, Cutout 8x8
      after normalisation, std (0.2471, 0.2435, 0.2616).
  "bfpsim" (CIFAR-100 default; docs/bfp.md): RandomCrop(32, padding=4), flip,
      mean (0.507, 0.487, 0.441), std (0.267, 0.256, 0.276).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

from jlp.data.dataset import (ArrayDataset, CropFlip, Normalization, check_split,
                              layout_message, require_dir, require_file)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
CIFAR10_STD_DAVIDNET = (0.2471, 0.2435, 0.2616)
CIFAR100_MEAN = (0.507, 0.487, 0.441)
CIFAR100_STD = (0.267, 0.256, 0.276)

RECIPES = {
    "cpd": dict(mean=CIFAR10_MEAN, std=CIFAR10_STD, crop=32, padding=4, pad_mode="constant",
                flip=True, cutout=0),
    "davidnet": dict(mean=CIFAR10_MEAN, std=CIFAR10_STD_DAVIDNET, crop=32, padding=4,
                     pad_mode="reflect", flip=True, cutout=8),
    "bfpsim": dict(mean=CIFAR100_MEAN, std=CIFAR100_STD, crop=32, padding=4,
                   pad_mode="constant", flip=True, cutout=0),
}

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR100_DIR = "cifar-100-python"
CIFAR10_TREE = f"""
{CIFAR10_DIR}/
├── data_batch_1 ... data_batch_5   (pickles: b"data" uint8 (10000, 3072), b"labels")
├── test_batch
└── batches.meta
(https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extracted here)
"""
CIFAR100_TREE = f"""
{CIFAR100_DIR}/
├── train   (pickle: b"data" uint8 (50000, 3072), b"fine_labels", b"coarse_labels")
├── test
└── meta
(https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz, extracted here)
"""


def _read_batch(path: str, label_key: bytes, what: str, root: str, tree: str
                ) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 (N, 32, 32, 3), labels int64 (N,)) from one pickle batch."""
  def malformed(problem: str) -> ValueError:
    return ValueError(layout_message(what, root, f"malformed batch {path!r}: {problem}", tree))

  try:
    with open(path, "rb") as f:
      entry = pickle.load(f, encoding="bytes")
  except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
          ImportError, IndexError) as e:
    raise malformed(f"not a readable pickle ({e})") from e
  if not isinstance(entry, dict):
    raise malformed(f"expected a dict, found {type(entry).__name__}")
  entry = {k.encode() if isinstance(k, str) else k: v for k, v in entry.items()}
  for key in (b"data", label_key):
    if key not in entry:
      raise malformed(f"no {key!r} entry (found {sorted(entry)})")
  data = np.asarray(entry[b"data"])
  labels = np.asarray(entry[label_key])
  if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
    raise malformed(f"b'data' is {data.dtype}{data.shape}, expected uint8 (N, 3072)")
  if labels.shape != (data.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
    raise malformed(f"{label_key!r} has shape {labels.shape} and dtype {labels.dtype}, "
                    f"expected {data.shape[0]} integers")
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return np.ascontiguousarray(images), labels.astype(np.int64)


def load_cifar_arrays(root: str | os.PathLike, num_classes: int, split: str,
                      label: str = "fine") -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 NHWC, labels int64) of CIFAR-`num_classes` (10 or 100), split "train"/"test".

  CIFAR-100 `label`: "fine" (100 classes) or "coarse" (20 superclasses).
  """
  check_split(split, ("train", "test"))
  root = os.path.expanduser(os.fspath(root))
  if num_classes == 10:
    what, tree, sub, label_key = "CIFAR-10", CIFAR10_TREE, CIFAR10_DIR, b"labels"
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    n_classes = 10
  elif num_classes == 100:
    if label not in ("fine", "coarse"):
      raise ValueError(f"label={label!r} is not allowed; expected 'fine' or 'coarse'.")
    what, tree, sub = "CIFAR-100", CIFAR100_TREE, CIFAR100_DIR
    label_key = b"fine_labels" if label == "fine" else b"coarse_labels"
    names = [split]
    n_classes = 100 if label == "fine" else 20
  else:
    raise ValueError(f"num_classes={num_classes!r} is not allowed; expected 10 or 100.")
  require_dir(root, what, root, tree)
  folder = require_dir(os.path.join(root, sub), what, root, tree)
  paths = [require_file(os.path.join(folder, name), what, root, tree) for name in names]
  parts = [_read_batch(p, label_key, what, root, tree) for p in paths]
  images = np.concatenate([p[0] for p in parts])
  labels = np.concatenate([p[1] for p in parts])
  if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
    raise ValueError(layout_message(
        what, root, f"labels outside 0..{n_classes - 1} (found {labels.min()}..{labels.max()})",
        tree))
  return images, labels


def cifar(root: str | os.PathLike, split: str = "train", *, num_classes: int = 10,
          augment: bool | None = None, recipe: str | None = None, label: str = "fine",
          **overrides: Any) -> ArrayDataset:
  """CIFAR-10/100 as an ArrayDataset with a recipe's normalisation and augmentation.

  Args:
    root: folder holding cifar-10-batches-py/ or cifar-100-python/.
    split: "train" or "test".
    num_classes: 10 or 100.
    augment: whether to apply the recipe's augmentation (default: split == "train").
    recipe: "cpd", "davidnet" or "bfpsim" (default "cpd" for 10, "bfpsim" for 100).
    label: CIFAR-100 only, "fine" or "coarse".
    **overrides: any of mean, std, crop, padding, pad_mode, flip, cutout, replacing
      the recipe's value (None: the recipe's).
  """
  if recipe is None:
    recipe = "cpd" if num_classes == 10 else "bfpsim"
  if recipe not in RECIPES:
    raise ValueError(f"recipe={recipe!r} is not allowed; expected one of {sorted(RECIPES)}.")
  settings = dict(RECIPES[recipe])
  for key, value in overrides.items():
    if key not in settings:
      raise ValueError(f"{key}={value!r} is not allowed; expected options among "
                       f"{sorted(settings)} (or split, augment, recipe, label, num_classes).")
    if value is not None:
      settings[key] = value
  images, labels = load_cifar_arrays(root, num_classes, split, label)
  if augment is None:
    augment = split == "train"
  normalization = Normalization(tuple(settings.pop("mean")), tuple(settings.pop("std")))
  crop_flip = CropFlip(**settings) if augment else None
  name = f"cifar{num_classes}"
  n_classes = 20 if (num_classes == 100 and label == "coarse") else num_classes
  return ArrayDataset(name, split, images, labels, n_classes, normalization, crop_flip)


def cifar10(root: str | os.PathLike, split: str = "train", *, augment: bool | None = None,
            recipe: str | None = None, mean: tuple[float, ...] | None = None,
            std: tuple[float, ...] | None = None, crop: int | None = None,
            padding: int | None = None, pad_mode: str | None = None, flip: bool | None = None,
            cutout: int | None = None) -> ArrayDataset:
  """CIFAR-10 (`cifar` with num_classes=10): recipe "cpd" unless given; the other options
  replace the recipe's values, None keeps them."""
  return cifar(root, split, num_classes=10, augment=augment, recipe=recipe, mean=mean, std=std,
               crop=crop, padding=padding, pad_mode=pad_mode, flip=flip, cutout=cutout)


def cifar100(root: str | os.PathLike, split: str = "train", *, augment: bool | None = None,
             recipe: str | None = None, label: str = "fine",
             mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
             crop: int | None = None, padding: int | None = None, pad_mode: str | None = None,
             flip: bool | None = None, cutout: int | None = None) -> ArrayDataset:
  """CIFAR-100 (`cifar` with num_classes=100): recipe "bfpsim" unless given, `label` "fine" (100
  classes) or "coarse" (20); the other options replace the recipe's values, None keeps them."""
  return cifar(root, split, num_classes=100, augment=augment, recipe=recipe, label=label,
               mean=mean, std=std, crop=crop, padding=padding, pad_mode=pad_mode, flip=flip,
               cutout=cutout)
