"""Image augmentation in numpy (NHWC), split into drawing the randomness and applying it.

Every random augmentation comes as a pair: `draw_*(rng, n, ...)` draws the
parameters of n examples from a `np.random.Generator` (and nothing else), and
a deterministic function applies them. The input pipeline draws for the whole
global batch and applies to each process's rows, so batches are a pure
function of (seed, step) and the same on any number of processes. The
`random_*` functions combine the two for direct use.

Semantics follow the torchvision transforms that the seed recipes use
(docs/cpd.md, docs/bfp.md):
  RandomCrop(size, padding, fill=0): pad every side by `padding`, then take the
    size x size window at (top, left), each uniform on 0..padded - size.
  RandomHorizontalFlip(): reverse the W axis with probability 1/2.
  ToTensor + Normalize(mean, std): (float32(x) / 255 - mean[c]) / std[c] in float32.
  RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)): torchvision's
    get_params (10 attempts, then the central-crop fallback), bilinear resize.
  Resize(s) + CenterCrop(c): shorter side to s (longer side int(s * long / short)),
    bilinear, then the c x c window at round((H - c) / 2), round((W - c) / 2).
DavidNet's Cutout (Myrtle, docs/cpd.md) zeroes an n x n square lying inside
the image, after normalisation.
mmsegmentation's PhotoMetricDistortion (docs/cpd.md; mmseg/datasets/pipelines/
transforms.py, read at upstream commits 0066ce88 / db54ce7b, after v0.5.0):
`photometric_distortion` with `draw_photometric`, on uint8 RGB, its HSV steps
through OpenCV's 8-bit cv2.cvtColor arithmetic (`rgb_to_hsv_u8`, `hsv_to_rgb_u8`,
from imgproc/src/color_hsv.simd.hpp; mmcv's bgr2hsv / hsv2bgr call cv2.cvtColor).
"""

from __future__ import annotations

import functools
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


# ----------------------------------------------------------------------------- photometric

# OpenCV's 8-bit HSV (cv2.COLOR_RGB2HSV / COLOR_HSV2RGB on uint8): H = hue in degrees / 2 (0..179),
# S and V on 0..255. RGB -> HSV is integer arithmetic with 12-bit fixed-point reciprocal tables
# (RGB2HSV_b in OpenCV's imgproc/src/color_hsv.simd.hpp); HSV -> RGB is float32 arithmetic.
HSV_HUE_RANGE = 180
_HSV_SHIFT = 12
_HSV_SDIV = np.array([0] + [round((255 << _HSV_SHIFT) / i) for i in range(1, 256)], np.int64)
_HSV_HDIV = np.array([0] + [round((HSV_HUE_RANGE << _HSV_SHIFT) / (6 * i)) for i in range(1, 256)],
                     np.int64)
# OpenCV's HSV2RGB_b converts each row in blocks of 4 SIMD float32 vectors (32 pixels on the AVX2
# code path that x86-64 opencv-python wheels dispatch to), truncating to uint8, and the remaining
# width % 32 pixels of the row with its scalar loop, rounding; see hsv_to_rgb_u8.
OPENCV_HSV_BLOCK = 32
# (b, g, r) indices into (v, v(1-s), v(1-sf), v(1-s(1-f))) by hue sector (OpenCV's sector_data).
_HSV_SECTORS = np.array([[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0]])


def _check_rgb_u8(name: str, image: np.ndarray) -> np.ndarray:
  image = np.asarray(image)
  if image.dtype != np.uint8 or image.ndim < 2 or image.shape[-1] != 3:
    raise ValueError(f"{name} of dtype {image.dtype} and shape {image.shape} is not allowed; "
                     "expected uint8 (..., W, 3).")
  return image


