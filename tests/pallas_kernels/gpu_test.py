"""The Pallas kernels compiled for a real GPU, bit for bit against the XLA path on the CPU.

The interpret-mode tests check each kernel's arithmetic on the CPU and the lowering tier checks
that Triton accepts it; this tier checks that the compiled kernel computes the same bits: no
flushed subnormals, no fused or reassociated float operations, shifts and integer operations as
written. It runs only where JAX sees a GPU and is skipped elsewhere (CI has none):

  JAX_PLATFORMS=cuda,cpu .venv/bin/python -m pytest tests/pallas_kernels/gpu_test.py -n 0

Each case quantizes (or multiplies, packs, selects) awkward inputs: normal values spread over
float32's whole exponent range, float32 subnormals, signed zeros, the largest finite values,
infinities and NaNs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp import BFPFormat, BlockScaledFormat, FloatFormat, MXFormat, NVFP4Format
from jlp.formats import TENSOR_BLOCK
from jlp.compression import ops
from jlp.gemm import matmul
from jlp.quantize import quantize


def _gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


GPU = _gpu()
pytestmark = pytest.mark.skipif(GPU is None, reason="needs a GPU (the kernels compiled by Triton)")
CPU = jax.devices("cpu")[0]


def awkward(shape, seed, finite=False):
  """float32 values over the whole exponent range with subnormals, zeros, maxima and specials."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 2.0 ** rng.integers(-140, 100, shape)
  flat = x.reshape(-1)
  n = flat.size
  picks = rng.choice(n, size=min(n, 64), replace=False)
  specials = [0.0, -0.0, 1e-45, -3e-41, 2.0 ** -126, np.finfo(np.float32).max, 448.0, 6.0]
  if not finite:
    specials += [np.inf, -np.inf, np.nan]
  flat[picks] = np.resize(specials, picks.size)
  return x.astype(np.float32)


def on(device, fn, *args):
  args = jax.device_put(args, device)
  with jax.default_device(device):
    return jax.tree.map(np.asarray, jax.jit(fn)(*args))


def assert_same_bits(got, want, what, any_nan=False):
  """Equal bit patterns; with `any_nan`, a NaN matches any NaN (a NaN that the hardware's float
  addition makes, inf + -inf, has the platform's sign and payload: 0x7FFFFFFF on NVIDIA GPUs,
  0xFFC00000 on x86)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, what
  g = got.view(np.uint32) if got.dtype == np.float32 else got
  w = want.view(np.uint32) if want.dtype == np.float32 else want
  same = g == w
  if any_nan:
    same |= np.isnan(got) & np.isnan(want)
  bad = np.flatnonzero(~same.reshape(-1))
  assert bad.size == 0, (f"{what}: {bad.size} of {g.size} differ, first at {bad[:5]}: "
                         f"gpu {got.reshape(-1)[bad[:5]]}, cpu {want.reshape(-1)[bad[:5]]}")


E4M3, E5M2 = FloatFormat(4, 3), FloatFormat(5, 2)
CASTS = {
    "e4m3": E4M3, "e5m2": E5M2, "bf16": FloatFormat(8, 7), "fp16": FloatFormat(5, 10),
    "e3m2 truncate": FloatFormat(3, 2, rounding="truncate"),
    "e4m3 stochastic": FloatFormat(4, 3, rounding="stochastic"),
    "e5m2 cpd": FloatFormat(5, 2, compat="cpd"),
    "bfp 4 (1,16)": BFPFormat(4, (1, 16)), "bfp 6 (4,4) nearest": BFPFormat(6, (4, 4), "nearest"),
    "bfp 4 stochastic": BFPFormat(4, (1, 16), "stochastic"),
    "mx e4m3": MXFormat("float8_e4m3fn"), "mx int8": MXFormat("int8"),
    **{f"mx e2m1 {mode}": MXFormat("float4_e2m1fn", scale_mode=mode)
       for mode in ("floor", "rceil", "ceil", "even")},
    "block fp8 1x128": BlockScaledFormat(), "block fp8 128x128": BlockScaledFormat(block=(128, 128)),
    "block fp8 pow2": BlockScaledFormat(pow2_scale=True),
    "block e5m2 axis 0": BlockScaledFormat("float8_e5m2", axis=0),
    "block e4m3 per tensor reciprocal": BlockScaledFormat(block=TENSOR_BLOCK,
                                                          scale_rule="reciprocal"),
    "block e5m2 reciprocal pow2": BlockScaledFormat("float8_e5m2", pow2_scale=True,
                                                    scale_rule="reciprocal"),
    "mx e2m1 prescale stochastic": MXFormat(FloatFormat.from_name("float4_e2m1fn",
                                                                  rounding="stochastic"),
                                            prescale=0.75),
    "nvfp4": NVFP4Format(), "nvfp4 16x16": NVFP4Format(block=(16, 16)),
    "nvfp4 rht": NVFP4Format(rht=True), "nvfp4 stochastic": NVFP4Format(rounding="stochastic"),
    "nvfp4 torchao": NVFP4Format(compat="torchao"),
    "nvfp4 torchao single": NVFP4Format(compat="torchao", tensor_scale=False),
}
# NVFP4's and block FP8's tensor-wide scales make one NaN or inf poison the whole tensor: they get
# finite inputs.
FINITE = ("block", "nvfp4")


@pytest.mark.parametrize("name", list(CASTS))
@pytest.mark.parametrize("shape", [(256, 272), (33, 130)], ids=str)
def test_quantize_kernel_on_gpu_is_the_xla_path_on_cpu(name, shape):
  fmt = CASTS[name]
  if getattr(fmt, "rht", False):  # TE's Hadamard transform takes whole 16-element blocks
    shape = (shape[0], shape[1] // 16 * 16)
  x = awkward(shape, seed=sum(shape) + len(name), finite=name.startswith(FINITE))
  key = jax.random.key(7)
  got = on(GPU, lambda x, k: quantize(x, fmt, key=k, impl="pallas"), x, key)
  want = on(CPU, lambda x, k: quantize(x, fmt, key=k, impl="xla"), x, key)
  assert_same_bits(got, want, name)


@pytest.mark.parametrize("name", [n for n in CASTS if n.startswith(FINITE)])
@pytest.mark.parametrize("data", ["normal", "awkward"])
def test_xla_path_on_gpu_is_the_xla_path_on_cpu(name, data):
  """The XLA paths of NVFP4 and block FP8 use the hardware's float operations where they give
  the integer operations' bits (ordinary tensors: "normal"), compiled by XLA for the GPU here."""
  fmt = CASTS[name]
  rng = np.random.default_rng(len(name))
  x = (rng.standard_normal((256, 256)).astype(np.float32) if data == "normal"
       else awkward((256, 256), seed=len(name), finite=True))
  key = jax.random.key(8)
  got = on(GPU, lambda x, k: quantize(x, fmt, key=k, impl="xla"), x, key)
  want = on(CPU, lambda x, k: quantize(x, fmt, key=k, impl="xla"), x, key)
  assert_same_bits(got, want, f"{name} {data}")


