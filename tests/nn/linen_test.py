"""Flax Linen: quantized layers through the `dot_general` / `conv_general_dilated` fields.

References:
  * forward: the same layers computed from `jlp.quantize`d operands with plain lax ops, and the
    unquantized model for an identity GemmQuant;
  * gradients: the role formulas of GemmQuant's docstring written out by hand (BFPsim's
    BFPConv2dFunction, bfp.md §2.1-§2.2), as tests/gemm/qdot_test.py and tests/nn/rules_test.py do
    for NNX: with g = dL/dy, dx = q_dgrad_dy(g) ·ᵀ q_dgrad_w(w̃) and dw = q_wgrad_x(x̃) ·ᵀ
    q_wgrad_dy(g), x̃ = q_x(x), w̃ = q_w(w) (bwd_from_fwd) or the raw x, w; `jlp.quantize` for q,
    float32 GEMMs at HIGHEST precision with the convolution's transposes written as einsums over
    explicit 3x3 patches (no jax.vjp, no jlp.gemm code). The mean's backward (g / 16 over 4x4
    positions) and the dense dgrad (three products of 3- and 4-bit significands) are exact, so the
    quantized cotangents feeding the convolution are the same bits in both.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlp
import references as ref

CFG = jlp.GemmQuant(x="e4m3", w="e4m3", dgrad_dy="e5m2", wgrad_dy="e5m2")
# Every backward role distinct and the raw operands in the backward GEMMs: a role applied to
# the wrong GEMM, or x̃ / w̃ taken from the wrong place, changes the gradients.
MIXED = jlp.GemmQuant(x="e4m3", w="e4m3", dgrad_dy="e5m2", dgrad_w="e3m2", wgrad_dy="e4m3",
                      wgrad_x="e5m2", bwd_from_fwd=False)
HI = jax.lax.Precision.HIGHEST


class Net(nn.Module):
  cfg: jlp.GemmQuant

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), conv_general_dilated=functools.partial(jlp.qconv, cfg=self.cfg))(x)
    return nn.Dense(3, dot_general=functools.partial(jlp.qdot_general, cfg=self.cfg))(x.mean((1, 2)))


X = jax.random.normal(jax.random.key(0), (2, 4, 4, 2))
# dL/d(output) of the loss sum(Net(x) * COT): not a constant, so quantizing it matters.
COT = jax.random.normal(jax.random.key(2), (2, 3))


@pytest.fixture(scope="module")
def variables():
  """Net's variables for key 1: the same for every cfg (the GemmQuant changes no parameter), so
  one jitted init serves all tests (an eager init ran the quantized forward op by op)."""
  return jax.jit(Net(jlp.GemmQuant()).init)(jax.random.key(1), X)


@jax.jit
def _reference_forward(p, x):
  q = lambda v: jlp.quantize(v, "e4m3")
  h = jax.lax.conv_general_dilated(q(x), q(p["Conv_0"]["kernel"]), (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=HI)
  h = (h + p["Conv_0"]["bias"]).mean((1, 2))
  return jnp.dot(q(h), q(p["Dense_0"]["kernel"]), precision=HI) + p["Dense_0"]["bias"]


def test_linen_layers_quantize_their_operands(variables):
  model = Net(CFG)
  got = jax.jit(model.apply)(variables, X)
  want = _reference_forward(variables["params"], X)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _q(v, fmt):
  return v if fmt is None else jlp.quantize(v, fmt)


def _patches(a):
  """(N, H + 2, W + 2, C) -> (N, H, W, 3, 3, C): [n, i, j, a, b] = a[n, i + a, j + b]."""
  h, w = a.shape[1] - 2, a.shape[2] - 2
  return jnp.stack([jnp.stack([a[:, i:i + h, j:j + w] for j in range(3)], 3) for i in range(3)], 3)


def _pad1(a):
  return jnp.pad(a, ((0, 0), (1, 1), (1, 1), (0, 0)))


@functools.partial(jax.jit, static_argnums=0)
def _reference_grads(cfg, p, x, cot):
  """d sum(Net(x) * cot) / d(params, x) from the role formulas (module docstring)."""
  k, cb = p["Conv_0"]["kernel"], p["Conv_0"]["bias"]
  wd = p["Dense_0"]["kernel"]
  xq, kq = _q(x, cfg.x), _q(k, cfg.w)
  # forward to the dense layer's input, as in the forward test
  y = jax.lax.conv_general_dilated(xq, kq, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=HI)
  h = (y + cb).mean((1, 2))
  hq, wdq = _q(h, cfg.x), _q(wd, cfg.w)
  h_t, wd_t = (hq, wdq) if cfg.bwd_from_fwd else (h, wd)
  x_t, k_t = (xq, kq) if cfg.bwd_from_fwd else (x, k)
  # dense: y = h · W + b
  d_wd = jnp.dot(_q(h_t, cfg.wgrad_x).T, _q(cot, cfg.wgrad_dy), precision=HI)
  d_h = jnp.dot(_q(cot, cfg.dgrad_dy), _q(wd_t, cfg.dgrad_w).T, precision=HI)
  # mean over the 4 x 4 positions: every position gets d_h / 16
  g = jnp.broadcast_to((d_h / 16)[:, None, None, :], y.shape)
  # conv: y[n, i, j, o] = sum_{a, b, c} xpad[n, i + a, j + b, c] k[a, b, c, o]
  d_k = jnp.einsum("nhwabc,nhwo->abco", _patches(_pad1(_q(x_t, cfg.wgrad_x))),
                   _q(g, cfg.wgrad_dy), precision=HI)
  # dx[n, p, q, c] = sum_{a, b, o} gpad[n, p + 2 - a, q + 2 - b, o] k[a, b, c, o]
  g_flipped = _patches(_pad1(_q(g, cfg.dgrad_dy)))[:, :, :, ::-1, ::-1]
  d_x = jnp.einsum("nhwabo,abco->nhwc", g_flipped, _q(k_t, cfg.dgrad_w), precision=HI)
  params = {"Conv_0": {"kernel": d_k, "bias": g.sum((0, 1, 2))},
            "Dense_0": {"kernel": d_wd, "bias": cot.sum(0)}}
  return params, d_x


def _grads(model, variables, x, cot):
  loss = lambda p, x: jnp.sum(model.apply({"params": p}, x) * cot)
  return jax.jit(jax.grad(loss, (0, 1)))(variables["params"], x)


def _assert_close(got, want, msg):
  check = lambda path, g, w: np.testing.assert_allclose(
      g, w, rtol=2e-6, atol=1e-6, err_msg=f"{msg}{jax.tree_util.keystr(path)}")
  jax.tree_util.tree_map_with_path(check, got, want)


@pytest.mark.parametrize("cfg", [CFG, MIXED], ids=["fp8", "mixed-raw-operands"])
def test_linen_gradients_follow_the_roles(cfg, variables):
  model = Net(cfg)
  got_p, got_x = _grads(model, variables, X, COT)
  want_p, want_x = _reference_grads(cfg, variables["params"], X, COT)
  _assert_close(got_p, want_p, "params")
  _assert_close(got_x, want_x, "input")
  # The backward roles matter on this data: without them the reference moves past the tolerance
  # in both GEMMs of both layers.
  plain_p, plain_x = _reference_grads(cfg.replace(dgrad_dy=None, dgrad_w=None, wgrad_dy=None,
                                                  wgrad_x=None), variables["params"], X, COT)
  for name, g, w in (("conv kernel", got_p["Conv_0"]["kernel"], plain_p["Conv_0"]["kernel"]),
                     ("dense kernel", got_p["Dense_0"]["kernel"], plain_p["Dense_0"]["kernel"]),
                     ("input", got_x, plain_x)):
    assert not np.allclose(g, w, rtol=1e-3, atol=1e-3), name


def test_identity_config_is_the_plain_model(variables):
  quant = Net(jlp.GemmQuant())

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.Conv(4, (3, 3))(x).mean((1, 2)))

  ref.assert_same_bits(quant.apply(variables, X), Plain().apply(variables, X))
