"""jlp.gemm.accum.matmul against a plain-Python triple loop written from cpd.md §2.1.

Reference: CPD's quant_gemm (Han, Demmel, You, arXiv:1911.08907; cpd.md §2.1),
one numpy float32 scalar operation at a time, with q = `references.round_to_format`
(a float64 reference cast; compat=None) or, for compat="cpd", the step-by-step
CPD emulation of tests/numerics/compat_test.py (cpd.md §1.2). Written from the
spec, not from jlp.
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.formats import FloatFormat
from jlp.gemm.accum import matmul
from pallas_kernels import accum_matmul as kernel
from compiles import backend_compiles
import references as ref

f32 = np.float32


def _load_test_module(subdir, name):
  """A sibling test module by path (tests/pallas_kernels would shadow the kernels package)."""
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), subdir, name + ".py")
  spec = importlib.util.spec_from_file_location("_accum_test_" + name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _cpd_reference():
  return _load_test_module("numerics", "compat_test").cpd_reference


def quantizer(fmt):
  if fmt.compat == "cpd":
    cpd = _cpd_reference()
    return lambda v: cpd(np.array([v], f32), fmt.exp, fmt.man)[0]
  return lambda v: ref.round_to_format(np.array([v], f32), fmt)[0]


def triple_loop(a, b, fmt, kahan, chunk=1):
  """cpd.md §2.1 per element; chunk > 1: float32 sums of `chunk` raw products, in k order."""
  q = quantizer(fmt)
  m, k = a.shape
  n = b.shape[1]
  out = np.zeros((m, n), f32)
  with np.errstate(all="ignore"):
    for i in range(m):
      for j in range(n):
        s, c = f32(0), f32(0)
        for k0 in range(0, k, chunk):
          partial = f32(a[i, k0] * b[k0, j])
          for kk in range(k0 + 1, min(k0 + chunk, k)):
            partial = f32(partial + f32(a[i, kk] * b[kk, j]))
          p = q(partial)
          if kahan:
            y = q(f32(p - c))
            t = q(f32(s + y))
            c = q(f32(q(f32(t - s)) - y))
            s = t
          else:
            s = q(f32(s + p))
        out[i, j] = s
  return out


def operands(m, k, n, seed, scale=1.0):
  rng = np.random.default_rng(seed)
  a = (rng.standard_normal((m, k)) * scale).astype(f32)
  b = rng.standard_normal((k, n)).astype(f32)
  return a, b


FORMATS = [FloatFormat.from_name("e5m2"), FloatFormat.from_name("e4m3"), FloatFormat(3, 0),
           FloatFormat(8, 7), FloatFormat(5, 2, compat="cpd")]


@pytest.fixture(scope="module")
def xla_matmul():
  return jax.jit(matmul, static_argnames=("accum", "kahan", "chunk", "impl"))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name + (f"-{f.compat}" if f.compat else ""))
@pytest.mark.parametrize("kahan", [False, True], ids=["plain", "kahan"])
def test_matches_triple_loop(fmt, kahan, xla_matmul):
  a, b = operands(5, 9, 7, seed=fmt.exp * 10 + fmt.man)
  got = np.asarray(xla_matmul(a, b, accum=fmt, kahan=kahan, impl="xla"))
  ref.assert_same_bits(got, triple_loop(a, b, fmt, kahan))


# Default: plain with chunks of 2 and 9 (= K), Kahan with 4 and 32 (> K); the loops round each
# chunk's sum the same way in both, so the other pairs are slow.
@pytest.mark.parametrize("kahan,chunk", [
    pytest.param(kahan, chunk, id=f"{'kahan' if kahan else 'plain'}-{chunk}",
                 marks=() if (chunk in (4, 32)) == kahan else pytest.mark.slow)
    for kahan in (False, True) for chunk in (2, 4, 9, 32)])
def test_chunked_matches_triple_loop(chunk, kahan, xla_matmul):
  fmt = FloatFormat.from_name("e5m2")
  a, b = operands(5, 9, 7, seed=chunk)
  got = np.asarray(xla_matmul(a, b, accum=fmt, kahan=kahan, chunk=chunk, impl="xla"))
  ref.assert_same_bits(got, triple_loop(a, b, fmt, kahan, chunk))


_CHUNKED_SHAPES = [
    ((3, 150, 2), 70),  # chunks longer than the unrolled limit: 70, 70, 10
    ((4, 40, 64), 8),  # N a multiple of 64 (padded b rows); 5 chunks: two loop steps and a tail
    ((1, 33, 3), 32),  # one row (paired with a padding row); one loop-free step and a tail
]


# Default: each shape once, plain or Kahan in turn (the shapes' branches are the chunking's, the
# same for both loops); the other half is slow.
@pytest.mark.parametrize("shape,chunk,kahan", [
    pytest.param(shape, chunk, kahan, id=f"{shape}-{chunk}-{'kahan' if kahan else 'plain'}",
                 marks=() if kahan == bool(i % 2) else pytest.mark.slow)
    for i, (shape, chunk) in enumerate(_CHUNKED_SHAPES) for kahan in (False, True)])
def test_chunked_shapes_match_triple_loop(shape, chunk, kahan, xla_matmul):
  m, k, n = shape
  fmt = FloatFormat.from_name("e4m3")
  a, b = operands(m, k, n, seed=chunk, scale=0.5)
  got = np.asarray(xla_matmul(a, b, accum=fmt, kahan=kahan, chunk=chunk, impl="xla"))
  ref.assert_same_bits(got, triple_loop(a, b, fmt, kahan, chunk))


# Every product -0 (a < 0, b = +0): the accumulator starts at +0, so s = +0 + q(-0) = +0 in every
# mode, also where one chunk is longer than K (under jit XLA folded a constant start away).
@pytest.mark.parametrize("kahan,chunk", [(False, 1), (True, 3), (False, 20), (True, 20)])
def test_negative_zero_products_sum_to_positive_zero(kahan, chunk, xla_matmul):
  fmt = FloatFormat.from_name("e5m2")
  a, b = -np.ones((3, 5), f32), np.zeros((5, 4), f32)
  want = triple_loop(a, b, fmt, kahan, chunk)
  assert not np.signbit(want).any()
  ref.assert_same_bits(np.asarray(xla_matmul(a, b, accum=fmt, kahan=kahan, chunk=chunk,
                                             impl="xla")), want)
  ref.assert_same_bits(np.asarray(matmul(a, b, accum=fmt, kahan=kahan, chunk=chunk,
                                         impl="xla")), want)


def test_chunk_products_not_fused():
  """The chunk's float32 sum rounds each product first (an FMA would round once)."""
  fmt = FloatFormat(8, 23)
  a = np.array([[1 + 2.0 ** -12, -1.0]], f32)
  b = np.array([[1 + 2.0 ** -12], [1 + 2.0 ** -11]], f32)
  # fl32(a0*b0) = 1 + 2^-11 (the 2^-24 is rounded off); minus 1 + 2^-11 -> 0. FMA: 2^-24.
  got = np.asarray(matmul(a, b, accum=fmt, chunk=2, impl="xla"))
  assert got[0, 0] == 0.0
  assert np.asarray(matmul(a, b, accum=fmt, chunk=2, impl="pallas"))[0, 0] == 0.0


