"""The MX Pallas kernel (interpret mode) against its XLA path and the spec reference, bit for bit.

References: `jlp.numerics.mx.mx_quantize` (the XLA path, compared as uint32 bit
patterns) and `mx_reference` of tests/numerics/mx_test.py (float64 + ml_dtypes,
written from OCP MX v1.0 §6.3, and torchao's rules for the other scale modes; NaNs
compared by sign only). Gradients: the straight-through identity, or the reference
applied to the cotangent. Grids stay at <= 16 steps. The kernel's lowering for cuda
in every scale mode uses `lower_for_h100` of kernel_lowering_test.py.
"""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlp
from jlp.formats import FloatFormat, MXFormat
from jlp.numerics import mx as xla_mx
from jlp.numerics.mx import mx_rows_bits
from numerics.mx_test import ELEMENTS, SCALE_MODES, mx_reference, random_blocks, scale_mode_blocks
from pallas_kernels import mx as mx_kernel
import references as ref

# (element name, rounding): every element format jlp names for MX, and stochastic elements.
ELEMS = [(name, "nearest") for name in ELEMENTS] + [("float8_e4m3fn", "stochastic"),
                                                   ("float4_e2m1fn", "stochastic")]
F32_MAX = np.float32(np.finfo(np.float32).max)


def _lowering_helpers():
  """tests/pallas_kernels/kernel_lowering_test.py, loaded by path (the directory is not a package,
  and `pallas_kernels` names the kernels' package)."""
  path = pathlib.Path(__file__).with_name("kernel_lowering_test.py")
  spec = importlib.util.spec_from_file_location("_kernel_lowering_helpers", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


lowering = _lowering_helpers()


def mx_format(elem: str, rounding: str, block: int, axis: int) -> MXFormat:
  if rounding == "nearest":
    return MXFormat(elem, block=block, axis=axis)
  return MXFormat(FloatFormat.from_name(elem, rounding=rounding), block=block, axis=axis)


def sample(shape, axis: int, seed: int = 0) -> np.ndarray:
  """float32 values whose blocks along `axis` span 2^-150..2^127 with wide spreads.

  `random_blocks` rows (zeros, -0, float32 subnormals, ±inf, NaN, saturating tops)
  plus, every 7th line, values within a factor 2 of float32's max, and every 11th
  line random bit patterns; the lines run along `axis`.
  """
  rng = np.random.default_rng(seed)
  lines = np.moveaxis(np.zeros(shape, np.float32), axis, -1)
  flat = random_blocks(rng, int(np.prod(lines.shape[:-1])), lines.shape[-1])
  big = (rng.random(flat[::7].shape) + 1.0).astype(np.float32) * np.float32(2.0 ** 127)
  flat[::7] = np.where(rng.random(big.shape) < 0.5, big, -big)
  flat[::7, 0] = F32_MAX
  patterns = rng.integers(0, 2 ** 32, flat[5::11].shape, dtype=np.uint64).astype(np.uint32)
  flat[5::11] = patterns.view(np.float32)
  return np.moveaxis(flat.reshape(lines.shape), -1, axis).copy()


def random_bits(shape, seed: int = 1) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32)


def _quantizers(fmts: tuple, quantize_fn):
  """One jitted function applying `quantize_fn` for every format (one compile for all)."""
  return jax.jit(lambda x, r: [quantize_fn(x, f, r if f.rounding == "stochastic" else None)
                               for f in fmts])


@functools.lru_cache(maxsize=None)
def _kernel_fn(fmts: tuple, rows_per_tile):
  return _quantizers(fmts, functools.partial(mx_kernel.mx_quantize, interpret=True,
                                             rows_per_tile=rows_per_tile))


@functools.lru_cache(maxsize=None)
def _xla_fn(fmts: tuple):
  return _quantizers(fmts, xla_mx.mx_quantize)


