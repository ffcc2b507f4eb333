r"""Input pipeline throughput: ImageNet-style and Cityscapes training batches through
jlp.data.Pipeline, against a plain one-thread PIL loop and today's code, in the same run.

Run: python -m benchmarks.data_bench [--workers=N] [--repeats=5] [--sections=imagenet,cityscapes]

The data are synthetic and written by the bench to a temporary folder (nothing is
downloaded): --images JPEGs in ImageNet's class-folder layout at ImageNet's common
sizes (500x375, 375x500, 500x333, 333x500, 500x500, 500x400; photo-like content,
quality 90, about 100 KB each: ImageNet's mean is about 110 KB), and
--cityscapes_images 2048x1024 image / trainId label PNG pairs.

ImageNet-style: the seeds' training transform (decode, RandomResizedCrop 224 with
bilinear resize, horizontal flip, ToTensor + Normalize), --batch images per step.
  loop:        a plain one-thread loop: PIL open + convert("RGB"), crop, resize,
               np.asarray, flip, normalise each image, np.stack; the same examples
               and crop / flip draws as the pipeline (its batch is checked to be
               bit-identical to the pipeline's).
  today:       the pipeline at --baseline_commit (git show of jlp/data/{augment,
               dataset,imagenet,cityscapes,pipeline}.py, imported as a separate
               package): Pipeline.prefetch, Pillow decode on the dataset's 8 threads in
               the calling process.
  threads:     this tree's Pipeline.prefetch with worker_processes=0 (the dataset's
               threads in the calling process).
  workers=N:   this tree's Pipeline.prefetch with worker_processes=N (Grain).
Cityscapes: configs/cpd_fcn_cityscapes.py's training transform (crop 769,
cat_max_ratio 0.75, flip, photometric on / off, Normalize, pad), batch 8: today,
threads, workers=N.

Each measurement consumes --steps batches (Cityscapes: --cityscapes_steps) and
reports images/s over the batches after the first --skip (start-up: worker
processes, first decodes, excluded; reported as "start s"). The variants run in
turn, --repeats times, rotating their order; the table shows medians, and the
ratios are of the medians. Run it on a quiet machine (uptime's load below ~1.5).
"""

from __future__ import annotations

import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags
from PIL import Image

from jlp.data import Pipeline, augment, get_dataset, jpeg

