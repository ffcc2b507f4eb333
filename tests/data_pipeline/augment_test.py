"""Tests for jlp.data.augment.

References: plain-Python loops over the padded image (every crop window is
searched), per-element np.float32 arithmetic for normalisation, and a
transcription of torchvision's RandomResizedCrop.get_params / Resize /
CenterCrop arithmetic (torchvision is not installed here).

Photometric distortion / HSV: a plain-Python transcription of OpenCV's 8-bit
RGB2HSV_b (imgproc/src/color_hsv.simd.hpp), colorsys (float64) within the 8-bit
quantisation, per-element np.float32 arithmetic for mmseg's `convert`, and
golden outputs of the real OpenCV (opencv-python 4.5.5, x86-64 AVX2): cv2.cvtColor
on the images below, and mmsegmentation's PhotoMetricDistortion.__call__
transcribed with its random draws replaced by the given parameters (mmcv's
bgr2hsv / hsv2bgr = cv2.cvtColor on the BGR image; outputs turned back to RGB).
opencv / mmseg are not dependencies; tests/data/make_augment_goldens.py regenerates the goldens
(and checks the stored ones) where opencv-python 4.5.5 is installed.
"""

import colorsys
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
  assert all(f or k for f, k in zip(flipped, kept, strict=True))
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


# ----------------------------------------------------------------------------- HSV, photometric

_EDGE_RGB = [(0, 0, 0), (255, 255, 255), (128, 128, 128), (255, 0, 0), (0, 255, 0), (0, 0, 255),
             (255, 0, 1), (255, 1, 0), (1, 0, 0), (255, 255, 0), (0, 255, 255), (255, 0, 255),
             (250, 5, 128), (3, 2, 1)]
_EDGE_HSV = [(0, 0, 0), (0, 0, 255), (0, 255, 255), (179, 255, 255), (30, 255, 255),
             (60, 200, 100), (90, 1, 254), (120, 255, 1), (150, 128, 128), (15, 153, 25),
             (1, 153, 225), (7, 187, 225), (178, 90, 170), (45, 77, 33)]


def _golden_rgb_input():
  """2 x 36 RGB: OpenCV's first 32 columns take its SIMD path, the last 4 its scalar path."""
  x = ((np.arange(2 * 36 * 3) * 97 + 13) % 256).astype(np.uint8).reshape(2, 36, 3)
  for i, c in enumerate(_EDGE_RGB):
    x[i % 2, 30 - 2 * i] = c
  x[0, 33], x[1, 35] = _EDGE_RGB[6], _EDGE_RGB[3]
  return x


def _golden_hsv_input():
  x = ((np.arange(2 * 36 * 3) * 61 + 7) % 256).astype(np.uint8).reshape(2, 36, 3)
  x[..., 0] %= 180
  for i, c in enumerate(_EDGE_HSV):
    x[i % 2, 31 - 2 * i] = c
  x[0, 32], x[1, 34], x[0, 35] = _EDGE_HSV[3], _EDGE_HSV[10], _EDGE_HSV[11]
  return x


def _golden(hex_string, shape=(2, 36, 3)):
  return np.frombuffer(bytes.fromhex("".join(hex_string)), np.uint8).reshape(shape)


