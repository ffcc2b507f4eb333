"""Tests for jlp.data.cityscapes on tiny PNG image / trainId pairs.

References: the arrays the test writes (PNG is lossless), explicit PIL resizes
for the rescaled cases, per-element np.float32 normalisation, a transcription of
mmsegmentation's RandomCrop.__call__ (np.unique histogram, 10 re-draws) for
cat_max_ratio, and per-element np.float32 arithmetic for mmseg's brightness /
contrast `convert`. The HSV steps of PhotoMetricDistortion are checked against
OpenCV in augment_test.py; here only where the dataset applies them.
"""

import os

import numpy as np
import pytest
from PIL import Image

from jlp.data import augment as aug
from jlp.data import cityscapes, get_dataset
from jlp.data.cityscapes import CROP_RETRIES, cat_ratio_accepts
from jlp.data.dataset import DataFileError
from jlp.data.pipeline import Pipeline
from references import imagenet_normalized

H, W = 6, 10
# The pipeline without mmseg's cat_max_ratio re-draws and PhotoMetricDistortion.
PLAIN = {"cat_max_ratio": 1.0, "photometric": False}


def write_cityscapes(root, cities=("zurich", "aachen"), per_city=2, seed=0):
  """Returns {(split, city, k): (image, label)} of what was written."""
  rng = np.random.default_rng(seed)
  written = {}
  for split in ("train", "val"):
    for city in cities:
      os.makedirs(os.path.join(root, "leftImg8bit", split, city))
      os.makedirs(os.path.join(root, "gtFine", split, city))
      for k in range(per_city):
        prefix = f"{city}_{k:06d}_000019"
        image = rng.integers(0, 256, size=(H, W, 3), dtype=np.uint8)
        label = rng.integers(0, 19, size=(H, W), dtype=np.uint8)
        label[0, 0] = 255
        Image.fromarray(image).save(
            os.path.join(root, "leftImg8bit", split, city, prefix + "_leftImg8bit.png"))
        Image.fromarray(label).save(
            os.path.join(root, "gtFine", split, city, prefix + "_gtFine_labelTrainIds.png"))
        # Other gtFine files (colour, instance ids) are ignored.
        Image.fromarray(label).save(
            os.path.join(root, "gtFine", split, city, prefix + "_gtFine_color.png"))
        written[(split, city, k)] = (image, label)
  return written


def test_val_split_loads_exact_pixels_and_labels_sorted_by_city(tmp_path):
  written = write_cityscapes(tmp_path)
  ds = get_dataset("cityscapes", root=tmp_path, split="val")
  assert (ds.size, ds.num_classes, ds.image_shape, ds.label_shape) == (4, 19, (H, W, 3), (H, W))
  assert not ds.augment
  batch = ds.get(np.arange(4), {})
  order = [("aachen", 0), ("aachen", 1), ("zurich", 0), ("zurich", 1)]
  for i, (city, k) in enumerate(order):
    image, label = written[("val", city, k)]
    np.testing.assert_array_equal(batch["image"][i], imagenet_normalized(image))
    np.testing.assert_array_equal(batch["label"][i], label)
  assert batch["label"].dtype == np.int32 and batch["label"][0, 0, 0] == 255


def test_train_crop_flips_then_pads_after_normalize(tmp_path):
  write_cityscapes(tmp_path)
  # Scale 1 and a crop larger than the image: the whole image, flipped or not, then mmseg's Pad
  # after Normalize: at the bottom and right, image 0 (after normalisation) and label 255.
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=(8, 12), scale_range=(1.0, 1.0),
                   **PLAIN)
  assert ds.augment and ds.image_shape == (8, 12, 3) and ds.label_shape == (8, 12)
  params = ds.draw(np.random.default_rng(0), 4)
  params["flip"] = np.array([False, True, False, True])
  batch = ds.get(np.arange(4), params)
  assert batch["image"].dtype == np.float32 and batch["label"].dtype == np.int32
  eval_ds = get_dataset("cityscapes", root=tmp_path, split="train", augment=False)
  plain = eval_ds.get(np.arange(4), {})
  for i in range(4):
    image, label = plain["image"][i], plain["label"][i]
    if params["flip"][i]:
      image, label = image[:, ::-1], label[:, ::-1]
    want_image = np.zeros((8, 12, 3), np.float32)
    want_image[:H, :W] = image
    want_label = np.full((8, 12), 255)
    want_label[:H, :W] = label
    np.testing.assert_array_equal(batch["image"][i], want_image)
    np.testing.assert_array_equal(batch["label"][i], want_label)