_SECTIONS = flags.DEFINE_list("sections", ["imagenet", "cityscapes"], "imagenet, cityscapes.")
_WORKERS = flags.DEFINE_integer("workers", os.cpu_count() or 1,
                                "Pipeline worker_processes (default: the CPU count).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "rounds over the variants; medians reported.")
_IMAGES = flags.DEFINE_integer("images", 512, "synthetic ImageNet-style JPEGs.")
_BATCH = flags.DEFINE_integer("batch", 64, "ImageNet-style images per step.")
_STEPS = flags.DEFINE_integer("steps", 30, "ImageNet-style batches per measurement.")
_SKIP = flags.DEFINE_integer("skip", 6, "first batches of a measurement left out of the rate.")
_CS_IMAGES = flags.DEFINE_integer("cityscapes_images", 16, "synthetic Cityscapes pairs.")
_CS_STEPS = flags.DEFINE_integer("cityscapes_steps", 14, "Cityscapes batches (of 8) per measurement.")
_CS_SKIP = flags.DEFINE_integer("cityscapes_skip", 6, "first Cityscapes batches left out of the rate.")
_BASELINE = flags.DEFINE_string(
    "baseline_commit", "8bf2ec0",
    "git commit whose jlp/data is 'today' (before issue 33); empty: no today column.")
_TODAY_CITYSCAPES = 8.8  # images/s with photometric, issue 33 (the same config, this machine)

IMAGENET_SIZES = ((375, 500), (500, 375), (333, 500), (500, 333), (500, 500), (400, 500))


# ----------------------------------------------------------------------------- synthetic data

def _photo(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
  """Photo-like uint8 RGB: smooth colour fields, a few blobs, sensor-like noise."""
  y, x = np.mgrid[0:h, 0:w].astype(np.float32)
  img = np.empty((h, w, 3), np.float32)
  for c in range(3):
    a, b, f = rng.uniform(-0.6, 0.6), rng.uniform(-0.6, 0.6), rng.uniform(0.005, 0.03)
    img[..., c] = 128 + 60 * np.sin(f * (a * x + b * y) + rng.uniform(0, 6.3))
  for _ in range(6):
    cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(20, 120)
    mask = (y - cy) ** 2 + (x - cx) ** 2 < r * r
    img[mask] = img[mask] * 0.4 + rng.uniform(0, 255, 3) * 0.6
  img += rng.normal(0, 18, img.shape)
  return np.clip(img, 0, 255).astype(np.uint8)


def write_imagenet(root: str, n: int, seed: int = 0) -> None:
  rng = np.random.default_rng(seed)
  for i in range(n):
    folder = os.path.join(root, "train", f"n{i % 10:08d}")
    os.makedirs(folder, exist_ok=True)
    h, w = IMAGENET_SIZES[i % len(IMAGENET_SIZES)]
    Image.fromarray(_photo(rng, h, w)).save(os.path.join(folder, f"img_{i:05d}.JPEG"),
                                            "JPEG", quality=90)
  os.makedirs(os.path.join(root, "val", "n00000000"), exist_ok=True)


def write_cityscapes(root: str, n: int, seed: int = 0) -> None:
  """Street-like 2048x1024 images (sky, buildings, road, cars) and their trainId maps."""
  rng = np.random.default_rng(seed)
  h, w = 1024, 2048
  for split in ("train", "val"):
    os.makedirs(os.path.join(root, "leftImg8bit", split, "bench"), exist_ok=True)
    os.makedirs(os.path.join(root, "gtFine", split, "bench"), exist_ok=True)
  y = np.arange(h)[:, None]
  for i in range(n):
    image = np.empty((h, w, 3), np.float32)
    label = np.full((h, w), 255, np.uint8)
    horizon = int(rng.uniform(300, 500))
    image[:horizon] = [110, 150, 210]
    label[:horizon] = 10  # sky
    image[horizon:] = [90, 90, 95]
    label[horizon:] = 0  # road
    for _ in range(12):  # buildings and vegetation
      x0, x1 = sorted(rng.integers(0, w, 2))
      top = int(rng.uniform(50, horizon))
      cls = int(rng.choice([2, 8]))
      image[top:horizon + 100, x0:x1] = rng.uniform(40, 200, 3)
      label[top:horizon + 100, x0:x1] = cls
    for _ in range(8):  # cars
      x0 = int(rng.uniform(0, w - 300))
      y0 = int(rng.uniform(horizon + 50, h - 150))
      image[y0:y0 + 120, x0:x0 + 260] = rng.uniform(0, 255, 3)
      label[y0:y0 + 120, x0:x0 + 260] = 13
    image += 20 * np.sin(y / 37.0)[..., None] + rng.normal(0, 6, image.shape)
    prefix = f"bench_{i:06d}_000019"
    for split in ("train",) + (("val",) if i == 0 else ()):
      Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(
          os.path.join(root, "leftImg8bit", split, "bench", prefix + "_leftImg8bit.png"))
      Image.fromarray(label, "L").save(
          os.path.join(root, "gtFine", split, "bench", prefix + "_gtFine_labelTrainIds.png"))


# ----------------------------------------------------------------------------- today's code

def load_baseline(commit: str, where: str):
  """jlp/data's augment, dataset, imagenet, cityscapes and pipeline at `commit`, as the package
  `jlp_data_<commit>` (imports of jlp.data rewritten to it); None without git or the commit."""
  package = f"jlp_data_{re.sub(r'[^0-9A-Za-z]', '_', commit)}"
  folder = os.path.join(where, package)
  os.makedirs(folder, exist_ok=True)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for name in ("augment", "dataset", "imagenet", "cityscapes", "pipeline"):
    try:
      source = subprocess.run(["git", "-C", repo, "show", f"{commit}:jlp/data/{name}.py"],
                              check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
      return None
    source = re.sub(r"from jlp\.data import ", f"from {package} import ", source)
    source = re.sub(r"from jlp\.data\.(\w+) import ", rf"from {package}.\1 import ", source)
    with open(os.path.join(folder, f"{name}.py"), "w") as f:
      f.write(source)
  open(os.path.join(folder, "__init__.py"), "w").close()
  sys.path.insert(0, where)
  for name in ("imagenet", "cityscapes", "pipeline"):
    importlib.import_module(f"{package}.{name}")
  return importlib.import_module(package)


# ----------------------------------------------------------------------------- measuring

def measure(make_iterator, steps: int, batch: int, skip: int) -> tuple[float, float]:
  """(start-up seconds to the first batch, images/s over the batches after the first skip)."""
  t0 = time.perf_counter()
  it = make_iterator()
  try:
    next(it)
    t_first = time.perf_counter()
    t_skip = t_first
    for k in range(1, steps):
      next(it)
      if k == skip - 1:
        t_skip = time.perf_counter()
    t_end = time.perf_counter()
  finally:
    close = getattr(it, "close", None)
    if close is not None:
      close()
  measured = steps - max(skip, 1)
  return t_first - t0, measured * batch / (t_end - t_skip)


def plain_loop(pipe: Pipeline, start: int, steps: int):
  """The seeds' ImageNet training transform in one thread with PIL, as torchvision runs it:
  per image open / convert / crop / resize / flip / normalise, then stack."""
  ds = pipe.dataset
  mean, std = ds.normalization.mean, ds.normalization.std
  c = ds.crop_size
  for step in range(start, start + steps):
    idx, _ = pipe.sampler.indices(step)
    params = ds.draw(np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [pipe.seed, 1, step]))), pipe.global_batch_size)
    images = []
    for i, index in enumerate(idx.tolist()):
      with Image.open(ds.paths[index]) as f:
        image = f.convert("RGB")
      width, height = image.size
      top, left, h, w = augment.resized_crop_box(params["resized_crop"][i], height, width,
                                                 ds.scale, ds.ratio)
      x = np.asarray(image.crop((left, top, left + w, top + h)).resize((c, c), Image.BILINEAR))
      if params["flip"][i]:
        x = x[:, ::-1]
      images.append(augment.normalize(x, mean, std))
    yield {"image": np.stack(images), "label": ds.labels[idx]}


