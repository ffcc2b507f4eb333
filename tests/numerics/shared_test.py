"""jlp.numerics.shared.shared_jit: the casts' inner computations stay calls in the compiled program
(XLA compiles them apart from the code around them), and the calls give the bits of the same
computations inlined (the previous compilation, restored here by re-jitting them plainly)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlp
from jlp.formats import BlockScaledFormat, MXFormat, NVFP4Format
from jlp.numerics import block_scaled, ieee_f32, mx, nvfp4

NVFP4 = NVFP4Format()
NVFP4_RHT = NVFP4Format(rht=True)
BLOCK = BlockScaledFormat("float8_e4m3fn", (1, 128))
BLOCK_TILES = BlockScaledFormat("float8_e4m3fn", (128, 128))
MXFP8 = MXFormat("float8_e4m3fn", 32)


def _inputs():
  """Values the float path takes and values that need the integer fallback: subnormals, a
  tensor whose amax is below 2^-60 (nvfp4), tiles that mix 2^100 and 2^-100 (block scaling,
  and MX blocks off the nearest scale's grid)."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((256, 256)) * 2.0 ** rng.integers(-20, 20, (256, 256))).astype(np.float32)
  x[:8] = rng.standard_normal((8, 256)).astype(np.float32) * np.float32(1e-39)
  x[8:16, ::2] = 2.0 ** 100
  x[8:16, 1::2] = 2.0 ** -100
  tiny = (rng.standard_normal((64, 32)) * 2.0 ** -80).astype(np.float32)
  return [jnp.asarray(x), jnp.asarray(tiny)]


@pytest.fixture
def inlined(monkeypatch):
  """The shared functions re-jitted without the inline option (XLA inlines them again)."""
  def use_plain():
    plain = {
        "tiles": jax.jit(nvfp4._tiles_chunk.__wrapped__, static_argnames=("fmt",)),
        "rht": jax.jit(nvfp4._rht_amax_chunk.__wrapped__, static_argnames=("exact",)),
        "blocks": jax.jit(block_scaled._blocks_chunk.__wrapped__, static_argnames=("fmt",)),
        "mx": jax.jit(mx._general_call.__wrapped__, static_argnames=("fmt", "axis", "block")),
        "div": jax.jit(ieee_f32.div_bits.__wrapped__),
        "mul": jax.jit(ieee_f32.mul_bits.__wrapped__)}
    shared = {"div_bits": ieee_f32.div_bits, "mul_bits": ieee_f32.mul_bits}
    for module in (ieee_f32, block_scaled, mx, nvfp4):  # and the modules that import them
      for name, key in (("div_bits", "div"), ("mul_bits", "mul")):
        if getattr(module, name, None) is shared[name]:
          monkeypatch.setattr(module, name, plain[key])
    monkeypatch.setattr(nvfp4, "_tiles_chunk", plain["tiles"])
    monkeypatch.setattr(nvfp4, "_rht_amax_chunk", plain["rht"])
    monkeypatch.setattr(block_scaled, "_blocks_chunk", plain["blocks"])
    monkeypatch.setattr(mx, "_general_call", plain["mx"])
    jax.clear_caches()
  yield use_plain
  jax.clear_caches()


def casts(xs):
  """Every format on the first input; the tiny tensor (amax below 2^-60: nvfp4's integer
  fallback for the whole tensor) in the nvfp4 formats only, whose fallback it is for (the block
  and MX formats scale its blocks like the first input's normal ones; each more cast is one more
  to compile, twice)."""
  x, tiny = xs
  return ([jlp.quantize(x, f) for f in (NVFP4, NVFP4_RHT, BLOCK, BLOCK_TILES, MXFP8)]
          + [jlp.quantize(tiny, f) for f in (NVFP4, NVFP4_RHT)])


def compile_casts():
  """`casts` of `_inputs()` compiled once: (the names of the computations its program calls,
  the bits of its results)."""
  xs = _inputs()
  compiled = jax.jit(casts).lower(xs).compile()
  called = re.findall(r" call\(.*?to_apply=%?([A-Za-z_]+)", compiled.as_text())
  return called, [np.asarray(a).view(np.uint32) for a in compiled(xs)]


@pytest.fixture(scope="module")
def shared_casts():
  """`compile_casts` with the shared functions as they are (shared by the tests below)."""
  return compile_casts()


def test_casts_are_calls_in_the_compiled_program(shared_casts):
  """Casts of two shapes in one program (nvfp4, block scaled with both tilings, MX): the
  integer divisions / products, nvfp4's and block scaling's chunk programs and MX's general
  rounding are calls."""
  called, _ = shared_casts
  for name in ("_tiles_chunk", "div_bits", "mul_bits", "_blocks_chunk", "_general_call"):
    assert name in called, (name, called)


def test_calls_give_the_inlined_bits(shared_casts, inlined):
  _, shared = shared_casts
  inlined()
  called, plain = compile_casts()
  assert not {"_tiles_chunk", "_blocks_chunk", "_general_call"} & set(called), called
  for k, (a, b) in enumerate(zip(shared, plain, strict=True)):
    np.testing.assert_array_equal(a, b, err_msg=f"cast {k}")
