"""A multilayer perceptron for small images (Flax NNX): flatten, hidden Linear + ReLU layers, a
linear classifier.

    fc/0   Linear(in_features -> hidden[0]) + ReLU        (the NHWC image flattened first)
    fc/i   Linear(hidden[i-1] -> hidden[i]) + ReLU
    head   Linear(hidden[-1] -> classes)

All layers have biases and PyTorch's default init (`jlp.models.resnet.linear`). The default
hidden=(1536, 1536, 1536) on scikit-learn's 8x8 digits has 4,836,874 parameters: wide enough that
a float32 gradient sync costs more than the step's compute on a 100 Mbit/s link (the cluster
study's comm-bound config, `configs/digits_wide.py`), with four GEMM layers for a pipeline of up
to four stages. Module paths: "fc/0", ..., "head".
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from jlp.models.resnet import linear

__all__ = ["MLP", "mlp"]


class MLP(nnx.Module):
  """Flatten, then Linear + ReLU per hidden width, then a linear classifier."""

  def __init__(self, num_classes: int = 10, *, in_features: int = 64,
               hidden: Sequence[int] = (1536, 1536, 1536), rngs: nnx.Rngs):
    widths = (in_features, *hidden)
    for name, value in (("in_features", in_features), *((f"hidden[{i}]", h)
                                                         for i, h in enumerate(hidden))):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mlp {name}={value!r} is not allowed; expected a positive integer.")
    self.fc = nnx.List([linear(widths[i], widths[i + 1], rngs=rngs) for i in range(len(hidden))])
    self.head = linear(widths[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    for layer in self.fc:
      x = jax.nn.relu(layer(x))
    return self.head(x)


def mlp(num_classes: int = 10, *, in_features: int = 64, hidden: Sequence[int] = (1536, 1536, 1536),
        rngs: nnx.Rngs | None = None) -> MLP:
  """The MLP; `in_features` is the flattened image size (64 for 8x8x1 digits)."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return MLP(num_classes, in_features=in_features, hidden=tuple(hidden), rngs=rngs)