def test_train_rescale_and_crop_window(tmp_path):
  write_cityscapes(tmp_path)
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=4, scale_range=(2.0, 2.0), **PLAIN)
  params = ds.draw(np.random.default_rng(3), 4)
  params["flip"][:] = False
  batch = ds.get(np.arange(4), params)
  for i in range(4):
    image = Image.open(ds.image_paths[i]).convert("RGB").resize((2 * W, 2 * H), Image.BILINEAR)
    label = Image.open(ds.label_paths[i]).resize((2 * W, 2 * H), Image.NEAREST)
    _, u_top, u_left = params["scale_crop"][i]
    top, left = int(u_top * (2 * H - 4 + 1)), int(u_left * (2 * W - 4 + 1))
    np.testing.assert_array_equal(batch["image"][i],
                                  imagenet_normalized(np.asarray(image)[top:top + 4, left:left + 4]))
    np.testing.assert_array_equal(batch["label"][i], np.asarray(label)[top:top + 4, left:left + 4])


def test_missing_folders_and_labels_show_the_layout(tmp_path):
  with pytest.raises(FileNotFoundError) as e:
    get_dataset("cityscapes", root=tmp_path)
  assert "leftImg8bit/" in str(e.value) and "_gtFine_labelTrainIds.png" in str(e.value)
  write_cityscapes(tmp_path)
  os.remove(tmp_path / "gtFine" / "val" / "zurich" /
            "zurich_000001_000019_gtFine_labelTrainIds.png")
  with pytest.raises(FileNotFoundError, match="zurich_000001_000019_leftImg8bit.png"):
    get_dataset("cityscapes", root=tmp_path, split="val")
  with pytest.raises(ValueError, match="crop_size"):
    get_dataset("cityscapes", root=tmp_path, crop_size=(0, 4))



def write_pair(root, image, label, split="train", city="aachen", k=0):
  """One image / trainId-map pair (a one-file split)."""
  prefix = f"{city}_{k:06d}_000019"
  for top, name in (("leftImg8bit", "_leftImg8bit.png"), ("gtFine", "_gtFine_labelTrainIds.png")):
    os.makedirs(os.path.join(root, top, split, city), exist_ok=True)
    Image.fromarray(image if top == "leftImg8bit" else label).save(
        os.path.join(root, top, split, city, prefix + name))


def mmseg_random_crop(label, offsets, crop, cat_max_ratio, ignore_index=255):
  """mmseg RandomCrop.__call__ with get_crop_bbox's draws replaced by `offsets` (in order)."""
  draws = iter(offsets)
  top, left = next(draws)
  if cat_max_ratio < 1.0:
    for _ in range(10):  # "Repeat 10 times"
      seg_temp = label[top:top + crop[0], left:left + crop[1]]
      labels, cnt = np.unique(seg_temp, return_counts=True)
      cnt = cnt[labels != ignore_index]
      if len(cnt) > 1 and np.max(cnt) / np.sum(cnt) < cat_max_ratio:
        break
      top, left = next(draws)
  return top, left


def _uniforms(offsets, size, crop):
  """(top, left) uniforms that give these window offsets: offset = int(u * (margin + 1))."""
  margins = (size[0] - crop[0] + 1, size[1] - crop[1] + 1)
  return np.array([[(t + 0.5) / margins[0], (l + 0.5) / margins[1]] for t, l in offsets])