# cv2.cvtColor(_golden_rgb_input(), cv2.COLOR_RGB2HSV)
_RGB_TO_HSV = (
    "69efcf69ccf230e1b430bdd730a2faa2d8bca5fafa69fcc469d6e730f0a95affff30aaefa2e5b1a2bfd400ff0169"
    "e1dc69c2ff30d2c100ffffa2f4a6a2cac9a2acec3cffff69cbf430dfb630bbd9000080a2d5bea2b4e169fac60000"
    "0030edab30c5ce00ffffa2e3b3a2bdd6a2a3f969dfde30fda030d0c30faa03a2f1a8a2c8cba2aaee96ffff69c9f6"
    "30dcb830b9db1effffa2d3c0a2b3e369f7c800ffff30eaad30c3d030a7f378ffffa2bcd8a2a2fb69dde000ffff30"
    "cec530afe8a2efaa0000ffa2a9f069e8d569c7f830daba30b7dda2ff9f00ffff"
)
# cv2.cvtColor(_golden_hsv_input(), cv2.COLOR_HSV2RGB)
_HSV_TO_RGB = (
    "81665e3813004858ef86a661565d5114031159cba9aa6e713915004752f084a761e15e5a15031259ccad83695f80"
    "3f7f464cf182a861565f52fdfefe59cdb1846b5f3b1900ffff0080a961576052170312ff0000856d5f3c1c004b45"
    "f3000000ff000818031358cfbbe1623c3d3d3d5044f47cab615762531903121c211787705f3e3d3d5544f5e1623c"
    "5763541a031257d1c419110a3f3e3e5b43f677ad610000011b031257d2c98974601564156042f775ae60576555ff"
    "000856d3ce8a766041403fffffff73af605766551d041256d4d4e15f5a424241"
)
# The same pixels one per row (width 1: OpenCV's scalar path everywhere).
_HSV_TO_RGB_SCALAR = (
    "81675f3813014859ef86a662565d511403125acba9aa6e723915014853f084a762e15f5a1503125accad836a5f80"
    "4080474df182a862575f52fdfefe59cdb2846b5f3b1a00ffff0080a961576053170312ff0000856d5f3c1c004b46"
    "f3000000ff000818031358cfbbe1623c3d3d3d5145f47cab615862541903131c21178771603e3e3e5644f5e1623c"
    "5863541a031258d1c519120a3f3f3f5b44f678ad610000011b031257d2ca8975601664166143f775ae61586555ff"
    "000857d3cf8a7760414140ffffff73af615866561d041256d4d4e15f5a424241"
)
# mmseg PhotoMetricDistortion on _golden_rgb_input() with (brightness, contrast, contrast_first,
# saturation, hue); None = that step's coin off.
_PHOTOMETRIC_CASES = {
    "all_contrast_first": ((20.5, 1.3, True, 0.7, -7), (
        "68e5ff89feffcaff70e1ff90fcffb1ff77f1ff61f95fdfff7ff6ffc0f5645dffd9f3ffa7ff6de6ff8dfe"
        "1b1a1a74ecff94fff7d3ff7cff5d83f161d9ff83faeda5ff83ff5d8bfeffcbff71e5ff92c0c0c0ff79f1"
        "f499ff61dfff1a1a1ac2f867dcff8aff5f84ff71ecfb91ffecb1ff76f1ffb4e958d3ff7d1d1b1af462db"
        "ff85faeaa7ffd95dff8cfeffccff74e6ff94ffd95dff7bf1f19bff62dfffff5d83c4fa68dfff89f6ffab"
        "5d83fffb91ffecb1ff78f1ffff5d83d4ff7fefffa1f666deffffffeaa9ff6eebff8efffbcdff78e7ff97"
        "e858d0ff5f84")),
    "all_contrast_last": ((20.5, 1.3, False, 0.7, -7), (
        "74f6ff9fffffcdff71faff9effffc6ff7ef5ff77ff66e8ff96ffffbff56473ffffffffbcff6de7ff9dff"
        "1b1a1a85ffffabffffdeff83ff73a6f161d9ff8fffffb9ffa6ff73a1ffffd1ff76feffa3c0c0c0ff7ff8"
        "ffacff6aebff1a1a1ac3f868f0ff95ff76a7ff72ebff9fffffc5ff8bffffb4e959e0ff841d1b1bf461db"
        "ff90ffffbbffff73ffa2ffffd2ff77ffffa5ffff73ff82faffafff6bedffff73a6c4fa68f3ff98ffffc0"
        "73a6ffffa1ffffc6ff8cffffff73a6e4ff89ffffb7f665deffffffffbdff7cfeffa5ffffd6ff7bffffa9"
        "e858d1ff76a7")),
    "saturation": ((None, None, False, 1.45, None), (
        "0067cf0078f247b40055d70070fa14bc0070fa007c0061c40073e743a90000feff64ef08b1006ad4007f"
        "010000006ddc007fff4dc100ff0000a60063c90078ec058f00ff000079f448b60056d900808080be0071"
        "e100860062c600000044ab0052ce00ff0000b3006bd60080f9129c006ede3fa0004dc300030100a80064"
        "cb0079ee0892ff00fe007af649b80057db00ffff00c00073e300880063c8ff000045ad0053d00068f30c"
        "0000ffd80081fb149e006fe0ff00004ec5005de801aa0065fffffff00993006ad5007bf84aba0058dd00"
        "9f005fff0000")),
    "hue_down": ((None, None, False, None, -18), (
        "0ccfbb30f2deb4b415d7d737fafa5b9c1cbce104fa02c4b025e7d3a9a90900ff66efef4f9112b1b435d4"
        "01000019dcc83cffebc1c122ff00988607a6a929c9cc4cec98ff0031f4e0b6b616d9d9398080809e1fbe"
        "c142e103c6b2000000abab0ccece2fff00999314b3b637d6d959f91bdecaa0a001c3c3230301018809a8"
        "ab2bcbce4fee6600ff34f6e2b8b819dbdb3cff6600a021c0c343e306c8b4ff0098adad0ed0d030f3f353"
        "0098ffb838d8db5bfb1de0ccff0098c5c525e8e8488a0aaaffffffd050f013d5c136f8e4baba1bdddd3e"
        "7f009fff0099")),
    "hue_up": ((None, None, False, None, 17), (
        "190ccf3d30f215b42f37d7525bfa75bc1c22fa15040f02c43225e709a924006eff4fef6ab11217d4353a"
        "0100002619dc493cff22c13cff9000a6070cc9292fec4c5200ff903e31f416b63139d954808080be1f24"
        "e142471003c60000000cab262fce49ff9100b31419d6373df9595f281bde01a01b23c33e020301a8090e"
        "cb2b31ee4f54ff006e4134f619b8333cdb566eff00c02126e343481306c8ff90000ead2830d04b53f36e"
        "9000ffd8383efb5b602a1de0ff900025c54048e863aa0a0ffffffff050562013d54336f81bba353edd59"
        "9f0005ff9100")),
    "brightness_contrast_hue": ((-30.25, 0.55, False, None, 9), (
        "000c60091e7402510016650d29782156001978000f00085a03186e004b0000557b23721a500014630c25"
        "0000000014670f257b0a59017b24004a00115d051f701833007b240a1f7505530017660e353535570019"
        "6a122d000c5b000000004d001160087b2400510015640d27771f3a0014690046040b5a020000004b0011"
        "5e06217119347b00550b207605540018670f557b0058001a6b132e000c5c7b2400024e0012610925741d"
        "24007b650e2879213b00146a7b24000c5b031f6e164c00147b7b7b721a350010640c2177055500196811"
        "46000e7b2400")),
}