# The Pallas kernel runs this in the slow tier: the same chunk-1 loops run in the default tier in
# tests/pallas_kernels/accum_matmul_kernel_test.py (plain E5M2 against the XLA path in
# test_matches_xla_for_every_k, Kahan E5M2 against a spec loop in test_matches_spec_loop[True-1])
# and below (Kahan CPD-E5M2 in test_pallas_matches_xla_bit_for_bit).
@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_cpd_reference_case(impl):
  """cpd.md §7: e5m2, [1, .3, .3, .3]·[1, 1, 1, 1]; q(0.3) = 0.3125, plain 1.75, Kahan 2.0."""
  fmt = FloatFormat.from_name("e5m2")
  assert ref.round_to_format(np.array([0.3], f32), fmt)[0] == 0.3125
  a = np.array([[1.0, 0.3, 0.3, 0.3]], f32)
  b = np.ones((4, 1), f32)
  assert float(matmul(a, b, accum=fmt, kahan=True, impl=impl)[0, 0]) == 2.0
  assert float(matmul(a, b, accum=fmt, impl=impl)[0, 0]) == 1.75
  cpd = FloatFormat(5, 2, compat="cpd")
  assert float(matmul(a, b, accum=cpd, kahan=True, impl=impl)[0, 0]) == 2.0


# Default: Kahan CPD-E5M2 with chunk 1. Slow: plain E5M2 with chunk 1 (tests/pallas_kernels/
# accum_matmul_kernel_test.py's test_matches_xla_for_every_k runs it against the XLA path at every
# K) and plain (8, 7) with chunk 3 (its test_padded_grid_matches_xla[False-3] runs plain chunks of
# 3 on this padded 3 x 3 grid); the other two as said below.
@pytest.mark.parametrize("kahan,chunk,fmt", [
    pytest.param(False, 1, FloatFormat.from_name("e5m2"), marks=pytest.mark.slow),
    # Slow: Kahan with chunk 1 runs here with cpd (the same loop, another cast), and with E5M2 in
    # accum_matmul_kernel_test.py::test_matches_spec_loop[True-1].
    pytest.param(True, 1, FloatFormat.from_name("e4m3"), marks=pytest.mark.slow),
    (True, 1, FloatFormat(5, 2, compat="cpd")),
    # Slow: Kahan with chunks > 1 against the XLA path in accum_matmul_kernel_test.py
    # (test_chunk_sizes_and_formats_match_xla[True-2-...E5M2...], test_matches_xla_for_every_k).
    pytest.param(True, 4, FloatFormat.from_name("e5m2"), marks=pytest.mark.slow),
    pytest.param(False, 3, FloatFormat(8, 7), marks=pytest.mark.slow),
], ids=str)
def test_pallas_matches_xla_bit_for_bit(kahan, chunk, fmt):
  # (37, 21) @ (21, 45), tiles 16x16: grid (3, 3) = 9 steps; M, N, K all padded. tile_k=4: K in
  # a fori_loop of 5 blocks of 4 unrolled steps and a rest of 1 (the default 16 unrolls 21 steps
  # into the program: the same loop and rest, four times the ops to compile).
  a, b = operands(37, 21, 45, seed=chunk, scale=8.0)
  want = np.asarray(matmul(a, b, accum=fmt, kahan=kahan, chunk=chunk, impl="xla"))
  got = np.asarray(kernel.accum_matmul(a, b, fmt, kahan=kahan, chunk=chunk, interpret=True,
                                       tile_m=16, tile_n=16, tile_k=4))
  ref.assert_same_bits(got, want)