def _crop_params(offsets, size, crop, flip=False):
  u = _uniforms(offsets, size, crop)
  return {"scale_crop": np.array([[0.5, *u[0]]]), "flip": np.array([flip]),
          "crop_retry": u[None, 1:]}


# An 8 x 16 label map: class 1 on the left half; classes 2 / 3 in a checkerboard on the right.
CAT_LABEL = np.ones((8, 16), np.uint8)
CAT_LABEL[:, 8:] = 2 + (np.add.outer(np.arange(8), np.arange(8)) % 2)
CAT_IMAGE = np.random.default_rng(7).integers(0, 256, (8, 16, 3), dtype=np.uint8)


def test_cat_max_ratio_redraws_rejected_windows_until_one_is_mixed(tmp_path):
  write_pair(tmp_path, CAT_IMAGE, CAT_LABEL)
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=4, scale_range=(1.0, 1.0),
                   photometric=False)
  assert ds.cat_max_ratio == 0.75
  # Window 0 (cols 0-3) and 1 (cols 3-6): class 1 only; 2 (cols 5-8): 12 of 16 pixels class 1,
  # 0.75 is not < 0.75; 3 (cols 6-9): 8 / 4 / 4 -> accepted; later windows unused.
  offsets = [(0, 0), (2, 3), (1, 5), (4, 6)] + [(0, 12)] * (CROP_RETRIES - 3)
  assert mmseg_random_crop(CAT_LABEL, offsets, (4, 4), 0.75) == (4, 6)
  image, label = ds.load(0, {k: v[0] for k, v in _crop_params(offsets, (8, 16), (4, 4)).items()})
  np.testing.assert_array_equal(image, CAT_IMAGE[4:8, 6:10])
  np.testing.assert_array_equal(label, CAT_LABEL[4:8, 6:10])
  # A laxer ratio accepts window 2; cat_max_ratio=1 keeps window 0.
  for ratio, (top, left) in ((0.8, (1, 5)), (1.0, (0, 0))):
    ds = get_dataset("cityscapes", root=tmp_path, crop_size=4, scale_range=(1.0, 1.0),
                     cat_max_ratio=ratio, photometric=False)
    assert mmseg_random_crop(CAT_LABEL, offsets, (4, 4), ratio) == (top, left)
    params = _crop_params(offsets, (8, 16), (4, 4))
    if ratio == 1.0:
      params.pop("crop_retry")
    image, _ = ds.load(0, {k: v[0] for k, v in params.items()})
    np.testing.assert_array_equal(image, CAT_IMAGE[top:top + 4, left:left + 4])


def test_cat_max_ratio_keeps_the_last_window_after_ten_rejections(tmp_path):
  label = np.full((8, 16), 5, np.uint8)
  label[0, :] = 255  # ignored pixels are not counted: still one class
  write_pair(tmp_path, CAT_IMAGE, label)
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=4, scale_range=(1.0, 1.0),
                   photometric=False)
  offsets = [(t % 5, l) for t, l in zip(range(11), range(1, 12))]  # 11 different windows
  assert len(offsets) == 1 + CROP_RETRIES
  assert mmseg_random_crop(label, offsets, (4, 4), 0.75) == offsets[-1] == (0, 11)
  params = _crop_params(offsets, (8, 16), (4, 4), flip=True)
  image, out_label = ds.load(0, {k: v[0] for k, v in params.items()})
  np.testing.assert_array_equal(image, CAT_IMAGE[0:4, 11:15][:, ::-1])
  np.testing.assert_array_equal(out_label, label[0:4, 11:15][:, ::-1])


