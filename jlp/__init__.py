"""jlp: low-precision and communication-efficient deep learning in JAX.

The public API: number formats, the differentiable `quantize`, and ordered sums
with rounded intermediates. See README.md for a tour.
"""

from jlp.formats import BFPFormat, FloatFormat, MXFormat
from jlp.numerics.sums import kahan_sum, sequential_sum
from jlp.quantize import quantize

__all__ = [
    "BFPFormat",
    "FloatFormat",
    "MXFormat",
    "kahan_sum",
    "quantize",
    "sequential_sum",
]
__version__ = "0.1.0"