def _opencv_rgb2hsv_pixel(r, g, b):
  """OpenCV RGB2HSV_b's scalar loop (hrange 180), transcribed in Python ints."""
  shift = 12
  v, vmin = max(r, g, b), min(r, g, b)
  diff = v - vmin
  sdiv = round((255 << shift) / v) if v else 0
  hdiv = round((180 << shift) / (6 * diff)) if diff else 0
  s = (diff * sdiv + (1 << (shift - 1))) >> shift
  if v == r:
    h = g - b
  elif v == g:
    h = b - r + 2 * diff
  else:
    h = r - g + 4 * diff
  h = (h * hdiv + (1 << (shift - 1))) >> shift
  return (h + 180 if h < 0 else h), s, v


def _mmseg_convert(x, alpha=1.0, beta=0.0):
  """mmseg PhotoMetricDistortion.convert on one value: float32 ops, clip, truncation to uint8."""
  y = np.float32(x) * np.float32(alpha) + np.float32(beta)
  return int(min(max(y, np.float32(0)), np.float32(255)))


def test_rgb_to_hsv_u8_matches_opencv_fixed_point_loop_and_golden():
  rng = np.random.default_rng(0)
  colours = np.concatenate([rng.integers(0, 256, (3000, 3)), np.repeat(np.arange(256), 3)
                            .reshape(-1, 3), np.array(_EDGE_RGB)]).astype(np.uint8)
  got = augment.rgb_to_hsv_u8(colours[None])[0]
  want = np.array([_opencv_rgb2hsv_pixel(*map(int, c)) for c in colours])
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(augment.rgb_to_hsv_u8(_golden_rgb_input()), _golden(_RGB_TO_HSV))