def test_vmap():
  fmt = FloatFormat.from_name("e5m2")
  rng = np.random.default_rng(3)
  a = rng.standard_normal((3, 4, 6)).astype(f32)
  b = rng.standard_normal((3, 6, 5)).astype(f32)
  for impl, chunk in (("xla", 1), ("xla", 4), ("pallas", 2)):
    got = np.asarray(jax.vmap(lambda x, y: matmul(x, y, accum=fmt, kahan=True, chunk=chunk,
                                                  impl=impl))(a, b))
    for i in range(3):
      ref.assert_same_bits(got[i], triple_loop(a[i], b[i], fmt, True, chunk))


def test_auto_is_xla_on_cpu_and_accepts_names():
  a, b = operands(3, 5, 2, seed=9)
  ref.assert_same_bits(np.asarray(matmul(a, b, accum="e4m3", kahan=True)),
                       np.asarray(matmul(a, b, accum=FloatFormat(4, 3), kahan=True, impl="xla")))


def test_empty_k_gives_zeros():
  out = matmul(np.zeros((2, 0), f32), np.zeros((0, 3), f32), accum="e5m2")
  assert out.shape == (2, 3) and not np.any(np.asarray(out))


@pytest.mark.parametrize("kwargs,a_shape,b_shape,dtype,match", [
    (dict(), (2, 3, 4), (4, 5), f32, "a.shape"),
    (dict(), (2, 3), (4,), f32, "b.shape"),
    (dict(), (2, 3), (4, 5), f32, r"b.shape=\(4, 5\)"),
    (dict(), (2, 3), (3, 5), np.float16, "a.dtype"),
    (dict(accum="int8"), (2, 3), (3, 5), f32, "accum"),
    (dict(accum=3), (2, 3), (3, 5), f32, "accum"),
    (dict(accum=FloatFormat(5, 2, rounding="stochastic")), (2, 3), (3, 5), f32, "stochastic"),
    (dict(chunk=0), (2, 3), (3, 5), f32, "chunk"),
    (dict(chunk=2.0), (2, 3), (3, 5), f32, "chunk"),
    (dict(kahan=1), (2, 3), (3, 5), f32, "kahan"),
    (dict(impl="cuda"), (2, 3), (3, 5), f32, "impl"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input(kwargs, a_shape, b_shape, dtype, match):
  kwargs = dict(dict(accum=FloatFormat(5, 2)), **kwargs)
  with pytest.raises(ValueError, match=match):
    matmul(np.ones(a_shape, dtype), np.ones(b_shape, f32), **kwargs)


@pytest.mark.lowering
@pytest.mark.parametrize("kahan,chunk", [(False, 1), (True, 1), (True, 32)])
def test_kernel_lowers_to_triton(kahan, chunk):
  lowering = _load_test_module("pallas_kernels", "kernel_lowering_test")
  fmt = FloatFormat.from_name("e5m2")
  sds = jax.ShapeDtypeStruct
  hlo = lowering.lower_for_h100(lambda a, b: kernel.accum_matmul(a, b, fmt, kahan=kahan, chunk=chunk),
                       sds((100, 70), jnp.float32), sds((70, 130), jnp.float32))
  assert lowering.TRITON_CALL in hlo
  assert "grid_x = 4 " in hlo  # (100, 130) in 32 x 32 tiles: grid (4, 5)


def test_an_eager_call_is_one_compiled_program():
  """Called eagerly, the XLA path compiles one program (not each scan, slice and cast apart), and
  gives the bits of the same call under an outer jit."""
  a, b = (jax.device_put(x) for x in operands(3, 11, 2, seed=11))
  with backend_compiles() as compiled:
    got = matmul(a, b, accum="e4m3", chunk=5, impl="xla")
  assert compiled == ["jit(_matmul_xla)"]
  want = jax.jit(lambda a, b: matmul(a, b, accum="e4m3", chunk=5, impl="xla"))(a, b)
  ref.assert_same_bits(np.asarray(got), np.asarray(want))
