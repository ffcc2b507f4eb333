"""JPEG decoding with simplejpeg where it gives Pillow's pixels, Pillow everywhere else.

`decode_rgb(path, fallback)` returns the image at `path` as RGB: a uint8 (H, W, 3)
array from simplejpeg (libjpeg-turbo's TurboJPEG API in one C call: 1.08 ms against
Pillow's `Image.open(path).convert("RGB")` 1.58 ms on 500x375 JPEGs of 95 KB),
or whatever `fallback(path)` returns (a decoded RGB PIL image; jlp.data.imagenet's
`decode_rgb`, which turns a bad file into a DataFileError naming it).

simplejpeg is used only where it decodes the pixels Pillow decodes
(tests/data_pipeline/jpeg_test.py compares them array for array): both run
libjpeg-turbo's accurate integer IDCT ("islow") with fancy upsampling, and
TurboJPEG's RGB output is libjpeg's YCbCr -> RGB (and gray -> RGB) conversion,
which is also how Pillow's convert("RGB") replicates a gray image. Everything
else goes to `fallback`, which decides what is decoded and what is an error:
  - files that do not start with a JPEG marker (PNG, BMP, WebP, `._*` AppleDouble files, ...);
  - colour spaces other than YCbCr, gray and RGB (CMYK and YCCK: Pillow inverts
    Adobe CMYK and converts with its own arithmetic);
  - images above Image.MAX_IMAGE_PIXELS (Pillow's decompression-bomb warning / error);
  - anything libjpeg-turbo reports, even a recoverable warning (strict mode:
    truncated data, corrupt segments, extraneous bytes), so a file that is bad for
    Pillow is bad here, and a file Pillow decodes with warnings hidden is decoded by Pillow.
Without simplejpeg installed, every file goes to `fallback`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

try:
  import simplejpeg
except ImportError:  # optional: Pillow decodes everything
  simplejpeg = None

# Colour spaces (decode_jpeg_header's names) whose RGB output matches Pillow's convert("RGB").
FAST_COLORSPACES = ("YCbCr", "Gray", "RGB")
_SOI = b"\xff\xd8"


def available() -> bool:
  """Whether simplejpeg is installed (else every file goes to the fallback)."""
  return simplejpeg is not None


def decode_bytes(data: bytes) -> np.ndarray | None:
  """uint8 (H, W, 3) RGB pixels of JPEG `data` where simplejpeg decodes Pillow's pixels
  (module docstring), else None."""
  if simplejpeg is None or not data.startswith(_SOI):
    return None
  try:
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data, strict=True)
    limit = Image.MAX_IMAGE_PIXELS
    if colorspace not in FAST_COLORSPACES or (limit is not None and height * width > limit):
      return None
    return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
  except (ValueError, RuntimeError):  # libjpeg's errors and warnings: the fallback reports them
    return None


def decode_rgb(path: str, fallback: Callable[[str], Any]) -> np.ndarray | Any:
  """The image at `path` in RGB: simplejpeg's uint8 (H, W, 3) array where it decodes Pillow's
  pixels, else `fallback(path)` (which raises for a bad file)."""
  if simplejpeg is not None:
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError:
      return fallback(path)  # the fallback names the file in its error
    pixels = decode_bytes(data)
    if pixels is not None:
      return pixels
  return fallback(path)
