"""Per-image steps of file-backed datasets that write into one batch buffer.

`normalize_into(out, image, normalization)` is `normalization(image)` (torchvision's
ToTensor + Normalize, `jlp.data.dataset.Normalization`) written into `out`, one
image at a time: the same float32 operations in the same order, so the values are
bit-identical to normalising the stacked batch, but each image stays in the cache
(normalising a stacked 256 x 224 x 224 x 3 batch makes four passes over 150 MB)
and the loading threads do it in parallel.
"""

from __future__ import annotations

import numpy as np

from jlp.data.dataset import Normalization


class RowConstants:
  """The per-row constants of a Normalization for images `width` pixels wide (tiled mean / std,
  as jlp.data.augment.normalize uses them)."""

  def __init__(self, normalization: Normalization, width: int):
    self.scale = np.float32(normalization.scale)
    self.mean = np.tile(np.asarray(normalization.mean, np.float32), width)
    self.std = np.tile(np.asarray(normalization.std, np.float32), width)


def normalize_into(out: np.ndarray, image: np.ndarray, constants: RowConstants) -> None:
  """out[...] = Normalization(image): out float32 (H, W, C) C-contiguous, image uint8 (H, W, C)
  (any strides, e.g. a flipped view)."""
  np.copyto(out, image, casting="unsafe")  # uint8 -> float32 is exact
  rows = out.reshape(out.shape[0], -1)
  rows /= constants.scale
  rows -= constants.mean
  rows /= constants.std