def test_cat_ratio_test_ignores_255_and_needs_two_classes():
  def mmseg_accepts(window, ratio):
    labels, cnt = np.unique(window, return_counts=True)
    cnt = cnt[labels != 255]
    return bool(len(cnt) > 1 and np.max(cnt) / np.sum(cnt) < ratio)
  windows = [np.full((4, 4), 255, np.uint8),                     # nothing counted
             np.array([[4, 255], [255, 255]], np.uint8),            # one class
             np.array([[4, 4, 5, 255], [255] * 4], np.uint8),       # 2 / 3 < 0.75
             np.array([[4, 4, 4, 5], [255] * 4], np.uint8),         # 3 / 4: not < 0.75
             np.array([[0, 0, 1, 2], [3, 3, 3, 3]], np.uint8),      # 4 / 8
             np.array([[0] * 7 + [1], [255] * 8], np.uint8)]        # 7 / 8
  for window in windows:
    for ratio in (0.5, 0.75, 0.9, 1.0):
      assert cat_ratio_accepts(window, ratio) == mmseg_accepts(window, ratio), (window, ratio)


def test_photometric_acts_on_the_flipped_window_before_padding(tmp_path):
  # 36 columns: OpenCV's HSV -> RGB rounds the last 4 (36 % 32) of a row unlike the others, so
  # distorting before flipping would differ from mmseg (flip, then distort).
  image = np.random.default_rng(3).integers(0, 256, (5, 36, 3), dtype=np.uint8)
  image[0, 0] = (250, 255, 3)  # clipped by the brightness below
  label = np.random.default_rng(4).integers(0, 19, (5, 36), dtype=np.uint8)
  write_pair(tmp_path, image, label)
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=(6, 38), scale_range=(1.0, 1.0))
  assert ds.photometric and ds.cat_max_ratio == 0.75
  params = ds.draw(np.random.default_rng(0), 1)
  assert set(params) == {"scale_crop", "flip", "crop_retry", "photometric"}
  for flip in (False, True):
    params["flip"][:] = flip
    params["photometric"][0] = aug.photometric_params(brightness=21.5, contrast=0.8)
    got, got_label = ds.load(0, {k: v[0] for k, v in params.items()})
    # The crop is larger than the image: the whole image (padded later, by get).
    window, window_label = (image[:, ::-1], label[:, ::-1]) if flip else (image, label)
    want = np.array([[[_mmseg_convert(_mmseg_convert(x, beta=21.5), alpha=0.8) for x in px]
                      for px in row] for row in window.tolist()], np.uint8)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_label, window_label)
    batch = ds.get(np.arange(1), params)
    np.testing.assert_array_equal(batch["image"][0, :5, :36], imagenet_normalized(want))
    pad = np.ones((6, 38), bool)
    pad[:5, :36] = False
    assert (batch["image"][0][pad] == 0).all() and (batch["label"][0][pad] == 255).all()
    # The HSV steps too act on the window as mmseg holds it: cropped, then flipped.
    params["photometric"][0] = aug.photometric_params(saturation=1.3, hue=-5, contrast=1.2,
                                                      contrast_first=True)
    got, _ = ds.load(0, {k: v[0] for k, v in params.items()})
    want = aug.photometric_distortion(window, params["photometric"][0])
    np.testing.assert_array_equal(got, want)
    if flip:
      unflipped_first = aug.photometric_distortion(image, params["photometric"][0])[:, ::-1]
      assert (unflipped_first != want).any()


def _mmseg_convert(x, alpha=1.0, beta=0.0):
  """mmseg PhotoMetricDistortion.convert on one value: float32 ops, clip, truncation to uint8."""
  y = np.float32(x) * np.float32(alpha) + np.float32(beta)
  return int(min(max(y, np.float32(0)), np.float32(255)))