def check(x, block: int, axis: int, rows_per_tile, elems=ELEMS, seed: int = 1):
  """Kernel == XLA path (bit for bit) and == mx_reference, for each element format."""
  fmts = tuple(mx_format(e, r, block, axis) for e, r in elems)
  rbits = random_bits(x.shape, seed)
  got_all = _kernel_fn(fmts, rows_per_tile)(x, rbits)
  want_all = _xla_fn(fmts)(x, rbits)
  for (elem, rounding), fmt, got, want in zip(elems, fmts, got_all, want_all, strict=True):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == x.shape
    gb, wb = got.view(np.uint32).ravel(), want.view(np.uint32).ravel()
    bad = np.flatnonzero(gb != wb)
    if bad.size:
      xb = x.view(np.uint32).ravel()
      detail = [(i, hex(xb[i]), hex(wb[i]), hex(gb[i])) for i in bad[:8]]
      raise AssertionError(f"{fmt}: {bad.size} of {gb.size} differ; (i, x, want, got): {detail}")
    r = rbits if rounding == "stochastic" else None
    with np.errstate(invalid="ignore"):  # the reference's casts of signalling NaNs
      ref.assert_same_bits(got, mx_reference(x, elem, block, axis, r), x, repr(fmt))


LAYOUTS = [
    ((40, 64), 32, -1, 8),      # OCP blocks along the last axis: G = 80, 10 tiles
    ((50, 24), 20, 0, 8),       # along axis 0, ragged (50 = 20 + 20 + 10): G = 72, P = 32, 9 tiles
]
# Half of ELEMS per layout in the default tier, each element (and stochastic rounding) in one of
# them: e5m2 / e4m3fn (elements with a finite max, same branches), e3m2fn / e2m3fn / e2m1fn
# (float6 takes float4's branches, other constants), int8, and one stochastic element each. Every
# element also runs through the kernel in test_special_values. The other halves are slow.
ELEM_HALVES = ([("float8_e5m2", "nearest"), ("float6_e3m2fn", "nearest"), ("int8", "nearest"),
                ("float8_e4m3fn", "stochastic")],
               [("float8_e4m3fn", "nearest"), ("float6_e2m3fn", "nearest"),
                ("float4_e2m1fn", "nearest"), ("float4_e2m1fn", "stochastic")])
assert sorted(ELEM_HALVES[0] + ELEM_HALVES[1]) == sorted(ELEMS)


@pytest.mark.parametrize("shape,block,axis,rows_per_tile,elems", [
    pytest.param(*layout, elems, id=f"{layout}-{'+'.join(e[0] + e[1][:2] for e in elems)}",
                 marks=() if h == i else pytest.mark.slow)
    for i, layout in enumerate(LAYOUTS) for h, elems in enumerate(ELEM_HALVES)])
def test_matches_xla_path_and_reference(shape, block, axis, rows_per_tile, elems):
  check(sample(shape, axis), block, axis, rows_per_tile, elems=elems)


def test_middle_axis_rank_3():
  # ragged (70 = 32 + 32 + 6): G = 3 * 3 * 5 = 45, 12 tiles
  elems = [("float8_e5m2", "nearest"), ("float6_e2m3fn", "nearest"),
           ("float4_e2m1fn", "stochastic")]
  check(sample((3, 70, 5), 1), 32, 1, 4, elems=elems)


@pytest.mark.parametrize("shape,block,axis", [
    ((64, 256), 32, 1),   # default tiles: 128 blocks per tile, 4 tiles
    ((6, 10), 32, -1),    # block longer than the axis: one (8, 16) tile, 2 padding rows
], ids=str)
def test_default_tiles(shape, block, axis):
  check(sample(shape, axis, seed=2), block, axis, None,
        elems=[("float8_e5m2", "nearest"), ("int8", "nearest")])


