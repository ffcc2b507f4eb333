"""The NVFP4 Pallas kernel (interpret mode) against its XLA path bit for bit, and its cuda lowering.

Reference: `jlp.numerics.nvfp4.nvfp4_quantize` (the XLA path, itself checked against numpy
transcriptions of TransformerEngine and torchao in tests/numerics/nvfp4_test.py), compared as
uint32 bit patterns. Grids stay at <= 16 steps. The lowering for cuda uses `lower_for_h100` of
kernel_lowering_test.py, and its shift-width check covers the kernel body.
"""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlp
from jlp.formats import MXFormat, NVFP4Format
from jlp.numerics import nvfp4
from pallas_kernels import nvfp4 as kernel

pytestmark = pytest.mark.usefixtures("fast_compile")  # XLA's passes off: compiles ~4x faster


def _lowering_helpers():
  """tests/pallas_kernels/kernel_lowering_test.py, loaded by path (the directory is not a package,
  and `pallas_kernels` names the kernels' package)."""
  path = pathlib.Path(__file__).with_name("kernel_lowering_test.py")
  spec = importlib.util.spec_from_file_location("_nvfp4_lowering_helpers", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


lowering = _lowering_helpers()

SHAPE = (100, 80)
# (format, rows_per_tile, grid steps): 1x16 tiles make 500 rows of 16 (560 along axis 0),
# 16x16 tiles 35 rows of 256.
CASES = [
    (NVFP4Format(compat="torchao"), 32, 16),
    (NVFP4Format(block=(16, 16)), 4, 9),
    (NVFP4Format(rht=True, rounding="stochastic"), None, 2),
    (NVFP4Format(block=(16, 16), rounding="stochastic", axis=0), 8, 5),
    (NVFP4Format(compat="torchao", tensor_scale=False, axis=0), 64, 9),
]


def sample(shape, seed=0):
  """Gaussian values with a zero tile row, tiny and subnormal tiles, large ones and -0.0."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x[3, :16] = 0.0
  x[5, 2] = -0.0
  x[17:33] *= np.float32(2.0 ** -130)
  x[40:48, 16:32] *= np.float32(2.0 ** 100)
  x[60, ::7] = np.float32(1e-45)
  return x


def random_bits(shape, seed=1):
  return np.random.default_rng(seed).integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)


# Slow: the 16 x 16 stochastic tiles along axis 0 (CASES[3]); 16 x 16 tiles, stochastic draws and
# axis 0 each run in another default case (CASES[1], CASES[2], CASES[4]).
@pytest.mark.parametrize("cases", [
    pytest.param(CASES[:3] + CASES[4:], id="default"),
    pytest.param(CASES[3:4], id="16x16-stochastic-axis0", marks=pytest.mark.slow)])
def test_kernel_matches_xla_bit_for_bit(cases):
  """Every case by the kernel and by the XLA path, in one jitted function (one compile)."""
  def both(x, r):
    out = []
    for fmt, rows_per_tile, _ in cases:
      rb = r if fmt.rounding == "stochastic" else None
      out.append((kernel.nvfp4_quantize(x, fmt, rb, interpret=True, rows_per_tile=rows_per_tile),
                  nvfp4.nvfp4_quantize(x, fmt, rb)))
    return out

  x = sample(SHAPE)
  outs = jax.jit(both)(x, random_bits(SHAPE))
  for (fmt, _, _), (got, want) in zip(cases, outs, strict=True):
    label = repr(fmt)
    got, want = np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
    assert got.shape == SHAPE
    bad = got != want
    assert not bad.any(), f"{label}: {bad.sum()} of {bad.size} differ"
  assert np.all(np.isfinite(np.asarray(outs[0][0])))


def test_quantize_dispatches_to_the_kernel():
  """jlp.quantize(impl="pallas") runs this kernel (its pallas_call, by name), impl="xla" none."""
  x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  for fmt in (NVFP4Format(), NVFP4Format(compat="torchao", tensor_scale=False)):
    pallas = str(jax.make_jaxpr(lambda v: jlp.quantize(v, fmt, impl="pallas"))(x))
    xla = str(jax.make_jaxpr(lambda v: jlp.quantize(v, fmt, impl="xla"))(x))
    assert "pallas_call" in pallas and "nvfp4_" in pallas
    assert "pallas_call" not in xla


@pytest.mark.lowering
@pytest.mark.parametrize("fmt,rows_per_tile,grid", CASES, ids=lambda v: repr(v))
def test_lowers_to_triton(fmt, rows_per_tile, grid):
  sds = (jax.ShapeDtypeStruct(SHAPE, jnp.float32), jax.ShapeDtypeStruct(SHAPE, jnp.uint32))
  hlo = lowering.lower_for_h100(
      lambda x, r: kernel.nvfp4_quantize(x, fmt, r, rows_per_tile=rows_per_tile), *sds)
  assert hlo.count(lowering.TRITON_CALL) == 1
  assert f"grid_x = {grid} " in hlo


def test_kernel_body_shifts_below_width():
  """Every shift in the kernel body (Hadamard butterflies, integer multiplication and division,
  the E4M3 / E2M1 casts) is by less than 32, on rows with subnormal, tiny and huge tiles."""
  rows = sample((64, 16)).view(np.uint32)
  draws = random_bits(rows.shape)
  bodies = {}
  for fmt in (NVFP4Format(rht=True, rounding="stochastic"),):
    # Jitted: one compile instead of one per eager op.
    scalars = jax.jit(lambda u, f=fmt: nvfp4.tensor_scalars(nvfp4.amax_bits(u), f))(rows)
    bodies[repr(fmt)] = functools.partial(
        lambda u, r, f, s: nvfp4.quantize_rows(u, s, f, r if f.rounding == "stochastic" else None),
        f=fmt, s=scalars)
  assert lowering.shifts_at_or_above_width(bodies, rows, draws) == []


def test_bad_arguments():
  x = np.ones((4, 32), np.float32)
  with pytest.raises(ValueError, match="rows_per_tile=3 is not allowed"):
    kernel.nvfp4_quantize(x, NVFP4Format(), rows_per_tile=3)
  with pytest.raises(ValueError, match="expected an NVFP4Format"):
    kernel.nvfp4_quantize(x, MXFormat("float4_e2m1fn"))
  with pytest.raises(ValueError, match="x.dtype=bfloat16 is not allowed"):
    kernel.nvfp4_quantize(x.astype(jnp.bfloat16), NVFP4Format())
  with pytest.raises(ValueError, match="rbits=None is not allowed"):
    kernel.nvfp4_quantize(x, NVFP4Format(rounding="stochastic"))
