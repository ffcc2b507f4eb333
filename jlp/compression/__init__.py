"""Gradient compression (HiPress, hipress.md): compressors with HiPress's wire formats and error
feedback, compression-aware synchronisation (CaSync PS and ring) inside `jax.shard_map`, and the
SeCoPa planner.

    c = jlp.compression.get("onebit")                  # or OneBit(), TBQ(threshold=1.0), ...
    payload, state = c.encode(grad, c.init(grad))      # fixed-shape packed arrays
    approx = c.decode(payload, grad.size)
    wire = c.to_bytes(payload)                         # HiPress's bytes, byte for byte

A new compressor is a small frozen dataclass with a payload layout and two functions over
unpacked fields (`jlp.compression.base`; README "Writing a compressor").
"""

from jlp.compression import ops
from jlp.compression.base import COMPRESSORS, Compressor, get, register
from jlp.compression.codecs import TBQ
from jlp.compression.layout import Header, Packed, Scalars, Sparse

__all__ = ["COMPRESSORS", "Compressor", "Header", "Packed", "Scalars", "Sparse", "TBQ", "get",
           "ops", "register"]