def special_blocks() -> np.ndarray:
  """(12, 32): one special case per row (each row is one block)."""
  x = np.tile(np.linspace(-3.0, 3.0, 32, dtype=np.float32), (12, 1))
  x[0] = np.where(np.arange(32) % 2, -0.0, 0.0)                    # all-zero, signed
  x[1, 7] = np.inf
  x[2, 0] = -np.inf
  x[3, 31] = np.nan
  x[4, 3] = np.float32(-np.nan)
  x[5] = (np.arange(32, dtype=np.uint32) * 0x3FFFF + 1).view(np.float32)  # float32 subnormals
  x[5, ::3] *= -1
  x[6] = np.float32(2.0 ** -126) * np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # normal/subnormal
  x[7] = F32_MAX * np.linspace(-1.0, 1.0, 32, dtype=np.float32)   # largest scale, 2^127 - emax
  x[7, 0] = -F32_MAX
  x[8] = np.float32(2.0 ** 127) * np.float32(1.96875)              # saturating near float32's max
  x[8, 1::2] = np.float32(2.0 ** 100)                              # elements rounding to ±0
  x[8, 3::4] *= -1
  x[9] = np.float32(957.0) * np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # microxcaling issue 4
  x[10, :] = 0.0
  x[10, 5] = np.float32(2.0 ** -149)                               # one smallest subnormal
  x[11] = np.float32(1e-40) * np.linspace(-1.0, 1.0, 32, dtype=np.float32)
  return x


def test_special_values():
  x = special_blocks()
  check(x, 32, -1, 4)
  got = np.asarray(jax.jit(lambda v: jlp.quantize(v, MXFormat("float8_e4m3fn"), impl="pallas"))(
      jnp.asarray(x)))  # jitted: one compile, not one per op
  ref.assert_same_bits(got[0], x[0])                      # signed zeros kept
  assert np.isnan(got[1:5]).all() and np.isfinite(got[5:]).all()
  # scale 2^(127 - 8): float32's max is 511.99.. there, saturating to 448
  assert got[7, 0] == np.float32(-1.75 * 2.0 ** 127) and got[8, 0] == np.float32(1.75 * 2.0 ** 127)
  assert np.signbit(got[8, 3::4]).all() and (got[8, 1::2] == 0).all()  # 2^100 / 2^119 -> ±0


def test_transposed_blocks_equal_row_blocks():
  """Blocks along axis 0 of x^T are the blocks along axis 1 of x (same kernel, other layout)."""
  x = sample((24, 40), -1, seed=3)
  fmt = MXFormat("float6_e3m2fn", block=16)
  rows, cols = jax.jit(lambda x, xt: (  # one compile, not one per op
      mx_kernel.mx_quantize(x, fmt, interpret=True, rows_per_tile=8),
      mx_kernel.mx_quantize(xt, MXFormat("float6_e3m2fn", block=16, axis=0), interpret=True,
                            rows_per_tile=8)))(x, x.T.copy())
  ref.assert_same_bits(np.asarray(cols).T, np.asarray(rows))


@pytest.mark.parametrize("elem,bwd_elem", [("float8_e4m3fn", "float8_e5m2"),
                                           ("float4_e2m1fn", "int8"),
                                           ("float6_e2m3fn", None)], ids=str)
def test_jlp_quantize_forward_and_gradient(elem, bwd_elem):
  """impl="pallas" == impl="xla" for the value and the custom_vjp's gradient; the gradient
  is the reference applied to the cotangent (or the cotangent itself, straight-through)."""
  x = sample((16, 48), -1, seed=4)
  x[~np.isfinite(x)] = 1.0
  w = sample((16, 48), -1, seed=5)[::-1].copy()
  w[~np.isfinite(w)] = -2.0
  fmt = MXFormat(elem)  # 48 = 32 + a ragged 16
  bwd = None if bwd_elem is None else MXFormat(bwd_elem, block=16, axis=0)

  def value_and_grad(x, impl):
    """The cast and the gradient of sum(cast * w) (its vjp of w)."""
    value, vjp = jax.vjp(lambda x: jlp.quantize(x, fmt, bwd=bwd, impl=impl), x)
    return value, vjp(jnp.asarray(w))[0]

  # both impls in one program (each forward compiled once, for its value and its gradient)
  got, want = jax.jit(lambda x: (value_and_grad(x, "pallas"), value_and_grad(x, "xla")))(
      jnp.asarray(x))
  for g, v in zip(got, want, strict=True):
    ref.assert_same_bits(np.asarray(g), np.asarray(v))
  ref.assert_same_bits(np.asarray(got[0]), mx_reference(x, elem, 32, -1), x)
  want_grad = w if bwd is None else mx_reference(w, bwd_elem, 16, 0)
  ref.assert_same_bits(np.asarray(got[1]), want_grad, w)


