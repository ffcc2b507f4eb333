"""jlp.quantize: gradients, keys, dtypes, errors, transformations, shard_map.

References: ml_dtypes casts for forward values; straight-through identity and
ml_dtypes-rounded cotangents for gradients.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jlp
from jlp import FloatFormat
import references as ref

X = np.array([0.3, -1.1, 2.7, 1e-3, -250.0, 1e5, 0.0, -7e-5], np.float32)


def test_forward_equals_ml_dtypes_and_gradient_is_straight_through():
  got = jlp.quantize(jnp.asarray(X), "float8_e5m2")
  ref.assert_same_bits(got, X.astype(ml_dtypes.float8_e5m2).astype(np.float32))
  w = jnp.asarray(np.linspace(-2, 2, X.size, dtype=np.float32))
  g = jax.grad(lambda x: jnp.sum(jlp.quantize(x, "e4m3") * w))(jnp.asarray(X))
  np.testing.assert_array_equal(g, w)


def test_bwd_format_rounds_the_cotangent():
  w = np.array([0.3, 0.1, 1e-4, -3.3, 7.0, 1e6, 0.5, 2.9], np.float32)
  g = jax.grad(lambda x: jnp.sum(jlp.quantize(x, "e4m3", bwd="e5m2") * w))(jnp.asarray(X))
  ref.assert_same_bits(g, w.astype(ml_dtypes.float8_e5m2).astype(np.float32))


def test_stochastic_needs_a_key_and_is_a_function_of_the_key():
  fmt = FloatFormat(4, 3, rounding="stochastic")
  with pytest.raises(ValueError, match="key=None.*stochastic"):
    jlp.quantize(jnp.asarray(X), fmt)
  with pytest.raises(ValueError, match="key=None.*bwd="):
    jlp.quantize(jnp.asarray(X), "e4m3", bwd=fmt)
  x = jnp.asarray(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
  a = jlp.quantize(x, fmt, key=jax.random.key(1))
  b = jax.jit(lambda x, k: jlp.quantize(x, fmt, key=k))(x, jax.random.key(1))
  w = np.asarray(x)[::-1].copy()

  @jax.jit  # the other casts in one program (eagerly, each op of each compiles on its own), and
  def others(x, k1, k2):  # the key words and jax.random.bits of the references (jax's, not jlp's)
    return (jlp.quantize(x, fmt, key=k2),
            jax.grad(lambda x: jnp.sum(jlp.quantize(x, "e4m3", bwd=fmt, key=k1) * w))(x),
            jlp.quantize(x, fmt, key=k1, rng="jax"),
            jlp.quantize(x, fmt, key=k1, index_offset=12345),
            jax.random.key_data(k1), jax.random.key_data(jax.random.fold_in(k1, 1)),
            jax.random.bits(k1, x.shape, jnp.uint32))

  c, g, by_jax, offset, k1_data, bwd_data, jbits = others(x, jax.random.key(1), jax.random.key(2))
  ref.assert_same_bits(a, b)
  assert not np.array_equal(a, c)
  # documented streams: "pairs" of key forward, of fold_in(key, 1) backward; "jax" = jax.random.bits
  words = lambda data: [int(v) for v in np.asarray(data)]
  rbits = ref.stochastic_draws(words(k1_data), x.size)
  ref.assert_same_bits(a, ref.round_to_format(np.asarray(x), fmt, rbits))
  bbits = ref.stochastic_draws(words(bwd_data), x.size)
  ref.assert_same_bits(g, ref.round_to_format(w, fmt, bbits))
  ref.assert_same_bits(by_jax, ref.round_to_format(np.asarray(x), fmt, np.asarray(jbits)))
  obits = ref.stochastic_draws(words(k1_data), x.size, offset=12345)
  ref.assert_same_bits(offset, ref.round_to_format(np.asarray(x), fmt, obits))


def test_stochastic_argument_errors_before_compute():
  fmt = FloatFormat(4, 3, rounding="stochastic")
  x = jnp.ones((4, 4))
  with pytest.raises(ValueError, match="rng='philox'"):
    jlp.quantize(x, fmt, key=jax.random.key(0), rng="philox")
  with pytest.raises(ValueError, match="index_offset=-3"):
    jlp.quantize(x, fmt, key=jax.random.key(0), index_offset=-3)
  with pytest.raises(ValueError, match="index_offset of shape"):
    jlp.quantize(x, "e4m3", bwd=fmt, key=jax.random.key(0), index_offset=jnp.float32(1))
  with pytest.raises(ValueError, match="threefry2x32"):
    jlp.quantize(x, fmt, key=jax.random.key(0, impl="rbg"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs_keep_their_dtype(dtype):
  x = jnp.asarray(X[np.abs(X) < 6e4]).astype(dtype)
  y = jlp.quantize(x, "e4m3")
  assert y.dtype == dtype
  want = np.asarray(x.astype(jnp.float32)).astype(ml_dtypes.float8_e4m3).astype(np.float32)
  ref.assert_same_bits(np.asarray(y.astype(jnp.float32)), want)
  g = jax.grad(lambda v: jnp.sum(jlp.quantize(v, "e4m3").astype(jnp.float32)))(x)
  assert g.dtype == dtype


def test_dtype_errors():
  with pytest.raises(ValueError, match="x.dtype=int32"):
    jlp.quantize(jnp.arange(3), "e4m3")
  with pytest.raises(ValueError, match="x.dtype=bfloat16 cannot hold"):
    jlp.quantize(jnp.ones(3, jnp.bfloat16), "float16")
  with pytest.raises(ValueError, match="x.dtype=float16 cannot hold"):
    jlp.quantize(jnp.ones(3, jnp.float16), "bfloat16")


def test_argument_errors_before_compute():
  x = jnp.ones((4, 4))
  with pytest.raises(ValueError, match="impl='cuda'"):
    jlp.quantize(x, "e4m3", impl="cuda")
  with pytest.raises(ValueError, match="name='e4m3x'"):
    jlp.quantize(x, "e4m3x")
  with pytest.raises(ValueError, match="fmt=3"):
    jlp.quantize(x, 3)
  with pytest.raises(ValueError, match=r"block=\(1, 24, 3, 3\).*ndim=2"):
    jlp.quantize(x, jlp.BFPFormat(8, (1, 24, 3, 3)))
  with pytest.raises(ValueError, match="axis=3"):
    jlp.quantize(x, jlp.MXFormat("float8_e4m3fn", axis=3))
  with pytest.raises(ValueError, match="axis=3"):
    jlp.quantize(x, jlp.MXFormat("float8_e4m3fn", axis=3), impl="pallas")


def test_vmap_jit_grad_compose():
  xs = jnp.asarray(np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32))
  f = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(jlp.quantize(x, "e3m0", bwd="e5m2") ** 2))))
  got = np.asarray(f(xs))
  q = ref.round_to_format(np.asarray(xs), FloatFormat(3, 0))
  ref.assert_same_bits(got, ref.round_to_format(2 * q, FloatFormat(5, 2)))


def test_stochastic_under_vmap_with_batched_keys():
  fmt = FloatFormat(5, 2, rounding="stochastic")
  xs = jnp.full((3, 64), 1.1, jnp.float32)
  keys = jax.random.split(jax.random.key(0), 3)
  got = jax.jit(jax.vmap(lambda x, k: jlp.quantize(x, fmt, key=k)))(xs, keys)
  one = jax.jit(lambda x, k: jlp.quantize(x, fmt, key=k))  # compiled once for the three rows
  for i in range(3):
    ref.assert_same_bits(got[i], one(xs[i], keys[i]))


def test_inside_shard_map_on_8_devices():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 32)).astype(np.float32))

  @jax.jit
  def f(x):
    def local(xb):
      q = jlp.quantize(xb, "e4m3", bwd="e5m2")
      return jax.lax.psum(jnp.sum(q, axis=0, keepdims=True), "d")
    return jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P())(x)

  got = f(x)
  want = np.asarray(x).astype(ml_dtypes.float8_e4m3).astype(np.float32)
  np.testing.assert_allclose(np.asarray(got)[0], want.sum(0), rtol=1e-6)
  g = jax.jit(jax.grad(lambda x: f(x).sum()))(x)
  np.testing.assert_array_equal(g, np.ones_like(x))


IMPL_FMTS = [FloatFormat(4, 3), FloatFormat(5, 2, rounding="stochastic"),
             jlp.BFPFormat(4, (1, 24)), jlp.BFPFormat(8, (2, 8), rounding="nearest"),
             jlp.MXFormat("float8_e4m3fn"),  # 48 = 32 + a ragged 16
             jlp.MXFormat(FloatFormat(2, 1, "stochastic", specials="none"), block=16, axis=0)]


@pytest.fixture(scope="module")
def both_impls():
  """{fmt: (value_and_grad with impl="xla", with impl="pallas")} of a loss of every format of
  IMPL_FMTS, in one jitted program (eagerly, every op of both paths compiles on its own)."""
  x = jnp.asarray(np.random.default_rng(5).standard_normal((16, 48)).astype(np.float32))
  key = jax.random.key(3)

  def loss(x, fmt, impl):
    return jnp.sum(jlp.quantize(x, fmt, bwd=fmt, key=key, impl=impl) * x[::-1])

  out = jax.jit(lambda x: [[jax.value_and_grad(loss)(x, fmt, impl) for impl in ("xla", "pallas")]
                           for fmt in IMPL_FMTS])(x)
  return dict(zip(IMPL_FMTS, out, strict=True))


@pytest.mark.parametrize("fmt", IMPL_FMTS, ids=repr)
def test_pallas_impl_equals_xla_impl_forward_and_backward(fmt, both_impls):
  xla, pallas = both_impls[fmt]
  for want, got in zip(xla, pallas, strict=True):
    ref.assert_same_bits(got, want)


def test_pallas_impl_inside_shard_map_with_check_vma_off():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.asarray(np.random.default_rng(6).standard_normal((8, 64)).astype(np.float32))

  def run(impl):
    f = jax.shard_map(lambda v: jlp.quantize(v, "e4m3", impl=impl), mesh=mesh, in_specs=P("d"),
                      out_specs=P("d"), check_vma=False)
    return jax.jit(f)(x)

  ref.assert_same_bits(run("pallas"), run("xla"))
  ref.assert_same_bits(run("xla"), np.asarray(x).astype(ml_dtypes.float8_e4m3).astype(np.float32))