def test_rgb_to_hsv_u8_is_colorsys_quantised():
  rng = np.random.default_rng(1)
  colours = np.concatenate([rng.integers(0, 256, (3000, 3)), np.array(_EDGE_RGB)]).astype(np.uint8)
  got = augment.rgb_to_hsv_u8(colours[None])[0].astype(np.int64)
  for (r, g, b), (h, s, v) in zip(colours.tolist(), got.tolist(), strict=True):
    hf, sf, vf = colorsys.rgb_to_hsv(r / 255, g / 255, b / 255)
    assert v == max(r, g, b) and abs(vf * 255 - v) < 1e-9
    # Rounded, up to the 12-bit fixed-point reciprocals: within one level.
    assert abs(sf * 255 - s) < 1
    dh = abs(hf * 180 - h)
    assert 0 <= h < 180 and min(dh, 180 - dh) < 1, ((r, g, b), h, hf * 180)
  # Hue wraps: just below red rounds to 179 or 0, never 180.
  np.testing.assert_array_equal(augment.rgb_to_hsv_u8(np.array([[[255, 0, 1], [255, 0, 5]]],
                                                               np.uint8))[0, :, 0], [0, 179])


def test_hsv_to_rgb_u8_matches_opencv_golden_on_simd_and_scalar_columns():
  hsv = _golden_hsv_input()
  np.testing.assert_array_equal(augment.hsv_to_rgb_u8(hsv), _golden(_HSV_TO_RGB))
  scalar = _golden(_HSV_TO_RGB_SCALAR)
  np.testing.assert_array_equal(augment.hsv_to_rgb_u8(hsv.reshape(-1, 1, 3)).reshape(hsv.shape),
                                scalar)
  np.testing.assert_array_equal(augment.hsv_to_rgb_u8(hsv, block=0), scalar)
  # The two paths differ (truncation vs rounding), and a 36-wide row has both.
  got = augment.hsv_to_rgb_u8(hsv)
  assert (got[:, :32] != scalar[:, :32]).any()
  np.testing.assert_array_equal(got[:, 32:], scalar[:, 32:])


def test_hsv_to_rgb_u8_is_colorsys_within_one_level():
  rng = np.random.default_rng(2)
  hsv = np.concatenate([rng.integers(0, 256, (4000, 3)), np.array(_EDGE_HSV)]).astype(np.uint8)
  hsv[:, 0] %= 180
  for block in (augment.OPENCV_HSV_BLOCK, 0):
    got = augment.hsv_to_rgb_u8(hsv[None], block)[0].astype(np.float64)
    want = np.array([colorsys.hsv_to_rgb(h / 180, s / 255, v / 255) for h, s, v in hsv.tolist()])
    assert np.abs(got - 255 * want).max() <= 1.0 + 1e-6


def test_photometric_brightness_and_contrast_are_mmseg_convert_per_element():
  # Values near both ends: clipping at 0 and 255, truncation of the float32 result.
  image = np.array([[[0, 5, 128], [200, 250, 255], [31, 97, 254]]], np.uint8)
  cases = [(None, None), (32.0, None), (-31.7, None), (None, 1.5), (None, 0.5), (20.25, 1.3)]
  for brightness, contrast in cases:
    for first in (False, True):  # without HSV steps the contrast position does not matter
      params = augment.photometric_params(brightness=brightness, contrast=contrast,
                                          contrast_first=first)
      got = augment.photometric_distortion(image, params)
      want = [_mmseg_convert(x, beta=brightness) if brightness is not None else int(x)
              for x in image.ravel().tolist()]
      if contrast is not None:
        want = [_mmseg_convert(x, alpha=contrast) for x in want]
      np.testing.assert_array_equal(got.ravel(), want, err_msg=str((brightness, contrast)))
      assert got.dtype == np.uint8 and got.shape == image.shape
  clipped = augment.photometric_distortion(image, augment.photometric_params(brightness=32.0))
  assert clipped[0, 1, 2] == 255 and clipped[0, 0, 0] == 32
  darker = augment.photometric_distortion(image, augment.photometric_params(brightness=-32.0))
  assert darker[0, 0, 1] == 0


@pytest.mark.parametrize("case", sorted(_PHOTOMETRIC_CASES))
def test_photometric_distortion_matches_mmseg_with_opencv(case):
  (brightness, contrast, first, saturation, hue), want = _PHOTOMETRIC_CASES[case]
  params = augment.photometric_params(brightness, contrast, first, saturation, hue)
  got = augment.photometric_distortion(_golden_rgb_input(), params)
  np.testing.assert_array_equal(got, _golden(want))


