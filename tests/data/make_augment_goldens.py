"""Regenerates the OpenCV / mmsegmentation goldens of tests/data_pipeline/augment_test.py.

This script is a standalone tool, NOT part of the test suite (no test imports it; it needs
OpenCV, which the jlp venv does not have). The goldens are uint8 arrays stored in the test as hex
strings, each under a comment naming the call that made it:

  _RGB_TO_HSV          cv2.cvtColor(_golden_rgb_input(), cv2.COLOR_RGB2HSV)
  _HSV_TO_RGB          cv2.cvtColor(_golden_hsv_input(), cv2.COLOR_HSV2RGB)
  _HSV_TO_RGB_SCALAR   the same with the pixels one per row (width 1: OpenCV's scalar path)
  _PHOTOMETRIC_CASES   mmsegmentation's PhotoMetricDistortion.__call__ on _golden_rgb_input()
                       (as BGR, result turned back to RGB) with its random draws replaced by each
                       case's (brightness, contrast, contrast_first, saturation, hue)

The inputs (_golden_rgb_input, _golden_hsv_input and their edge colours) and the photometric
parameters are read from the test file itself (its source is parsed, not imported), so the two
cannot drift apart.

Versions: opencv-python 4.5.5 (the goldens were made with the 4.5.5.64 wheel, x86-64, whose HSV
code dispatches to AVX2; jlp.data.augment.hsv_to_rgb_u8 says how later wheels differ) with
numpy < 2 (4.5.5 wheels are built against numpy 1.x and do not import under numpy 2).
opencv-python-headless of the same version gives the same bytes. mmcv and mmsegmentation are
not needed: PhotoMetricDistortion below is mmsegmentation 0.x's (CPD uses v0.5.0, cpd.md §6.4;
read at upstream commits 0066ce88 / db54ce7b, as jlp.data.augment), transcribed line for line
with its `numpy.random` draws served from a script, and mmcv's bgr2hsv / hsv2bgr are
cv2.cvtColor(img, cv2.COLOR_BGR2HSV / COLOR_HSV2BGR) (mmcv/image/colorspace.py). With
`--mmseg` the script runs mmsegmentation 0.x's own class instead (needs mmsegmentation 0.x and
mmcv-full 1.x importable; its module-level `random` is swapped for the same scripted draws).

A throwaway venv (outside the repo; ~10 s from the local index):

    /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /tmp/cvvenv
    /tmp/cvvenv/bin/pip install opencv-python-headless==4.5.5.64 "numpy<2"

Running it from the repository root:

    /tmp/cvvenv/bin/python tests/data/make_augment_goldens.py          # compare with the test
    /tmp/cvvenv/bin/python tests/data/make_augment_goldens.py --print  # also print the source
    /tmp/cvvenv/bin/python tests/data/make_augment_goldens.py --write  # rewrite the test's goldens

Without --write it exits 1 when any generated golden differs from the stored one. The
comparison is of the test file's text: each generated block (hex lines wrapped as stored) must
appear in it verbatim.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import sys

import numpy as np

TEST = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                    "data_pipeline", "augment_test.py"))
INPUTS = ("_EDGE_RGB", "_EDGE_HSV", "_golden_rgb_input", "_golden_hsv_input")
GOLDENS = ("_RGB_TO_HSV", "_HSV_TO_RGB", "_HSV_TO_RGB_SCALAR", "_PHOTOMETRIC_CASES")
HEX_PER_LINE = 92        # module-level constants: 4-space indent, 46 bytes a line
CASE_HEX_PER_LINE = 84   # _PHOTOMETRIC_CASES entries: 8-space indent, 42 bytes a line


# ----------------------------------------------------------------------------- the test's source


def _top_level(tree: ast.Module, names, path: str) -> dict[str, ast.stmt]:
  found = {}
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name in names:
      found[node.name] = node
    elif (isinstance(node, ast.Assign) and len(node.targets) == 1
          and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names):
      found[node.targets[0].id] = node
  missing = sorted(set(names) - set(found))
  if missing:
    raise SystemExit(f"{path}: no top-level definition of {', '.join(missing)}")
  return found


def load_test(source: str, path: str):
  """(namespace with the inputs and stored goldens, their AST nodes) from the test's source."""
  tree = ast.parse(source)
  nodes = _top_level(tree, INPUTS + GOLDENS, path)
  namespace = {"np": np}
  exec(compile(ast.Module([nodes[n] for n in INPUTS + GOLDENS], []), path, "exec"), namespace)
  return namespace, nodes