# The conversions run through lookup tables that hold OpenCV's arithmetic evaluated once for
# every input it can see (built on first use): RGB -> HSV's S by (V, V - min) and H by (hue
# numerator, V - min); HSV -> RGB's factor of each output channel by (S, H), one table per code
# path (SIMD / scalar), so that a pixel costs two float32 products (V / 255 * factor * 255) and
# its rounding, as in OpenCV. The tables are the formulas below evaluated on every (V, V - min),
# (numerator, V - min) and (S, H), so the results are those of the formulas, bit for bit.
_HSV_NUMERATOR_MIN = -255  # the hue numerator h' lies in -diff..5 diff, so in -255..1275


@functools.lru_cache(maxsize=None)
def _rgb_to_hsv_tables() -> tuple[np.ndarray, np.ndarray]:
  """(S by V << 8 | diff, H by (h' + 255) << 8 | diff), uint8, with OpenCV's fixed-point steps."""
  half = 1 << (_HSV_SHIFT - 1)
  diff = np.arange(256)
  s = (diff[None, :] * _HSV_SDIV[:, None] + half) >> _HSV_SHIFT  # rows V; diff > V never read
  numerator = np.arange(_HSV_NUMERATOR_MIN, 5 * 255 + 1)[:, None]
  h = (numerator * _HSV_HDIV[diff][None, :] + half) >> _HSV_SHIFT
  h = np.where(h < 0, h + HSV_HUE_RANGE, h)
  return (s.astype(np.uint8).ravel(), (h % 256).astype(np.uint8).ravel())


