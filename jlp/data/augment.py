"""Image augmentation in numpy (NHWC), split into drawing the randomness and applying it.

Every random augmentation comes as a pair: `draw_*(rng, n, ...)` draws the
parameters of n examples from a `np.random.Generator` (and nothing else), and
a deterministic function applies them. The input pipeline draws for the whole
global batch and applies to each process's rows, so batches are a pure
function of (seed, step) and the same on any number of processes. The
`random_*` functions combine the two for direct use.

Semantics follow the torchvision transforms that the seed recipes use
(cpd.md §6.1-6.3, bfp.md §5.1):
  RandomCrop(size, padding, fill=0): pad every side by `padding`, then take the
    size x size window at (top, left), each uniform on 0..padded - size.
  RandomHorizontalFlip(): reverse the W axis with probability 1/2.
  ToTensor + Normalize(mean, std): (float32(x) / 255 - mean[c]) / std[c] in float32.
  RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)): torchvision's
    get_params (10 attempts, then the central-crop fallback), bilinear resize.
  Resize(s) + CenterCrop(c): shorter side to s (longer side int(s * long / short)),
    bilinear, then the c x c window at round((H - c) / 2), round((W - c) / 2).
DavidNet's Cutout (Myrtle, cpd.md §6.2) zeroes an n x n square lying inside
the image, after normalisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

PAD_MODES = ("constant", "reflect")
# RandomResizedCrop tries this many (area, ratio) draws before its fallback (torchvision).
RESIZED_CROP_ATTEMPTS = 10


# ----------------------------------------------------------------------------- normalisation

def normalize(images: np.ndarray, mean: Sequence[float], std: Sequence[float],
              scale: float = 255.0) -> np.ndarray:
  """(float32(x) / scale - mean[c]) / std[c], each step one float32 operation.

  NHWC (or any ...WC) images in, float32 out of the same shape.
  """
  images = np.asarray(images)
  mean32 = np.asarray(mean, np.float32)
  std32 = np.asarray(std, np.float32)
  if images.ndim < 2 or images.shape[-1] != mean32.shape[0]:
    raise ValueError(f"images.shape={images.shape} is not allowed; expected {mean32.shape[0]} "
                     "channels (the length of mean) in the last dimension.")
  # Rows of W * C values with the constants tiled along them: numpy's inner loops
  # are slow over a last axis of length 3.
  w, c = images.shape[-2:]
  x = images.astype(np.float32).reshape(-1, w * c)
  x /= np.float32(scale)
  x -= np.tile(mean32, w)
  x /= np.tile(std32, w)
  return x.reshape(images.shape)


# ----------------------------------------------------------------------------- crop / flip

def draw_crop_offsets(rng: np.random.Generator, n: int, size: tuple[int, int],
                      crop: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """(top, left) of n crop windows, uniform over all crop-sized windows of a size image."""
  (h, w), (ch, cw) = size, crop
  if ch > h or cw > w:
    raise ValueError(f"crop={crop} is not allowed; expected at most size={size}.")
  top = rng.integers(0, h - ch + 1, size=n)
  left = rng.integers(0, w - cw + 1, size=n)
  return top, left


def draw_flips(rng: np.random.Generator, n: int) -> np.ndarray:
  """n booleans, each True with probability 1/2."""
  return rng.random(n) < 0.5


def pad(images: np.ndarray, padding: int, mode: str = "constant") -> np.ndarray:
  """NHWC images padded by `padding` on both sides of H and W (zeros or reflection)."""
  if mode not in PAD_MODES:
    raise ValueError(f"mode={mode!r} is not allowed; expected one of {PAD_MODES}.")
  widths = ((0, 0), (padding, padding), (padding, padding), (0, 0))
  return np.pad(images, widths, mode=mode)


def crop(images: np.ndarray, top: np.ndarray, left: np.ndarray, size: int) -> np.ndarray:
  """images[i, top[i]:top[i]+size, left[i]:left[i]+size] for every i (NHWC)."""
  out = np.empty((images.shape[0], size, size) + images.shape[3:], images.dtype)
  for i, (t, l) in enumerate(zip(np.asarray(top).tolist(), np.asarray(left).tolist())):
    out[i] = images[i, t:t + size, l:l + size]
  return out


def pad_crop(images: np.ndarray, top: np.ndarray, left: np.ndarray, size: int, padding: int,
             mode: str = "constant") -> np.ndarray:
  """The size x size window at (top, left) of each image padded by `padding`."""
  return crop(pad(images, padding, mode) if padding else images, top, left, size)


def flip(images: np.ndarray, flags: np.ndarray) -> np.ndarray:
  """A copy of the images with the W axis reversed where flags is True (NHWC or NHW)."""
  flags = np.asarray(flags, bool)
  out = np.array(images, copy=True)
  out[flags] = images[flags][:, :, ::-1]
  return out


def cutout(images: np.ndarray, top: np.ndarray, left: np.ndarray, size: int) -> np.ndarray:
  """A copy of the images with the size x size square at (top, left) set to 0."""
  out = np.array(images, copy=True)
  n = out.shape[0]
  rows = np.asarray(top)[:, None] + np.arange(size)
  cols = np.asarray(left)[:, None] + np.arange(size)
  out[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]] = 0
  return out


def random_crop(images: np.ndarray, rng: np.random.Generator, size: int, padding: int = 0,
                mode: str = "constant") -> np.ndarray:
  """torchvision RandomCrop(size, padding) on each NHWC image (zero padding by default)."""
  h, w = images.shape[1:3]
  top, left = draw_crop_offsets(rng, images.shape[0], (h + 2 * padding, w + 2 * padding),
                                (size, size))
  return pad_crop(images, top, left, size, padding, mode)


def random_flip(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """torchvision RandomHorizontalFlip() on each image."""
  return flip(images, draw_flips(rng, images.shape[0]))


def random_cutout(images: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
  """DavidNet's Cutout(size, size): a zero square placed uniformly inside each image."""
  top, left = draw_crop_offsets(rng, images.shape[0], images.shape[1:3], (size, size))
  return cutout(images, top, left, size)


