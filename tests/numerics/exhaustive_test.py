"""Every float32 bit pattern (2^32) against ml_dtypes: `make test-slow` (pytest -m slow).

Reference: ml_dtypes / numpy `astype` round trips. Takes several minutes on 2 cores.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jlp import FloatFormat
from jlp.numerics.float_cast import float_cast
import references as ref

CHUNK = 1 << 25


@pytest.mark.slow
@pytest.mark.parametrize("name", ["float8_e4m3", "float8_e5m2", "float16", "bfloat16"])
def test_all_float32_bit_patterns(name):
  fmt = FloatFormat.from_name(name)
  dtype = np.float16 if name == "float16" else getattr(ml_dtypes, name)
  cast = jax.jit(lambda u: jax.lax.bitcast_convert_type(
      float_cast(jax.lax.bitcast_convert_type(u, jnp.float32), fmt), jnp.uint32))
  for start in range(0, 1 << 32, CHUNK):
    u = np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32)
    got = np.asarray(cast(u)).view(np.float32)
    with np.errstate(all="ignore"):
      want = u.view(np.float32).astype(dtype).astype(np.float32)
    if name == "float16":  # numpy keeps NaN payloads; ml_dtypes and jlp give the canonical quiet NaN
      nan = np.isnan(want)
      want[nan] = np.copysign(np.float32(np.nan), want[nan])
    ref.assert_same_bits(got, want, u.view(np.float32), f"{name} chunk {start:#x}")