# ----------------------------------------------------------------------------- mmseg v0.5.0


class ScriptedRandom:
  """numpy.random's randint / uniform as PhotoMetricDistortion calls them, from a fixed list."""

  def __init__(self, draws):
    self.draws = list(draws)

  def _next(self, kind, args):
    if not self.draws:
      raise AssertionError(f"PhotoMetricDistortion drew more than scripted ({kind}{args})")
    want_kind, value = self.draws.pop(0)
    if want_kind != kind:
      raise AssertionError(f"scripted a {want_kind} draw, PhotoMetricDistortion asked {kind}{args}")
    lo, hi = (0, args[0]) if len(args) == 1 else args
    if not lo <= value < hi:
      raise AssertionError(f"{kind}{args} cannot draw {value!r}")
    return value

  def randint(self, *args):
    return self._next("randint", args)

  def uniform(self, *args):
    return self._next("uniform", args)


def scripted_draws(brightness, contrast, contrast_first, saturation, hue):
  """The draws of one __call__ in mmseg's order; None = that step's coin off."""
  def step(kind, value):
    return [("randint", 0)] if value is None else [("randint", 1), (kind, value)]
  contrast_draws = step("uniform", contrast)
  return (step("uniform", brightness) + [("randint", 1 if contrast_first else 0)]
          + (contrast_draws if contrast_first else [])
          + step("uniform", saturation) + step("randint", hue)
          + ([] if contrast_first else contrast_draws))


def transcribed_photometric_distortion(cv2, random):
  """mmseg 0.x's PhotoMetricDistortion (mmseg/datasets/pipelines/transforms.py), verbatim
  except that `random` (numpy.random there) is passed in and mmcv.bgr2hsv / hsv2bgr are spelled
  as the cv2.cvtColor calls they are."""
  bgr2hsv = lambda img: cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
  hsv2bgr = lambda img: cv2.cvtColor(img, cv2.COLOR_HSV2BGR)

  class PhotoMetricDistortion:

    def __init__(self, brightness_delta=32, contrast_range=(0.5, 1.5),
                 saturation_range=(0.5, 1.5), hue_delta=18):
      self.brightness_delta = brightness_delta
      self.contrast_lower, self.contrast_upper = contrast_range
      self.saturation_lower, self.saturation_upper = saturation_range
      self.hue_delta = hue_delta

    def convert(self, img, alpha=1, beta=0):
      img = img.astype(np.float32) * alpha + beta
      img = np.clip(img, 0, 255)
      return img.astype(np.uint8)

    def brightness(self, img):
      if random.randint(2):
        return self.convert(img, beta=random.uniform(-self.brightness_delta,
                                                     self.brightness_delta))
      return img

    def contrast(self, img):
      if random.randint(2):
        return self.convert(img, alpha=random.uniform(self.contrast_lower, self.contrast_upper))
      return img

    def saturation(self, img):
      if random.randint(2):
        img = bgr2hsv(img)
        img[:, :, 1] = self.convert(img[:, :, 1], alpha=random.uniform(self.saturation_lower,
                                                                         self.saturation_upper))
        img = hsv2bgr(img)
      return img

    def hue(self, img):
      if random.randint(2):
        img = bgr2hsv(img)
        img[:, :, 0] = (img[:, :, 0].astype(int)
                        + random.randint(-self.hue_delta, self.hue_delta)) % 180
        img = hsv2bgr(img)
      return img

    def __call__(self, results):
      img = results["img"]
      img = self.brightness(img)
      mode = random.randint(2)
      if mode == 1:
        img = self.contrast(img)
      img = self.saturation(img)
      img = self.hue(img)
      if mode == 0:
        img = self.contrast(img)
      results["img"] = img
      return results

  return PhotoMetricDistortion()


