"""jlp.nn.rules: per-layer quantization rules on Flax NNX models."""

import logging
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

from jlp.formats import BFPFormat, FloatFormat
from jlp.gemm.config import GemmQuant, ROLES
from jlp.nn import QConv, QDotGeneral, QEinsum, QuantRule, quantize_model, unquantize_model
from jlp.quantize import quantize, quantize_f32

HI = lax.Precision.HIGHEST
E4M3 = FloatFormat(4, 3)
E5M2 = FloatFormat(5, 2)
CFG = GemmQuant(x=E4M3, w=E4M3)


class Net(nnx.Module):
  """conv -> mean -> [Linear, Einsum] (+ a nested Linear)."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.heads = nnx.List([nnx.Linear(4, 5, rngs=rngs),
                           nnx.Einsum("bi,oi->bo", (5, 4), (5,), rngs=rngs)])
    self.block = Block(rngs)

  def __call__(self, x):
    y = jax.nn.relu(self.conv(x)).mean((1, 2))
    return self.block(self.heads[0](y) + self.heads[1](y))


class Block(nnx.Module):

  def __init__(self, rngs):
    self.fc = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return self.fc(x)


def _grid(seed, shape, scale=8):
  """Small multiples of 1/scale: every product and short float32 sum is exact."""
  return jnp.asarray(np.random.default_rng(seed).integers(-8, 9, shape) / scale, jnp.float32)


def _net(seed=0):
  m = Net(nnx.Rngs(seed))
  # exact-sum friendly params
  for i, (_, v) in enumerate(nnx.iter_graph(m)):
    if isinstance(v, nnx.Param):
      v[...] = _grid(100 + i, v.shape)
  return m


X = _grid(1, (2, 5, 5, 3))
fwd = nnx.jit(lambda m, x: m(x))
PATHS = ["block/fc", "conv", "heads/0", "heads/1"]


def test_first_match_wins_and_report(caplog):
  m = _net()
  rules = [QuantRule("heads/.*", CFG.replace(x=E5M2)),   # 0
           QuantRule("heads/0", None),                   # 1: shadowed by rule 0
           QuantRule("conv", CFG),                        # 2
           QuantRule("block/fc", None),                   # 3: keeps fp32, still "used"
           QuantRule("nope/.*", CFG),                     # 4: typo
           QuantRule(".*", CFG)]                          # 5
  with caplog.at_level(logging.WARNING, logger="jlp.nn"):
    rep = quantize_model(m, rules)
  assert sorted(rep.kinds) == PATHS
  assert rep.kinds == {"block/fc": "linear", "conv": "conv", "heads/0": "linear", "heads/1": "einsum"}
  assert rep.matched == {"block/fc": 3, "conv": 2, "heads/0": 0, "heads/1": 0}
  assert dict(rep) == {"conv": CFG, "heads/0": CFG.replace(x=E5M2), "heads/1": CFG.replace(x=E5M2)}
  assert rep.unused_rules == [rules[1], rules[4], rules[5]]
  assert rep.unchanged == ["block/fc"]
  assert "nope/.*" in caplog.text and "matched no layer" in caplog.text
  s = str(rep)
  assert "heads/1" in s and "einsum" in s and "float32" in s and "unused" in s
  assert isinstance(m.conv.conv_general_dilated, QConv)
  assert isinstance(m.heads[0].dot_general, QDotGeneral)
  assert isinstance(m.heads[1].einsum_op, QEinsum)
  assert m.block.fc.dot_general is lax.dot_general


def test_rule_regex_is_fullmatch_and_kinds():
  m = _net()
  rep = quantize_model(m, [QuantRule("fc", CFG),                    # not a fullmatch of block/fc
                           QuantRule(".*", {"conv": CFG, "einsum": None}),
                           QuantRule("(block|heads)/.*", {"linear": CFG.replace(w=E5M2)})])
  assert rep.matched == {"block/fc": 2, "conv": 1, "heads/0": 2, "heads/1": 1}
  assert sorted(rep) == ["block/fc", "conv", "heads/0"]
  assert [r.path for r in rep.unused_rules] == ["fc"]
  # (regex, cfg) pairs are accepted too
  assert sorted(quantize_model(_net(), [(".*/0", CFG)])) == ["heads/0"]


def test_bad_rules():
  with pytest.raises(ValueError, match=r"QuantRule\(path='conv\['\).*does not compile"):
    QuantRule("conv[", CFG)
  with pytest.raises(ValueError, match="QuantRule\\('mine'\\).*does not compile"):
    QuantRule("(", CFG, name="mine")
  with pytest.raises(ValueError, match="layer kind 'dense'"):
    QuantRule(".*", {"dense": CFG})
  with pytest.raises(ValueError, match="expected a GemmQuant"):
    QuantRule(".*", {"conv": E4M3})
  with pytest.raises(ValueError, match="rules\\[0\\]"):
    quantize_model(_net(), ["conv"])
  # a weight-role BFP block that does not fit the kernel rank, before any computation
  with pytest.raises(ValueError, match="'conv'.*kernel shape \\(3, 3, 3, 4\\).*cfg.w"):
    quantize_model(_net(), [QuantRule("conv", GemmQuant(w=BFPFormat(4, (8, 1))))])
  # a layer whose hook already holds a custom op is not silently replaced
  m = _net()
  m.heads[0].dot_general = lambda *a, **k: lax.dot_general(*a, **k)
  with pytest.raises(ValueError, match="'heads/0'.*custom op"):
    quantize_model(m, [QuantRule(".*", CFG)])


def _loss(m, x):
  return jnp.sum(m(x) ** 2)


def test_no_matching_rule_is_bit_exact():
  ref, m = _net(), _net()
  x = jnp.asarray(np.random.default_rng(3).normal(size=X.shape), jnp.float32)
  rep = quantize_model(m, [QuantRule("nothing", CFG), QuantRule("conv|heads/.*|block/fc", None),
                           QuantRule(".*", CFG)])
  assert len(rep) == 0 and rep.unchanged == sorted(PATHS)
  assert m.conv.conv_general_dilated is lax.conv_general_dilated
  assert m.heads[1].einsum_op is jnp.einsum
  np.testing.assert_array_equal(fwd(m, x), fwd(ref, x))
  grad = nnx.jit(nnx.grad(_loss))
  g, gref = grad(m, x), grad(ref, x)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(g), nnx.to_pure_dict(gref))
  # and an empty rule list
  assert len(quantize_model(m, [])) == 0
  np.testing.assert_array_equal(m(x), ref(x))
  # an identity GemmQuant is the plain op too
  assert len(quantize_model(m, [QuantRule(".*", GemmQuant())])) == 4
  np.testing.assert_array_equal(fwd(m, x), fwd(ref, x))


BFP_CONV = GemmQuant(x=BFPFormat(3, (1, 2, 2, 2)), w=BFPFormat(3, (3, 3, 2, 1)), y=E5M2)
LIN = GemmQuant(x=E5M2, w=E4M3)


def test_forward_matches_hand_reference():
  m = _net()
  quantize_model(m, [QuantRule("conv", BFP_CONV), QuantRule(".*", LIN)])
  x = X * 1.37  # not on the grid: quantization matters
  ref = jax.jit(_reference)(m.conv.kernel[...], m.conv.bias[...], m.heads[0].kernel[...],
                            m.heads[0].bias[...], m.heads[1].kernel[...], m.heads[1].bias[...],
                            m.block.fc.kernel[...], m.block.fc.bias[...], x)
  np.testing.assert_allclose(fwd(m, x), ref, rtol=1e-6, atol=1e-6)
  assert not np.allclose(fwd(m, x), fwd(_net(), x), rtol=1e-3)


def _reference(ck, cb, k0, b0, k1, b1, fk, fb, x):
  """Hand-built reference of Net with BFP_CONV / LIN, from jlp.quantize and lax ops."""
  q = lambda a, f: quantize(a, f)
  bfp_conv = BFP_CONV
  y = lax.conv_general_dilated(q(x, bfp_conv.x), q(ck, bfp_conv.w), (1, 1), "SAME",
                               dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=HI)
  y = jax.nn.relu(q(y, E5M2) + cb).mean((1, 2))
  h0 = jnp.dot(q(y, E5M2), q(k0, E4M3), precision=HI) + b0
  h1 = jnp.einsum("bi,oi->bo", q(y, E5M2), q(k1, E4M3), precision=HI) + b1
  return jnp.dot(q(h0 + h1, E5M2), q(fk, E4M3), precision=HI) + fb


@pytest.mark.parametrize("spec,in_shape,k_shape", [
    ("bi,oi->bo", (2, 4), (3, 4)),
    ("btd,dhk->bthk", (2, 3, 4), (4, 2, 3)),
    ("...d,dk->k...", (2, 3, 4), (4, 5)),
])
def test_einsum_specs(spec, in_shape, k_shape):
  layer = nnx.Einsum(spec, k_shape, rngs=nnx.Rngs(0), bias_shape=None)
  x = jnp.asarray(np.random.default_rng(0).normal(size=in_shape), jnp.float32)
  quantize_model(layer, [QuantRule(".*", CFG)])
  # both jitted: one compile each instead of the quantizers' ops one by one
  ref = jax.jit(lambda x, k: jnp.einsum(spec, quantize(x, E4M3), quantize(k, E4M3),
                                        precision=HI))(x, layer.kernel[...])
  np.testing.assert_allclose(fwd(layer, x), ref, rtol=1e-6, atol=1e-6)


def test_einsum_unsupported_spec():
  layer = nnx.Einsum("bii,io->bo", (3, 2), rngs=nnx.Rngs(0), bias_shape=None)
  quantize_model(layer, [QuantRule(".*", CFG)])
  with pytest.raises(ValueError, match="repeated"):
    layer(jnp.ones((2, 3, 3)))


def test_jit_grad_optimizer_and_unquantize():
  m = _net()
  quantize_model(m, [QuantRule(".*", GemmQuant(x=E4M3, w=E4M3, dgrad_dy=E5M2, wgrad_dy=E5M2))])
  x = X * 1.37
  opt = nnx.Optimizer(m, optax.sgd(0.01), wrt=nnx.Param)

  traces = []

  @nnx.jit
  def step(m, opt, x):
    traces.append(1)  # the quantized graphdef is hashable: one trace for both steps
    loss, g = nnx.value_and_grad(_loss)(m, x)
    opt.update(m, g)
    return loss, g

  # jax.grad through split / merge equals nnx.grad
  gdef, params, rest = nnx.split(m, nnx.Param, ...)
  g_jax = jax.jit(jax.grad(lambda p, r: _loss(nnx.merge(gdef, p, r), x)))(params, rest)
  k0 = m.conv.kernel[...]
  l0, g = step(m, opt, x)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(g), nnx.to_pure_dict(g_jax))
  assert float(jnp.abs(g["conv"]["kernel"][...]).sum()) > 0
  np.testing.assert_allclose(m.conv.kernel[...], k0 - 0.01 * g["conv"]["kernel"][...], rtol=1e-6)
  l1, _ = step(m, opt, x)
  assert np.isfinite(l1) and l1 != l0 and len(traces) == 1
  assert sorted(unquantize_model(m)) == sorted(PATHS)
  assert m.conv.conv_general_dilated is lax.conv_general_dilated


def test_stochastic_rule_keys():
  sr = FloatFormat(4, 3, rounding="stochastic")
  cfg = GemmQuant(w=sr)
  with pytest.raises(ValueError, match="'heads/0'.*stochastic.*rngs=None"):
    quantize_model(_net(), [QuantRule("heads/0", cfg)])
  m = nnx.Linear(4, 3, rngs=nnx.Rngs(0), use_bias=False)
  quantize_model(m, [QuantRule(".*", cfg)], rngs=nnx.Rngs(quant=7))
  # the documented scheme: fold_in(rngs.quant(), crc32(path)) -> RngStream -> role index
  layer_key = jax.random.fold_in(nnx.Rngs(quant=7).quant(), zlib.crc32(b"") & 0x7FFFFFFF)
  x = jnp.eye(4)  # y = w~ exactly
  y0, y1 = fwd(m, x), fwd(m, x)
  w = m.kernel[...]
  q = jax.jit(lambda w, k: quantize_f32(w, sr, k, "xla"))  # one compile for both keys
  for n, y in enumerate((y0, y1)):
    k = jax.random.fold_in(jax.random.fold_in(layer_key, n), ROLES.index("w"))
    np.testing.assert_array_equal(y, q(w, k))
  assert not np.array_equal(y0, y1)
  # different layers draw independent streams
  net = _net()
  quantize_model(net, [QuantRule("heads/.*|block/fc", cfg)], rngs=nnx.Rngs(0))
  k0, k1 = net.heads[0].dot_general.rng.key[...], net.block.fc.dot_general.rng.key[...]
  assert not np.array_equal(jax.random.key_data(k0), jax.random.key_data(k1))


def test_linear_general():
  layer = nnx.LinearGeneral((2, 3), 4, axis=(-2, -1), rngs=nnx.Rngs(0), use_bias=False)
  assert layer.dot_general is None
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 2, 3)), jnp.float32)
  rep = quantize_model(layer, [QuantRule(".*", GemmQuant(x=E4M3, w=BFPFormat(4, (2, 3, 1))))])
  assert rep.kinds == {"": "linear"}
  ref = jax.jit(lambda x, k: jnp.einsum(  # jitted: one compile, not the quantizers op by op
      "bij,ijo->bo", quantize(x, E4M3), quantize(k, BFPFormat(4, (2, 3, 1))),
      precision=HI))(x, layer.kernel[...])
  np.testing.assert_allclose(fwd(layer, x), ref, rtol=1e-6, atol=1e-6)
