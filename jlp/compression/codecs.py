"""HiPress's five compressors (hipress.md §1), written with the authoring API (jlp.compression.base).

References:
  Strom, "Scalable distributed DNN training using commodity GPU cloud computing", Interspeech
    2015 (TBQ).
  Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
    Learning", NeurIPS 2017 (HiPress's TernGrad is a min/max b-bit quantiser, §1.2).
  Lin et al., "Deep Gradient Compression", ICLR 2018 (DGC).
  Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017 (GradDrop).
  Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
    Distributed Training of Speech DNNs", Interspeech 2014 (onebit).
  Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN Training",
    SOSP 2021 (HiPress).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jlp.compression.base import Compressor, check_impl, invalid, register
from jlp.compression.layout import Packed

__all__ = ["TBQ"]


def _positive_finite(owner: str, field: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value > 0):
    raise invalid(f"{owner}.{field}", value, "a positive finite float")


@register("tbq")
@dataclasses.dataclass(frozen=True)
class TBQ(Compressor):
  """Threshold binary quantisation with fused error feedback (hipress.md §1.1).

  Per element, on the residual r (state) in place:  r += x;  r >= τ: send +τ (code 2), r -= τ;
  r <= -τ: send -τ (code 0), r += τ;  else send 0 (code 1). Decode: (code - 1) * τ.
  Wire: ceil(n/4) bytes, no header, element 4i+k at bits 2k..2k+1 of byte i; unused tail slots
  hold code 1 (HiPress starts every byte at 0x55). τ is known to both sides.
  """

  threshold: float = 1.0
  impl: str = "xla"

  layout = (Packed("codes", bits=2, pad=1),)

  def __post_init__(self):
    _positive_finite("TBQ", "threshold", self.threshold)
    check_impl("TBQ", self.impl)

  def init(self, x):
    return self.residual_state(x)

  def compress(self, x, state, key):
    del key
    tau = jnp.float32(self.threshold)
    r = state["residual"] + x
    up, down = r >= tau, r <= -tau
    codes = jnp.where(up, 2, jnp.where(down, 0, 1)).astype(jnp.uint8)
    r = jnp.where(up, r - tau, jnp.where(down, r + tau, r))
    return {"codes": codes}, {"residual": r}

  def decompress(self, fields, n):
    del n
    return (fields["codes"].astype(jnp.float32) - 1.0) * jnp.float32(self.threshold)