def photometric(cv2, rgb, params, use_mmseg: bool):
  """PhotoMetricDistortion (defaults) on the RGB image given as BGR, returned as RGB."""
  random = ScriptedRandom(scripted_draws(*params))
  if use_mmseg:
    from mmseg.datasets.pipelines import transforms  # mmsegmentation 0.x
    transforms.random = random
    transform = transforms.PhotoMetricDistortion()
  else:
    transform = transcribed_photometric_distortion(cv2, random)
  out = transform({"img": np.ascontiguousarray(rgb[..., ::-1])})["img"]
  if random.draws:
    raise AssertionError(f"draws left unused: {random.draws}")
  return np.ascontiguousarray(out[..., ::-1])


# ----------------------------------------------------------------------------- the goldens


def _hex_lines(data: np.ndarray, indent: int, width: int) -> list[str]:
  h = np.ascontiguousarray(data, np.uint8).tobytes().hex()
  return [" " * indent + f'"{h[i:i + width]}"' for i in range(0, len(h), width)]


def constant_source(name: str, data: np.ndarray) -> str:
  return "\n".join([f"{name} = ("] + _hex_lines(data, 4, HEX_PER_LINE) + [")"])


def cases_source(cases: dict[str, tuple[tuple, np.ndarray]]) -> str:
  lines = ["_PHOTOMETRIC_CASES = {"]
  for key, (params, data) in cases.items():
    body = _hex_lines(data, 8, CASE_HEX_PER_LINE)
    body[-1] += ")),"
    lines += [f'    "{key}": ({params!r}, ('] + body
  return "\n".join(lines + ["}"])


def generate(cv2, ns, use_mmseg: bool) -> dict[str, str]:
  """Source text of each golden, as the test stores it."""
  rgb, hsv = ns["_golden_rgb_input"](), ns["_golden_hsv_input"]()
  scalar = cv2.cvtColor(np.ascontiguousarray(hsv.reshape(-1, 1, 3)), cv2.COLOR_HSV2RGB)
  cases = {key: (params, photometric(cv2, rgb, params, use_mmseg))
           for key, (params, _) in ns["_PHOTOMETRIC_CASES"].items()}
  return {
      "_RGB_TO_HSV": constant_source("_RGB_TO_HSV", cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)),
      "_HSV_TO_RGB": constant_source("_HSV_TO_RGB", cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)),
      "_HSV_TO_RGB_SCALAR": constant_source("_HSV_TO_RGB_SCALAR", scalar.reshape(hsv.shape)),
      "_PHOTOMETRIC_CASES": cases_source(cases),
  }


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--print", action="store_true", help="print the generated source")
  parser.add_argument("--write", action="store_true", help="rewrite the goldens in the test")
  parser.add_argument("--mmseg", action="store_true",
                      help="run mmsegmentation 0.x's PhotoMetricDistortion, not the transcription")
  parser.add_argument("--test", default=TEST, help="the test file (default: %(default)s)")
  args = parser.parse_args()

  import cv2
  print(f"opencv {cv2.__version__}, numpy {np.__version__}, python {platform.python_version()}, "
        f"{platform.machine()}; photometric: "
        f"{'mmsegmentation ' + __import__('mmseg').__version__ if args.mmseg else 'transcription'}")
  if not cv2.__version__.startswith("4.5.5"):
    print(f"warning: the goldens were made with opencv-python 4.5.5, not {cv2.__version__}")

  with open(args.test) as f:
    source = f.read()
  ns, nodes = load_test(source, args.test)
  generated = generate(cv2, ns, args.mmseg)
  differ = [name for name, text in generated.items() if text not in source]
  for name in GOLDENS:
    print(f"{name}: {'differs from' if name in differ else 'matches'} the stored golden")
    if args.print:
      print(generated[name])

  if args.write and differ:
    lines = source.split("\n")
    for name in sorted(differ, key=lambda n: -nodes[n].lineno):  # bottom up: line numbers hold
      node = nodes[name]
      lines[node.lineno - 1:node.end_lineno] = generated[name].split("\n")
    with open(args.test, "w") as f:
      f.write("\n".join(lines))
    print(f"rewrote {', '.join(differ)} in {os.path.normpath(args.test)}")
    return 0
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
