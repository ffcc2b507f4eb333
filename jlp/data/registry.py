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
$JLP_DATA_DIR/cifar10, data/imagenet, ...; glue_tsv: the SST-2 folder the configs train); a
leading "~" in either is expanded. `augment` defaults to True for the training split only. See
each loader's module and docs/data.md for the layout and transforms; a missing or malformed
folder raises FileNotFoundError / ValueError showing the expected tree, before any compute, and
a file that cannot be used raises DataFileError (a ValueError) naming it.

Options: `dataset_options(name)` is {option: default} of a data set (the keyword-only parameters
of its builder; None means "decided by the loader", e.g. augment by the split, CIFAR's mean by
its recipe); `config_kwargs(name, **values)` is the ml_collections ConfigDict of all of them that
configs put in `config.dataset.kwargs`, so that each can be overridden from the command line
(--config.dataset.kwargs.num_workers=32): a None default becomes a typed placeholder (bool, int,
str or tuple, from the parameter's annotation) that a flag can set.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import types
import typing
from collections.abc import Callable
from typing import Any

from jlp.data.cifar import cifar10, cifar100
from jlp.data.cityscapes import CityscapesDataset, cityscapes
from jlp.data.dataset import Dataset
from jlp.data.digits import digits, digits_segmentation
from jlp.data.imagenet import ImageFolderDataset, imagenet
from jlp.data.text import digits_tokens, glue_tsv

DATA_DIR_ENV = "JLP_DATA_DIR"
DEFAULT_DATA_DIR = "data"


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """A registry entry: the builder, its split names, and its options: the keyword-only
  parameters of `spec` (the builder unless given) other than `exclude`."""
  builder: Callable[..., Dataset]
  train_split: str
  eval_split: str
  folder: str = ""  # its default folder under the data directory ("": the data set's name)
  spec: Callable[..., Any] | None = None
  exclude: tuple[str, ...] = ()

  def parameters(self) -> list[inspect.Parameter]:
    """The options as inspect.Parameters, in signature order."""
    return [p for p in inspect.signature(self.spec or self.builder).parameters.values()
            if p.kind == p.KEYWORD_ONLY and p.name not in self.exclude]

  @property
  def options(self) -> tuple[str, ...]:
    return tuple(p.name for p in self.parameters())


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(digits, "train", "test"),
    "digits_segmentation": DatasetInfo(digits_segmentation, "train", "test"),
    "cifar10": DatasetInfo(cifar10, "train", "test"),
    "cifar100": DatasetInfo(cifar100, "train", "test"),
    "imagenet": DatasetInfo(imagenet, "train", "val", spec=ImageFolderDataset, exclude=("name",)),
    "cityscapes": DatasetInfo(cityscapes, "train", "val", spec=CityscapesDataset),
    "glue_tsv": DatasetInfo(glue_tsv, "train", "dev", "SST-2"),
    "digits_tokens": DatasetInfo(digits_tokens, "train", "test"),
}


def _info(name: str) -> DatasetInfo:
  if name not in DATASETS:
    raise ValueError(f"name={name!r} is not allowed; expected one of {sorted(DATASETS)}.")
  return DATASETS[name]


def dataset_options(name: str) -> dict[str, Any]:
  """{option: default} of data set `name`, in its builder's order (None: the loader decides)."""
  return {p.name: p.default for p in _info(name).parameters()}


def _value_type(hint: Any) -> type:
  """The type a command-line flag parses for an annotation: `X | None` -> X, tuple[...] ->
  tuple."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
    hint = args[0]
  origin = typing.get_origin(hint)
  return origin if isinstance(origin, type) else hint


def option_types(name: str) -> dict[str, type]:
  """{option: the type of its values} of data set `name`, from the builder's annotations."""
  info = _info(name)
  spec = info.spec or info.builder
  hints = typing.get_type_hints(spec.__init__ if isinstance(spec, type) else spec)
  out = {}
  for p in info.parameters():
    if p.name in hints:
      out[p.name] = _value_type(hints[p.name])
    else:
      out[p.name] = type(p.default)
  return out


def config_kwargs(name: str, **values: Any):
  """An ml_collections ConfigDict of every option of data set `name`: `values` where given, else
  the default; a None becomes `placeholder(type)` (None until a flag sets it, of the option's
  type), so that `--config.dataset.kwargs.OPTION=VALUE` works for every option. Configs set
  `c.dataset.kwargs = config_kwargs(name, ...)`."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from ml_collections.config_dict import placeholder  # pylint: disable=g-import-not-at-top
  defaults = dataset_options(name)
  unknown = sorted(set(values) - set(defaults))
  if unknown:
    raise ValueError(f"{unknown[0]}={values[unknown[0]]!r} is not allowed for {name!r}; expected "
                     f"options among {sorted(defaults)}.")
  kinds = option_types(name)
  fields = {}
  for option, default in defaults.items():
    value = values.get(option, default)
    fields[option] = placeholder(kinds[option]) if value is None else value
  return ml_collections.ConfigDict(fields)


def data_dir() -> str:
  """$JLP_DATA_DIR, else "data" ("~" expanded)."""
  return os.path.expanduser(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def default_root(name: str) -> str:
  """Data set `name`'s folder under `data_dir()`: e.g. $JLP_DATA_DIR/cifar10."""
  return os.path.join(data_dir(), _info(name).folder or name)


def get_dataset(name: str, root: str | os.PathLike | None = None, split: str = "train",
                **options: Any) -> Dataset:
  """The split `split` of data set `name` (see the module docstring for names and options)."""
  info = _info(name)
  if split == "eval":
    split = info.eval_split
  if split not in (info.train_split, info.eval_split):
    raise ValueError(f"split={split!r} is not allowed for {name!r}; expected "
                     f"{info.train_split!r}, {info.eval_split!r} or 'eval'.")
  unknown = sorted(set(options) - set(info.options))
  if unknown:
    raise ValueError(f"{unknown[0]}={options[unknown[0]]!r} is not allowed for {name!r}; "
                     f"expected options among {sorted(info.options)}.")
  root = default_root(name) if root is None else os.path.expanduser(os.fspath(root))
  return info.builder(root, split, **options)
