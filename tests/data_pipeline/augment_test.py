"""Tests for jlp.data.augment.

References: plain-Python loops over the padded image (every crop window is
searched), per-element np.float32 arithmetic for normalisation, and a
transcription of torchvision's RandomResizedCrop.get_params / Resize /
CenterCrop arithmetic (torchvision is not installed here).
"""

import math

import numpy as np
import pytest

from jlp.data import augment


def _distinct_images(n=6, h=8, w=8, c=3, seed=0):
  """uint8 images whose 3x3x3 patches are all different (so a window has one origin)."""
  rng = np.random.default_rng(seed)
  return rng.integers(1, 256, size=(n, h, w, c), dtype=np.uint8)  # no zeros: padding stands out


def _origins(window, padded):
  """Every (top, left) at which `window` occurs in `padded` (plain loops)."""
  s = window.shape[0]
  found = []
  for top in range(padded.shape[0] - s + 1):
    for left in range(padded.shape[1] - s + 1):
      if np.array_equal(padded[top:top + s, left:left + s], window):
        found.append((top, left))
  return found


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_random_crop_windows_come_from_the_padded_image(mode):
  images = _distinct_images()
  out = augment.random_crop(images, np.random.default_rng(1), size=8, padding=2, mode=mode)
  assert out.shape == images.shape and out.dtype == np.uint8
  seen = set()
  for i in range(images.shape[0]):
    padded = np.pad(images[i], ((2, 2), (2, 2), (0, 0)), mode=mode)
    origins = _origins(out[i], padded)
    assert origins, f"image {i}: the crop is no window of the padded image"
    seen.update(origins)
  if mode == "constant":
    padded = np.pad(images[0], ((2, 2), (2, 2), (0, 0)))
    assert padded[0, 0, 0] == 0 and padded[2, 2, 0] == images[0, 0, 0, 0]
  assert len(seen) > 1  # offsets vary between images


def test_crop_offsets_cover_all_windows_uniformly():
  rng = np.random.default_rng(0)
  top, left = augment.draw_crop_offsets(rng, 9000, (40, 40), (32, 32))
  assert top.min() == 0 and top.max() == 8 and left.min() == 0 and left.max() == 8
  counts = np.bincount(top, minlength=9)
  assert np.all(np.abs(counts - 1000) < 150)


def test_crop_takes_the_given_window():
  images = _distinct_images(n=2, h=10, w=10)
  out = augment.crop(images, np.array([0, 3]), np.array([2, 1]), 5)
  np.testing.assert_array_equal(out[0], images[0, 0:5, 2:7])
  np.testing.assert_array_equal(out[1], images[1, 3:8, 1:6])


def test_flip_is_a_horizontal_flip():
  images = _distinct_images(n=4)
  out = augment.flip(images, np.array([True, False, True, False]))
  for i in range(4):
    expect = images[i][:, ::-1] if i % 2 == 0 else images[i]
    np.testing.assert_array_equal(out[i], expect)
  labels = images[..., 0]
  np.testing.assert_array_equal(augment.flip(labels, np.array([1, 0, 0, 1], bool))[3],
                                labels[3][:, ::-1])


def test_random_flip_flips_about_half():
  images = _distinct_images(n=400, h=2, w=3, c=1)
  out = augment.random_flip(images, np.random.default_rng(3))
  flipped = [np.array_equal(out[i], images[i][:, ::-1]) for i in range(400)]
  kept = [np.array_equal(out[i], images[i]) for i in range(400)]
  assert all(f or k for f, k in zip(flipped, kept))
  assert 150 < sum(flipped) < 250


def test_same_seed_same_output_different_seed_different():
  images = _distinct_images(n=16)

  def run(seed):
    rng = np.random.default_rng(seed)
    x = augment.random_crop(images, rng, 8, 4)
    x = augment.random_flip(x, rng)
    return augment.random_cutout(x, rng, 3)

  np.testing.assert_array_equal(run(5), run(5))
  assert not np.array_equal(run(5), run(6))


