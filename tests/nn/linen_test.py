"""Flax Linen: quantized layers through the `dot_general` / `conv_general_dilated` fields.

Reference: the same layers computed from `jlp.quantize`d operands with plain lax ops, and the
unquantized model for an identity GemmQuant.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jlp
import references as ref

CFG = jlp.GemmQuant(x="e4m3", w="e4m3", dgrad_dy="e5m2", wgrad_dy="e5m2")


class Net(nn.Module):
  cfg: jlp.GemmQuant

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), conv_general_dilated=functools.partial(jlp.qconv, cfg=self.cfg))(x)
    return nn.Dense(3, dot_general=functools.partial(jlp.qdot_general, cfg=self.cfg))(x.mean((1, 2)))


X = jax.random.normal(jax.random.key(0), (2, 5, 5, 2))


def test_linen_layers_quantize_their_operands():
  model = Net(CFG)
  variables = model.init(jax.random.key(1), X)
  got = jax.jit(model.apply)(variables, X)
  p = variables["params"]
  q = lambda v: jlp.quantize(v, "e4m3")
  hi = jax.lax.Precision.HIGHEST
  h = jax.lax.conv_general_dilated(q(X), q(p["Conv_0"]["kernel"]), (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=hi)
  h = (h + p["Conv_0"]["bias"]).mean((1, 2))
  want = jnp.dot(q(h), q(p["Dense_0"]["kernel"]), precision=hi) + p["Dense_0"]["bias"]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  grads = jax.grad(lambda v: model.apply(v, X).sum())(variables)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_identity_config_is_the_plain_model():
  quant = Net(jlp.GemmQuant())
  variables = quant.init(jax.random.key(1), X)

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.Conv(4, (3, 3))(x).mean((1, 2)))

  ref.assert_same_bits(quant.apply(variables, X), Plain().apply(variables, X))
