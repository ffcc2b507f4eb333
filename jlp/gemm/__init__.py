"""Quantized GEMMs: per-role quantizers, quantized dot_general / conv, custom accumulators."""

from jlp.gemm.accum import matmul
from jlp.gemm.config import ROLES, GemmQuant
from jlp.gemm.qdot import qconv, qdot_general
