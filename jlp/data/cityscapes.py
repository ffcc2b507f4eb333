"""Cityscapes-style semantic segmentation folders (images + trainId label maps).

Layout (the official leftImg8bit / gtFine packages, with the *_labelTrainIds.png
maps made by cityscapesScripts' createTrainIdLabelImgs.py, as mmsegmentation
expects):
  root/leftImg8bit/{train,val}/<city>/<city>_<seq>_<frame>_leftImg8bit.png
  root/gtFine/{train,val}/<city>/<city>_<seq>_<frame>_gtFine_labelTrainIds.png
Each image is paired with the label map of the same prefix; an image without
one is an error. Files are sorted by (city, file name). Labels are trainIds
0..18 (19 classes) and 255 = ignore.

Transforms (a reduced version of mmsegmentation's FCN Cityscapes pipeline,
cpd.md §6.4; this module does not implement mmseg's PhotoMetricDistortion or
RandomCrop's cat_max_ratio re-draws):
  train: rescale by s = uniform(scale_range) (new size int(W * s + 0.5) x
         int(H * s + 0.5); image bilinear, labels nearest), a random crop_size
         window (offsets uniform on 0..max(size - crop, 0)), padding to crop_size
         at the bottom / right (image 0, labels 255), horizontal flip with p 1/2;
  eval:  rescale by eval_scale (default 1: native resolution), no crop.
Then Normalize with the ImageNet mean / std (mmseg's 123.675... / 58.395...
on 0..255). Eval batches need images of one size (Cityscapes: 2048 x 1024).
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
from PIL import Image

from jlp.data import augment as aug
from jlp.data.dataset import (Batch, Dataset, Normalization, check_split, layout_message,
                              require_dir)
from jlp.data.imagenet import IMAGENET_MEAN, IMAGENET_STD

CITYSCAPES_NUM_CLASSES = 19
IGNORE_LABEL = 255
IMAGE_SUFFIX = "_leftImg8bit.png"
LABEL_SUFFIX = "_gtFine_labelTrainIds.png"
CITYSCAPES_TREE = f"""
leftImg8bit/
├── train/<city>/<city>_<seq>_<frame>{IMAGE_SUFFIX}
└── val/<city>/...
gtFine/
├── train/<city>/<city>_<seq>_<frame>{LABEL_SUFFIX}   (trainIds 0..18, 255 = ignore)
└── val/<city>/...
"""


def scan_pairs(root: str | os.PathLike, split: str) -> tuple[list[str], list[str]]:
  """(image paths, label paths) of one split, paired by prefix, sorted by (city, name)."""
  what = "Cityscapes"
  root = os.fspath(root)
  require_dir(root, what, root, CITYSCAPES_TREE)
  image_dir = require_dir(os.path.join(root, "leftImg8bit", split), what, root, CITYSCAPES_TREE)
  label_dir = require_dir(os.path.join(root, "gtFine", split), what, root, CITYSCAPES_TREE)
  images, labels = [], []
  for city in sorted(e.name for e in os.scandir(image_dir) if e.is_dir()):
    names = sorted(e.name for e in os.scandir(os.path.join(image_dir, city))
                   if e.is_file() and e.name.endswith(IMAGE_SUFFIX))
    for name in names:
      label = os.path.join(label_dir, city, name[:-len(IMAGE_SUFFIX)] + LABEL_SUFFIX)
      if not os.path.isfile(label):
        raise FileNotFoundError(layout_message(
            what, root, f"no label map {label!r} for image {name!r}", CITYSCAPES_TREE))
      images.append(os.path.join(image_dir, city, name))
      labels.append(label)
  if not images:
    raise FileNotFoundError(layout_message(
        what, root, f"no *{IMAGE_SUFFIX} files under {image_dir!r}", CITYSCAPES_TREE))
  return images, labels


class CityscapesDataset(Dataset):
  """Image / trainId-map pairs; `get` returns "image" (N, H, W, 3) and "label" int32 (N, H, W)."""

  def __init__(self, root: str | os.PathLike, split: str = "train", *,
               augment: bool | None = None, crop_size: tuple[int, int] = (769, 769),
               scale_range: tuple[float, float] = (0.5, 2.0), eval_scale: float = 1.0,
               mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
               num_workers: int = 8):
    check_split(split, ("train", "val"))
    if isinstance(crop_size, int):
      crop_size = (crop_size, crop_size)
    crop_size = tuple(crop_size)
    if len(crop_size) != 2 or any(not isinstance(c, int) or c < 1 for c in crop_size):
      raise ValueError(f"crop_size={crop_size!r} is not allowed; expected (height, width) "
                       "positive ints.")
    if not 0 < scale_range[0] <= scale_range[1]:
      raise ValueError(f"scale_range={scale_range!r} is not allowed; expected 0 < lo <= hi.")
    if not eval_scale > 0:
      raise ValueError(f"eval_scale={eval_scale!r} is not allowed; expected a positive number.")
    if not isinstance(num_workers, int) or num_workers < 1:
      raise ValueError(f"num_workers={num_workers!r} is not allowed; expected a positive int.")
    self.image_paths, self.label_paths = scan_pairs(root, split)
    self.name, self.split = "cityscapes", split
    self.num_classes = CITYSCAPES_NUM_CLASSES
    self.augment = split == "train" if augment is None else bool(augment)
    self.crop_size = crop_size
    self.scale_range = tuple(scale_range)
    self.eval_scale = eval_scale
    self.normalization = Normalization(tuple(mean), tuple(std))
    self.num_workers = num_workers
    self._eval_hw = None

  @property
  def size(self) -> int:
    return len(self.image_paths)

  @property
  def image_shape(self) -> tuple[int, int, int]:
    if self.augment:
      return self.crop_size + (3,)
    if self._eval_hw is None:  # the first image's header (no decode)
      with Image.open(self.image_paths[0]) as image:
        w, h = image.size
      self._eval_hw = self._scaled(h, w, self.eval_scale)
    return self._eval_hw + (3,)

  @property
  def label_shape(self) -> tuple[int, int]:
    return self.image_shape[:2]

  @staticmethod
  def _scaled(height: int, width: int, s: float) -> tuple[int, int]:
    return int(height * s + 0.5), int(width * s + 0.5)

  def draw(self, rng: np.random.Generator, n: int) -> Batch:
    if not self.augment:
      return {}
    return {"scale_crop": rng.random((n, 3)), "flip": aug.draw_flips(rng, n)}

  def load(self, index: int, params: Batch | None) -> tuple[np.ndarray, np.ndarray]:
    """One (image uint8 (H, W, 3), label uint8 (H, W)) pair after the transform."""
    with Image.open(self.image_paths[index]) as f:
      image = f.convert("RGB")
    with Image.open(self.label_paths[index]) as f:
      label = f.convert("L") if f.mode not in ("L", "P") else f.copy()
    if image.size != label.size:
      raise ValueError(f"label map {self.label_paths[index]!r} is {label.size[0]}x"
                       f"{label.size[1]}, its image {image.size[0]}x{image.size[1]}.")
    width, height = image.size
    if not params:
      h, w = self._scaled(height, width, self.eval_scale)
      return (np.asarray(aug.resize(image, h, w), np.uint8),
              np.asarray(aug.resize(label, h, w, Image.NEAREST), np.uint8))
    u_scale, u_top, u_left = (float(u) for u in params["scale_crop"])
    lo, hi = self.scale_range
    h, w = self._scaled(height, width, lo + u_scale * (hi - lo))
    image = np.asarray(aug.resize(image, h, w), np.uint8)
    label = np.asarray(aug.resize(label, h, w, Image.NEAREST), np.uint8)
    ch, cw = self.crop_size
    top = min(int(u_top * (max(h - ch, 0) + 1)), max(h - ch, 0))
    left = min(int(u_left * (max(w - cw, 0) + 1)), max(w - cw, 0))
    out_image = np.zeros((ch, cw, 3), np.uint8)
    out_label = np.full((ch, cw), IGNORE_LABEL, np.uint8)
    window = image[top:top + ch, left:left + cw]
    out_image[:window.shape[0], :window.shape[1]] = window
    out_label[:window.shape[0], :window.shape[1]] = label[top:top + ch, left:left + cw]
    if params["flip"]:
      out_image, out_label = out_image[:, ::-1], out_label[:, ::-1]
    return out_image, out_label

  def get(self, indices: np.ndarray, params: Batch) -> Batch:
    indices = np.asarray(indices)
    rows = [{k: v[i] for k, v in params.items()} for i in range(len(indices))]
    with concurrent.futures.ThreadPoolExecutor(min(self.num_workers, max(len(indices), 1))) as ex:
      pairs = list(ex.map(self.load, indices.tolist(), rows))
    shapes = {p[0].shape for p in pairs}
    if len(shapes) > 1:
      raise ValueError(f"images of different sizes {sorted(shapes)} in one batch; eval batches "
                       "need one image size (use augment=True crops or same-size images).")
    if not pairs:
      h, w, _ = self.image_shape
      return {"image": np.zeros((0, h, w, 3), np.float32), "label": np.zeros((0, h, w), np.int32)}
    images = np.stack([p[0] for p in pairs])
    labels = np.stack([p[1] for p in pairs]).astype(np.int32)
    return {"image": self.normalization(images), "label": labels}


def cityscapes(root: str | os.PathLike, split: str = "train", **options) -> CityscapesDataset:
  """Cityscapes-style segmentation folders; options as CityscapesDataset."""
  return CityscapesDataset(root, split, **options)