def test_stochastic_through_jlp_quantize_uses_the_documented_draws():
  fmt = MXFormat(FloatFormat.from_name("float8_e5m2", rounding="stochastic"), block=32, axis=0)
  x = sample((40, 12), 0, seed=6)
  key = jax.random.key(7)
  run = jax.jit(lambda x, k: [jlp.quantize(x, fmt, key=k, impl=i) for i in ("pallas", "xla")])
  got, want = (np.asarray(v) for v in run(jnp.asarray(x), key))
  words = [int(v) for v in np.asarray(jax.random.key_data(key))]
  rbits = ref.stochastic_draws(words, x.size).reshape(x.shape)
  ref.assert_same_bits(got, mx_reference(x, "float8_e5m2", 32, 0, rbits), x)
  ref.assert_same_bits(got, want)


def test_auto_picks_the_kernel_on_gpu(monkeypatch):
  calls = []
  kernel = mx_kernel.mx_quantize

  def spy(x, fmt, rbits=None, *, interpret=False, **kwargs):
    calls.append(interpret)
    return kernel(x, fmt, rbits, interpret=True, **kwargs)

  x = jnp.asarray(sample((8, 32), -1, seed=8))
  run = lambda x, impl: jlp.quantize(x, MXFormat("int8"), impl=impl)  # noqa: E731
  want = np.asarray(jax.jit(run, static_argnums=1)(x, "xla"))
  monkeypatch.setattr(mx_kernel, "mx_quantize", spy)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  got = np.asarray(jax.jit(run, static_argnums=1)(x, "auto"))
  assert calls == [False]  # compiled (not interpreted) on a GPU
  ref.assert_same_bits(got, want)


def test_empty_array():
  out = mx_kernel.mx_quantize(jnp.zeros((0, 32), jnp.float32), MXFormat("int8"), interpret=True)
  assert out.shape == (0, 32) and out.dtype == jnp.float32


def test_argument_errors():
  x = jnp.ones((4, 64), jnp.float32)
  with pytest.raises(ValueError, match="rbits"):
    mx_kernel.mx_quantize(x, mx_format("float8_e4m3fn", "stochastic", 32, -1), interpret=True)
  with pytest.raises(ValueError, match="rbits has shape"):
    mx_kernel.mx_quantize(x, mx_format("float8_e4m3fn", "stochastic", 32, -1),
                          jnp.zeros((4, 32), jnp.uint32), interpret=True)
  with pytest.raises(ValueError, match="axis=2"):
    mx_kernel.mx_quantize(x, MXFormat("int8", axis=2), interpret=True)
  with pytest.raises(ValueError, match="rows_per_tile"):
    mx_kernel.mx_quantize(x, MXFormat("int8"), interpret=True, rows_per_tile=3)
  with pytest.raises(TypeError):
    mx_kernel.mx_quantize(x, jlp.BFPFormat(8, (1, 32)), interpret=True)


# -- scale modes -------------------------------------------------------------------------------

def check_modes(x, block: int, axis: int, rows_per_tile, elems, modes=SCALE_MODES[1:]):
  """Kernel == XLA path (uint32 views) == mx_reference, for each element format and scale mode."""
  fmts = tuple(MXFormat(e, block=block, axis=axis, scale_mode=m) for e in elems for m in modes)
  got_all = _kernel_fn(fmts, rows_per_tile)(x, None)
  want_all = _xla_fn(fmts)(x, None)
  for fmt, got, want in zip(fmts, got_all, want_all, strict=True):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=repr(fmt))
    name = "int8" if fmt.elem == "int8" else fmt.elem.name
    with np.errstate(invalid="ignore"):
      ref.assert_same_bits(got, mx_reference(x, name, block, axis, mode=fmt.scale_mode), x,
                           repr(fmt))


# Slow: the float6 elements, whose kernel body takes the branches of float4_e2m1fn (a float element
# without inf or NaN, with subnormals; `mx_rows_bits` and the cast differ in constants only).
@pytest.mark.parametrize("elem", [pytest.param(e, marks=pytest.mark.slow) if e.startswith("float6")
                                  else e for e in ELEMENTS])