def test_options_off_draw_and_give_exactly_the_plain_pipeline(tmp_path):
  write_cityscapes(tmp_path)
  on = get_dataset("cityscapes", root=tmp_path, crop_size=4, scale_range=(0.8, 1.6))
  off = get_dataset("cityscapes", root=tmp_path, crop_size=4, scale_range=(0.8, 1.6), **PLAIN)
  a, b = on.draw(np.random.default_rng(9), 4), off.draw(np.random.default_rng(9), 4)
  assert set(b) == {"scale_crop", "flip"}
  assert a["crop_retry"].shape == (4, CROP_RETRIES, 2)
  assert a["photometric"].shape == (4, len(aug.PHOTOMETRIC_FIELDS))
  for k in b:  # the new draws come after the old ones
    np.testing.assert_array_equal(a[k], b[k])
  # Photometric off / cat_max_ratio 1 through their parameters: the same batch as the plain one.
  a["photometric"][:] = aug.photometric_params()
  a.pop("crop_retry")
  np.testing.assert_array_equal(on.get(np.arange(4), a)["image"], off.get(np.arange(4), b)["image"])
  # Evaluation draws nothing.
  val = get_dataset("cityscapes", root=tmp_path, split="val")
  assert val.draw(np.random.default_rng(0), 2) == {}


def test_train_batches_are_a_pure_function_of_seed_and_step(tmp_path):
  write_cityscapes(tmp_path)
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=(4, 6), scale_range=(0.8, 1.6))
  kw = {"process_count": 1, "process_index": 0}
  first = Pipeline(ds, 4, seed=3, **kw).batch(2)
  again = Pipeline(ds, 4, seed=3, **kw).batch(2)
  for k in first:
    np.testing.assert_array_equal(first[k], again[k])
  assert not np.array_equal(first["image"], Pipeline(ds, 4, seed=3, **kw).batch(3)["image"])
  assert not np.array_equal(first["image"], Pipeline(ds, 4, seed=4, **kw).batch(2)["image"])
  # Two processes' rows (each drawing for the whole global batch) join to the same batch.
  parts = [Pipeline(ds, 4, seed=3, process_count=2, process_index=p).batch(2) for p in (0, 1)]
  for k in first:
    np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), first[k])


@pytest.mark.parametrize("field,value", [
    ("cat_max_ratio", 0), ("cat_max_ratio", -0.5), ("cat_max_ratio", 1.5),
    ("cat_max_ratio", True), ("cat_max_ratio", "0.75"), ("cat_max_ratio", None),
    ("photometric", "yes"), ("photometric", 1), ("photometric", None)])
def test_bad_options_are_rejected(tmp_path, field, value):
  write_cityscapes(tmp_path)
  with pytest.raises(ValueError, match=f"{field}={value!r} is not allowed"):
    get_dataset("cityscapes", root=tmp_path, **{field: value})


# ----------------------------------------------------------------------------- bad files (issue 33)

def _label_path(root, split="val", city="zurich", k=1):
  name = f"{city}_{k:06d}_000019_gtFine_labelTrainIds.png"
  return os.path.join(root, "gtFine", split, city, name)


def _image_path(root, split="val", city="zurich", k=1):
  return os.path.join(root, "leftImg8bit", split, city, f"{city}_{k:06d}_000019_leftImg8bit.png")


def test_label_values_other_than_train_ids_are_refused_naming_the_file(tmp_path):
  write_cityscapes(tmp_path)
  raw = np.random.default_rng(5).integers(0, 34, (H, W), dtype=np.uint8)  # raw labelIds
  raw[0, :3] = (33, 24, 255)
  Image.fromarray(raw).save(_label_path(tmp_path))
  for split, kw in (("val", {}), ("train", {"crop_size": 4})):
    if split == "train":
      Image.fromarray(raw).save(_label_path(tmp_path, "train"))
    ds = get_dataset("cityscapes", root=tmp_path, split=split, **kw)
    with pytest.raises(DataFileError) as e:
      ds.get(np.arange(4), ds.draw(np.random.default_rng(0), 4))
    message = str(e.value)
    assert e.value.path == _label_path(tmp_path, split)
    assert message.startswith(_label_path(tmp_path, split))
    assert "24" in message and "33" in message and "255" in message.split("are not")[1]
    assert "createTrainIdLabelImgs" in message and "labelIds" in message
    assert [err.path for err in ds.verify()] == [_label_path(tmp_path, split)]
  # trainIds and 255 only, as PIL modes L, P and 16-bit grey: accepted, same values.
  good = np.random.default_rng(6).integers(0, 19, (H, W)).astype(np.uint16)
  good[1, 1] = 255
  palette = Image.frombytes("P", (W, H), good.astype(np.uint8).tobytes())
  palette.putpalette(np.random.default_rng(7).integers(0, 256, 768).tolist())
  for image in (Image.fromarray(good.astype(np.uint8)), palette, Image.fromarray(good)):
    image.save(_label_path(tmp_path))
    assert Image.open(_label_path(tmp_path)).mode in ("L", "P", "I;16")
    ds = get_dataset("cityscapes", root=tmp_path, split="val")
    np.testing.assert_array_equal(ds.get(np.array([3]), {})["label"][0], good)
    assert ds.verify() == []
  good[2, 2] = 256  # 16-bit: not clipped to 255
  Image.fromarray(good).save(_label_path(tmp_path))
  with pytest.raises(DataFileError, match="label values 256"):
    get_dataset("cityscapes", root=tmp_path, split="val").get(np.array([3]), {})


