"""Image files that cannot be used, named: decoding through PIL with every failure turned into a
`jlp.data.DataFileError` that says which file and what is wrong (the ImageNet folders and
Cityscapes loaders share it)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from PIL import Image

from jlp.data.dataset import DataFileError

__all__ = ["decode_problem", "decoded"]

T = TypeVar("T")


def decode_problem(path: str, error: BaseException) -> str:
  """What is wrong with the image file `path`, given the exception decoding it raised."""
  if isinstance(error, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
    return (f"too many pixels for PIL's decompression-bomb guard ({error}); shrink the image, or "
            "raise PIL.Image.MAX_IMAGE_PIXELS if it is genuine")
  if isinstance(error, FileNotFoundError):
    return "no such file (removed after the split was scanned?)"
  if isinstance(error, PermissionError):
    return "cannot be read (permission denied)"
  if isinstance(error, Image.UnidentifiedImageError):
    if os.path.basename(path).startswith("._"):
      return ("not an image: a macOS AppleDouble ('._') metadata file; delete them "
              "(find ROOT -name '._*' -delete, or dot_clean on macOS)")
    try:
      if os.path.getsize(path) == 0:
        return "not an image: the file is empty (0 bytes)"
    except OSError:
      pass
    return "not an image Pillow can read (corrupt, or another format under an image extension)"
  if isinstance(error, OSError) and "truncated" in str(error).lower():
    return (f"truncated image ({error}): the file is incomplete, copy it again (jlp keeps PIL's "
            "LOAD_TRUNCATED_IMAGES off so that a damaged image is never trained on)")
  return f"corrupt image, decoding failed: {type(error).__name__}: {error}"


def decoded(path: str, use: Callable[[Image.Image], T]) -> T:
  """use(image) on the PIL image at `path` after a full decode. A file that cannot be decoded
  (truncated, empty, corrupt, not an image, more pixels than PIL.Image.MAX_IMAGE_PIXELS: PIL only
  warns between 1x and 2x the limit) raises DataFileError naming it and what is wrong."""
  try:
    with Image.open(path) as image:
      width, height = image.size
      limit = Image.MAX_IMAGE_PIXELS
      if limit and width * height > limit:
        raise DataFileError(path, (
            f"{width}x{height} = {width * height} pixels, over PIL.Image.MAX_IMAGE_PIXELS = "
            f"{limit} (PIL's decompression-bomb guard); shrink the image, or raise the limit if "
            "it is genuine"))
      image.load()
      return use(image)
  except (DataFileError, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-except  (PIL's plugins raise many kinds)
    raise DataFileError(path, decode_problem(path, e)) from e