def test_photometric_contrast_position_and_hue_wrap_around():
  image = _golden_rgb_input()
  first = _golden(_PHOTOMETRIC_CASES["all_contrast_first"][1])
  last = _golden(_PHOTOMETRIC_CASES["all_contrast_last"][1])
  assert (first != last).any()  # mmseg's `mode`: contrast before or after the HSV steps
  # Hue: pure red (H 0) shifted by -18 wraps to H 162 (324 degrees), by +17 to H 17; pure blue
  # (H 120) by +17 stays inside. colorsys gives the colours to within one level.
  reds = np.array([[[255, 0, 0], [0, 0, 255]]], np.uint8)
  for shift in (-18, 17):
    got = augment.photometric_distortion(reds, augment.photometric_params(hue=shift))
    for pixel, h0 in zip(got[0].tolist(), (0, 120), strict=True):
      want = 255 * np.array(colorsys.hsv_to_rgb(((h0 + shift) % 180) / 180, 1.0, 1.0))
      assert np.abs(np.array(pixel) - want).max() <= 1.0, (shift, h0, pixel, want)
  down = augment.photometric_distortion(reds, augment.photometric_params(hue=-18))
  assert down[0, 0, 0] == 255 and down[0, 0, 1] == 0 and down[0, 0, 2] > 100  # magenta side
  # The whole golden image: hue shifts only move H (mod 180) for saturated, bright pixels.
  hsv = augment.rgb_to_hsv_u8(image)
  up = augment.rgb_to_hsv_u8(_golden(_PHOTOMETRIC_CASES["hue_up"][1]))
  sure = (hsv[..., 1] == 255) & (hsv[..., 2] == 255)
  np.testing.assert_array_equal(up[..., 0][sure], (hsv[..., 0][sure].astype(int) + 17) % 180)


def test_photometric_all_off_is_a_copy():
  image = _golden_rgb_input()
  out = augment.photometric_distortion(image, augment.photometric_params())
  np.testing.assert_array_equal(out, image)
  assert out is not image


def test_draw_photometric_distribution_and_determinism():
  rng = np.random.default_rng(5)
  p = augment.draw_photometric(rng, 20000)
  np.testing.assert_array_equal(p, augment.draw_photometric(np.random.default_rng(5), 20000))
  assert p.shape == (20000, len(augment.PHOTOMETRIC_FIELDS))
  col = {name: p[:, i] for i, name in enumerate(augment.PHOTOMETRIC_FIELDS)}
  for name in ("brightness_on", "contrast_on", "contrast_first", "saturation_on", "hue_on"):
    assert set(np.unique(col[name])) == {0.0, 1.0}
    assert abs(col[name].mean() - 0.5) < 0.02, name
  assert -32 <= col["brightness"].min() and col["brightness"].max() < 32
  assert abs(col["brightness"].mean()) < 1.0
  for name in ("contrast", "saturation"):
    assert 0.5 <= col[name].min() and col[name].max() < 1.5 and abs(col[name].mean() - 1) < 0.02
  # numpy.random.randint(-18, 18): the integers -18..17, uniformly.
  hue = col["hue"]
  assert np.array_equal(hue, np.round(hue)) and set(hue.astype(int)) == set(range(-18, 18))
  assert np.all(np.abs(np.bincount(hue.astype(int) + 18) - 20000 / 36) < 120)


def test_photometric_bad_inputs():
  image = _golden_rgb_input()
  ok = augment.photometric_params()
  with pytest.raises(ValueError, match="uint8"):
    augment.photometric_distortion(image.astype(np.float32), ok)
  with pytest.raises(ValueError, match="uint8"):
    augment.photometric_distortion(image[..., :2], ok)
  with pytest.raises(ValueError, match="params of shape"):
    augment.photometric_distortion(image, ok[:5])
  with pytest.raises(ValueError, match="hue=2.5"):
    augment.photometric_distortion(image, augment.photometric_params(hue=2.5))
  with pytest.raises(ValueError, match="block=-1"):
    augment.hsv_to_rgb_u8(image, block=-1)
  with pytest.raises(ValueError, match="uint8"):
    augment.rgb_to_hsv_u8(np.zeros((2, 2, 4), np.uint8))
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="hue_delta"):
    augment.draw_photometric(rng, 2, hue_delta=1.5)
  with pytest.raises(ValueError, match="contrast_range"):
    augment.draw_photometric(rng, 2, contrast_range=(1.5, 0.5))
  with pytest.raises(ValueError, match="brightness_delta"):
    augment.draw_photometric(rng, 2, brightness_delta=-1)


