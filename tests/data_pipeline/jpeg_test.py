"""Tests for jlp.data.jpeg: simplejpeg's pixels are Pillow's wherever it is used.

Reference: `np.asarray(Image.open(path).convert("RGB"))` (what jlp.data.imagenet's
decode_rgb returns) on JPEGs of every kind Pillow writes: chroma subsampling
4:4:4 / 4:2:2 / 4:2:0, baseline and progressive, optimised Huffman tables, restart
markers, qualities 50-100, odd sizes, gray, and Adobe RGB (no YCbCr transform).
Everything simplejpeg must not decode (CMYK, truncated, not a JPEG, over
MAX_IMAGE_PIXELS) goes to the fallback.
"""

import numpy as np
import pytest
from PIL import Image

from jlp.data import jpeg
from jlp.data.dataset import DataFileError
from jlp.data.imagenet import decode_rgb

pytestmark = pytest.mark.skipif(not jpeg.available(), reason="simplejpeg is not installed")


def _photo(rng, h, w):
  """Smooth gradients plus noise: DCT blocks with both low and high frequencies."""
  y, x = np.mgrid[0:h, 0:w]
  base = np.stack([(x * 1.3 + y * 0.4) % 256, (x * 0.2 + y * 1.7) % 256, (x + y) * 0.9 % 256], -1)
  return np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)


_VARIANTS = [
    dict(quality=90),
    dict(quality=75, subsampling=0),
    dict(quality=95, subsampling=1),
    dict(quality=50, subsampling=2),
    dict(quality=85, progressive=True),
    dict(quality=100, optimize=True),
    dict(quality=80, restart_marker_rows=1),
    dict(quality=90, keep_rgb=True),
]


def _never(path):
  raise AssertionError(f"fallback called for {path}")


@pytest.mark.parametrize("size", [(375, 500), (333, 500), (17, 23), (1, 9), (64, 1)])
def test_simplejpeg_decodes_pillows_pixels(tmp_path, size):
  rng = np.random.default_rng(size[0] * 1000 + size[1])
  for k, options in enumerate(_VARIANTS):
    path = str(tmp_path / f"v{k}.jpg")
    Image.fromarray(_photo(rng, *size)).save(path, "JPEG", **options)
    got = jpeg.decode_rgb(path, _never)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8, options
    np.testing.assert_array_equal(got, np.asarray(decode_rgb(path)), err_msg=str(options))
  path = str(tmp_path / "gray.jpg")
  Image.fromarray(_photo(rng, *size)[..., 1]).save(path, "JPEG", quality=90)
  assert Image.open(path).mode == "L"
  np.testing.assert_array_equal(jpeg.decode_rgb(path, _never), np.asarray(decode_rgb(path)))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_everything_else_goes_to_the_fallback(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  image = Image.fromarray(_photo(rng, 40, 60))
  calls = []

  def fallback(path):
    calls.append(path)
    return decode_rgb(path)

  cmyk = str(tmp_path / "cmyk.jpg")
  image.convert("CMYK").save(cmyk, "JPEG")
  np.testing.assert_array_equal(np.asarray(jpeg.decode_rgb(cmyk, fallback)),
                                np.asarray(decode_rgb(cmyk)))
  png = str(tmp_path / "real_png.jpg")
  image.save(png, "PNG")
  jpeg.decode_rgb(png, fallback)
  good = str(tmp_path / "good.jpg")
  image.save(good, "JPEG")
  data = open(good, "rb").read()
  truncated = str(tmp_path / "truncated.jpg")
  with open(truncated, "wb") as f:
    f.write(data[:len(data) // 2])
  with pytest.raises(DataFileError, match="truncated.jpg: truncated image"):
    jpeg.decode_rgb(truncated, fallback)
  missing = str(tmp_path / "missing.jpg")
  with pytest.raises(DataFileError, match="missing.jpg"):
    jpeg.decode_rgb(missing, fallback)
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 60 - 1)
  with pytest.raises(DataFileError, match="MAX_IMAGE_PIXELS"):
    jpeg.decode_rgb(good, fallback)
  assert calls == [cmyk, png, truncated, missing, good]
  assert jpeg.decode_bytes(b"") is None and jpeg.decode_bytes(b"\xff\xd8garbage") is None
