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


# -- bad files (issue 33 §1) -----------------------------------------------------------------------


def _jpeg_bytes(h=12, w=16, seed=0):
  import io
  buf = io.BytesIO()
  Image.fromarray(_image(np.random.default_rng(seed), h, w)).save(buf, format="JPEG", quality=95)
  return buf.getvalue()


def _small_tree(root, files):
  """train/ and val/ with class folders; `files`: {relative path: bytes or None (a valid JPEG)}."""
  for rel, data in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_jpeg_bytes() if data is None else data)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_bad_files_raise_data_file_error_naming_the_file(tmp_path, monkeypatch):
  from jlp.data import DataFileError
  from jlp.data.imagenet import decode_rgb
  good = _jpeg_bytes()
  cases = {
      "half.JPEG": (good[:len(good) // 2], "truncated"),
      "zero.JPEG": (b"", "empty"),
      "noise.JPEG": (bytes(range(256)) * 4, "not an image"),
      "._apple.JPEG": (b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ", "AppleDouble"),
  }
  for name, (data, what) in cases.items():
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataFileError) as e:
      decode_rgb(str(path))
    assert e.value.path == str(path) and str(e.value).startswith(f"{path}: "), str(e.value)
    assert what in str(e.value), str(e.value)
  big = tmp_path / "big.JPEG"
  big.write_bytes(good)  # 12 x 16 = 192 pixels
  for limit in (100, 150):  # PIL raises DecompressionBombError above 2x, warns above 1x
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(DataFileError, match=f"big.JPEG: .*(16x12|192).*MAX_IMAGE_PIXELS"):
      decode_rgb(str(big))
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 192)
  assert decode_rgb(str(big)).size == (16, 12)


def test_a_bad_file_in_a_batch_and_verify_lists_every_bad_file(tmp_path):
  from jlp.data import DataFileError
  good = _jpeg_bytes()
  _small_tree(tmp_path, {"train/a/1.JPEG": None, "train/a/2.JPEG": good[:len(good) // 2],
                         "train/b/3.JPEG": None, "train/b/4.JPEG": b"",
                         "val/a/5.JPEG": None, "val/b/6.JPEG": None})
  ds = get_dataset("imagenet", root=tmp_path, split="train", crop_size=8, resize_size=8)
  assert ds.size == 4
  with pytest.raises(DataFileError, match="2.JPEG: truncated"):
    ds.get(np.arange(4), ds.draw(np.random.default_rng(0), 4))
  bad = ds.verify()
  assert [os.path.basename(e.path) for e in bad] == ["2.JPEG", "4.JPEG"]
  assert all(isinstance(e, DataFileError) for e in bad)
  assert get_dataset("imagenet", root=tmp_path, split="val", crop_size=8,
                     resize_size=8).verify() == []


def test_manifest_is_the_files_in_index_order_relative_to_root(tmp_path):
  _small_tree(tmp_path, {"train/b/x.jpg": None, "train/a/sub/y.png": None, "train/a/z.JPEG": None,
                         "val/a/v.JPEG": None})
  ds = get_dataset("imagenet", root=tmp_path, split="train", crop_size=8, resize_size=8)
  assert ds.manifest() == ["train/a/z.JPEG", "train/a/sub/y.png", "train/b/x.jpg"]
  val = get_dataset("imagenet", root=tmp_path, split="val", crop_size=8, resize_size=8)
  assert val.manifest() == ["val/a/v.JPEG"]


# -- torchvision's ImageFolder rules (issue 33 §3) -------------------------------------------------

#: torchvision.datasets.folder.IMG_EXTENSIONS, as its documentation lists them.
TORCHVISION_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def torchvision_image_folder(directory):
  """(classes, [(path, label)]) by torchvision's documented ImageFolder rules, written out:
  find_classes = sorted folder names (os.scandir, is_dir); make_dataset = for each class in
  sorted order, sorted(os.walk(class folder, followlinks=True)), files sorted within a folder,
  kept when their lower-cased name ends with an IMG_EXTENSIONS entry; a class without a file is
  a FileNotFoundError."""
  classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
  class_to_idx = {name: i for i, name in enumerate(classes)}
  samples, found = [], set()
  for target in sorted(class_to_idx):
    for root, _, fnames in sorted(os.walk(os.path.join(directory, target), followlinks=True)):
      for fname in sorted(fnames):
        if fname.lower().endswith(TORCHVISION_EXTENSIONS):
          samples.append((os.path.join(root, fname), class_to_idx[target]))
          found.add(target)
  if set(classes) - found:
    raise FileNotFoundError(sorted(set(classes) - found))
  return classes, samples


def _rule_tree(root):
  """A tree exercising the rules: subfolders (nested, a name sorting around "/"), every extension
  in mixed case, files that are not images, a symlinked subfolder."""
  files = {
      "train/cat/b.JPG": None, "train/cat/a.jpeg": None, "train/cat/sub/c.Png": None,
      "train/cat/sub-2/d.tif": None, "train/cat/sub/deeper/e.TIFF": None,
      "train/cat/notes.txt": b"x", "train/cat/f.webp": None, "train/Dog/g.bmp": None,
      "train/Dog/h.PGM": None, "train/Dog/i.ppm": None, "train/Dog/j.gif": None,
      "train/ant/k.jpg": None,
      "val/cat/v1.jpg": None, "val/ant/v2.jpg": None, "val/Dog/x/v3.jpg": None,
  }
  for rel, data in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if data is not None:
      path.write_bytes(data)
      continue
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".tif": "TIFF", ".tiff": "TIFF",
           ".webp": "WEBP", ".bmp": "BMP", ".pgm": "PPM", ".ppm": "PPM",
           ".gif": "GIF"}[path.suffix.lower()]
    pixels = _image(np.random.default_rng(len(rel)), 6, 7)
    image = Image.fromarray(pixels[..., 0] if path.suffix.lower() == ".pgm" else pixels)
    image.save(path, format=fmt)
  (root / "extra").mkdir()
  Image.fromarray(_image(np.random.default_rng(9), 6, 7)).save(root / "extra" / "l.png")
  os.symlink(root / "extra", root / "train" / "ant" / "linked")


@pytest.mark.parametrize("split", ["train", "val"])
def test_files_and_labels_are_torchvisions(tmp_path, split):
  _rule_tree(tmp_path)
  ds = get_dataset("imagenet", root=tmp_path, split=split, crop_size=4, resize_size=4)
  classes, samples = torchvision_image_folder(tmp_path / "train")
  assert ds.classes == classes == ["Dog", "ant", "cat"]
  if split == "val":  # torchvision would index val's own folders; jlp uses train's (the same here)
    _, samples = torchvision_image_folder(tmp_path / "val")
  assert list(zip(ds.paths, ds.labels.tolist())) == [(str(p), l) for p, l in samples]
  if split == "train":
    assert ds.size == 11  # .gif and .txt are not images
    # folders by sorted path: sub < sub-2 < sub/deeper ("-" sorts before "/"), not depth first
    assert [os.path.relpath(p, tmp_path / "train/cat") for p in ds.paths[-6:]] == [
        "a.jpeg", "b.JPG", "f.webp", "sub/c.Png", "sub-2/d.tif", "sub/deeper/e.TIFF"]
    batch = ds.get(np.arange(ds.size), {})  # every extension decodes (.pgm: grey -> RGB)
    assert batch["image"].shape == (11, 4, 4, 3)


def test_hidden_entries_are_skipped_and_labels_are_torchvisions_without_them(tmp_path):
  import shutil
  _rule_tree(tmp_path)
  clean = tmp_path / "clean"
  shutil.copytree(tmp_path / "train", clean, symlinks=True)
  hidden = {"train/.ipynb_checkpoints/x-checkpoint.jpg": None, "train/cat/._b.JPG": b"\x00\x05",
            "train/cat/.hidden.png": None, "train/cat/sub/.cache/y.jpg": None,
            "train/.DS_Store": b"\x00", "val/.ipynb_checkpoints/z.jpg": None,
            "val/cat/._v1.jpg": b"\x00\x05"}
  _small_tree(tmp_path, hidden)
  ds = get_dataset("imagenet", root=tmp_path, split="train", crop_size=4, resize_size=4)
  classes, samples = torchvision_image_folder(clean)
  assert ds.classes == classes and ds.num_classes == 3
  rel = [(os.path.relpath(p, tmp_path / "train"), l) for p, l in zip(ds.paths, ds.labels.tolist())]
  assert rel == [(os.path.relpath(p, clean), l) for p, l in samples]
  val = get_dataset("imagenet", root=tmp_path, split="val", crop_size=4, resize_size=4)
  assert [os.path.basename(p) for p in val.paths] == ["v3.jpg", "v2.jpg", "v1.jpg"]
  assert val.verify() == []


def test_a_class_folder_without_images_is_an_error_naming_it(tmp_path):
  _small_tree(tmp_path, {"train/a/1.jpg": None, "train/b/notes.txt": b"x",
                         "train/c/._2.jpg": b"\x00", "val/a/3.jpg": None})
  (tmp_path / "train" / "d" / "sub").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match=r"no image files .* class folders 'b', 'c', 'd'"):
    get_dataset("imagenet", root=tmp_path, split="train")
  (tmp_path / "val" / "b").mkdir()
  with pytest.raises(FileNotFoundError, match=r"class folders 'b' of"):
    get_dataset("imagenet", root=tmp_path, split="val")


# -- errors that say what to do (issue 33 §4) ------------------------------------------------------


def test_imagenets_flat_val_folder_says_how_to_sort_it(tmp_path):
  _small_tree(tmp_path, {"train/n01/1.JPEG": None, "train/n02/2.JPEG": None,
                         "val/ILSVRC2012_val_00000001.JPEG": None,
                         "val/ILSVRC2012_val_00000002.JPEG": None})
  assert get_dataset("imagenet", root=tmp_path, split="train").size == 2
  with pytest.raises(ValueError) as e:
    get_dataset("imagenet", root=tmp_path, split="val")
  message = str(e.value)
  assert "holds 2 image files directly" in message and "one folder per class" in message
  assert "ILSVRC2012_validation_ground_truth.txt" in message and "valprep.sh" in message
  (tmp_path / "val" / "n01").mkdir()
  (tmp_path / "val" / "ILSVRC2012_val_00000001.JPEG").rename(
      tmp_path / "val" / "n01" / "ILSVRC2012_val_00000001.JPEG")
  with pytest.raises(ValueError, match="1 image files outside the class folders"):
    get_dataset("imagenet", root=tmp_path, split="val")
