"""Tests for jlp.data.cityscapes on tiny PNG image / trainId pairs.

References: the arrays the test writes (PNG is lossless), explicit PIL resizes
for the rescaled cases, and per-element np.float32 normalisation.
"""

import os

import numpy as np
import pytest
from PIL import Image

from jlp.data import get_dataset
from references import imagenet_normalized

H, W = 6, 10


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


def test_train_crop_pads_with_ignore_and_flips_image_and_label_together(tmp_path):
  write_cityscapes(tmp_path)
  # Scale 1 and a crop larger than the image: the whole image, padded at bottom/right.
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=(8, 12), scale_range=(1.0, 1.0))
  assert ds.augment and ds.image_shape == (8, 12, 3) and ds.label_shape == (8, 12)
  params = ds.draw(np.random.default_rng(0), 4)
  params["flip"] = np.array([False, True, False, True])
  batch = ds.get(np.arange(4), params)
  eval_ds = get_dataset("cityscapes", root=tmp_path, split="train", augment=False)
  plain = eval_ds.get(np.arange(4), {})
  for i in range(4):
    image = np.zeros((8, 12, 3), np.float32) + imagenet_normalized(np.zeros((1, 1, 3), np.uint8))
    image[:H, :W] = plain["image"][i]
    label = np.full((8, 12), 255)
    label[:H, :W] = plain["label"][i]
    if params["flip"][i]:
      image, label = image[:, ::-1], label[:, ::-1]
    np.testing.assert_array_equal(batch["image"][i], image)
    np.testing.assert_array_equal(batch["label"][i], label)


def test_train_rescale_and_crop_window(tmp_path):
  write_cityscapes(tmp_path)
  ds = get_dataset("cityscapes", root=tmp_path, crop_size=4, scale_range=(2.0, 2.0))
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
