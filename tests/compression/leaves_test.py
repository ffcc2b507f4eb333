"""jlp.compression.leaves.nonfinite_count against numpy's count."""

import jax
import numpy as np
import pytest

from jlp.compression.leaves import nonfinite_count

pytestmark = pytest.mark.usefixtures("fast_compile")


@pytest.mark.parametrize("values", [
    [1.0, -2.0, 0.0, -0.0],
    [3e38, 3e38, -3e38],  # finite values whose sum overflows: none counted
    [np.nan, 1.0, np.inf, -np.inf, np.nan],
    [np.inf],
    [-np.inf, -np.inf, 5e-45],
    [],
])
def test_nonfinite_count(values):
  x = np.array(values, np.float32)
  for a in (x, np.resize(x, (7, 5)) if x.size else x.reshape(0, 3)):
    got = jax.jit(nonfinite_count)(a)
    assert got.dtype == np.int32 and int(got) == int(np.sum(~np.isfinite(a))), a
