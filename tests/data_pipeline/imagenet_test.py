"""Tests for jlp.data.imagenet on tiny JPEG / PNG files in class-folder layout.

References: the files as Pillow decodes them in the test, cropped and resized
with explicit PIL calls (torchvision's Resize / CenterCrop / RandomResizedCrop
arithmetic written out), and per-element np.float32 normalisation.
"""

import os

import numpy as np
import pytest
from PIL import Image

from jlp.data import get_dataset
from references import imagenet_normalized

CLASSES = ["n02", "n01", "n03"]  # written unsorted; labels follow the sorted names


def _image(rng, h, w):
  return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def write_imagenet(root, sizes=((12, 16), (16, 12), (10, 10)), seed=0):
  """Two images per class in train/ and one in val/; returns {path: label}."""
  rng = np.random.default_rng(seed)
  labels = {}
  for split, per_class in (("train", 2), ("val", 1)):
    for name in CLASSES:
      os.makedirs(os.path.join(root, split, name))
      for k in range(per_class):
        h, w = sizes[(k + len(name)) % len(sizes)]
        path = os.path.join(root, split, name, f"{name}_{k}.JPEG")
        Image.fromarray(_image(rng, h, w)).save(path, format="JPEG", quality=95)
        labels[path] = sorted(CLASSES).index(name)
  # Files that are not images are skipped; a PNG counts.
  with open(os.path.join(root, "train", "n01", "notes.txt"), "w") as f:
    f.write("x")
  path = os.path.join(root, "train", "n03", "n03_9.png")
  Image.fromarray(_image(rng, 9, 9)).save(path)
  labels[path] = 2
  return labels


def test_files_and_labels_follow_sorted_classes(tmp_path):
  labels = write_imagenet(tmp_path)
  ds = get_dataset("imagenet", root=tmp_path, split="train", crop_size=8, resize_size=8)
  assert ds.classes == ["n01", "n02", "n03"] and ds.num_classes == 3
  assert ds.size == 7 and ds.image_shape == (8, 8, 3) and ds.augment
  assert ds.paths == sorted(ds.paths)  # class order, then file order
  np.testing.assert_array_equal(ds.labels, [labels[p] for p in ds.paths])
  val = get_dataset("imagenet", root=tmp_path, split="eval", crop_size=8, resize_size=8)
  assert val.split == "val" and val.size == 3 and not val.augment
  np.testing.assert_array_equal(val.labels, [0, 1, 2])


def test_eval_transform_is_resize_shorter_side_then_center_crop(tmp_path):
  write_imagenet(tmp_path)
  ds = get_dataset("imagenet", root=tmp_path, split="train", augment=False, crop_size=6,
                   resize_size=8)
  batch = ds.get(np.arange(ds.size), {})
  assert batch["image"].shape == (ds.size, 6, 6, 3) and batch["image"].dtype == np.float32
  for i, path in enumerate(ds.paths):
    image = Image.open(path).convert("RGB")
    w, h = image.size
    if w <= h:
      nw, nh = 8, int(8 * h / w)
    else:
      nh, nw = 8, int(8 * w / h)
    if (nw, nh) != (w, h):
      image = image.resize((nw, nh), Image.BILINEAR)
    top, left = int(round((nh - 6) / 2.0)), int(round((nw - 6) / 2.0))
    expect = np.asarray(image)[top:top + 6, left:left + 6]
    np.testing.assert_array_equal(batch["image"][i], imagenet_normalized(expect))
    assert batch["label"][i] == ds.labels[i]


def test_eval_at_native_size_returns_the_decoded_pixels(tmp_path):
  write_imagenet(tmp_path, sizes=((10, 10),))
  ds = get_dataset("imagenet", root=tmp_path, split="val", crop_size=10, resize_size=10)
  batch = ds.get(np.array([1]), {})
  expect = np.asarray(Image.open(ds.paths[1]).convert("RGB"))
  np.testing.assert_array_equal(batch["image"][0], imagenet_normalized(expect))


def test_train_transform_is_random_resized_crop_and_flip(tmp_path):
  write_imagenet(tmp_path)
  ds = get_dataset("imagenet", root=tmp_path, split="train", crop_size=5, resize_size=6)
  params = ds.draw(np.random.default_rng(0), ds.size)
  assert params["resized_crop"].shape == (ds.size, 10, 4) and params["flip"].shape == (ds.size,)
  batch = ds.get(np.arange(ds.size), params)
  assert batch["image"].shape == (ds.size, 5, 5, 3)
  from jlp.data import augment  # the box arithmetic is tested against torchvision in augment_test
  for i, path in enumerate(ds.paths):
    image = Image.open(path).convert("RGB")
    top, left, h, w = augment.resized_crop_box(params["resized_crop"][i], image.size[1],
                                               image.size[0])
    expect = np.asarray(image.crop((left, top, left + w, top + h)).resize((5, 5), Image.BILINEAR))
    if params["flip"][i]:
      expect = expect[:, ::-1]
    np.testing.assert_array_equal(batch["image"][i], imagenet_normalized(expect))
  same = ds.get(np.arange(ds.size), ds.draw(np.random.default_rng(0), ds.size))
  other = ds.get(np.arange(ds.size), ds.draw(np.random.default_rng(1), ds.size))
  np.testing.assert_array_equal(same["image"], batch["image"])
  assert not np.array_equal(other["image"], batch["image"])


def test_missing_and_malformed_folders_show_the_layout(tmp_path):
  with pytest.raises(FileNotFoundError) as e:
    get_dataset("imagenet", root=tmp_path)
  assert "train/" in str(e.value) and "val/" in str(e.value) and ".JPEG" in str(e.value)
  (tmp_path / "train").mkdir()
  (tmp_path / "val").mkdir()
  with pytest.raises(FileNotFoundError, match="no class folders"):
    get_dataset("imagenet", root=tmp_path)
  (tmp_path / "train" / "n01").mkdir()
  with pytest.raises(FileNotFoundError, match="no image files"):
    get_dataset("imagenet", root=tmp_path)
  (tmp_path / "val" / "n99").mkdir()
  with pytest.raises(ValueError, match="n99"):
    get_dataset("imagenet", root=tmp_path, split="val")


def test_bad_sizes_are_rejected(tmp_path):
  with pytest.raises(ValueError, match="resize_size=4"):
    get_dataset("imagenet", root=tmp_path, crop_size=8, resize_size=4)
  with pytest.raises(ValueError, match="crop_size=0"):
    get_dataset("imagenet", root=tmp_path, crop_size=0)
