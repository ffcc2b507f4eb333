"""NVFP4 (XLA path) against numpy transcriptions of its peers, and torchao's own output.

References: tests/nvfp4_reference.py (numpy float32 + ml_dtypes, written from
TransformerEngine's NVFP4QuantizerRef and torchao 0.18's nvfp4_quantize / dequantize; the
Hadamard transform in jlp's documented order), `references.round_to_format` (float64, for the
stochastic E2M1 step), and tests/data/nvfp4_torchao.npz (torchao 0.18 run on CPU by
tests/data/make_nvfp4_goldens.py). Codes, scales (as bytes), amax and decoded values are compared
bit for bit; a NaN decoded value only as NaN (its sign and payload are the platform's), and the
codes and scale bytes of blocks that decode to NaN against jlp's documented NaN codes.
Shapes are shared between tests so that each jitted function compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jlp
from jlp.formats import FloatFormat, NVFP4Format
from jlp.numerics import nvfp4
import nvfp4_reference as R
import references as ref

TE_SHAPES = [(128, 128), (256, 272), (304, 304), (320, 256)]  # TE's exact tests (1x16 and 16x16)
TE_FMTS = (NVFP4Format(), NVFP4Format(block=(16, 16)))
AO_FMTS = (NVFP4Format(compat="torchao", tensor_scale=False), NVFP4Format(compat="torchao"))
ALL_FMTS = TE_FMTS + AO_FMTS
E2M1_SR = FloatFormat.from_name("float4_e2m1fn", rounding="stochastic")
F32_MAX = np.finfo(np.float32).max
pytestmark = pytest.mark.usefixtures("fast_compile")  # XLA's passes off: compiles ~4x faster


def _casts(x, r, fmts):
  """(codes, scales, amax, quantized) of x for each format."""
  return [(*nvfp4.encode(x, fmt, r if fmt.rounding == "stochastic" else None),
           nvfp4.nvfp4_quantize(x, fmt, r if fmt.rounding == "stochastic" else None))
          for fmt in fmts]


@functools.lru_cache(maxsize=None)
def _run(fmts: tuple):
  """One jitted function: `_casts` of x."""
  return jax.jit(lambda x, r: _casts(x, r, fmts))


SR_FMTS = (NVFP4Format(rounding="stochastic"), NVFP4Format(block=(16, 16), rounding="stochastic"))
RHT_FMTS = (NVFP4Format(rht=True), NVFP4Format(rht=True, rounding="stochastic"))
# The formats of the (128, 128) tests: x of that shape is cast to all of them by one program
# (compiled once; a program per set of formats would compile their casts again).
SQUARE_FMTS = ALL_FMTS + SR_FMTS + RHT_FMTS


def run(x, fmts, rbits=None):
  x = np.asarray(x, np.float32)
  r = np.zeros(x.shape, np.uint32) if rbits is None else rbits
  if x.shape == (128, 128) and set(fmts) <= set(SQUARE_FMTS):
    out = _run(SQUARE_FMTS)(x, r)
    out = [out[SQUARE_FMTS.index(f)] for f in fmts]
  else:
    out = _run(tuple(fmts))(x, r)
  return [tuple(np.asarray(a) for a in o) for o in out]


def random_bits(shape, seed):
  return np.random.default_rng(seed).integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)


# -- expected results in x's layout -------------------------------------------------------------

def _matrix(x, axis):
  moved = np.moveaxis(x, axis, -1)
  return moved.reshape(-1, x.shape[axis]), moved.shape


def _back(m, moved_shape, axis):
  return np.moveaxis(m.reshape(moved_shape), -1, axis)


def _scales_layout(s, x_shape, moved_shape, fmt):
  axis = fmt.axis % len(x_shape)
  if fmt.block == (1, 16):
    return np.moveaxis(s.reshape(moved_shape[:-1] + (s.shape[-1],)), -1, axis)
  if len(x_shape) == 2 and axis == 0:
    return s.T
  return s


def expected(x, fmt, rbits=None):
  """(codes, scales, amax, decoded, NaN scaled values) from the numpy transcriptions, in jlp's
  layouts; the last is None for TE (whose codes do not depend on a NaN's bits)."""
  m, moved = _matrix(np.asarray(x, np.float32), fmt.axis)
  nan_v = None
  if fmt.compat == "torchao":
    pad = -m.shape[1] % 16
    mp = np.pad(m, ((0, 0), (0, pad)))
    amax = np.float32(np.max(np.abs(m)))
    pts = R.per_tensor_amax_to_scale(amax) if fmt.tensor_scale else None
    s, c = R.torchao_quantize(mp, pts)
    q = R.torchao_dequantize(c, s, pts)[:, :m.shape[1]]
    c = c[:, :m.shape[1]]
    nan_v = _back(np.isnan(R.torchao_scaled(mp, pts)[1][:, :m.shape[1]]), moved, fmt.axis)
  else:
    t = R.rht(m) if fmt.rht else m
    if fmt.rounding == "stochastic":
      c, s, amax = te_stochastic(t, fmt.block, _matrix(rbits, fmt.axis)[0])
    else:
      c, s, amax = R.te_quantize(t, fmt.block)
    s = s[:-(-m.shape[0] // fmt.block[0]), :-(-m.shape[1] // 16)]
    q = R.te_decode(c, s, amax, fmt.block)
    if fmt.rht:
      q = R.inverse_rht(q)
  return (_back(c, moved, fmt.axis), _scales_layout(s, x.shape, moved, fmt), amax,
          _back(q, moved, fmt.axis), nan_v)


def te_stochastic(x2d, tile, rbits2d):
  """TE's scaling with the E2M1 step rounded stochastically (float64 `round_to_format`) and
  TE's sign rule (bit 8 iff the scaled value is < 0)."""
  scaled, scales, amax = R.te_scaled(x2d, tile)
  with np.errstate(all="ignore"):
    clipped = np.clip(scaled, np.float32(-6), np.float32(6))
  mag = ref.round_to_format(np.abs(clipped), E2M1_SR, rbits2d)
  codes = np.searchsorted(R.FP4_VALUES[:8], mag).astype(np.uint8) | np.where(clipped < 0, 8, 0)
  codes = np.where(np.isnan(clipped), 0, codes).astype(np.uint8)
  return codes, (scales[::16] if tile == (16, 16) else scales), amax


def assert_matches(got, want, fmt, label=""):
  """Bit equality of codes, scale bytes, amax and decoded values (NaNs as NaN). Where torchao's
  scaled value is NaN its code depends on the NaN's sign and payload (the platform's), so there
  jlp's documented code 3 is expected; NaN scales are jlp's 0x7F."""
  (c, s, a, q), (wc, ws, wa, wq, nan_v) = got, want
  msg = f"{label} {fmt!r}"
  nan_q = np.isnan(wq)
  assert np.array_equal(np.isnan(q), nan_q), msg + ": NaN positions"
  nan_v = np.zeros(c.shape, bool) if nan_v is None else nan_v
  assert np.array_equal(c[~nan_v], wc[~nan_v]), msg + f": codes ({(c != wc).sum()} differ)"
  assert np.all(c[nan_v] == 3), msg + ": codes of NaN"
  s8, ws8 = s.view(np.uint8), np.asarray(ws).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  nan_s = np.isnan(np.asarray(ws, np.float32))
  assert s8.shape == ws8.shape, msg + f": scale shape {s8.shape} != {ws8.shape}"
  assert np.array_equal(s8[~nan_s], ws8[~nan_s]), msg + ": scales"
  assert np.all(s8[nan_s] == 0x7F), msg + ": NaN scales"
  assert ref.bits(a) == ref.bits(wa) or (np.isnan(a) and np.isnan(wa)), msg + ": amax"
  ref.assert_same_bits(np.where(nan_q, np.nan, q), np.where(nan_q, np.nan, wq), msg=msg)


def check(x, fmts, rbits=None, label="", results=None):
  """The casts of x (`run`, or the `results` of `run` given) against the references."""
  for fmt, got in zip(fmts, run(x, fmts, rbits) if results is None else results, strict=True):
    assert_matches(got, expected(x, fmt, rbits), fmt, label)


# -- TransformerEngine's exact tests ------------------------------------------------------------

# Slow: (256, 272), (304, 304) and (320, 256), whole 16 x 16 tiles and 1 x 16 blocks like
# (128, 128), which runs every format (each shape is its own program; the tiling and the code
# take the same branches).
@pytest.mark.parametrize("shape", [s if s == (128, 128) else pytest.param(s, marks=pytest.mark.slow)
                                   for s in TE_SHAPES], ids=str)
def test_te_exact_shapes(shape):
  x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
  check(x, ALL_FMTS if shape == (128, 128) else TE_FMTS, label=str(shape))


@pytest.mark.parametrize("value", [0.0, F32_MAX, -F32_MAX], ids=["zeros", "maxima", "minima"])
def test_extrema(value):
  check(np.full((128, 128), value, np.float32), ALL_FMTS)


def boundary_values(rows):
  """TE's boundary test: linspace(-12, 12, N / 2) - 1e-3 and + 1e-3, interleaved, in every row."""
  base = np.linspace(-12.0, 12.0, 64, dtype=np.float32)
  row = np.stack([base - np.float32(1e-3), base + np.float32(1e-3)], axis=1).reshape(-1)
  return np.tile(row, (rows, 1))


def test_boundary_values():
  check(boundary_values(128), ALL_FMTS)


def test_e2m1_thresholds_and_ties():
  """Every E2M1 value, midpoint (tie) and their float32 neighbours up to 6, as exactly scaled
  values: each row's first tile has max 6 and the tensor amax is 2688, so TE's encode scale is
  exactly 1 (ges = 1, s = e4m3(6 * float32(1/6)) = 1), as are torchao's (s = 1, pts = 1)."""
  mids = ref.midpoints_and_neighbours(FloatFormat.from_name("float4_e2m1fn"))
  vals = np.concatenate([mids, R.FP4_VALUES, [-0.0, 1e-40, -1e-40]]).astype(np.float32)
  vals = vals[np.abs(vals) <= 6]
  x = np.zeros((128, 128), np.float32)
  x[:, 1:16] = np.resize(vals, (128, 15))
  x[:, 0] = 6.0
  x[0, 127] = 2688.0
  check(x, ALL_FMTS)


def test_tiny_and_wide_ranges():
  """Subnormal and tiny tensors (subnormal global decode scales, products and quotients) and
  tiles spanning 2^-150 .. 2^120: the float32 steps are exact under XLA:CPU's flushing."""
  rng = np.random.default_rng(7)
  exps = np.repeat(rng.integers(-150, -100, (128, 8)), 16, axis=1)
  check((rng.standard_normal((128, 128)) * 2.0 ** exps).astype(np.float32), ALL_FMTS, label="tiny")
  wide = rng.standard_normal((128, 128)) * 2.0 ** rng.integers(-150, 120, (128, 128))
  check(wide.astype(np.float32), ALL_FMTS, label="wide")
  mixed = rng.standard_normal((128, 128)).astype(np.float32) * np.float32(2.0 ** -126)
  mixed[::3, ::5] = np.float32(1e-45)
  mixed[1::7] *= np.float32(-1)
  check(mixed, ALL_FMTS, label="subnormal")


def test_specials():
  x = np.random.default_rng(3).standard_normal((128, 128)).astype(np.float32)
  inf = x.copy()
  inf[3, 7], inf[40, 100] = np.inf, -np.inf
  check(inf, ALL_FMTS, label="inf")
  nan = x.copy()
  nan[5, 21] = np.nan
  nan[9, :16] = 0.0
  nan[10, 0] = -0.0
  check(nan, ALL_FMTS, label="nan")


# -- layouts: other axes, ragged axes, more dimensions ------------------------------------------

AXIS0_FMTS = (NVFP4Format(axis=0), NVFP4Format(block=(16, 16), axis=0),
              NVFP4Format(compat="torchao", tensor_scale=False, axis=0))
MIDDLE_FMTS = (NVFP4Format(axis=1), NVFP4Format(block=(16, 16), axis=-2))


def axis_zero_input():
  x = np.random.default_rng(11).standard_normal((37, 100)).astype(np.float32)
  x[:, 5] *= 1000
  return x


def middle_axis_input():
  return np.random.default_rng(12).standard_normal((3, 37, 20)).astype(np.float32)


@pytest.fixture(scope="module")
def layouts(goldens):
  """`run` of the inputs of the two tests below and of torchao's batched golden input, all in
  one program (they differ in shape: a program each would compile each apart)."""
  groups = {"axis 0": (axis_zero_input(), AXIS0_FMTS),
            "middle axis": (middle_axis_input(), MIDDLE_FMTS),
            "batched": (goldens["x_batched"].astype(np.float32), AO_FMTS)}
  args = [(x, np.zeros(x.shape, np.uint32)) for x, _ in groups.values()]
  outs = jax.jit(lambda args: [_casts(x, r, fmts)
                               for (x, r), (_, fmts) in zip(args, groups.values())])(args)
  return {k: [tuple(np.asarray(a) for a in o) for o in out] for k, out in zip(groups, outs)}


def test_axis_zero_ragged(layouts):
  check(axis_zero_input(), AXIS0_FMTS, results=layouts["axis 0"])


def test_three_dimensional_middle_axis(layouts):
  check(middle_axis_input(), MIDDLE_FMTS, results=layouts["middle axis"])


@pytest.mark.parametrize("shape,fmt,scale_shape", [
    ((40,), NVFP4Format(), (3,)),
    ((40,), NVFP4Format(block=(16, 16)), (3,)),
    ((33, 40), NVFP4Format(block=(16, 16)), (3, 3)),
    ((40, 33), NVFP4Format(block=(16, 16), axis=0), (3, 3)),
    ((4, 5, 40), NVFP4Format(block=(16, 16)), (2, 3)),
    ((4, 40, 5), NVFP4Format(axis=1), (4, 3, 5)),
], ids=str)
def test_encode_shapes(shape, fmt, scale_shape):
  codes, scales, amax = jax.eval_shape(lambda x: nvfp4.encode(x, fmt),
                                       jax.ShapeDtypeStruct(shape, jnp.float32))
  assert (codes.shape, codes.dtype) == (shape, jnp.uint8)
  assert (scales.shape, scales.dtype) == (scale_shape, jnp.float8_e4m3fn)
  assert (amax.shape, amax.dtype) == ((), jnp.float32)


def test_empty():
  codes, scales, amax = nvfp4.encode(np.zeros((0, 32), np.float32), NVFP4Format())
  assert codes.shape == (0, 32) and scales.shape == (0, 2) and float(amax) == 0.0
  assert nvfp4.nvfp4_quantize(np.zeros((4, 0), np.float32), NVFP4Format()).shape == (4, 0)


def test_mul_div_bits_match_numpy():
  """The products and quotients (with their special operands) against numpy's IEEE float32."""
  specials = ref.special_inputs()
  a = np.concatenate([np.repeat(specials, specials.size), ref.sampled_inputs(4096, seed=1)])
  b = np.concatenate([np.tile(specials, specials.size), ref.sampled_inputs(4096, seed=2)])
  b[-1024:] = (b[-1024:].view(np.uint32) & np.uint32(0x807FFFFF)).view(np.float32)  # subnormals
  mul, div = jax.jit(lambda u, v: (nvfp4.mul_bits(u, v), nvfp4.div_bits(u, v)))(ref.bits(a),
                                                                               ref.bits(b))
  with np.errstate(all="ignore"):
    want_mul, want_div = a * b, a / b
  for got, want in ((mul, want_mul), (div, want_div)):
    got = np.asarray(got).view(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ref.assert_same_bits(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want))


def test_code_values():
  got = np.asarray(nvfp4.e2m1_bits(jnp.arange(16, dtype=jnp.uint32)))
  assert np.array_equal(got, ref.bits(R.FP4_VALUES))


# -- torchao's own output -----------------------------------------------------------------------

def _unpack(qdata):
  out = np.empty(qdata.shape[:-1] + (2 * qdata.shape[-1],), np.uint8)
  out[..., 0::2], out[..., 1::2] = qdata & 15, qdata >> 4
  return out


@pytest.fixture(scope="module")
def goldens():
  import pathlib  # pylint: disable=g-import-not-at-top
  return np.load(pathlib.Path(__file__).parent.parent / "data" / "nvfp4_torchao.npz")


def test_torchao_goldens(goldens, layouts):
  assert "torchao 0.18.0" in list(goldens["versions"])
  names = [k[2:] for k in goldens.files if k.startswith("x_")]
  assert len(names) == 8 and goldens["x_batched"].ndim == 3
  for name in names:
    x = goldens["x_" + name]
    results = layouts["batched"] if name == "batched" else run(x, AO_FMTS)
    for fmt, got in zip(AO_FMTS, results, strict=True):
      level = "two" if fmt.tensor_scale else "single"
      scale = goldens[f"{level}_{name}_scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
      reference = expected(x, fmt)
      want = (_unpack(goldens[f"{level}_{name}_qdata"]), scale.reshape(got[1].shape), got[2],
              goldens[f"{level}_{name}_dequant"], reference[4])
      assert_matches(got, want, fmt, f"torchao {name}")
      assert_matches(got, reference, fmt, f"reference {name}")


# -- stochastic rounding ------------------------------------------------------------------------

def test_stochastic_matches_reference():
  x = np.random.default_rng(21).standard_normal((128, 128)).astype(np.float32)
  x[::9] *= np.float32(2.0 ** -120)
  check(x, SR_FMTS, rbits=random_bits(x.shape, 22))


def test_stochastic_rounding_is_unbiased():
  """The mean of n = 4096 draws of each E2M1 value is within Hoeffding's bound of the scaled
  value v: P(|mean - v| >= t) <= 2 exp(-2 n t^2 / d^2) for draws in an interval of width d (the
  E2M1 step at |v|: 0.5, 1 or 2), union-bounded over the 64 values at failure probability 1e-9.
  Rounding to nearest would miss the bound wherever v is over 0.06 d from the nearest value."""
  rng = np.random.default_rng(31)
  row = rng.uniform(-7, 7, 64).astype(np.float32)
  x = np.tile(row, (4096, 1))
  fmt = NVFP4Format(rounding="stochastic")
  codes = np.asarray(jax.jit(lambda x: nvfp4.nvfp4_encode(x, fmt, key=jax.random.key(5))[0])(x))
  values = R.FP4_VALUES[codes].astype(np.float64)
  scaled, _, _ = R.te_scaled(x[:1], (1, 16))
  v = np.clip(scaled[0].astype(np.float64), -6, 6)
  d = np.where(np.abs(v) < 2, 0.5, np.where(np.abs(v) < 4, 1.0, 2.0))
  bound = d * np.sqrt(np.log(2 * 64 / 1e-9) / (2 * x.shape[0]))
  assert np.all(np.abs(values.mean(axis=0) - v) <= bound)
  frac = np.abs(v) / d - np.floor(np.abs(v) / d)
  between = (frac > 0.05) & (frac < 0.95)
  assert between.sum() > 40
  assert np.all(values[:, between].std(axis=0) > 0)  # both neighbours occur


def test_quantize_with_key_decodes_encode():
  """jlp.quantize with a key decodes exactly the codes nvfp4_encode draws with that key."""
  x = np.random.default_rng(41).standard_normal((128, 128)).astype(np.float32)
  fmt = NVFP4Format(rounding="stochastic")
  key = jax.random.key(9)
  q, (codes, scales, amax) = jax.jit(lambda x: (jlp.quantize(x, fmt, key=key, impl="xla"),
                                                nvfp4.nvfp4_encode(x, fmt, key=key)))(x)
  want = R.te_decode(np.asarray(codes), np.asarray(scales).astype(np.float32), amax)
  ref.assert_same_bits(q, want)


# -- the Hadamard transform ---------------------------------------------------------------------

def test_hadamard_is_tes_orthonormal_transform():
  i = np.arange(16)
  popcount = np.vectorize(lambda v: bin(v).count("1"))
  sylvester = (-1.0) ** popcount(i[:, None] & i[None, :])
  t = np.diag(R.TE_SIGNS.astype(np.float64)) @ sylvester / 4
  assert np.array_equal(nvfp4.hadamard_transform(), t)
  assert np.array_equal(t @ t.T, np.eye(16))
  assert tuple(nvfp4.HADAMARD_SIGNS) == tuple(R.TE_SIGNS)


def test_hadamard_butterflies_bit_exact():
  rng = np.random.default_rng(51)
  x = rng.standard_normal((512, 16)).astype(np.float32)
  x[::4] *= np.float32(2.0 ** -140)                      # subnormal blocks
  x[1::4] *= np.float32(2.0 ** 120)
  x[2::8, ::3] = np.float32(1e-45)
  fwd = jax.jit(lambda u: (nvfp4.rht_bits(u), nvfp4.inverse_rht_bits(u)))
  got_t, got_i = fwd(ref.bits(x))
  ref.assert_same_bits(np.asarray(got_t).view(np.float32), R.rht(x), msg="rht")
  ref.assert_same_bits(np.asarray(got_i).view(np.float32), R.inverse_rht(x), msg="inverse")
  normal = np.abs(x).min(axis=1) > 2.0 ** -100
  back = R.inverse_rht(R.rht(x))[normal]
  assert np.all(np.abs(back - x[normal]) <= 2.0 ** -21 * np.abs(x[normal]).max(axis=1,
                                                                               keepdims=True))
  t = nvfp4.hadamard_transform()
  assert np.allclose(R.rht(x[normal]), x[normal].astype(np.float64) @ t, rtol=1e-6,
                     atol=1e-6 * np.abs(x[normal]).max())


def test_rht_quantize_maps_back():
  rng = np.random.default_rng(61)
  x = rng.standard_normal((128, 128)).astype(np.float32)
  x[:, 7] *= 30  # an outlier channel: the transform spreads it over its block
  rbits = random_bits(x.shape, 62)
  check(x, RHT_FMTS, rbits=rbits)
  q_rht, q = run(x, RHT_FMTS, rbits)[0][3], run(x, ALL_FMTS)[0][3]
  rms = lambda v: np.sqrt(np.mean(np.square(v, dtype=np.float64)))
  # Mapped back to x's basis: the error is a quantization error (x is far from rht(x)).
  assert rms(q_rht - x) < 0.15 * rms(x)
  assert rms(q_rht - x) < 0.2 * rms(R.rht(x) - x)
  assert rms(q_rht - x) < 2 * rms(q - x)


# -- the XLA path's float operations -------------------------------------------------------------

FLOAT_PATH_FMTS = (NVFP4Format(), NVFP4Format(block=(16, 16)), NVFP4Format(axis=0),
                   NVFP4Format(rht=True), NVFP4Format(rht=True, axis=0, rounding="stochastic"),
                   NVFP4Format(rounding="stochastic"), *AO_FMTS)


@functools.lru_cache(maxsize=None)
def _float_path(fmts: tuple):
  """jitted x, rbits -> for each format, (whether `nvfp4_quantize` takes its float path, its
  result)."""
  def run(x, r):
    out = []
    for fmt in fmts:
      rf = r if fmt.rounding == "stochastic" else None
      to_tiles, _ = nvfp4._tiles_view(x.shape, fmt)  # pylint: disable=protected-access
      tiles = to_tiles(jax.lax.bitcast_convert_type(x, jnp.uint32))[0]
      rt = to_tiles(r)[0] if rf is not None else None
      exact = nvfp4._float_ops(tiles, fmt, rt)[0]  # pylint: disable=protected-access
      out.append((exact, nvfp4.nvfp4_quantize(x, fmt, rf)))
    return out
  return jax.jit(run)


def check_float_path(x, taken, label, taken_rht=None, taken_single_level=None):
  """The XLA path's decoded values against the references, with XLA's optimisations on (the
  production build: fusion and the choice of fused multiply-adds are the optimiser's), and the
  float path taken (or not) as `taken` says (`taken_rht` for the formats with rht and
  `taken_single_level` for torchao's single level, if given). The codes and scales come from
  `encode`, which has no float path (`check` covers them)."""
  fmts = FLOAT_PATH_FMTS
  rbits = random_bits(x.shape, 81)
  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    results = _float_path(fmts)(x, rbits)
  finally:
    jax.config.update("jax_disable_most_optimizations", old)
  for fmt, (exact, q) in zip(fmts, results):
    want = taken
    if fmt.rht and taken_rht is not None:
      want = taken_rht
    if fmt.compat == "torchao" and not fmt.tensor_scale and taken_single_level is not None:
      want = taken_single_level
    assert bool(exact) == want, f"{label} {fmt!r}: float path"
    wq = expected(x, fmt, rbits)[3]
    nan = np.isnan(wq)
    ref.assert_same_bits(np.where(nan, np.nan, np.asarray(q)), np.where(nan, np.nan, wq),
                         msg=f"{label} {fmt!r}")


def test_float_path_on_ordinary_tensors():
  x = np.random.default_rng(82).standard_normal((64, 96)).astype(np.float32)
  x[3, :20] = 0.0
  x[7, 5] = -0.0
  x[:, 9] *= 300  # an outlier channel
  check_float_path(x, True, "ordinary")


def test_float_path_guards():
  """Each condition of the float path, just inside and just outside: a tile (of every tiling)
  whose products with the encode scale reach 2^-125 or fall below float32's normal range (where
  XLA:CPU would flush a negative one to -0, which TE codes as 0, not 8), an amax at 2^-60 and
  below it, and (with rht, whose transform spreads a tile's maximum over the tile) a nonzero
  input at 2^-90 and below it."""
  rng = np.random.default_rng(83)
  base = rng.standard_normal((64, 96)).astype(np.float32)
  wide_ok, wide = base.copy(), base.copy()
  wide_ok[4, 0] = wide[4, 0] = 2.0 ** 100
  wide_ok[5, 0] = wide_ok[4, 1] = -(2.0 ** -20)
  wide[5, 0] = wide[4, 1] = -(2.0 ** -40)
  check_float_path(wide_ok, True, "wide tile, products normal")
  # torchao's single level clamps the tile's scale at 448: its products stay normal.
  check_float_path(wide, False, "wide tile, products below 2^-126", taken_rht=True,
                   taken_single_level=True)
  unit = base / np.abs(base).max()
  check_float_path((unit * 2.0 ** -60).astype(np.float32), True, "amax 2^-60",
                   taken_rht=False)  # the transformed amax is below 2^-60 here
  check_float_path((unit * 2.0 ** -58).astype(np.float32), True, "amax 2^-58")
  check_float_path((unit * 2.0 ** -61).astype(np.float32), False, "amax 2^-61")
  tiny_input = base.copy()
  tiny_input[9, 3] = np.float32(2.0 ** -90)
  check_float_path(tiny_input, True, "rht input 2^-90")
  tiny_input[9, 4] = np.float32(-(2.0 ** -91))
  check_float_path(tiny_input, True, "rht input 2^-91", taken_rht=False)
  tiny_input[10, 16:32] *= np.float32(2.0 ** -128)  # subnormal inputs and (with rht) sums
  check_float_path(tiny_input, False, "a tile of subnormals")


# -- the XLA path's program: the looped fallback and its size -----------------------------------

RECIPE_FMTS = (NVFP4Format((1, 16)), NVFP4Format((16, 16), axis=-2),
               NVFP4Format((1, 16), rounding="stochastic"),
               NVFP4Format((1, 16), axis=-2, rht=True),
               NVFP4Format((1, 16), axis=-2, rounding="stochastic", rht=True))


# Slow: the (16, 16) tiles, stochastic rounding and rht; the fallback of each of them is
# compared with the references (through `nvfp4_quantize`) where the float path is not taken:
# test_tiny_and_wide_ranges, test_stochastic_matches_reference (its 2^-120 rows) and
# test_float_path_guards ("a tile of subnormals", every format).
@pytest.mark.parametrize("fmt", [f if f == RECIPE_FMTS[0]
                                 else pytest.param(f, marks=pytest.mark.slow)
                                 for f in RECIPE_FMTS[:4]], ids=str)
def test_looped_fallback_matches_quantize_rows(fmt):
  """The XLA path's fallback (`_quantize_rows_looped`: one division and one product in a loop)
  gives `quantize_rows`' bits (the Pallas kernel's body) on rows spanning float32: random bit
  patterns (NaN amax), an inf amax, subnormal tensors, wide and huge exponents."""
  rng = np.random.default_rng(84)
  p = 256 if fmt.block == (16, 16) else 16
  shape = (48, p)
  bits = lambda lo, hi: ((rng.integers(lo, hi, shape).astype(np.uint32) << 23)
                         | rng.integers(0, 2 ** 23, shape).astype(np.uint32)
                         | (rng.integers(0, 2, shape).astype(np.uint32) << 31))
  with_inf = bits(100, 140)
  with_inf[3, 5] = 0x7F800000
  cases = [random_bits(shape, 85), with_inf, bits(0, 1), bits(0, 20), bits(0, 255),
           bits(100, 140), bits(230, 255)]
  r = jnp.asarray(random_bits(shape, 86)) if fmt.rounding == "stochastic" else None

  @jax.jit
  def both(u, r):
    t = nvfp4.rht_bits(u) if fmt.rht else u
    amax = nvfp4.amax_bits(t)
    return (nvfp4.quantize_rows(u, nvfp4.tensor_scalars(amax, fmt), fmt, r),
            nvfp4._quantize_rows_looped(u, amax, fmt, r))  # pylint: disable=protected-access
  for i, u in enumerate(cases):
    want, got = both(jnp.asarray(u), r)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"case {i}")


def test_cast_programs_are_small():
  """Each cast of the nvfp4 recipe's formats lowers to a small program (issue 38: 5000 to 8300
  lines of StableHLO per cast before the float per-tile values and the looped fallback, most of
  it integer IEEE division and multiplication), and casts of one format at different shapes
  share their fallback's chunk program (lowered once)."""
  x = jnp.zeros((512, 64), jnp.float32)
  r = jnp.zeros(x.shape, jnp.uint32)
  lines = lambda f, *a: len(jax.jit(f).lower(*a).as_text().splitlines())
  for fmt in RECIPE_FMTS:
    rf = r if fmt.rounding == "stochastic" else None
    n = lines(lambda x, r, fmt=fmt: nvfp4.nvfp4_quantize(x, fmt, r), x, rf)
    assert n <= (3600 if fmt.rht else 2000), (fmt, n)
  fmt = RECIPE_FMTS[0]
  one = lines(lambda x: nvfp4.nvfp4_quantize(x, fmt), x)
  shapes = [(512, 64), (256, 128), (128, 256), (64, 512)]
  four = lines(lambda xs: [nvfp4.nvfp4_quantize(v, fmt) for v in xs],
               [jnp.zeros(s, jnp.float32) for s in shapes])
  assert four < 2.5 * one, (one, four)


# -- jlp.quantize and bad arguments -------------------------------------------------------------

def test_quantize_dispatch_and_straight_through_gradient():
  x = np.random.default_rng(71).standard_normal((128, 128)).astype(np.float32)
  fmt = NVFP4Format()
  def f(x):
    return jlp.quantize(x, fmt, impl="xla"), jax.grad(
        lambda v: jnp.sum(jlp.quantize(v, fmt, impl="xla") * v))(x)

  q, g = jax.jit(f)(x)
  ref.assert_same_bits(q, run(x, ALL_FMTS)[0][3])
  ref.assert_same_bits(g, np.asarray(q) + x)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block=(1, 32)), r"block=\(1, 32\) is not allowed; expected \(1, 16\) or \(16, 16\)"),
    (dict(block=16), "block=16 is not allowed"),
    (dict(axis=1.0), "axis=1.0 is not allowed; expected an int"),
    (dict(axis=True), "axis=True is not allowed"),
    (dict(tensor_scale=1), "tensor_scale=1 is not allowed; expected True or False"),
    (dict(rounding="up"), "rounding='up' is not allowed"),
    (dict(compat="te"), "compat='te' is not allowed"),
    (dict(tensor_scale=False), "tensor_scale=False is not allowed; expected True with compat=None"),
    (dict(compat="torchao", rounding="stochastic"), "rounding='stochastic' is not allowed"),
    (dict(compat="torchao", rht=True), "rht=True is not allowed; expected False with compat="),
    (dict(compat="torchao", block=(16, 16)),
     r"block=\(16, 16\) is not allowed; expected \(1, 16\)"),
    (dict(rht=True, block=(16, 16)), "rht=True is not allowed; expected False with block"),
], ids=str)
def test_bad_formats(kwargs, match):
  with pytest.raises(ValueError, match=match):
    NVFP4Format(**kwargs)