def run_variants(variants: dict, steps: int, batch: int, skip: int, repeats: int) -> dict:
  """{name: (median start-up s, median images/s, all rates)}, variants rotated each round."""
  names = list(variants)
  starts = {n: [] for n in names}
  rates = {n: [] for n in names}
  for r in range(repeats):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      start, rate = measure(variants[name], steps, batch, skip)
      starts[name].append(start)
      rates[name].append(rate)
    print(f"  round {r}: " + "  ".join(f"{n} {rates[n][-1]:.1f}" for n in names), flush=True)
  return {n: (statistics.median(starts[n]), statistics.median(rates[n]), rates[n]) for n in names}


def table(results: dict, base: str, unit: str = "img/s") -> None:
  header = f"  {'variant':22s} {'median ' + unit:>14s} {'min':>8s} {'max':>8s} {'start s':>8s} {'x ' + base:>10s}"
  print(header)
  print("  " + "-" * (len(header) - 2))
  ref = results[base][1]
  for name, (start, rate, all_rates) in results.items():
    print(f"  {name:22s} {rate:14.1f} {min(all_rates):8.1f} {max(all_rates):8.1f} {start:8.2f} "
          f"{rate / ref:10.2f}")


# ----------------------------------------------------------------------------- sections

def imagenet_section(tmp: str, baseline) -> dict:
  root = os.path.join(tmp, "imagenet")
  t0 = time.perf_counter()
  write_imagenet(root, _IMAGES.value)
  sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs]
  print(f"ImageNet-style: {len(sizes)} JPEGs, mean {np.mean(sizes) / 1e3:.0f} KB, written in "
        f"{time.perf_counter() - t0:.1f} s; batch {_BATCH.value}, crop 224; simplejpeg "
        f"{'on' if jpeg.available() else 'off (not installed)'}")
  b, w = _BATCH.value, _WORKERS.value
  ds = get_dataset("imagenet", root=root, split="train")
  pipe = Pipeline(ds, b, seed=0, process_index=0, process_count=1)
  workers = Pipeline(ds, b, seed=0, process_index=0, process_count=1, worker_processes=w)
  # The same work: the loop's batch is the pipeline's, bit for bit.
  reference = next(plain_loop(pipe, 5, 1))
  got = pipe.batch(5)
  np.testing.assert_array_equal(reference["image"], got["image"])
  np.testing.assert_array_equal(reference["label"], got["label"])
  variants = {"loop (1 thread, PIL)": lambda: plain_loop(pipe, 0, _STEPS.value)}
  if baseline is not None:
    old_ds = baseline.imagenet.ImageFolderDataset(root, "train")
    old = baseline.pipeline.Pipeline(old_ds, b, seed=0, process_index=0, process_count=1)
    np.testing.assert_array_equal(old.batch(5)["image"], got["image"])
    variants["today"] = lambda: old.prefetch(0, _STEPS.value)
  variants["threads (workers=0)"] = lambda: pipe.prefetch(0, _STEPS.value)
  variants[f"workers={w}"] = lambda: workers.prefetch(0, _STEPS.value)
  results = run_variants(variants, _STEPS.value, b, _SKIP.value, _REPEATS.value)
  print()
  table(results, "loop (1 thread, PIL)")
  return results


