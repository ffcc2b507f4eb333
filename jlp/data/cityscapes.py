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
docs/cpd.md: Resize, RandomCrop(cat_max_ratio=0.75), RandomFlip, PhotoMetricDistortion,
Normalize, Pad):
  train: rescale by s = uniform(scale_range) (new size int(W * s + 0.5) x
         int(H * s + 0.5); image bilinear, labels nearest); a random crop_size
         window (offsets uniform on 0..max(size - crop, 0)), re-drawn while the
         window's labels fail mmseg's cat_max_ratio test (below); horizontal flip
         with p 1/2; mmseg's PhotoMetricDistortion on the (flipped) window
         (`photometric`, jlp.data.augment.photometric_distortion); Normalize;
         padding to crop_size at the bottom and at the right, as mmseg's Pad
         after Normalize: padded image values are 0 after normalisation, padded
         labels 255;
  eval:  rescale by eval_scale (default 1: native resolution), no crop.
Normalize uses the ImageNet mean / std (mmseg's 123.675... / 58.395... on
0..255). Eval batches need images of one size (Cityscapes: 2048 x 1024).
Still unlike mmseg: its Resize scales to img_scale (2049, 1025) x ratio with
cv2's bilinear (here: the image size x s with PIL's).

RandomCrop's cat_max_ratio, as mmseg's RandomCrop.__call__: the window is
accepted when its labels other than 255 hold more than one class and
max(count) / sum(count) < cat_max_ratio; otherwise another window is drawn, at
most CROP_RETRIES = 10 times, and the last one drawn is kept whatever its labels
(so up to 11 windows, the 11th unchecked). cat_max_ratio=1 turns it off.