@pytest.mark.parametrize("call", ["quantize", "encode", "numerics"])
def test_bad_arguments_fail_before_compute(call):
  def go(x, fmt, **kw):
    if call == "quantize":
      return jlp.quantize(x, fmt, **kw)
    if call == "encode":
      return nvfp4.nvfp4_encode(x, fmt, **kw)
    return nvfp4.nvfp4_quantize(x, fmt, None)

  x = np.ones((4, 40), np.float32)
  bad_dtypes = [jnp.bfloat16, np.float16, np.int32] + ([np.float64] if call != "quantize" else [])
  for dtype in bad_dtypes:  # (jlp.quantize reads a float64 numpy array as float32, as jnp does)
    with pytest.raises(ValueError, match=f"x.dtype={np.dtype(dtype).name}"):
      go(x.astype(dtype), NVFP4Format())
  with pytest.raises(ValueError, match="axis=2 is out of range"):
    go(x, NVFP4Format(axis=2))
  with pytest.raises(ValueError, match=r"x.shape\[-1\]=40 is not allowed with rht=True"):
    go(x, NVFP4Format(rht=True))
  with pytest.raises(ValueError, match="key=None is not allowed|rbits=None is not allowed"):
    go(x, NVFP4Format(rounding="stochastic"))
  if call == "numerics":
    with pytest.raises(ValueError, match="rbits of shape"):
      nvfp4.nvfp4_quantize(x, NVFP4Format(rounding="stochastic"), np.zeros((4, 40), np.int32))
    with pytest.raises(ValueError, match="fmt=.* is not allowed; expected an NVFP4Format"):
      nvfp4.nvfp4_quantize(x, FloatFormat.from_name("e4m3"))
