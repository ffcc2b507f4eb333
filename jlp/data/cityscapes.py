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
0..255). Still unlike mmseg: its Resize scales to img_scale (2049, 1025) x ratio
with cv2's bilinear (here: the image size x s with PIL's).

Evaluation stacks whole images into batches, so an evaluation split
(augment=False) must hold images of one size (Cityscapes: 2048 x 1024 each).
The constructor reads every image's header (PIL's Image.open reads only the
header: 500 val files in about 30 ms from the page cache) and refuses a split of
several sizes, naming a file of each. mmseg evaluates one image at a time instead (samples_per_gpu=1, Resize
keep_ratio to (2048, 1024), logits resized back to each label map); here a
model call per image size would recompile, so mixed sizes are refused rather
than handled: resize the odd files, or evaluate them as a split of their own.

Files are checked as they are read; each problem raises DataFileError naming
the file (`verify()` decodes the whole split and returns every one):
  - an image or label map that cannot be decoded (truncated, empty, corrupt,
    not an image, more pixels than PIL.Image.MAX_IMAGE_PIXELS);
  - a label map with more than one channel (mode RGB, RGBA, LA, ...: a colour
    map such as *_gtFine_color.png saved under the trainIds name);
  - a label map holding values other than 0..18 and 255 (raw labelIds 0..33,
    a colour palette's indices, ...). Such maps trained to NaN losses before;
    cityscapesScripts' createTrainIdLabelImgs writes the right ones (TRAIN_ID_HELP);
  - a label map whose size differs from its image's.
Single-channel label maps of PIL modes L, P (the palette indices), 1 and I /
I;16 (16- or 32-bit grey) are read as their integer values.
`manifest()` lists image and label map of each example, relative to root.

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

Speed (one example: decode, rescale, crop with re-draws, flip, photometric,
Normalize, pad; `load` then `_padded`, or `get` for a batch): the image is
decoded once and converted only when not RGB; the label map is decoded once,
checked, and rescaled whole (nearest, cheap) for the cat_max_ratio tests; the
image is rescaled only where the crop window needs it (`resize_window`: PIL's
bilinear result bit for bit, computed on the rows and columns the window reads);
PhotoMetricDistortion runs through lookup tables (jlp.data.augment).

Randomness: `draw` gives per example "scale_crop" (scale, top, left uniforms),
"flip", and, when on, "crop_retry" (CROP_RETRIES x (top, left) uniforms for the
re-drawn windows) and "photometric" (augment.draw_photometric); `load` applies
them, so batches stay a pure function of (seed, step). With cat_max_ratio=1 and
photometric=False the draws and the batches are those of the pipeline without
either step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
import os

import numpy as np
from PIL import Image

from jlp.data import augment as aug
from jlp.data.dataset import (Batch, DataFileError, Dataset, Normalization, check_split,
                              layout_message, require_dir)
from jlp.data.imagenet import IMAGENET_MEAN, IMAGENET_STD
from jlp.data.image_files import decoded

CITYSCAPES_NUM_CLASSES = 19
IGNORE_LABEL = 255
# mmseg RandomCrop: windows re-drawn at most this many times while cat_max_ratio rejects them.
CROP_RETRIES = 10
IMAGE_SUFFIX = "_leftImg8bit.png"
LABEL_SUFFIX = "_gtFine_labelTrainIds.png"
# Where correct *_labelTrainIds.png maps come from (shown with label errors).
TRAIN_ID_HELP = (
    "make the trainId maps from the gtFine polygons with cityscapesScripts' "
    "createTrainIdLabelImgs (pip install cityscapesscripts, then CITYSCAPES_DATASET=<root> "
    "csCreateTrainIdLabelImgs; mmsegmentation's tools/convert_datasets/cityscapes.py runs the "
    "same)")
# PIL modes of one channel whose pixel values are the label values.
LABEL_MODES = ("L", "P", "1", "I", "I;16", "I;16L", "I;16B", "I;16N")
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
  root = os.path.expanduser(os.fspath(root))
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


def read_image(path: str) -> Image.Image:
  """The RGB image at `path` (converted only when its mode is not RGB); DataFileError if it
  cannot be decoded."""
  return decoded(path, lambda image: image if image.mode == "RGB" else image.convert("RGB"))


def check_train_ids(label: np.ndarray, path: str) -> np.ndarray:
  """`label` as uint8 if every value is a trainId (0..18) or 255, else DataFileError naming the
  file, the values found and where good maps come from."""
  if label.dtype == np.uint8:
    # 0..18 -> 1..19 and 255 -> 0 (uint8 wraps): one pass and a max.
    if label.size == 0 or int((label + np.uint8(1)).max()) <= CITYSCAPES_NUM_CLASSES:
      return label
  else:
    wide = label.astype(np.int64)
    if ((wide >= 0) & (wide < CITYSCAPES_NUM_CLASSES) | (wide == IGNORE_LABEL)).all():
      return wide.astype(np.uint8)
  wide = label.astype(np.int64)
  bad = np.unique(wide[~((wide >= 0) & (wide < CITYSCAPES_NUM_CLASSES) | (wide == IGNORE_LABEL))])
  count = int(np.isin(wide, bad).sum())
  shown = ", ".join(str(v) for v in bad[:12].tolist()) + (", ..." if bad.size > 12 else "")
  guess = (" They look like raw labelIds (0..33, *_gtFine_labelIds.png) saved under the trainIds "
           "name." if 0 <= bad.min() and bad.max() <= 33 else "")
  raise DataFileError(path, (
      f"label values {shown} ({count} of {label.size} pixels) are not trainIds: a "
      f"*{LABEL_SUFFIX} map holds 0..{CITYSCAPES_NUM_CLASSES - 1} (the classes) and "
      f"{IGNORE_LABEL} (ignore), and other values train to NaN losses.{guess} Fix: "
      f"{TRAIN_ID_HELP}"))


def _label_array(image: Image.Image, path: str) -> np.ndarray:
  if image.mode not in LABEL_MODES:
    bands = len(image.getbands())
    raise DataFileError(path, (
        f"a {image.mode} image ({bands} channel{'s' if bands > 1 else ''}); a *{LABEL_SUFFIX} map "
        "is one channel of trainIds, not colours (a colour map such as *_gtFine_color.png saved "
        f"under this name?). Fix: {TRAIN_ID_HELP}"))
  label = np.asarray(image)
  return label.astype(np.uint8) if label.dtype == bool else label


def read_label(path: str) -> np.ndarray:
  """The trainId map at `path` as uint8 (H, W), checked (check_train_ids); DataFileError if it
  cannot be decoded, has several channels or holds other values."""
  return check_train_ids(decoded(path, lambda image: _label_array(image, path)), path)


def header_size(path: str) -> tuple[int, int] | None:
  """(width, height) from the file's header (PIL reads no pixels); None if unreadable (the
  file is then refused when it is loaded, or listed by verify)."""
  try:
    with Image.open(path) as image:
      return image.size
  except Exception:  # pylint: disable=broad-except
    return None


def check_one_size(paths: list[str], root: str, split: str) -> tuple[int, int] | None:
  """The (width, height) that all readable `paths` share (from their headers), None if none
  is readable; ValueError naming a file of each size when they differ."""
  by_size = collections.defaultdict(list)
  for path in paths:
    size = header_size(path)
    if size is not None:
      by_size[size].append(path)
  if len(by_size) > 1:
    ordered = sorted(by_size.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    listing = "; ".join(f"{w}x{h}: {len(ps)} file{'s' if len(ps) > 1 else ''} "
                        f"(e.g. {os.path.relpath(ps[0], root)!r})" for (w, h), ps in ordered)
    raise ValueError(
        f"Cityscapes {split} images under {root!r} have {len(by_size)} sizes ({listing}). "
        "Evaluation (augment=False) stacks whole images into batches, so it needs one size "
        "(Cityscapes: 2048x1024); resize the odd files, or evaluate them as a split of their own.")
  return next(iter(by_size), None)


@functools.lru_cache(maxsize=None)
def _window_resize_is_exact() -> bool:
  """Whether resize_window's pass-by-pass route gives this Pillow's full resize (checked once
  on small images; False keeps the full resize)."""
  rng = np.random.default_rng(0)
  for (w0, h0), (w1, h1), (top, left, ch, cw) in (
      ((37, 19), (61, 31), (5, 9, 12, 20)), ((37, 19), (25, 13), (2, 3, 8, 11)),
      ((40, 30), (79, 59), (17, 40, 30, 33)), ((40, 30), (40, 47), (9, 0, 20, 40)),
      ((40, 30), (71, 30), (0, 20, 30, 25))):
    image = Image.fromarray(rng.integers(0, 256, (h0, w0, 3), dtype=np.uint8))
    full = np.asarray(image.resize((w1, h1), Image.BILINEAR))[top:top + ch, left:left + cw]
    if not np.array_equal(_resize_window_by_passes(image, h1, w1, top, left, ch, cw), full):
      return False
  return True


def _resize_window_by_passes(image: Image.Image, height: int, width: int, top: int, left: int,
                             crop_h: int, crop_w: int) -> np.ndarray:
  src_w, src_h = image.size
  bottom, right = min(top + crop_h, height), min(left + crop_w, width)
  # Source rows the window's output rows read: the filter reaches max(src_h / height, 1) rows
  # either side of each centre; 2 more for safety (extra rows are computed, never wrong).
  reach = max(src_h / height, 1.0) + 2
  lo = max(int(top * src_h / height - reach), 0)
  hi = min(int(math.ceil(bottom * src_h / height + reach)), src_h)
  # Horizontal pass on those rows only: output rows depend on their source row alone.
  strip = image.crop((0, lo, src_w, hi)).resize((width, hi - lo), Image.BILINEAR)
  # Vertical pass on the window's columns only: output columns depend on their column alone,
  # and the coefficients on (src_h, height) alone, so the strip goes back at its rows of a
  # src_h-row image (the other rows are never read).
  tall = Image.new(image.mode, (right - left, src_h))
  tall.paste(strip.crop((left, 0, right, hi - lo)), (0, lo))
  out = tall.resize((right - left, height), Image.BILINEAR)
  return np.asarray(out.crop((0, top, right - left, bottom)))


def resize_window(image: Image.Image, height: int, width: int, top: int, left: int,
                  crop_h: int, crop_w: int) -> np.ndarray:
  """np.asarray(image.resize((width, height), BILINEAR))[top:top + crop_h, left:left + crop_w]
  (uint8), bit for bit, computing little more than the window when it is a small part.

  PIL's bilinear resize (libImaging/Resample.c) is two separable passes with an 8-bit image
  between them: horizontal (coefficients from the widths alone, each output row from its source
  row), then vertical (coefficients from the heights alone, each output column from its input
  column). So the window needs the horizontal pass on the source rows it reads only, and the
  vertical pass on its columns only (given back their rows of a full-height image, so that the
  coefficients are the full resize's). Pillow 13 runs the vertical pass first when src_h -
  height > max(0, 2 (src_w - width)) (read from its build; never for Cityscapes' 2:1 images
  scaled alike); there, and where the window is over half the image (no gain), this takes
  the full resize. `_window_resize_is_exact` checks the route once against this
  Pillow's full resize; tests/data_pipeline/cityscapes_test.py on random sizes.
  """
  src_w, src_h = image.size
  if (src_w, src_h) == (width, height):
    return np.asarray(image.crop((left, top, min(left + crop_w, width), min(top + crop_h, height))))
  vertical_first = src_h - height > 0 and src_h - height > 2 * (src_w - width)
  # Windows over half the image (a 769 crop of a Cityscapes image scaled by 0.75 or less): the
  # full resize is as fast.
  if (vertical_first or 2 * min(crop_h, height) * min(crop_w, width) > height * width
      or not _window_resize_is_exact()):
    full = image.resize((width, height), Image.BILINEAR)
    return np.asarray(full.crop((left, top, min(left + crop_w, width),
                                 min(top + crop_h, height))))
  return _resize_window_by_passes(image, height, width, top, left, crop_h, crop_w)


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
  Both only act with augment (the training split's default). Without augment the split's
  images must share one size (read from their headers here; ValueError naming a file of each).
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
    self.root = os.path.expanduser(os.fspath(root))
    self.image_paths, self.label_paths = scan_pairs(self.root, split)
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
    if not self.augment:  # whole images are stacked: one size (headers only)
      size = check_one_size(self.image_paths, self.root, split)
      if size is not None:
        self._eval_hw = self._scaled(size[1], size[0], self.eval_scale)

  @property
  def size(self) -> int:
    return len(self.image_paths)

  @property
  def image_shape(self) -> tuple[int, int, int]:
    if self.augment:
      return self.crop_size + (3,)
    if self._eval_hw is None:  # no readable header at construction: the first image's size
      w, h = read_image(self.image_paths[0]).size
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

  def read(self, index: int) -> tuple[Image.Image, np.ndarray]:
    """Example `index` as stored: (RGB image, checked uint8 trainId map of its size); a file
    that cannot be used raises DataFileError naming it."""
    image = read_image(self.image_paths[index])
    label = read_label(self.label_paths[index])
    if image.size != (label.shape[1], label.shape[0]):
      raise self._size_mismatch(index, image.size, label)
    return image, label

  def _size_mismatch(self, index: int, image_size: tuple[int, int],
                     label: np.ndarray) -> DataFileError:
    return DataFileError(self.label_paths[index], (
        f"the label map is {label.shape[1]}x{label.shape[0]}, its image "
        f"{os.path.basename(self.image_paths[index])!r} {image_size[0]}x{image_size[1]}"))

  def load(self, index: int, params: Batch | None) -> tuple[np.ndarray, np.ndarray]:
    """One (image uint8 (h, w, 3), label uint8 (h, w)) pair after the transform, before
    Normalize (and, for train windows smaller than crop_size, before padding)."""
    image, label = self.read(index)
    width, height = image.size
    if not params:
      h, w = self._scaled(height, width, self.eval_scale)
      label_image = Image.fromarray(label)
      return (np.asarray(aug.resize(image, h, w), np.uint8),
              np.asarray(aug.resize(label_image, h, w, Image.NEAREST), np.uint8))
    u_scale, u_top, u_left = (float(u) for u in params["scale_crop"])
    lo, hi = self.scale_range
    h, w = self._scaled(height, width, lo + u_scale * (hi - lo))
    # The whole label map (nearest: cheap) for the cat_max_ratio tests; the image only where
    # the window reads it.
    label = np.asarray(aug.resize(Image.fromarray(label), h, w, Image.NEAREST), np.uint8)
    ch, cw = self.crop_size
    uniforms = np.array([[u_top, u_left]])
    if "crop_retry" in params:
      uniforms = np.concatenate([uniforms, np.asarray(params["crop_retry"]).reshape(-1, 2)])
    top, left = crop_window(label, uniforms, self.crop_size, self.cat_max_ratio)
    window = resize_window(image, h, w, top, left, ch, cw)
    window_label = label[top:top + ch, left:left + cw]
    if params["flip"]:  # before PhotoMetricDistortion, whose HSV rounding depends on the column
      window, window_label = window[:, ::-1], window_label[:, ::-1]
    if "photometric" in params:
      window = aug.photometric_distortion(window, params["photometric"])
    return window, window_label

  def verify(self) -> list[DataFileError]:
    """Every file of the split that cannot be used (`read`: each image and label map decoded
    fully, labels checked, sizes compared; on num_workers threads), in index order."""
    def problems(index: int) -> list[DataFileError]:
      found, decoded = [], []
      for path, read in ((self.image_paths[index], read_image),
                         (self.label_paths[index], read_label)):
        try:
          decoded.append(read(path))
        except DataFileError as e:
          found.append(e)
      if not found and decoded[0].size != decoded[1].shape[::-1]:
        found.append(self._size_mismatch(index, decoded[0].size, decoded[1]))
      return found

    with concurrent.futures.ThreadPoolExecutor(self.num_workers) as ex:
      return [e for found in ex.map(problems, range(self.size)) for e in found]

  def manifest(self) -> list[str]:
    """Image and label map of each example in index order, relative to root with "/"
    separators (e.g. "leftImg8bit/val/frankfurt/frankfurt_000000_000294_leftImg8bit.png")."""
    return [os.path.relpath(p, self.root).replace(os.sep, "/")
            for pair in zip(self.image_paths, self.label_paths) for p in pair]

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
