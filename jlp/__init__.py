"""jlp: low-precision and communication-efficient deep learning in JAX.

The public API: number formats, the differentiable `quantize`, ordered sums with
rounded intermediates, and quantized GEMMs (nine tensor roles, custom-precision
accumulation). See docs/tour.md for a tour.
"""

from jlp.formats import BFPFormat, BlockScaledFormat, FloatFormat, MXFormat, NVFP4Format
from jlp.gemm import GemmQuant, matmul, qconv, qdot_general
from jlp.numerics.nvfp4 import nvfp4_encode
from jlp.numerics.sums import kahan_sum, sequential_sum
from jlp.quantize import quantize

__all__ = [
    "BFPFormat",
    "BlockScaledFormat",
    "FloatFormat",
    "GemmQuant",
    "MXFormat",
    "NVFP4Format",
    "kahan_sum",
    "matmul",
    "nvfp4_encode",
    "qconv",
    "qdot_general",
    "quantize",
    "sequential_sum",
]
__version__ = "0.1.0"
