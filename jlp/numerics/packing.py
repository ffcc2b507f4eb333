"""The bit-packing layout shared by the compressors' payloads (`jlp.compression.layout`) and the
packing kernel (`pallas_kernels.pack_bits`): one b-bit code per element, b in BITS, packed
LSB-first into ceil(n*b/8) bytes."""

from __future__ import annotations

__all__ = ["BITS", "packed_size"]

BITS = (1, 2, 4, 8)


def packed_size(n: int, bits: int) -> int:
  """Bytes of n packed b-bit codes: ceil(n*b/8)."""
  return -(-n * bits // 8)
