"""ImageNet (ILSVRC-2012) in class-folder layout, decoded with Pillow.

Layout (torchvision ImageFolder's):
  root/train/<wnid>/*.JPEG
  root/val/<wnid>/*.JPEG
Classes are the sorted sub-folder names of root/train (the val split uses the
same class list and must not have other folders); files are sorted within a
class, and the label of a file is the index of its class. Extensions accepted
(case-insensitive): .jpeg .jpg .png .bmp .ppm .webp (as ImageFolder).

Transforms (docs/cpd.md, docs/bfp.md; torchvision semantics, see
`jlp.data.augment`), images converted to RGB first:
  train: RandomResizedCrop(crop_size, scale=(0.08, 1), ratio=(3/4, 4/3)),
         bilinear, + RandomHorizontalFlip;
  eval:  Resize(resize_size) (shorter side) + CenterCrop(crop_size);
then ToTensor + Normalize with the ImageNet mean (0.485, 0.456, 0.406) and
std (0.229, 0.224, 0.225). crop_size=224 and resize_size=256 by default;
tests use tiny sizes. Images are decoded on `num_workers` threads (Pillow
releases the GIL while decoding and resizing).
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
from PIL import Image

from jlp.data import augment as aug
from jlp.data.dataset import (Batch, Dataset, Normalization, check_split, layout_message,
                              require_dir)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".ppm", ".webp")
IMAGENET_TREE = """
train/
├── n01440764/
│   ├── n01440764_10026.JPEG
│   └── ...
└── ... (one folder per class, sorted names = labels 0, 1, ...)
val/
├── n01440764/
│   └── ILSVRC2012_val_00000293.JPEG ...
└── ... (the same class folders)
"""


def scan_class_folders(root: str | os.PathLike, split: str, what: str = "ImageNet",
                       tree: str = IMAGENET_TREE) -> tuple[list[str], list[str], np.ndarray]:
  """(classes, file paths, labels) of root/<split>/<class>/<image>, classes from root/train."""
  root = os.fspath(root)
  require_dir(root, what, root, tree)
  train_dir = require_dir(os.path.join(root, "train"), what, root, tree)
  split_dir = require_dir(os.path.join(root, split), what, root, tree)
  classes = sorted(e.name for e in os.scandir(train_dir) if e.is_dir())
  if not classes:
    raise FileNotFoundError(layout_message(what, root, f"no class folders in {train_dir!r}", tree))
  found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
  unknown = sorted(set(found) - set(classes))
  if unknown:
    raise ValueError(layout_message(
        what, root, f"{split_dir!r} has class folders not in train/: {unknown[:5]}", tree))
  paths, labels = [], []
  for label, name in enumerate(classes):
    folder = os.path.join(split_dir, name)
    if not os.path.isdir(folder):
      continue
    files = sorted(e.name for e in os.scandir(folder)
                   if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))
    paths += [os.path.join(folder, f) for f in files]
    labels += [label] * len(files)
  if not paths:
    raise FileNotFoundError(layout_message(
        what, root, f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {split_dir!r}", tree))
  return classes, paths, np.asarray(labels, np.int32)


def decode_rgb(path: str) -> Image.Image:
  """The image at `path`, decoded and converted to RGB."""
  with Image.open(path) as image:
    return image.convert("RGB")


class ImageFolderDataset(Dataset):
  """Class-folder images with the ImageNet train / eval transforms."""

  def __init__(self, root: str | os.PathLike, split: str = "train", *,
               augment: bool | None = None, crop_size: int = 224, resize_size: int = 256,
               scale: tuple[float, float] = (0.08, 1.0),
               ratio: tuple[float, float] = (3 / 4, 4 / 3),
               mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
               num_workers: int = 8, name: str = "imagenet"):
    check_split(split, ("train", "val"))
    for field, value in (("crop_size", crop_size), ("resize_size", resize_size),
                         ("num_workers", num_workers)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}={value!r} is not allowed; expected a positive int.")
    if resize_size < crop_size:
      raise ValueError(f"resize_size={resize_size!r} is not allowed; expected at least "
                       f"crop_size={crop_size}.")
    if not 0 < scale[0] <= scale[1] <= 1:
      raise ValueError(f"scale={scale!r} is not allowed; expected 0 < lo <= hi <= 1.")
    if not 0 < ratio[0] <= ratio[1]:
      raise ValueError(f"ratio={ratio!r} is not allowed; expected 0 < lo <= hi.")
    self.classes, self.paths, self.labels = scan_class_folders(root, split)
    self.name, self.split = name, split
    self.num_classes = len(self.classes)
    self.augment = split == "train" if augment is None else bool(augment)
    self.crop_size, self.resize_size = crop_size, resize_size
    self.scale, self.ratio = tuple(scale), tuple(ratio)
    self.normalization = Normalization(tuple(mean), tuple(std))
    self.num_workers = num_workers

  @property
  def size(self) -> int:
    return len(self.paths)

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return (self.crop_size, self.crop_size, 3)

  def draw(self, rng: np.random.Generator, n: int) -> Batch:
    if not self.augment:
      return {}
    return {"resized_crop": aug.draw_resized_crop_uniforms(rng, n),
            "flip": aug.draw_flips(rng, n)}

  def transform(self, image: Image.Image, params: Batch | None) -> np.ndarray:
    """One decoded RGB image -> uint8 (crop_size, crop_size, 3); params: one example's row."""
    width, height = image.size
    c = self.crop_size
    if params:
      top, left, h, w = aug.resized_crop_box(params["resized_crop"], height, width,
                                             self.scale, self.ratio)
      image = image.crop((left, top, left + w, top + h)).resize((c, c), Image.BILINEAR)
      out = np.asarray(image, np.uint8)
      return out[:, ::-1] if params["flip"] else out
    h, w = aug.shorter_side_size(height, width, self.resize_size)
    image = aug.resize(image, h, w)
    top, left = aug.center_crop_box(h, w, c)
    return np.asarray(image, np.uint8)[top:top + c, left:left + c]

  def load(self, index: int, params: Batch | None) -> np.ndarray:
    return self.transform(decode_rgb(self.paths[index]), params)

  def get(self, indices: np.ndarray, params: Batch) -> Batch:
    indices = np.asarray(indices)
    rows = [{k: v[i] for k, v in params.items()} for i in range(len(indices))]
    with concurrent.futures.ThreadPoolExecutor(min(self.num_workers, max(len(indices), 1))) as ex:
      images = list(ex.map(self.load, indices.tolist(), rows))
    x = np.stack(images) if images else np.zeros((0,) + self.image_shape, np.uint8)
    return {"image": self.normalization(x), "label": self.labels[indices]}


def imagenet(root: str | os.PathLike, split: str = "train", **options) -> ImageFolderDataset:
  """ImageNet (class folders) with the seeds' transforms; options as ImageFolderDataset."""
  return ImageFolderDataset(root, split, **options)