Followed: mmsegmentation mmseg/datasets/pipelines/transforms.py (RandomCrop,
PhotoMetricDistortion; the stored upstream copies at commits 0066ce88 and db54ce7b,
both after v0.5.0 and identical in these two classes), mmcv mmcv/image/colorspace.py
(bgr2hsv / hsv2bgr = cv2.cvtColor) and OpenCV imgproc/src/color_hsv.simd.hpp for the
8-bit HSV conversions. The image is RGB here (mmcv's is BGR): the HSV steps read
the channels by name, so the result is mmseg's with the channels reversed.

Randomness: `draw` gives per example "scale_crop" (scale, top, left uniforms),
"flip", and, when on, "crop_retry" (CROP_RETRIES x (top, left) uniforms for the
re-drawn windows) and "photometric" (augment.draw_photometric); `load` applies
them, so batches stay a pure function of (seed, step). With cat_max_ratio=1 and
photometric=False the draws and the batches are those of the pipeline without
either step.
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
# mmseg RandomCrop: windows re-drawn at most this many times while cat_max_ratio rejects them.
CROP_RETRIES = 10
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


def crop_offset(u_top: float, u_left: float, size: tuple[int, int],
                crop_size: tuple[int, int]) -> tuple[int, int]:
  """(top, left) of a crop window from two uniforms: each uniform on 0..max(size - crop, 0)."""
  margin_h, margin_w = max(size[0] - crop_size[0], 0), max(size[1] - crop_size[1], 0)
  return (min(int(u_top * (margin_h + 1)), margin_h),
          min(int(u_left * (margin_w + 1)), margin_w))


def cat_ratio_accepts(window_label: np.ndarray, cat_max_ratio: float,
                      ignore_index: int = IGNORE_LABEL) -> bool:
  """mmseg RandomCrop's test of a window: its labels other than ignore_index hold more than one
  class and the largest class count / their total < cat_max_ratio."""
  counts = np.bincount(np.asarray(window_label, np.int64).ravel())
  if ignore_index < counts.size:
    counts[ignore_index] = 0
  counts = counts[counts > 0]
  return counts.size > 1 and counts.max() / counts.sum() < cat_max_ratio


def crop_window(label: np.ndarray, uniforms: np.ndarray, crop_size: tuple[int, int],
                cat_max_ratio: float = 1.0, ignore_index: int = IGNORE_LABEL) -> tuple[int, int]:
  """(top, left) of mmseg RandomCrop's window on `label` (H, W), driven by (top, left) uniforms.

  uniforms[0] gives the first window; while cat_max_ratio < 1 and a window fails
  cat_ratio_accepts, the next row gives the next window, and the window of the last row is
  kept unchecked (mmseg: 10 re-draws, so 11 rows).
  """
  uniforms = np.asarray(uniforms, np.float64).reshape(-1, 2)
  size = label.shape[:2]
  top, left = crop_offset(*uniforms[0], size, crop_size)
  if cat_max_ratio < 1.0:
    ch, cw = crop_size
    for u_top, u_left in uniforms[1:]:
      if cat_ratio_accepts(label[top:top + ch, left:left + cw], cat_max_ratio, ignore_index):
        break
      top, left = crop_offset(u_top, u_left, size, crop_size)
  return top, left


class CityscapesDataset(Dataset):
  """Image / trainId-map pairs; `get` returns "image" (N, H, W, 3) and "label" int32 (N, H, W).

  cat_max_ratio: mmseg RandomCrop's largest-class share (0 < r <= 1; 1 = no re-draws).
  photometric: mmseg's PhotoMetricDistortion on the training crops.
  Both only act with augment (the training split's default).
  """

  def __init__(self, root: str | os.PathLike, split: str = "train", *,
               augment: bool | None = None, crop_size: tuple[int, int] = (769, 769),
               scale_range: tuple[float, float] = (0.5, 2.0), eval_scale: float = 1.0,
               cat_max_ratio: float = 0.75, photometric: bool = True,
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
    if (isinstance(cat_max_ratio, (bool, np.bool_))
        or not isinstance(cat_max_ratio, (int, float, np.integer, np.floating))
        or not 0 < cat_max_ratio <= 1):
      raise ValueError(f"cat_max_ratio={cat_max_ratio!r} is not allowed; expected a number in "
                       "(0, 1] (1: no re-draws).")
    if not isinstance(photometric, (bool, np.bool_)):
      raise ValueError(f"photometric={photometric!r} is not allowed; expected True or False.")
    if not isinstance(num_workers, int) or num_workers < 1:
      raise ValueError(f"num_workers={num_workers!r} is not allowed; expected a positive int.")
    self.image_paths, self.label_paths = scan_pairs(root, split)
    self.name, self.split = "cityscapes", split
    self.num_classes = CITYSCAPES_NUM_CLASSES
    self.augment = split == "train" if augment is None else bool(augment)
    self.crop_size = crop_size
    self.scale_range = tuple(scale_range)
    self.eval_scale = eval_scale
    self.cat_max_ratio = float(cat_max_ratio)
    self.photometric = bool(photometric)
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
    params = {"scale_crop": rng.random((n, 3)), "flip": aug.draw_flips(rng, n)}
    if self.cat_max_ratio < 1.0:
      params["crop_retry"] = rng.random((n, CROP_RETRIES, 2))
    if self.photometric:
      params["photometric"] = aug.draw_photometric(rng, n)
    return params

  def load(self, index: int, params: Batch | None) -> tuple[np.ndarray, np.ndarray]:
    """One (image uint8 (h, w, 3), label uint8 (h, w)) pair after the transform, before
    Normalize (and, for train windows smaller than crop_size, before padding)."""
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
    uniforms = np.array([[u_top, u_left]])
    if "crop_retry" in params:
      uniforms = np.concatenate([uniforms, np.asarray(params["crop_retry"]).reshape(-1, 2)])
    top, left = crop_window(label, uniforms, self.crop_size, self.cat_max_ratio)
    window = image[top:top + ch, left:left + cw]
    window_label = label[top:top + ch, left:left + cw]
    if params["flip"]:  # before PhotoMetricDistortion, whose HSV rounding depends on the column
      window, window_label = window[:, ::-1], window_label[:, ::-1]
    if "photometric" in params:
      window = aug.photometric_distortion(window, params["photometric"])
    return window, window_label

  def _padded(self, image: np.ndarray, label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mmseg's Pad after Normalize: the normalised window at the top left of crop_size, padded
    with 0 (image) and IGNORE_LABEL (label)."""
    h, w = label.shape
    out_image = np.zeros(self.crop_size + (3,), np.float32)
    out_label = np.full(self.crop_size, IGNORE_LABEL, np.int32)
    out_image[:h, :w] = self.normalization(image)
    out_label[:h, :w] = label
    return out_image, out_label

  def get(self, indices: np.ndarray, params: Batch) -> Batch:
    indices = np.asarray(indices)
    rows = [{k: v[i] for k, v in params.items()} for i in range(len(indices))]
    with concurrent.futures.ThreadPoolExecutor(min(self.num_workers, max(len(indices), 1))) as ex:
      pairs = list(ex.map(self.load, indices.tolist(), rows))
    if not pairs:
      h, w, _ = self.image_shape
      return {"image": np.zeros((0, h, w, 3), np.float32), "label": np.zeros((0, h, w), np.int32)}
    if params:
      padded = [self._padded(*p) for p in pairs]
      return {"image": np.stack([p[0] for p in padded]), "label": np.stack([p[1] for p in padded])}
    shapes = {p[0].shape for p in pairs}
    if len(shapes) > 1:
      raise ValueError(f"images of different sizes {sorted(shapes)} in one batch; eval batches "
                       "need one image size (use augment=True crops or same-size images).")
    images = np.stack([p[0] for p in pairs])
    labels = np.stack([p[1] for p in pairs]).astype(np.int32)
    return {"image": self.normalization(images), "label": labels}


def cityscapes(root: str | os.PathLike, split: str = "train", **options) -> CityscapesDataset:
  """Cityscapes-style segmentation folders; options as CityscapesDataset."""
  return CityscapesDataset(root, split, **options)
