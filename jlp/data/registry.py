"""`get_dataset(name, root, split, **options)`: the data sets by the names configs use.

  name          splits        root holds                         options (besides augment)
  "digits"      train, test   nothing (ships with scikit-learn)  variant, crop, padding, flip
  "digits_segmentation"       (the same; per-pixel labels)       variant
  "cifar10"     train, test   cifar-10-batches-py/               recipe, mean, std, crop, ...
  "cifar100"    train, test   cifar-100-python/                  recipe, label, mean, std, ...
  "imagenet"    train, val    train/<wnid>/, val/<wnid>/         crop_size, resize_size, ...
  "cityscapes"  train, val    leftImg8bit/, gtFine/              crop_size, scale_range, ...
  "glue_tsv"    train, dev    train.tsv, dev.tsv, vocab.txt      vocab, max_len, lowercase, ...
  "digits_tokens"             nothing (digits as token ids)      max_len
(the last two, jlp.data.text, give int32 token ids under "image", for BERT.)

`split` may also be "eval" (the evaluation split: "test", "val" or "dev"). `root`
defaults to the data set's own folder under $JLP_DATA_DIR, else under "data" (`default_root`:
$JLP_DATA_DIR/cifar10, data/imagenet, ...; glue_tsv: the SST-2 folder the configs train). `augment`
defaults to True for the training split only. See each loader's module for the
layout and transforms; a missing or malformed folder raises
FileNotFoundError / ValueError showing the expected tree, before any compute.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any

from jlp.data.cifar import cifar
from jlp.data.cityscapes import CityscapesDataset, cityscapes
from jlp.data.dataset import Dataset
from jlp.data.digits import digits, digits_segmentation
from jlp.data.imagenet import ImageFolderDataset, imagenet
from jlp.data.text import digits_tokens, glue_tsv

DATA_DIR_ENV = "JLP_DATA_DIR"
DEFAULT_DATA_DIR = "data"


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """A registry entry: the builder and its split names."""
  builder: Callable[..., Dataset]
  train_split: str
  eval_split: str
  options: tuple[str, ...]
  folder: str = ""  # its default folder under the data directory ("": the data set's name)


def _keyword_options(*functions: Callable[..., Any]) -> tuple[str, ...]:
  names = []
  for fn in functions:
    for p in inspect.signature(fn).parameters.values():
      if p.kind == p.KEYWORD_ONLY and p.name not in names:
        names.append(p.name)
  return tuple(names)


_CIFAR_OPTIONS = _keyword_options(cifar) + ("mean", "std", "crop", "padding", "pad_mode", "flip",
                                            "cutout")
DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(digits, "train", "test", _keyword_options(digits)),
    "digits_segmentation": DatasetInfo(digits_segmentation, "train", "test",
                                       _keyword_options(digits_segmentation)),
    "cifar10": DatasetInfo(lambda root, split, **kw: cifar(root, split, num_classes=10, **kw),
                           "train", "test",
                           tuple(o for o in _CIFAR_OPTIONS if o not in ("num_classes", "label"))),
    "cifar100": DatasetInfo(lambda root, split, **kw: cifar(root, split, num_classes=100, **kw),
                            "train", "test",
                            tuple(o for o in _CIFAR_OPTIONS if o != "num_classes")),
    "imagenet": DatasetInfo(imagenet, "train", "val",
                            tuple(o for o in _keyword_options(ImageFolderDataset) if o != "name")),
    "cityscapes": DatasetInfo(cityscapes, "train", "val", _keyword_options(CityscapesDataset)),
    "glue_tsv": DatasetInfo(glue_tsv, "train", "dev", _keyword_options(glue_tsv), "SST-2"),
    "digits_tokens": DatasetInfo(digits_tokens, "train", "test", _keyword_options(digits_tokens)),
}


def data_dir() -> str:
  """$JLP_DATA_DIR, else "data"."""
  return os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR


def default_root(name: str) -> str:
  """Data set `name`'s folder under `data_dir()`: e.g. $JLP_DATA_DIR/cifar10."""
  if name not in DATASETS:
    raise ValueError(f"name={name!r} is not allowed; expected one of {sorted(DATASETS)}.")
  return os.path.join(data_dir(), DATASETS[name].folder or name)


def get_dataset(name: str, root: str | os.PathLike | None = None, split: str = "train",
                **options: Any) -> Dataset:
  """The split `split` of data set `name` (see the module docstring for names and options)."""
  if name not in DATASETS:
    raise ValueError(f"name={name!r} is not allowed; expected one of {sorted(DATASETS)}.")
  info = DATASETS[name]
  if split == "eval":
    split = info.eval_split
  if split not in (info.train_split, info.eval_split):
    raise ValueError(f"split={split!r} is not allowed for {name!r}; expected "
                     f"{info.train_split!r}, {info.eval_split!r} or 'eval'.")
  unknown = sorted(set(options) - set(info.options))
  if unknown:
    raise ValueError(f"{unknown[0]}={options[unknown[0]]!r} is not allowed for {name!r}; "
                     f"expected options among {sorted(info.options)}.")
  return info.builder(default_root(name) if root is None else root, split, **options)
