"""The block-scaled Pallas kernel (interpret mode) against its XLA path and the numpy reference.

References: `jlp.numerics.block_scaled.block_scaled_quantize` (the XLA path, compared as uint32
bit patterns) and `block_scaled_reference` of tests/numerics/block_scaled_test.py (numpy float32
arithmetic and ml_dtypes casts, written from the issue's rule; NaNs compared by sign only).
Grids stay at <= 16 steps. The lowering for cuda uses `lower_for_h100` of
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
from jlp.formats import BlockScaledFormat, FloatFormat, MXFormat
from jlp.numerics import block_scaled as xla_block_scaled
from jlp.numerics.block_scaled import block_scaled_rows_bits
from numerics.block_scaled_test import (block_scaled_reference, boundary_values, outlier_normal,
                                        scaled_ties, special_rows)
from pallas_kernels import block_scaled as kernel
import references as ref


def _lowering_helpers():
  """tests/pallas_kernels/kernel_lowering_test.py, loaded by path (the directory is not a package,
  and `pallas_kernels` names the kernels' package)."""
  path = pathlib.Path(__file__).with_name("kernel_lowering_test.py")
  spec = importlib.util.spec_from_file_location("_kernel_lowering_helpers", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


lowering = _lowering_helpers()


@functools.lru_cache(maxsize=None)
def _both(fmts: tuple, rows_per_tile):
  """One jitted function: (kernel results, XLA results) for every format."""
  def run(x):
    return ([kernel.block_scaled_quantize(x, f, interpret=True, rows_per_tile=rows_per_tile)
             for f in fmts], [xla_block_scaled.block_scaled_quantize(x, f) for f in fmts])
  return jax.jit(run)


def _formats(block, axis, rule, combos):
  return tuple(BlockScaledFormat(e, block=block, axis=axis, pow2_scale=p, scale_rule=rule)
               for e, p in combos)


def check(x, block, axis, rows_per_tile, elems=("float8_e4m3fn", "float8_e5m2"), rule="divide",
          combos=None, results=None):
  """Kernel == XLA path (uint32 views) == reference, for each element format, pow2 on and off
  (or for the (element, pow2) pairs `combos`); `results`: those of `_both`, computed already."""
  combos = combos or tuple((e, p) for e in elems for p in (False, True))
  fmts = _formats(block, axis, rule, combos)
  got_all, want_all = _both(fmts, rows_per_tile)(jnp.asarray(x)) if results is None else results
  for fmt, got, want in zip(fmts, got_all, want_all, strict=True):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=repr(fmt))
    ref.assert_same_bits(got, block_scaled_reference(x, fmt.elem.name, block, axis,
                                                     fmt.pow2_scale, rule), x, repr(fmt))


CASES = [
    # (1, 128): G = 128, P = 128, default tiles of 32 -> 4 steps
    ("128x128 normal", lambda: outlier_normal((128, 128), 0), (1, 128), -1, None),
    # (128, 128): G = 2 x 3 = 6 one-block tiles of 16384 (272 = 128 + 128 + 16)
    ("256x272 normal", lambda: outlier_normal((256, 272), 1), (128, 128), -1, None),
    # (1, 128): G = 304 x 3 = 912, 15 tiles of 64
    ("304x304 boundary", lambda: boundary_values((304, 304), 2), (1, 128), -1, 64),
    # (128, 128) along axis 0: G = 9 ragged blocks (304 = 128 + 128 + 48)
    ("304x304 axis 0", lambda: boundary_values((304, 304), 3), (128, 128), 0, None),
    # (128, 128): G = 3 x 2 = 6
    ("320x256 normal", lambda: outlier_normal((320, 256), 4), (128, 128), -1, None),
    # (1, 128): G = 640, 10 tiles of 64
    ("320x256 boundary", lambda: boundary_values((320, 256), 5), (1, 128), -1, 64),
    # moderate scales (the XLA path's float ops), inf and NaN blocks: 10 tiles of 64
    ("320x256 moderate", lambda: boundary_values((320, 256), 5, -60, 60), (1, 128), -1, 64),
    # x / s on and beside the E4M3 grid's ties: 64 blocks, 4 tiles
    ("ties", lambda: scaled_ties("float8_e4m3fn", 17), (1, 128), -1, 16),
    # 11 special rows of 200: G = 22 (200 = 128 + 72), tiles of 2 -> 11 steps
    ("specials", lambda: special_rows(200, 6), (1, 128), -1, 2),
    ("all zeros", lambda: np.zeros((130, 140), np.float32), (128, 128), -1, None),
    ("all maxima", lambda: np.full((130, 140), np.finfo(np.float32).max, np.float32),
     (128, 128), -1, None),
    # rank 3, blocks (3, 16) along axis 1 (moved last): a (35, 50) matrix, G = 12 x 4 = 48,
    # P = 64, tiles of 4 -> 12 steps
    ("3-d axis 1 ragged", lambda: outlier_normal((5, 50, 7), 7), (3, 16), 1, 4),
]


COMBOS = tuple((e, p) for e in ("float8_e4m3fn", "float8_e5m2") for p in (False, True))
E4, E4P, E5, E5P = COMBOS


def _ident(name, combos):
  return name + "-" + "+".join(f"{e[len('float8_'):]}{'-pow2' if p else ''}" for e, p in combos)


def _split(cases, default_combos):
  """(case..., combos) params: the (element, pow2) pairs `default_combos[name]` of each case in
  the default tier, its other pairs (one param, one compile) slow; all four slow for cases not in
  `default_combos`."""
  params = []
  for case in cases:
    default = default_combos.get(case[0], ())
    rest = tuple(c for c in COMBOS if c not in default)
    if default:
      params.append(pytest.param(*case, default, id=_ident(case[0], default)))
    params.append(pytest.param(*case, rest, id=_ident(case[0], rest), marks=pytest.mark.slow))
  return params


# One (element, pow2) pair per case in the default tier, each pair in one or two cases: e4m3fn and
# e5m2 take the same branches of the kernel body (a saturating cast to an element with a finite
# max; other constants), and pow2_scale off and on each run on normal, boundary and special data
# and on (128, 128) and (1, 128) tiles ("specials" keeps two pairs); "ties" keeps e4m3fn without pow2 (its data is built for
# that grid and a non-power-of-two scale). The other pairs of each case are slow.
# Slow (all pairs): "320x256 normal" (the one-block (128, 128) tiles of "256x272 normal", which
# has a partial block too), "320x256 boundary" ("304x304 boundary": the same data kind and tile
# size, and a padded last tile), "all zeros" and "all maxima" ("specials" has all-zero (signed)
# and all-maxima blocks; "256x272 normal" the (128, 128) tiles), "320x256 moderate" (the tiles of
# "304x304 boundary"; its inf and NaN blocks are in "specials", and the XLA path's float ops, which
# it takes, run in "128x128 normal" and "ties"; its XLA path against the reference in
# tests/numerics/block_scaled_test.py).
DEFAULT_COMBOS = {"128x128 normal": (E5P,), "256x272 normal": (E4,), "304x304 boundary": (E5,),
                  "304x304 axis 0": (E4P,), "ties": (E4,), "specials": (E4P, E5),
                  "3-d axis 1 ragged": (E5P,)}


@pytest.mark.parametrize("name,make,block,axis,rows_per_tile,combos", _split(CASES, DEFAULT_COMBOS))
def test_matches_xla_path_and_reference(name, make, block, axis, rows_per_tile, combos, request):
  x = make()
  check(x, block, axis, rows_per_tile, combos=combos,
        results=_default_results(request, ("divide", name, combos), x))


RECIPROCAL_CASES = [c for c in CASES if c[0] in ("128x128 normal", "304x304 axis 0", "ties",
                                                 "specials", "3-d axis 1 ragged")] + [
    # one (96 x 130) block: TE's per-tensor current scaling, P = 16384, one tile
    ("per tensor", lambda: outlier_normal((96, 130), 10), (2 ** 31 - 1, 2 ** 31 - 1), -1, None),
]


# Slow (all pairs): "128x128 normal", "304x304 axis 0" and "3-d axis 1 ragged": their tilings
# run in test_matches_xla_path_and_reference, the reciprocal body on every data kind in "ties"
# and "specials" here, one tile of a whole tensor in "per tensor". Each (element, pow2) pair runs
# once in the default tier (e4m3fn without pow2 on "ties", as above).
RECIPROCAL_DEFAULT_COMBOS = {"ties": (E4,), "specials": (E4P, E5), "per tensor": (E5P,)}


@pytest.mark.parametrize("name,make,block,axis,rows_per_tile,combos",
                         _split(RECIPROCAL_CASES, RECIPROCAL_DEFAULT_COMBOS))
def test_reciprocal_rule_matches_xla_path_and_reference(name, make, block, axis, rows_per_tile,
                                                        combos, request):
  """scale_rule="reciprocal" (TransformerEngine's multiplier and scale_inv)."""
  x = make()
  check(x, block, axis, rows_per_tile, rule="reciprocal", combos=combos,
        results=_default_results(request, ("reciprocal", name, combos), x))


WIDER_DEFAULT = (("float16", False), ("bfloat16", True))


def wider_input():
  return np.concatenate([special_rows(130, 8), outlier_normal((6, 130), 9)])


# Each element and each pow2_scale once in the default tier; the other two pairs are slow.
@pytest.mark.parametrize("combos", [
    pytest.param(WIDER_DEFAULT, id="float16+bfloat16-pow2"),
    pytest.param((("float16", True), ("bfloat16", False)), id="float16-pow2+bfloat16",
                 marks=pytest.mark.slow)])
def test_wider_elements(combos, request):
  """float16 / bfloat16 elements (subnormal quotients): G = 17 x 3 = 51 blocks of 64, 13 tiles."""
  x = wider_input()
  check(x, (1, 64), -1, 4, combos=combos,
        results=_default_results(request, ("divide", "wider", combos), x))


@functools.lru_cache(maxsize=None)
def _default_keys():
  keys = {(rule, name, combos)
          for rule, default in (("divide", DEFAULT_COMBOS),
                                ("reciprocal", RECIPROCAL_DEFAULT_COMBOS))
          for name, combos in default.items()}
  return keys | {("divide", "wider", WIDER_DEFAULT)}


def _default_checks():
  """(key, x, block, axis, rows_per_tile, rule, combos) of the default tier's `check` calls above
  (test_matches_xla_path_and_reference, test_reciprocal_rule_..., test_wider_elements)."""
  out = []
  for rule, cases, default in (("divide", CASES, DEFAULT_COMBOS),
                               ("reciprocal", RECIPROCAL_CASES, RECIPROCAL_DEFAULT_COMBOS)):
    for name, make, block, axis, rows_per_tile in cases:
      if name in default:
        out.append(((rule, name, default[name]), make(), block, axis, rows_per_tile, rule,
                    default[name]))
  out.append((("divide", "wider", WIDER_DEFAULT), wider_input(), (1, 64), -1, 4, "divide",
              WIDER_DEFAULT))
  return out


@pytest.fixture(scope="module")
def default_results():
  """{key: (x, `_both` results)} of `_default_checks`, all computed by one jitted program (a
  program per check compiles each apart, with more overhead per program)."""
  checks = _default_checks()
  assert {c[0] for c in checks} == _default_keys()
  fmts = [_formats(block, axis, rule, combos) for _, _, block, axis, _, rule, combos in checks]
  rows = [c[4] for c in checks]

  def run(xs):
    return [([kernel.block_scaled_quantize(x, f, interpret=True, rows_per_tile=r) for f in fs],
             [xla_block_scaled.block_scaled_quantize(x, f) for f in fs])
            for x, fs, r in zip(xs, fmts, rows, strict=True)]

  outs = jax.jit(run)([jnp.asarray(c[1]) for c in checks])
  return {c[0]: (c[1], o) for c, o in zip(checks, outs, strict=True)}


def _default_results(request, key, x):
  """The results of a default-tier check from `default_results` (None for the slow params);
  x must be the input they were computed from, bit for bit."""
  if key not in _default_keys():
    return None
  bx, results = request.getfixturevalue("default_results")[key]
  assert np.array_equal(np.asarray(bx, np.float32).view(np.uint32),
                        np.asarray(x, np.float32).view(np.uint32))
  return results


def test_jlp_quantize_pallas_equals_xla_with_gradient():
  x = outlier_normal((32, 256), 10)
  w = np.random.default_rng(11).standard_normal(x.shape).astype(np.float32)
  fmt = BlockScaledFormat("float8_e5m2", block=(16, 128))
  bwd = BlockScaledFormat(block=(1, 128), axis=0, pow2_scale=True)

  def value_and_grad(v, impl):
    """The cast and the gradient of sum(cast * w) (its vjp of w)."""
    value, vjp = jax.vjp(lambda v: jlp.quantize(v, fmt, bwd=bwd, impl=impl), v)
    return value, vjp(jnp.asarray(w))[0]

  # both impls in one program (each forward compiled once, for its value and its gradient)
  (value, got), (want_value, want) = jax.jit(
      lambda v: (value_and_grad(v, "pallas"), value_and_grad(v, "xla")))(jnp.asarray(x))
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  ref.assert_same_bits(got, block_scaled_reference(w, "float8_e4m3fn", (1, 128), 0, True), w)
  value = np.asarray(value)
  np.testing.assert_array_equal(value.view(np.uint32), np.asarray(want_value).view(np.uint32))
  ref.assert_same_bits(value, block_scaled_reference(x, "float8_e5m2", (16, 128), -1), x)


def test_empty_and_argument_errors():
  out = kernel.block_scaled_quantize(jnp.zeros((0, 8), jnp.float32), BlockScaledFormat(),
                                     interpret=True)
  assert out.shape == (0, 8) and out.dtype == jnp.float32
  x = jnp.ones((4, 256), jnp.float32)
  with pytest.raises(TypeError, match="expected a BlockScaledFormat"):
    kernel.block_scaled_quantize(x, MXFormat("int8"), interpret=True)
  with pytest.raises(ValueError, match="x.dtype=float16 is not allowed"):
    kernel.block_scaled_quantize(x.astype(jnp.float16), BlockScaledFormat(), interpret=True)
  with pytest.raises(ValueError, match="axis=-3"):
    kernel.block_scaled_quantize(x, BlockScaledFormat(axis=-3), interpret=True)
  with pytest.raises(ValueError, match="rows_per_tile=3 is not allowed"):
    kernel.block_scaled_quantize(x, BlockScaledFormat(), interpret=True, rows_per_tile=3)
  with pytest.raises(ValueError, match="expected at most 1048576 elements per block"):
    kernel.block_scaled_quantize(jnp.ones((2048, 1024), jnp.float32),
                                 BlockScaledFormat(block=(2048, 1024)), interpret=True)


LOWERING_FORMATS = [BlockScaledFormat(e, block=b, pow2_scale=p)
                    for e in ("float8_e4m3fn", "float8_e5m2") for b in ((1, 128), (128, 128))
                    for p in (False, True)] + [BlockScaledFormat(FloatFormat.from_name("bfloat16"),
                                                                 block=(2, 48), axis=0)] + [
    BlockScaledFormat(e, block=(1, 128), pow2_scale=p, scale_rule="reciprocal")
    for e in ("float8_e4m3fn", "float8_e5m2") for p in (False, True)]


# Slow: the (1, 128) and (128, 128) divide-rule formats with e4m3fn and pow2_scale off or e5m2 and
# pow2_scale on (each element, pow2 setting and block shape lowers in the default tier; e4m3fn and
# e5m2 take the same ops, other constants).
@pytest.mark.lowering
@pytest.mark.parametrize("fmt", [
    pytest.param(f, id=repr(f), marks=pytest.mark.slow
                 if f.scale_rule == "divide" and f.elem.name.startswith("float8")
                 and (f.elem.name == "float8_e4m3fn") != f.pow2_scale else ())
    for f in LOWERING_FORMATS])
def test_lowers_to_triton(fmt):
  """(1000, 1000): (1, 128) blocks -> G = 8000, tiles of 32 -> 250 steps; (128, 128) -> 64
  one-block tiles of 16384; (2, 48) along axis 0 -> P = 128, 500 x 21 blocks."""
  hlo = lowering.lower_for_h100(lambda x: kernel.block_scaled_quantize(x, fmt),
                                jax.ShapeDtypeStruct((1000, 1000), jnp.float32))
  assert lowering.TRITON_CALL in hlo
  grid = {(1, 128): 250, (128, 128): 64, (2, 48): -(-500 * 21 // 32)}[fmt.block]
  assert f"grid_x = {grid} " in hlo


SHIFT_FORMATS = [f for f in LOWERING_FORMATS if f.block == (1, 128)]


# Half of the (1, 128) formats in the default tier: each rule with e4m3fn and e5m2 (same branches,
# other constants; see DEFAULT_COMBOS) and with pow2_scale off and on. The other half is slow.
@pytest.mark.parametrize("fmts", [
    pytest.param([f for f in SHIFT_FORMATS if (f.elem.name == "float8_e4m3fn") != f.pow2_scale],
                 id="e4m3fn+e5m2-pow2"),
    pytest.param([f for f in SHIFT_FORMATS if (f.elem.name == "float8_e4m3fn") == f.pow2_scale],
                 id="e4m3fn-pow2+e5m2", marks=pytest.mark.slow)])
def test_kernel_body_shifts_below_width(fmts):
  """Every shift in `block_scaled_rows_bits` (division, multiply, element cast, pow2 scale) is
  below 32 bits on blocks with tiny, zero-quotient, zero, huge and non-finite maxima."""
  assert len(fmts) == 4 and {f.scale_rule for f in fmts} == {"divide", "reciprocal"}
  u = np.concatenate([special_rows(128, 12), outlier_normal((8, 128), 13),
                      boundary_values((8, 128), 14)]).view(np.uint32)
  bodies = {repr(f): (lambda u, r, f=f: block_scaled_rows_bits(u, f)) for f in fmts}
  assert lowering.shifts_at_or_above_width(bodies, u, u) == []


def test_pallas_on_gpu_compiles_the_kernel(monkeypatch):
  """impl="pallas" on a GPU runs the kernel compiled, not interpreted (impl="auto" takes the
  XLA path there: tests/numerics/block_scaled_test.py)."""
  calls = []
  quantize_kernel = kernel.block_scaled_quantize

  def spy(x, fmt, *, interpret=False, **kwargs):
    calls.append(interpret)
    return quantize_kernel(x, fmt, interpret=True, **kwargs)

  x = jnp.asarray(outlier_normal((8, 256), 15))
  run = lambda x, impl: jlp.quantize(x, BlockScaledFormat(), impl=impl)  # noqa: E731
  want = np.asarray(jax.jit(run, static_argnums=1)(x, "xla"))
  monkeypatch.setattr(kernel, "block_scaled_quantize", spy)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  got = np.asarray(jax.jit(run, static_argnums=1)(x, "pallas"))
  assert calls == [False]  # compiled (not interpreted) on a GPU
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
