"""The jaxpr tools of the flush schedules' F, B, I and W (jlp.pipeline.residuals): which residuals
depend on a stage's input, and a backward cut into ZB's input-gradient half (I) and weight-gradient
half (W). References: jax.vjp's own backward, run whole."""

import jax
import jax.numpy as jnp
import numpy as np

from jlp.pipeline.residuals import depends, split_backward


def test_depends_follows_every_path_from_the_marked_inputs():
  closed = jax.make_jaxpr(lambda a, b, c: (a * 2, b + 1, jnp.sin(a) + b, c))(1.0, 2.0, 3.0)
  assert depends(closed.jaxpr, [True, False, False]) == [True, False, True, False]
  assert depends(closed.jaxpr, [False, True, False]) == [False, True, True, False]
  assert depends(closed.jaxpr, [False, False, False]) == [False] * 4


def _stage(w, x):
  return jnp.tanh(jnp.tanh(x @ w["a"]) @ w["b"])


def test_i_plus_w_is_the_backward_each_dot_once():
  """A two-layer stage: B = jax.vjp's backward in (weights, input). I computes the input gradient
  and keeps its dots' results that W reads; W computes the weight gradient from them. Both halves
  give B's bits, and together they run each of B's dots once (B: 4 dots, two per layer)."""
  rng = np.random.default_rng(0)
  w = {"a": rng.normal(size=(6, 5)).astype(np.float32),
       "b": rng.normal(size=(5, 4)).astype(np.float32)}
  x = rng.normal(size=(3, 6)).astype(np.float32)
  ct = rng.normal(size=(3, 4)).astype(np.float32)

  _, vjp_fn = jax.vjp(_stage, w, x)
  residuals, treedef = jax.tree.flatten(vjp_fn)  # what F keeps: B runs no forward

  def backward(residuals, ct):
    gw, gx = jax.tree.unflatten(treedef, residuals)(ct)
    return (*jax.tree.leaves(gw), gx)

  closed = jax.make_jaxpr(backward)(residuals, ct)
  split = split_backward(closed, num_gw=2)
  assert split is not None and split.carried
  args = jax.tree.leaves((residuals, ct))
  gx, carried = split.input_half(args)
  gw = split.weight_half(args, carried)
  *expected_gw, expected_gx = backward(residuals, ct)
  np.testing.assert_array_equal(gx, expected_gx)
  for got, want in zip(gw, expected_gw, strict=True):
    np.testing.assert_array_equal(got, want)
  dots = {k for k, eqn in enumerate(closed.jaxpr.eqns) if eqn.primitive.name == "dot_general"}
  assert len(dots) == 4
  assert not dots & set(split.i_eqns) & set(split.w_eqns)
  assert dots <= set(split.i_eqns) | set(split.w_eqns)


def test_a_backward_whose_weight_gradient_shares_no_dot_with_i_has_no_split():
  """The input gradient of x * w (elementwise) needs no dot: nothing for W to take from I."""
  closed = jax.make_jaxpr(lambda w, x, ct: (*jax.vjp(jnp.multiply, w, x)[1](ct),))(
      np.ones(3, np.float32), np.ones(3, np.float32), np.ones(3, np.float32))
  assert split_backward(closed, num_gw=1) is None