def test_scale_modes_match_xla_path_and_reference(elem):
  """Each mode's boundary blocks (`scale_mode_blocks`: 100-odd blocks of 32, 8 tiles of 16)."""
  x = scale_mode_blocks(elem, np.random.default_rng(len(elem)))
  check_modes(x, 32, -1, 16, [elem])


# Slow: every element but int8 (the element with its own branches in "even" and "rceil"): the
# layout (axis 0, ragged blocks, padded tiles) is the same for every element and mode, and runs for
# every element in test_matches_xla_path_and_reference and for "rceil" E4M3 in
# test_prescale_matches_xla_path_and_reference.
@pytest.mark.parametrize("elem", [e if e == "int8" else pytest.param(e, marks=pytest.mark.slow)
                                  for e in ELEMENTS])
def test_scale_modes_along_axis_0(elem):
  """Along axis 0 with ragged blocks, the wide sample (G = 72, P = 32, 9 tiles of 8)."""
  check_modes(sample((50, 24), 0, seed=7), 20, 0, 8, [elem])


def test_scale_modes_special_values():
  check_modes(special_blocks(), 32, -1, 4, ["float8_e4m3fn", "float4_e2m1fn", "int8"])


@pytest.mark.lowering
@pytest.mark.parametrize("elem,mode", lowering.covering_grid(
    [("float8_e4m3fn",), ("float6_e2m3fn",), ("int8",)], [(m,) for m in SCALE_MODES]))
def test_scale_modes_lower_to_triton(elem, mode):
  fmt = MXFormat(elem, block=32, axis=-1, scale_mode=mode)
  hlo = lowering.lower_for_h100(lambda x: mx_kernel.mx_quantize(x, fmt),
                                jax.ShapeDtypeStruct((257, 1000), jnp.float32))
  assert lowering.TRITON_CALL in hlo
  assert "grid_x = 65 " in hlo


def test_scale_mode_kernel_bodies_shift_below_width():
  """Every shift in `mx_rows_bits` (incl. the "rceil" division and the prescale's multiply and
  division) is below 32 bits on boundary
  blocks (XLA and Triton disagree on wider shifts; kernel_lowering_test.py)."""
  u = np.concatenate([scale_mode_blocks(e, np.random.default_rng(5)) for e in ELEMENTS])
  u = np.concatenate([u, special_blocks()]).view(np.uint32)
  fmts = [MXFormat(e, scale_mode=m) for e in ("float8_e4m3fn", "int8") for m in SCALE_MODES]
  fmts += [MXFormat("float4_e2m1fn", scale_mode=m, prescale=0.75) for m in ("floor", "rceil")]
  bodies = {repr(f): (lambda u, r, f=f: mx_rows_bits(u, f)) for f in fmts}
  assert lowering.shifts_at_or_above_width(bodies, u, u) == []


# -- prescale ------------------------------------------------------------------------------------

def test_prescale_matches_xla_path_and_reference():
  """Tseng et al.'s 3/4 prescale (nearest and stochastic E2M1, "floor" and "rceil" E4M3) on the
  wide sample along axis 0 with ragged blocks (G = 72, P = 32, 9 tiles of 8)."""
  x = sample((50, 24), 0, seed=9)
  rbits = random_bits(x.shape, 3)
  sr = FloatFormat.from_name("float4_e2m1fn", rounding="stochastic")
  fmts = (MXFormat(sr, block=20, axis=0, prescale=0.75),
          MXFormat("float4_e2m1fn", block=20, axis=0, prescale=0.75),
          MXFormat("float8_e4m3fn", block=20, axis=0, scale_mode="rceil", prescale=0.75))
  names = ("float4_e2m1fn", "float4_e2m1fn", "float8_e4m3fn")
  got_all = _kernel_fn(fmts, 8)(x, rbits)
  want_all = _xla_fn(fmts)(x, rbits)
  for fmt, name, got, want in zip(fmts, names, got_all, want_all, strict=True):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=repr(fmt))
    r = rbits if fmt.rounding == "stochastic" else None
    with np.errstate(invalid="ignore"):
      ref.assert_same_bits(got, mx_reference(x, name, 20, 0, r, fmt.scale_mode, 0.75), x,
                           repr(fmt))
