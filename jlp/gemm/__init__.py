"""Quantized GEMMs: per-role quantizers, quantized dot_general / conv, custom accumulators."""

from jlp.gemm.config import GemmQuant, ROLES