@pytest.mark.parametrize("accum, options", [
    (E5M2, {}), (E5M2, {"kahan": True}), (E4M3, {"chunk": 4}),
    (FloatFormat(8, 13, rounding="truncate"), {"promote_every": 128}),
    (FloatFormat(8, 23), {"promote_every": 1}),
], ids=str)
@pytest.mark.parametrize("spread", [2, 8])
def test_accumulating_matmul_kernel_on_gpu_is_the_xla_path_on_cpu(accum, options, spread):
  """spread 2: finite sums; spread 8: partial sums past e4m3's range (inf, then inf - inf)."""
  rng = np.random.default_rng(3)
  a = (rng.standard_normal((70, 300)) + 0.5).astype(np.float32)
  b = (rng.standard_normal((300, 45)) * 2.0 ** rng.integers(-spread, spread, (300, 45))
       ).astype(np.float32)
  got = on(GPU, lambda a, b: matmul(a, b, accum=accum, impl="pallas", **options), a, b)
  want = on(CPU, lambda a, b: matmul(a, b, accum=accum, impl="xla", **options), a, b)
  assert_same_bits(got, want, f"{accum} {options}", any_nan=True)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bit_packing_kernels_on_gpu_are_the_xla_path_on_cpu(bits):
  codes = np.random.default_rng(bits).integers(0, 1 << bits, 10_001).astype(np.uint8)
  packed = on(GPU, lambda c: ops.pack_bits(c, bits, impl="pallas"), codes)
  assert_same_bits(packed, on(CPU, lambda c: ops.pack_bits(c, bits, impl="xla"), codes),
                   f"pack {bits}")
  unpacked = on(GPU, lambda p: ops.unpack_bits(p, bits, codes.size, impl="pallas"), packed)
  assert_same_bits(unpacked, codes, f"unpack {bits}")


def test_threshold_selection_kernel_on_gpu_is_the_xla_path_on_cpu():
  values = awkward((100_003,), seed=5, finite=True)
  for capacity in (0, 100, 50_000):
    got = on(GPU, lambda v: ops.threshold_select(v, 1e-3, capacity, impl="pallas"), values)
    want = on(CPU, lambda v: ops.threshold_select(v, 1e-3, capacity, impl="xla"), values)
    for g, w, part in zip(got, want, ("indices", "total")):
      assert_same_bits(g, w, f"capacity {capacity} {part}")
