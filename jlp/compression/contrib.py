"""Compressors beyond HiPress's five, each a short class written with the authoring API
(docs/tour.md, "Writing a compressor"): a payload layout, `compress` over unpacked fields,
`decompress`.
Registration gives them `jlp.compression.get(name)`, packing with ragged tails, to_bytes /
from_bytes, wire_bytes, and use in both CaSync topologies and the runner.

References:
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
    ICML 2019 (EF-signSGD, Algorithm 1).
  Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding",
    NeurIPS 2017 (QSGD, the stochastic quantiser Q_s without Elias coding).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jlp.compression import ops
from jlp.compression.base import Compressor, check_impl, invalid, register
from jlp.compression.layout import Packed, Scalars

__all__ = ["EFSignSGD", "QSGD"]


@register("efsignsgd")
@dataclasses.dataclass(frozen=True)
class EFSignSGD(Compressor):
  """EF-signSGD (Karimireddy et al. 2019): v = x + r; send the signs of v (bit 1: v >= 0) and
  scale = ||v||_1 / n; decode +-scale; r = v - decode. Wire: ceil(n/8) bytes (element i at
  bit i mod 8 of byte i // 8), then float32 scale."""

  impl: str = "auto"

  layout = (Packed("signs", bits=1), Scalars("scale"))
  error_feedback = True  # the base class adds the residual r to x and keeps r = v - decode

  def __post_init__(self):
    check_impl("EFSignSGD", self.impl)

  def compress(self, v, state, key):
    scale = ops.block_sums((jnp.abs(v),))[0] / v.shape[0]
    return {"signs": (v >= 0).astype(jnp.uint8), "scale": scale[None]}, state

  def decompress(self, fields, n):
    scale = fields["scale"][0]
    return jnp.where(fields["signs"] == 1, scale, -scale)


@register("qsgd")
@dataclasses.dataclass(frozen=True)
class QSGD(Compressor):
  """QSGD (Alistarh et al. 2017) with s = `levels`: x_i -> ||x||_2 * sign(x_i) * l_i / s, l_i =
  floor(s |x_i| / ||x||_2 + u_i), u uniform [0, 1) from the key (unbiased; no EF). Wire: float32
  norm, then one code l_i * sign(x_i) + s per element in the fewest of 2, 4, 8 bits."""

  levels: int = 7
  impl: str = "auto"

  needs_key = True

  def __post_init__(self):
    if isinstance(self.levels, bool) or not isinstance(self.levels, int) or not (
        1 <= self.levels <= 127):
      raise invalid("QSGD.levels", self.levels, "an int in [1, 127]")
    check_impl("QSGD", self.impl)

  @property
  def layout(self):
    bits = next(b for b in (2, 4, 8) if 2 * self.levels < 1 << b)
    return (Scalars("norm"), Packed("codes", bits=bits, pad=self.levels))

  def compress(self, x, state, key):
    norm = jnp.sqrt(ops.block_sums((x * x,))[0])
    scaled = jnp.abs(x) * (self.levels / jnp.where(norm > 0, norm, 1.0))
    level = jnp.minimum(jnp.floor(scaled + ops.uniform(key, x.shape)), self.levels)
    codes = (jnp.where(x < 0, -level, level) + self.levels).astype(jnp.uint8)
    return {"norm": norm[None], "codes": codes}, state

  def decompress(self, fields, n):
    signed_level = fields["codes"].astype(jnp.float32) - self.levels
    return signed_level * (fields["norm"][0] / self.levels)