def _rgb_to_hsv_planes(image: np.ndarray, s_map: np.ndarray | None = None,
                       h_map: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
  """(H, S, V) uint8 planes of OpenCV's RGB2HSV_b on (..., W, 3) uint8; s_map / h_map (256
  uint8 values) are applied to S / H on the way out."""
  s_table, h_table = _rgb_to_hsv_tables()
  if s_map is not None:
    s_table = s_map[s_table]
  if h_map is not None:
    h_table = h_map[h_table]
  r, g, b = image[..., 0], image[..., 1], image[..., 2]
  v = np.maximum(np.maximum(r, g), b)
  diff = v - np.minimum(np.minimum(r, g), b)
  s = np.take(s_table, (v.astype(np.uint16) << 8) | diff)
  # h' by the first channel that equals V, picked with all-ones / all-zeros int16 masks (faster
  # than np.where on int16).
  r16, g16, b16, diff16 = (x.astype(np.int16) for x in (r, g, b, diff))
  v_is_r = v == r
  r_mask = -v_is_r.view(np.int8).astype(np.int16)
  b_mask = -((v != g) & ~v_is_r).view(np.int8).astype(np.int16)
  g_mask = ~(r_mask | b_mask)
  numerator = (g16 - b16) & r_mask
  numerator |= (b16 - r16 + 2 * diff16) & g_mask
  numerator |= (r16 - g16 + 4 * diff16) & b_mask
  numerator -= _HSV_NUMERATOR_MIN
  h = np.take(h_table, (numerator.astype(np.int32) << 8) | diff)
  return h, s, v


def rgb_to_hsv_u8(image: np.ndarray) -> np.ndarray:
  """OpenCV's cv2.cvtColor(image, COLOR_RGB2HSV) on uint8 (..., W, 3), bit for bit.

  V = max(r, g, b); S = round(255 (V - min) / V) and H = round(30 (...) / (V - min)) (+180 when
  negative) through OpenCV's fixed-point tables: s = (diff * sdiv[V] + 2^11) >> 12 with
  sdiv[i] = round(255 * 2^12 / i), h = (h' * hdiv[diff] + 2^11) >> 12 with hdiv[i] =
  round(180 * 2^12 / (6 i)), h' = g - b if V == r, else b - r + 2 diff if V == g, else
  r - g + 4 diff. mmcv's bgr2hsv on the BGR image gives the same (H, S, V).
  """
  image = _check_rgb_u8("image", image)
  return np.stack(_rgb_to_hsv_planes(image), axis=-1)


@functools.lru_cache(maxsize=None)
def _hsv_to_rgb_factors(simd: bool) -> np.ndarray:
  """(65536, 3) float32: for S << 8 | H, the factor f of each output channel (R, G, B) with
  channel = V / 255 * f (OpenCV's v, v (1 - s), v (1 - s f), v (1 - s (1 - f)) by sector)."""
  f32 = np.float32
  h = np.arange(256).astype(f32) * f32(6.0 / HSV_HUE_RANGE)
  s = np.arange(256).astype(f32)[:, None] * f32(1.0 / 255.0)  # rows S, columns H
  if simd:  # sector = trunc(h) - 6 trunc(trunc(h) / 6)
    whole = np.trunc(h)
    sector = whole - np.trunc(whole * f32(1.0 / 6.0)) * f32(6.0)
    frac = h - whole
  else:  # h = fmod(h, 6), sector = floor(h)
    h_mod = np.fmod(h, f32(6.0))
    sector = np.floor(h_mod)
    frac = h_mod - sector
  sector = sector.astype(np.intp)
  # s * x is exact in float64, so float32(1 - s * x) in float64 rounds once, as an FMA does.
  s64 = s.astype(np.float64)
  one_minus_frac = f32(1.0) - frac
  tab2 = (1.0 - s64 * frac.astype(np.float64)).astype(f32)
  tab3 = ((1.0 - s64 * one_minus_frac.astype(np.float64)).astype(f32) if simd
          else f32(1.0) - s * one_minus_frac)
  tab = np.stack(np.broadcast_arrays(np.ones_like(s), f32(1.0) - s, tab2, tab3), axis=-1)
  picks = np.broadcast_to(_HSV_SECTORS[sector][:, ::-1], tab.shape[:2] + (3,))
  return np.ascontiguousarray(np.take_along_axis(tab, picks, axis=-1).reshape(-1, 3))


def _hsv_planes_to_rgb(h: np.ndarray, s: np.ndarray, v: np.ndarray, block: int) -> np.ndarray:
  """OpenCV's HSV2RGB_b on uint8 planes (..., W) -> (..., W, 3) (see hsv_to_rgb_u8)."""
  f32 = np.float32
  index = (s.astype(np.uint16) << 8) | h
  value = v.astype(f32) * f32(1.0 / 255.0)
  width = h.shape[-1]
  simd_width = (width // block) * block if block else 0
  out = np.empty(h.shape + (3,), np.uint8)
  for lo, hi, simd in ((0, simd_width, True), (simd_width, width, False)):
    if hi == lo:
      continue
    rgb = np.take(_hsv_to_rgb_factors(simd), index[..., lo:hi], axis=0)
    rgb *= value[..., lo:hi, None]
    rgb *= f32(255.0)
    (np.trunc if simd else np.rint)(rgb, out=rgb)
    np.clip(rgb, 0, 255, out=rgb)
    out[..., lo:hi, :] = rgb
  return out


def hsv_to_rgb_u8(hsv: np.ndarray, block: int = OPENCV_HSV_BLOCK) -> np.ndarray:
  """OpenCV's cv2.cvtColor(hsv, COLOR_HSV2RGB) on uint8 (..., W, 3) (H in 0..179), bit for bit.

  In float32: h = H * (6 / 180), s = S * (1 / 255), v = V * (1 / 255), sector = floor(h) mod 6,
  f = h - floor(h); the channels are v, v (1 - s), v (1 - s f), v (1 - s (1 - f)) picked by
  sector (OpenCV's HSV2RGB_native / HSV2RGB_simd), then * 255. OpenCV converts the first
  (W // block) * block pixels of each row with SIMD code (both `1 - s x` fused multiply-adds,
  truncation to uint8) and the rest of the row with scalar code (`1 - s f` fused, `1 - s (1 - f)`
  not, as the compiler built it; rounding half to even); `block` = 0 takes the scalar path
  everywhere. Bit for bit as opencv-python 4.5.5 (AVX2 dispatch) on every (H < 180, S, V), both
  paths, and on row widths 1..1024. Later wheels differ only in builds: 5.0 fuses both products
  on the scalar path too, and 4.14 on an AVX-512 CPU converts 64-pixel blocks (block=64); either
  way at most 1 level in a few pixels of the last W % block columns.
  """
  hsv = _check_rgb_u8("hsv", hsv)
  if not isinstance(block, int) or block < 0:
    raise ValueError(f"block={block!r} is not allowed; expected an int >= 0.")
  return _hsv_planes_to_rgb(hsv[..., 0], hsv[..., 1], hsv[..., 2], block)


# mmsegmentation's PhotoMetricDistortion, one example's parameters: each step's on/off coin and
# its value (brightness delta, contrast / saturation factors, hue shift in OpenCV hue units).
PHOTOMETRIC_FIELDS = ("brightness_on", "brightness", "contrast_on", "contrast", "contrast_first",
                      "saturation_on", "saturation", "hue_on", "hue")
(_PM_BRIGHTNESS_ON, _PM_BRIGHTNESS, _PM_CONTRAST_ON, _PM_CONTRAST, _PM_CONTRAST_FIRST,
 _PM_SATURATION_ON, _PM_SATURATION, _PM_HUE_ON, _PM_HUE) = range(len(PHOTOMETRIC_FIELDS))


def photometric_params(brightness: float | None = None, contrast: float | None = None,
                       contrast_first: bool = False, saturation: float | None = None,
                       hue: int | None = None) -> np.ndarray:
  """One example's PhotoMetricDistortion parameters (float64, PHOTOMETRIC_FIELDS); None = off."""
  row = np.zeros(len(PHOTOMETRIC_FIELDS))
  for on, col, value in ((_PM_BRIGHTNESS_ON, _PM_BRIGHTNESS, brightness),
                         (_PM_CONTRAST_ON, _PM_CONTRAST, contrast),
                         (_PM_SATURATION_ON, _PM_SATURATION, saturation),
                         (_PM_HUE_ON, _PM_HUE, hue)):
    if value is not None:
      row[on], row[col] = 1.0, value
  row[_PM_CONTRAST_FIRST] = float(bool(contrast_first))
  return row


def draw_photometric(rng: np.random.Generator, n: int, brightness_delta: float = 32,
                     contrast_range: tuple[float, float] = (0.5, 1.5),
                     saturation_range: tuple[float, float] = (0.5, 1.5),
                     hue_delta: int = 18) -> np.ndarray:
  """(n, len(PHOTOMETRIC_FIELDS)) parameters of mmseg's PhotoMetricDistortion (its defaults).

  Each step is on with probability 1/2 (numpy.random.randint(2)); brightness uniform on
  [-delta, delta), contrast and saturation uniform on their ranges, contrast before the HSV steps
  with probability 1/2 (mmseg's `mode`), hue an integer uniform on -hue_delta..hue_delta - 1
  (numpy.random.randint(-hue_delta, hue_delta) excludes the upper end).
  """
  if not isinstance(hue_delta, int) or hue_delta < 0:
    raise ValueError(f"hue_delta={hue_delta!r} is not allowed; expected an int >= 0.")
  if not brightness_delta >= 0:
    raise ValueError(f"brightness_delta={brightness_delta!r} is not allowed; expected >= 0.")
  for name, (lo, hi) in (("contrast_range", contrast_range),
                         ("saturation_range", saturation_range)):
    if not 0 <= lo <= hi:
      raise ValueError(f"{name}={(lo, hi)!r} is not allowed; expected 0 <= lo <= hi.")
  u = rng.random((n, len(PHOTOMETRIC_FIELDS)))
  out = np.empty_like(u)
  for col in (_PM_BRIGHTNESS_ON, _PM_CONTRAST_ON, _PM_CONTRAST_FIRST, _PM_SATURATION_ON,
              _PM_HUE_ON):
    out[:, col] = u[:, col] < 0.5
  out[:, _PM_BRIGHTNESS] = brightness_delta * (2.0 * u[:, _PM_BRIGHTNESS] - 1.0)
  for col, (lo, hi) in ((_PM_CONTRAST, contrast_range), (_PM_SATURATION, saturation_range)):
    out[:, col] = lo + u[:, col] * (hi - lo)
  # floor(u * 2d) <= 2d - 1 for every u < 1: the integers -d..d-1, each with probability 1 / 2d.
  out[:, _PM_HUE] = np.floor(u[:, _PM_HUE] * (2 * hue_delta)) - hue_delta if hue_delta else 0.0
  return out


def _scale_shift_u8(x: np.ndarray, alpha: float = 1.0, beta: float = 0.0) -> np.ndarray:
  """mmseg's PhotoMetricDistortion.convert: uint8(clip(float32(x) * alpha + beta, 0, 255)) with
  float32 arithmetic (alpha, beta Python floats meet a float32 array) and truncation."""
  y = x.astype(np.float32) * np.float32(alpha) + np.float32(beta)
  return np.clip(y, 0, 255).astype(np.uint8)


_U8_VALUES = np.arange(256, dtype=np.uint8)


def photometric_distortion(image: np.ndarray, params: np.ndarray,
                           block: int = OPENCV_HSV_BLOCK) -> np.ndarray:
  """mmsegmentation's PhotoMetricDistortion on one uint8 RGB image (H, W, 3), given parameters.

  In order, each step only where its coin is on: brightness x + delta; contrast x * alpha (here
  when contrast_first); saturation: to HSV, S * alpha, back; hue: to HSV, H = (H + delta) mod 180,
  back; contrast (here when not contrast_first). Brightness / contrast / saturation compute
  float32(x) * alpha + beta in float32, clip to 0..255 and truncate to uint8; the HSV steps use
  OpenCV's 8-bit conversions (rgb_to_hsv_u8, hsv_to_rgb_u8 with `block`), each its own round trip.
  On an RGB image this is mmseg's BGR result with the channels reversed.

  The saturation and hue maps act on one uint8 value at a time, so they run as 256-entry tables
  (`_scale_shift_u8` on 0..255, (H + delta) mod 180 on 0..255) folded into the RGB -> HSV tables:
  the same values without a pass over the image.
  """
  image = _check_rgb_u8("image", image)
  params = np.asarray(params, np.float64)
  if params.shape != (len(PHOTOMETRIC_FIELDS),):
    raise ValueError(f"params of shape {params.shape} is not allowed; expected "
                     f"({len(PHOTOMETRIC_FIELDS)},) values {PHOTOMETRIC_FIELDS}.")
  hue = params[_PM_HUE]
  if params[_PM_HUE_ON] and hue != int(hue):
    raise ValueError(f"hue={float(hue)!r} is not allowed; expected an integer shift (OpenCV hue "
                     "units, degrees / 2).")
  if not isinstance(block, int) or block < 0:
    raise ValueError(f"block={block!r} is not allowed; expected an int >= 0.")
  out = image
  if params[_PM_BRIGHTNESS_ON]:
    out = _scale_shift_u8(out, beta=params[_PM_BRIGHTNESS])
  contrast_on, contrast_first = bool(params[_PM_CONTRAST_ON]), bool(params[_PM_CONTRAST_FIRST])
  if contrast_on and contrast_first:
    out = _scale_shift_u8(out, alpha=params[_PM_CONTRAST])
  if params[_PM_SATURATION_ON]:
    s_map = _scale_shift_u8(_U8_VALUES, alpha=params[_PM_SATURATION])
    out = _hsv_planes_to_rgb(*_rgb_to_hsv_planes(out, s_map=s_map), block)
  if params[_PM_HUE_ON]:
    h_map = ((_U8_VALUES.astype(np.int64) + int(hue)) % HSV_HUE_RANGE).astype(np.uint8)
    out = _hsv_planes_to_rgb(*_rgb_to_hsv_planes(out, h_map=h_map), block)
  if contrast_on and not contrast_first:
    out = _scale_shift_u8(out, alpha=params[_PM_CONTRAST])
  return out if out is not image else image.copy()