def test_colour_label_maps_are_refused(tmp_path):
  write_cityscapes(tmp_path)
  colour = np.random.default_rng(1).integers(0, 256, (H, W, 3), dtype=np.uint8)
  for mode in ("RGB", "RGBA"):
    Image.fromarray(colour).convert(mode).save(_label_path(tmp_path))
    ds = get_dataset("cityscapes", root=tmp_path, split="val")
    with pytest.raises(DataFileError, match=f"a {mode} image") as e:
      ds.get(np.arange(4), {})
    assert e.value.path == _label_path(tmp_path)
    assert "colour map" in str(e.value) and "createTrainIdLabelImgs" in str(e.value)


def test_truncated_corrupt_and_missing_files_are_named(tmp_path):
  write_cityscapes(tmp_path, per_city=3)
  truncated = _image_path(tmp_path, k=0)  # the header (size) is intact, pixel data cut
  with open(truncated, "rb") as f:
    data = f.read()
  with open(truncated, "wb") as f:
    f.write(data[:len(data) // 2])
  empty_label = _label_path(tmp_path, k=1)
  open(empty_label, "wb").close()
  garbage = _image_path(tmp_path, k=2)
  with open(garbage, "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
  ds = get_dataset("cityscapes", root=tmp_path, split="val")  # headers that fail are left to load
  # Index order: aachen 0..2, then zurich 0..2.
  for index, path, what in ((3, truncated, "truncated"), (4, empty_label, "empty"),
                            (5, garbage, "not an image|corrupt")):
    with pytest.raises(DataFileError, match=what) as e:
      ds.get(np.array([index]), {})
    assert e.value.path == path and str(e.value).startswith(path)
  assert [e.path for e in ds.verify()] == [truncated, empty_label, garbage]
  os.remove(_image_path(tmp_path, k=1))  # removed after the scan
  with pytest.raises(DataFileError, match="no such file"):
    ds.get(np.array([4]), {})


def test_label_and_image_sizes_must_match(tmp_path):
  write_cityscapes(tmp_path)
  Image.fromarray(np.zeros((H + 1, W), np.uint8)).save(_label_path(tmp_path, "train"))
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=4)
  with pytest.raises(DataFileError, match=f"is {W}x{H + 1}, its image") as e:
    ds.get(np.arange(4), ds.draw(np.random.default_rng(0), 4))
  assert e.value.path == _label_path(tmp_path, "train")
  assert [e.path for e in ds.verify()] == [_label_path(tmp_path, "train")]


def test_eval_images_of_several_sizes_are_refused_at_construction(tmp_path):
  write_cityscapes(tmp_path)
  for split in ("val", "train"):
    Image.fromarray(np.zeros((8, 12, 3), np.uint8)).save(_image_path(tmp_path, split))
    Image.fromarray(np.zeros((8, 12), np.uint8)).save(_label_path(tmp_path, split))
  with pytest.raises(ValueError) as e:
    get_dataset("cityscapes", root=tmp_path, split="val")
  message = str(e.value)
  assert "10x6: 3 files" in message and "12x8: 1 file" in message
  assert "zurich_000001_000019_leftImg8bit.png" in message  # the odd one
  assert "aachen_000000_000019_leftImg8bit.png" in message  # an example of the others
  with pytest.raises(ValueError, match="sizes"):
    get_dataset("cityscapes", root=tmp_path, split="train", augment=False)
  # Training crops are padded to crop_size: mixed sizes are fine there.
  ds = get_dataset("cityscapes", root=tmp_path, split="train", crop_size=4)
  assert ds.get(np.arange(4), ds.draw(np.random.default_rng(0), 4))["image"].shape == (4, 4, 4, 3)


def test_manifest_lists_image_and_label_of_each_example(tmp_path):
  write_cityscapes(tmp_path)
  ds = get_dataset("cityscapes", root=tmp_path, split="val")
  assert ds.manifest() == [
      f"{top}/val/{city}/{city}_{k:06d}_000019_{suffix}"
      for city in ("aachen", "zurich") for k in (0, 1)
      for top, suffix in (("leftImg8bit", "leftImg8bit.png"),
                          ("gtFine", "gtFine_labelTrainIds.png"))]
  assert ds.verify() == []


# ----------------------------------------------------------------------------- speed (issue 33)

def test_resize_window_is_pils_full_resize_then_crop():
  rng = np.random.default_rng(0)
  assert cityscapes._window_resize_is_exact()
  for _ in range(300):
    src_w, src_h = (int(x) for x in rng.integers(2, 70, 2))
    scale = rng.uniform(0.3, 3.0)
    width, height = max(int(src_w * scale + 0.5), 1), max(int(src_h * scale + 0.5), 1)
    if rng.random() < 0.2:  # one axis unchanged, one portrait image scaled down
      width, height = (src_w, height) if rng.random() < 0.5 else (width, src_h)
    crop_h, crop_w = (int(x) for x in rng.integers(1, 40, 2))
    top = int(rng.integers(0, max(height - crop_h, 0) + 1))
    left = int(rng.integers(0, max(width - crop_w, 0) + 1))
    image = Image.fromarray(rng.integers(0, 256, (src_h, src_w, 3), dtype=np.uint8))
    full = np.asarray(image.resize((width, height), Image.BILINEAR))
    args = (image, height, width, top, left, crop_h, crop_w)
    want = full[top:top + crop_h, left:left + crop_w]
    np.testing.assert_array_equal(cityscapes.resize_window(*args), want, err_msg=str(args[1:]))
    # The pass-by-pass route itself wherever Pillow resizes horizontally first (13: unless
    # src_h - height > max(0, 2 (src_w - width))), also where the full resize is taken.
    if not src_h - height > max(0, 2 * (src_w - width)):
      np.testing.assert_array_equal(cityscapes._resize_window_by_passes(*args), want,
                                    err_msg=str(args[1:]))


def test_resize_window_computes_the_window_not_the_image(monkeypatch):
  """A 769 crop of a 2048 x 1024 image scaled by 2 (Cityscapes' largest training scale) takes the
  window route (the passes over the window only); a window over half the image takes the full
  resize. (Speed: benchmarks/data_bench.py.)"""
  image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1024, 2048, 3), np.uint8))
  calls = []
  by_passes = cityscapes._resize_window_by_passes  # pylint: disable=protected-access

  def recorded(*args):
    calls.append(args[1:])
    return by_passes(*args)
  monkeypatch.setattr(cityscapes, "_resize_window_by_passes", recorded)
  cityscapes.resize_window(image, 2048, 4096, 900, 1700, 769, 769)
  assert calls == [(2048, 4096, 900, 1700, 769, 769)]
  cityscapes.resize_window(image, 1024, 1536, 100, 100, 900, 1400)
  assert len(calls) == 1
