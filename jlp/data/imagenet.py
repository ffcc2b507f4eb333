"""ImageNet (ILSVRC-2012) in class-folder layout, decoded with Pillow.

Layout (torchvision ImageFolder's rules, docs/data.md#imagenet):
  root/train/<wnid>/*.JPEG
  root/val/<wnid>/*.JPEG
Classes are the sorted folder names of root/train (the val split uses the
same class list and must not have other folders); the label of a file is the
index of its class. Each class folder is walked with its subfolders
(os.walk, symlinks followed) in torchvision's order: folders by sorted path,
files sorted within a folder. Extensions accepted (case-insensitive):
IMAGE_EXTENSIONS, torchvision's IMG_EXTENSIONS. Unlike torchvision, hidden
entries (names starting with ".": .ipynb_checkpoints/, macOS ._x.JPEG
AppleDouble files, .DS_Store) are skipped at every level, so labels are
torchvision's for the same tree without its hidden entries. Refused with a
message: a class folder without an image file (torchvision's
FileNotFoundError), image files directly in train/ or val/ (ImageNet's flat
val/ gets how to sort it into class folders), val folders unknown to train/.

A file that cannot be decoded (truncated, empty, corrupt, not an image, over
PIL's Image.MAX_IMAGE_PIXELS) raises DataFileError naming it when it is
loaded (`decode_rgb`; PIL's LOAD_TRUNCATED_IMAGES stays off); `verify()`
decodes every file of the split and returns them all; `manifest()` is the
split's file paths relative to root, in index order.

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
from jlp.data import batching, jpeg
from jlp.data.dataset import (Batch, Dataset, DataFileError, Normalization, check_split,
                              layout_message, require_dir)
from jlp.data.image_files import decoded

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: torchvision's IMG_EXTENSIONS (datasets/folder.py), matched case-insensitively.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
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
#: How to sort ImageNet's flat val/ into class folders (shown when val/ holds images directly).
IMAGENET_VAL_PREP = (
    "ILSVRC2012_img_val.tar unpacks its 50,000 images flat; val/ needs them in one folder per "
    "class, named like the train/ folders (wnids). Sort them with the labels of the ILSVRC2012 "
    "devkit (ILSVRC2012_devkit_t12.tar.gz): data/ILSVRC2012_validation_ground_truth.txt gives, "
    "line by line, the class ID (1..1000) of ILSVRC2012_val_00000001.JPEG, 00000002, ..., and "
    "data/meta.mat maps each ID to its wnid. The widely shared valprep.sh does exactly these "
    "moves (mkdir -p n01440764; mv ILSVRC2012_val_00000293.JPEG n01440764/; ...), and "
    "torchvision.datasets.ImageNet(root, split='val') sorts them from the two archives.")


def is_hidden(name: str) -> bool:
  """Names starting with "." (.ipynb_checkpoints, .DS_Store, macOS ._x.JPEG AppleDouble files)."""
  return name.startswith(".")


def is_image_file(name: str) -> bool:
  """A visible file name with one of IMAGE_EXTENSIONS (any case)."""
  return not is_hidden(name) and name.lower().endswith(IMAGE_EXTENSIONS)


def class_folders(directory: str) -> list[str]:
  """The sorted names of the visible folders (symlinks to folders count) in `directory`."""
  return sorted(e.name for e in os.scandir(directory) if e.is_dir() and not is_hidden(e.name))


def walk_images(folder: str) -> list[str]:
  """The image files under `folder` and its visible subfolders, in torchvision make_dataset's
  order: sorted(os.walk(folder, followlinks=True)) (folders by path), files sorted in each."""
  visits = []
  for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
    dirnames[:] = [d for d in dirnames if not is_hidden(d)]
    visits.append((dirpath, filenames))
  visits.sort(key=lambda visit: visit[0])
  return [os.path.join(dirpath, f) for dirpath, filenames in visits
          for f in sorted(filenames) if is_image_file(f)]


def scan_class_folders(root: str | os.PathLike, split: str, what: str = "ImageNet",
                       tree: str = IMAGENET_TREE) -> tuple[list[str], list[str], np.ndarray]:
  """(classes, file paths, labels) of root/<split>/<class>/.../<image>, classes from root/train
  (the module docstring's rules)."""
  root = os.path.expanduser(os.fspath(root))
  require_dir(root, what, root, tree)
  train_dir = require_dir(os.path.join(root, "train"), what, root, tree)
  split_dir = require_dir(os.path.join(root, split), what, root, tree)
  classes = class_folders(train_dir)
  found = class_folders(split_dir)
  loose = sorted(e.name for e in os.scandir(split_dir) if not e.is_dir() and is_image_file(e.name))
  if loose and not found:
    problem = (f"{split_dir!r} holds {len(loose)} image files directly (e.g. {loose[0]!r}) and "
               f"no class folders; {split}/ needs one folder per class, as train/")
    if split == "val":
      problem += ". " + IMAGENET_VAL_PREP
    raise ValueError(layout_message(what, root, problem, tree))
  if not classes:
    raise FileNotFoundError(layout_message(what, root, f"no class folders in {train_dir!r}", tree))
  if loose:
    raise ValueError(layout_message(
        what, root, f"{split_dir!r} holds {len(loose)} image files outside the class folders "
        f"(e.g. {loose[0]!r}), which would belong to no class; move them into their class "
        "folders or away", tree))
  unknown = sorted(set(found) - set(classes))
  if unknown:
    raise ValueError(layout_message(
        what, root, f"{split_dir!r} has class folders not in train/: {unknown[:5]}", tree))
  paths, labels, empty = [], [], []
  for label, name in enumerate(classes):
    folder = os.path.join(split_dir, name)
    if not os.path.isdir(folder):
      continue
    files = walk_images(folder)
    if not files:
      empty.append(name)
    paths += files
    labels += [label] * len(files)
  if empty:
    shown = ", ".join(repr(n) for n in empty[:10]) + (f" and {len(empty) - 10} more"
                                                       if len(empty) > 10 else "")
    raise FileNotFoundError(layout_message(
        what, root, f"no image files ({', '.join(IMAGE_EXTENSIONS)}, any case; hidden files "
        f"skipped) in the class folders {shown} of {split_dir!r}; a class needs at least one "
        "image (remove the folder if it is not a class)", tree))
  return classes, paths, np.asarray(labels, np.int32)


def decode_rgb(path: str) -> Image.Image:
  """The image at `path`, decoded fully and converted to RGB. A file that cannot be (truncated,
  empty, corrupt, not an image, more pixels than PIL.Image.MAX_IMAGE_PIXELS) raises DataFileError
  naming it and what is wrong (`jlp.data.image_files.decoded`)."""
  return decoded(path, lambda image: image.convert("RGB"))


def find_bad_files(paths: list[str], decode=decode_rgb, num_workers: int = 8
                   ) -> list[DataFileError]:
  """DataFileError of every path that `decode` refuses, in the order of `paths` (decoded on
  `num_workers` threads)."""
  def check(path: str) -> DataFileError | None:
    try:
      decode(path)
    except DataFileError as e:
      return e
    return None

  with concurrent.futures.ThreadPoolExecutor(max(1, num_workers)) as ex:
    return [e for e in ex.map(check, paths) if e is not None]


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
    self.root = os.path.expanduser(os.fspath(root))
    self.classes, self.paths, self.labels = scan_class_folders(self.root, split)
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

  def verify(self) -> list[DataFileError]:
    """Every file of the split that `decode_rgb` refuses (each decoded fully, on num_workers
    threads), in index order."""
    return find_bad_files(self.paths, decode_rgb, self.num_workers)

  def manifest(self) -> list[str]:
    """The split's files in index order, relative to root with "/" separators
    (e.g. "train/n01440764/n01440764_10026.JPEG")."""
    return [os.path.relpath(p, self.root).replace(os.sep, "/") for p in self.paths]

  def draw(self, rng: np.random.Generator, n: int) -> Batch:
    if not self.augment:
      return {}
    return {"resized_crop": aug.draw_resized_crop_uniforms(rng, n),
            "flip": aug.draw_flips(rng, n)}

  def transform(self, image: Image.Image | np.ndarray, params: Batch | None) -> np.ndarray:
    """One decoded RGB image (a PIL image, or a uint8 (H, W, 3) array as jlp.data.jpeg decodes
    it) -> uint8 (crop_size, crop_size, 3); params: one example's row. The crop is an exact
    copy of the window either way, so both give the same pixels."""
    if isinstance(image, np.ndarray):
      height, width = image.shape[:2]
    else:
      width, height = image.size
    c = self.crop_size
    if params:
      top, left, h, w = aug.resized_crop_box(params["resized_crop"], height, width,
                                             self.scale, self.ratio)
      if isinstance(image, np.ndarray):
        window = Image.fromarray(np.ascontiguousarray(image[top:top + h, left:left + w]))
      else:
        window = image.crop((left, top, left + w, top + h))
      out = np.asarray(window.resize((c, c), Image.BILINEAR), np.uint8)
      return out[:, ::-1] if params["flip"] else out
    if isinstance(image, np.ndarray):
      image = Image.fromarray(image)
    h, w = aug.shorter_side_size(height, width, self.resize_size)
    image = aug.resize(image, h, w)
    top, left = aug.center_crop_box(h, w, c)
    return np.asarray(image, np.uint8)[top:top + c, left:left + c]

  def load(self, index: int, params: Batch | None) -> np.ndarray:
    """Example `index` after the transform (uint8, before Normalize). JPEGs are decoded by
    simplejpeg where it gives Pillow's pixels (jlp.data.jpeg), everything else by decode_rgb;
    a bad file raises decode_rgb's DataFileError."""
    return self.transform(jpeg.decode_rgb(self.paths[index], decode_rgb), params)

  def get(self, indices: np.ndarray, params: Batch) -> Batch:
    """Examples `indices`, loaded on num_workers threads, each normalised into the batch as
    soon as it is loaded (jlp.data.batching: the values of normalising the stacked batch)."""
    indices = np.asarray(indices)
    n = len(indices)
    out = np.empty((n,) + self.image_shape, np.float32)
    constants = batching.RowConstants(self.normalization, self.crop_size)

    def load_into(i: int) -> None:
      row = {k: v[i] for k, v in params.items()}
      batching.normalize_into(out[i], self.load(int(indices[i]), row), constants)

    if n == 1 or self.num_workers == 1:
      for i in range(n):
        load_into(i)
    elif n:
      with concurrent.futures.ThreadPoolExecutor(min(self.num_workers, n)) as ex:
        for _ in ex.map(load_into, range(n)):  # re-raises the first error, in index order
          pass
    return {"image": out, "label": self.labels[indices]}


def imagenet(root: str | os.PathLike, split: str = "train", **options) -> ImageFolderDataset:
  """ImageNet (class folders) with the seeds' transforms; options as ImageFolderDataset."""
  return ImageFolderDataset(root, split, **options)