def _rgb_to_hsv_formula(image):
  """OpenCV's RGB2HSV_b as whole-array int64 arithmetic (the formulas of rgb_to_hsv_u8's doc)."""
  rgb = image.astype(np.int64)
  r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
  v = np.maximum(np.maximum(r, g), b)
  diff = v - np.minimum(np.minimum(r, g), b)
  sdiv = np.array([0] + [round((255 << 12) / i) for i in range(1, 256)], np.int64)
  hdiv = np.array([0] + [round((180 << 12) / (6 * i)) for i in range(1, 256)], np.int64)
  s = (diff * sdiv[v] + (1 << 11)) >> 12
  h = np.where(v == r, g - b, np.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
  h = (h * hdiv[diff] + (1 << 11)) >> 12
  return np.stack([np.where(h < 0, h + 180, h), s, v], axis=-1).astype(np.uint8)


def _hsv_to_rgb_formula(hsv, simd):
  """OpenCV's HSV2RGB_b as whole-array float32 arithmetic, one code path for every pixel
  (hsv_to_rgb_u8's doc; float64 products of float32 values round once, as the FMAs do)."""
  f32 = np.float32
  h = hsv[..., 0].astype(f32) * f32(6.0 / 180)
  s = hsv[..., 1].astype(f32) * f32(1.0 / 255.0)
  v = hsv[..., 2].astype(f32) * f32(1.0 / 255.0)
  if simd:
    whole = np.trunc(h)
    sector, frac = whole - np.trunc(whole * f32(1.0 / 6.0)) * f32(6.0), h - whole
  else:
    h = np.fmod(h, f32(6.0))
    sector = np.floor(h)
    frac = h - sector
  s64 = s.astype(np.float64)
  tab2 = v * (1.0 - s64 * frac).astype(f32)
  tab3 = ((1.0 - s64 * (f32(1.0) - frac)).astype(f32) if simd
          else f32(1.0) - s * (f32(1.0) - frac)) * v
  tab = np.stack([v, v * (f32(1.0) - s), tab2, tab3], axis=-1)
  order = np.array([[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0]])[:, ::-1]
  rgb = np.take_along_axis(tab, order[sector.astype(np.intp)], axis=-1) * f32(255.0)
  return np.clip(np.trunc(rgb) if simd else np.rint(rgb), 0, 255).astype(np.uint8)


def test_hsv_tables_give_the_formulas_on_every_input_they_hold():
  # rgb_to_hsv_u8 / hsv_to_rgb_u8 read lookup tables: every (R, G) with 16 B values, and every
  # (H, S) (H up to 255) with 12 V values on both code paths, against the formulas.
  values = np.array([0, 1, 2, 17, 64, 127, 128, 129, 200, 253, 254, 255], np.uint8)
  r, g, b = np.meshgrid(np.arange(256), np.arange(256), np.append(values, [5, 99, 180, 250]),
                        indexing="ij")
  rgb = np.stack([r, g, b], axis=-1).astype(np.uint8).reshape(-1, 256, 3)
  np.testing.assert_array_equal(augment.rgb_to_hsv_u8(rgb), _rgb_to_hsv_formula(rgb))
  h, s, v = np.meshgrid(np.arange(256), np.arange(256), values, indexing="ij")
  hsv = np.stack([h, s, v], axis=-1).astype(np.uint8).reshape(-1, 64, 3)
  np.testing.assert_array_equal(augment.hsv_to_rgb_u8(hsv), _hsv_to_rgb_formula(hsv, True))
  np.testing.assert_array_equal(augment.hsv_to_rgb_u8(hsv, block=0),
                                _hsv_to_rgb_formula(hsv, False))
  mixed = augment.hsv_to_rgb_u8(hsv.reshape(-1, 48, 3))  # 32 SIMD columns, then 16 scalar
  np.testing.assert_array_equal(mixed[:, :32], _hsv_to_rgb_formula(hsv.reshape(-1, 48, 3)[:, :32],
                                                                   True))
  np.testing.assert_array_equal(mixed[:, 32:], _hsv_to_rgb_formula(hsv.reshape(-1, 48, 3)[:, 32:],
                                                                   False))