# ----------------------------------------------------------------------------- resized crops

def draw_resized_crop_uniforms(rng: np.random.Generator, n: int) -> np.ndarray:
  """(n, RESIZED_CROP_ATTEMPTS, 4) uniforms on [0, 1): scale, log-ratio, top, left per attempt."""
  return rng.random((n, RESIZED_CROP_ATTEMPTS, 4))


def resized_crop_box(uniforms: np.ndarray, height: int, width: int,
                     scale: tuple[float, float] = (0.08, 1.0),
                     ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
  """torchvision RandomResizedCrop.get_params driven by one example's uniforms: (top, left, h, w).

  Attempt a: area fraction scale[0] + u0 * (scale[1] - scale[0]), aspect ratio
  exp(log ratio[0] + u1 * (log ratio[1] - log ratio[0])), w = round(sqrt(area *
  ratio)), h = round(sqrt(area / ratio)); the first attempt that fits is placed
  at top = floor(u2 * (height - h + 1)), left = floor(u3 * (width - w + 1)).
  If none fits: the central crop with the aspect ratio clamped to `ratio`.
  """
  area = height * width
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  for u in uniforms:
    target_area = area * (scale[0] + float(u[0]) * (scale[1] - scale[0]))
    aspect = math.exp(log_lo + float(u[1]) * (log_hi - log_lo))
    w = int(round(math.sqrt(target_area * aspect)))
    h = int(round(math.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      top = min(int(float(u[2]) * (height - h + 1)), height - h)
      left = min(int(float(u[3]) * (width - w + 1)), width - w)
      return top, left, h, w
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, int(round(width / min(ratio)))
  elif in_ratio > max(ratio):
    h, w = height, int(round(height * max(ratio)))
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def shorter_side_size(height: int, width: int, size: int) -> tuple[int, int]:
  """(new_height, new_width) of torchvision Resize(size): shorter side = size."""
  if width <= height:
    return int(size * height / width), size
  return size, int(size * width / height)


def center_crop_box(height: int, width: int, size: int) -> tuple[int, int]:
  """(top, left) of torchvision CenterCrop(size) on a height x width image (size <= both)."""
  return int(round((height - size) / 2.0)), int(round((width - size) / 2.0))


def resize(image: Image.Image, height: int, width: int,
           resample: int = Image.BILINEAR) -> Image.Image:
  """A PIL image resized to (height, width) (a no-op when the size is unchanged)."""
  if image.size == (width, height):
    return image
  return image.resize((width, height), resample)