def test_cutout_zeroes_one_square_inside_the_image():
  x = np.ones((3, 6, 6, 2), np.float32)
  out = augment.cutout(x, np.array([0, 2, 4]), np.array([4, 1, 0]), 2)
  for i, (t, l) in enumerate([(0, 4), (2, 1), (4, 0)]):
    expect = np.ones((6, 6, 2), np.float32)
    expect[t:t + 2, l:l + 2] = 0
    np.testing.assert_array_equal(out[i], expect)
  assert np.all(x == 1)  # the input is not modified


def test_normalize_matches_float32_torchvision_arithmetic():
  """Reference: per element, (f32(v) / f32(255) - f32(mean)) / f32(std) with np.float32 scalars."""
  mean, std = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
  images = np.arange(256 * 3, dtype=np.int64).reshape(1, 16, 16, 3).astype(np.uint8)
  images[0, 0, 0] = (0, 255, 128)
  out = augment.normalize(images, mean, std)
  assert out.dtype == np.float32 and out.shape == images.shape
  for idx in np.ndindex(images.shape):
    c = idx[-1]
    ref = (np.float32(images[idx]) / np.float32(255) - np.float32(mean[c])) / np.float32(std[c])
    assert out[idx] == ref, idx
  # Non-uint8 input goes the arithmetic way, with the same values.
  np.testing.assert_array_equal(augment.normalize(images.astype(np.int32), mean, std), out)


def test_normalize_rejects_wrong_channel_count():
  with pytest.raises(ValueError, match="channels"):
    augment.normalize(np.zeros((1, 2, 2, 1), np.uint8), (0.5, 0.5), (1.0, 1.0))


def _torchvision_get_params(uniforms, height, width, scale, ratio):
  """torchvision.transforms.RandomResizedCrop.get_params, with uniform draws supplied."""
  area = height * width
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for u in uniforms:
    target_area = area * (scale[0] + (scale[1] - scale[0]) * u[0])
    aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[1])
    w = int(round(math.sqrt(target_area * aspect_ratio)))
    h = int(round(math.sqrt(target_area / aspect_ratio)))
    if 0 < w <= width and 0 < h <= height:
      i = math.floor(u[2] * (height - h + 1))  # randint(0, height - h + 1)
      j = math.floor(u[3] * (width - w + 1))
      return i, j, h, w
  in_ratio = float(width) / float(height)
  if in_ratio < min(ratio):
    w = width
    h = int(round(w / min(ratio)))
  elif in_ratio > max(ratio):
    h = height
    w = int(round(h * max(ratio)))
  else:
    w = width
    h = height
  i = (height - h) // 2
  j = (width - w) // 2
  return i, j, h, w


@pytest.mark.parametrize("height,width", [(50, 70), (120, 40), (33, 33)])
def test_resized_crop_box_matches_torchvision_get_params(height, width):
  rng = np.random.default_rng(height)
  scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
  uniforms = augment.draw_resized_crop_uniforms(rng, 300)
  for u in uniforms:
    got = augment.resized_crop_box(u, height, width, scale, ratio)
    assert got == _torchvision_get_params(u.tolist(), height, width, scale, ratio)
    top, left, h, w = got
    assert 0 <= top and top + h <= height and 0 <= left and left + w <= width


def test_resized_crop_box_fallback_is_the_clamped_central_crop():
  # Scale 1 with a ratio range excluding the image's ratio never fits -> fallback.
  never = np.zeros((augment.RESIZED_CROP_ATTEMPTS, 4))
  assert augment.resized_crop_box(never, 100, 20, (1.0, 1.0), (0.75, 1.333)) == (
      _torchvision_get_params(never.tolist(), 100, 20, (1.0, 1.0), (0.75, 1.333)))
  assert augment.resized_crop_box(never, 100, 20, (1.0, 1.0), (0.75, 1.333))[2:] == (27, 20)


def test_shorter_side_and_center_crop_arithmetic():
  # torchvision Resize(256) on 500x375 (W x H): H -> 256, W -> int(256 * 500 / 375) = 341.
  assert augment.shorter_side_size(375, 500, 256) == (256, 341)
  assert augment.shorter_side_size(500, 375, 256) == (341, 256)
  assert augment.shorter_side_size(300, 300, 256) == (256, 256)
  # CenterCrop: round((341 - 224) / 2) = round(58.5) = 58 (round half to even).
  assert augment.center_crop_box(256, 341, 224) == (16, 58)