def cityscapes_section(tmp: str, baseline) -> dict:
  root = os.path.join(tmp, "cityscapes")
  t0 = time.perf_counter()
  write_cityscapes(root, _CS_IMAGES.value)
  sizes = [os.path.getsize(os.path.join(d, f))
           for d, _, fs in os.walk(os.path.join(root, "leftImg8bit", "train")) for f in fs]
  print(f"Cityscapes: {_CS_IMAGES.value} 2048x1024 image / label PNG pairs (images "
        f"{np.mean(sizes) / 1e6:.1f} MB: Cityscapes' are about 2 MB), written in "
        f"{time.perf_counter() - t0:.1f} s; batch 8, crop 769, cat_max_ratio 0.75")
  b, w, steps = 8, _WORKERS.value, _CS_STEPS.value
  out = {}
  for photometric in (True, False):
    options = dict(crop_size=769, cat_max_ratio=0.75, photometric=photometric)
    ds = get_dataset("cityscapes", root=root, split="train", **options)
    pipe = Pipeline(ds, b, seed=0, process_index=0, process_count=1)
    workers = Pipeline(ds, b, seed=0, process_index=0, process_count=1, worker_processes=w)
    variants = {}
    if baseline is not None:
      old_ds = baseline.cityscapes.CityscapesDataset(root, "train", **options)
      old = baseline.pipeline.Pipeline(old_ds, b, seed=0, process_index=0, process_count=1)
      variants["today"] = lambda old=old: old.prefetch(0, steps)
    variants["threads (workers=0)"] = lambda pipe=pipe: pipe.prefetch(0, steps)
    variants[f"workers={w}"] = lambda workers=workers: workers.prefetch(0, steps)
    print(f"photometric={photometric}:")
    results = run_variants(variants, steps, b, _CS_SKIP.value, _REPEATS.value)
    print()
    table(results, "today" if baseline is not None else "threads (workers=0)")
    if photometric:
      rate = results[f"workers={w}"][1]
      print(f"  workers={w} against the issue's 8.8 img/s (today, photometric): "
            f"{rate / _TODAY_CITYSCAPES:.2f}x")
    print()
    out[photometric] = results
  return out


def main(argv):
  del argv
  load = os.getloadavg()[0]
  print(f"data_bench {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPUs, load average "
        f"{load:.2f}; workers={_WORKERS.value}, {_REPEATS.value} rounds")
  if load > 1.5:
    print("  warning: the machine is busy (load above 1.5); the numbers will be low and noisy")
  with tempfile.TemporaryDirectory(prefix="jlp_data_bench_") as tmp:
    baseline = load_baseline(_BASELINE.value, tmp) if _BASELINE.value else None
    if _BASELINE.value and baseline is None:
      print(f"  no git commit {_BASELINE.value!r}: no 'today' column")
    if "imagenet" in _SECTIONS.value:
      results = imagenet_section(tmp, baseline)
      rate = results[f"workers={_WORKERS.value}"][1]
      cores = os.cpu_count() or 1
      per_core = rate / cores
      print(f"\n  per core: {per_core:.0f} img/s (workers={_WORKERS.value} on {cores} cores, "
            "the consumer included)")
      for gpu, per_gpu in (("V100 (fp16)", 1400), ("A100 (bf16)", 2700), ("H100 (bf16)", 5000)):
        need = 8 * per_gpu
        print(f"  8 x {gpu} at ~{per_gpu} img/s each (ResNet-50, batch 8192 = 1024 per GPU: "
              f"{8192 / need:.2f} s/step) needs {need} img/s: ~{need / per_core:.0f} cores")
      print()
    if "cityscapes" in _SECTIONS.value:
      cityscapes_section(tmp, baseline)


if __name__ == "__main__":
  app.run(main)
