"""Optimizers and schedules of jlp.train.optim against plain numpy loops written from the spec.

* torch_sgd (momentum, Nesterov, masked weight decay, a warm-up + step schedule) against a float64
  numpy loop of cpd.md §6.1 (d = g + wd*w; buf = m*buf + d; w -= lr*buf; Nesterov
  w -= lr*(d + m*buf)), five steps.
* LARS: cpd_lars against a float64 loop of cpd.md §5; optax.lars (`lars`) against the same loop
  with wd = 0, where the two rules coincide, and shown to differ with wd > 0 and on a zero
  parameter (CPD never moves it, optax does). `lars`'s decay mask and Nesterov momentum, and the
  runner's use_lars with wd_exclude and nesterov, against a float64 loop of optax's formula.
* cpd_resnet18_lr against the spec's formula written out here (float64, cast to float32 once).
* The weight-decay masks on the small CNN's parameter paths.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jlp.models as zoo
import jlp.train as jt


def _params():
  rng = np.random.default_rng(0)
  return {
      "conv": {"kernel": jnp.asarray(rng.standard_normal((3, 3, 2, 4)), jnp.float32)},
      "bn": {"scale": jnp.asarray(1 + 0.1 * rng.standard_normal(4), jnp.float32),
             "bias": jnp.asarray(0.1 * rng.standard_normal(4), jnp.float32)},
      "linear": {"kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
                 "bias": jnp.asarray(rng.standard_normal(3), jnp.float32)},
  }


def _grads(steps):
  rng = np.random.default_rng(1)
  return [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 0.3, jnp.float32),
                       _params()) for _ in range(steps)]


def _apply(optimizer, steps):
  params = _params()
  state = optimizer.init(params)
  update = jax.jit(optimizer.update)
  for g in _grads(steps):
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _flat(tree):
  return {jt.optim.param_path(p): np.asarray(x, np.float64)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _torch_sgd_reference(steps, lr_at, momentum, nesterov, wd, no_decay):
  """cpd.md §6.1, float64."""
  w = _flat(_params())
  buf = {k: np.zeros_like(v) for k, v in w.items()}
  for t, g in enumerate(_grads(steps)):
    g = _flat(g)
    for k in w:
      d = g[k] + (0.0 if no_decay(k) else wd) * w[k]
      buf[k] = momentum * buf[k] + d
      step = d + momentum * buf[k] if nesterov else buf[k]
      w[k] = w[k] - lr_at(t) * step
  return w


@pytest.mark.parametrize("nesterov", [False, True])
def test_torch_sgd_matches_the_spec_loop(nesterov):
  warmup, base = 2, 0.4
  schedule = jt.warmup_step_schedule(base, warmup, {3: 0.1}, warmup_init=0.1)
  lr_at = lambda t: 0.1 + (base - 0.1) * t / warmup if t < warmup else base * (0.1 if t >= 3 else 1)
  np.testing.assert_allclose([float(schedule(t)) for t in range(6)], [lr_at(t) for t in range(6)],
                             rtol=1e-6)
  opt = jt.torch_sgd(schedule, 0.9, nesterov=nesterov, weight_decay=0.05,
                     decay_mask=jt.decay_mask(jt.is_bn_or_bias))
  got = _flat(_apply(opt, 5))
  want = _torch_sgd_reference(5, lr_at, 0.9, nesterov, 0.05, jt.is_bn_or_bias)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-7, err_msg=k)
  # The mask matters: decaying everything gives other BN / bias values.
  everything = _torch_sgd_reference(5, lr_at, 0.9, nesterov, 0.05, lambda k: False)
  assert np.max(np.abs(everything["bn/scale"] - want["bn/scale"])) > 1e-3


def _cpd_lars_reference(steps, lr, momentum, wd, params=None):
  """cpd.md §5, float64: local_lr = 0.001 ||w|| / (||g|| + wd ||w||);
  buf = m buf + lr local_lr (g + wd w); w -= buf."""
  w = _flat(_params() if params is None else params)
  buf = {k: np.zeros_like(v) for k, v in w.items()}
  for g in _grads(steps):
    g = _flat(g)
    for k in w:
      wn, gn = np.linalg.norm(w[k]), np.linalg.norm(g[k])
      with np.errstate(invalid="ignore", divide="ignore"):
        local_lr = 0.001 * wn / (gn + wd * wn)
      buf[k] = momentum * buf[k] + lr * local_lr * (g[k] + wd * w[k])
      w[k] = w[k] - buf[k]
  return w


def _max_rel_diff(got, want):
  return max(float(np.max(np.abs(got[k] - want[k]) / (np.abs(want[k]) + 1e-12))) for k in want)


def test_cpd_lars_matches_the_spec_loop():
  got = _flat(_apply(jt.cpd_lars(2.0, 0.9, weight_decay=0.1), 4))
  want = _cpd_lars_reference(4, 2.0, 0.9, 0.1)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=1e-8, err_msg=k)


def test_optax_lars_equals_cpd_without_weight_decay_and_differs_with_it():
  got = _flat(_apply(jt.lars(2.0, 0.9, weight_decay=0.0), 4))
  want = _cpd_lars_reference(4, 2.0, 0.9, 0.0)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=1e-8, err_msg=k)
  # With wd > 0 optax divides by ||g + wd w|| where CPD divides by ||g|| + wd ||w||.
  got = _flat(_apply(jt.lars(2.0, 0.9, weight_decay=0.5), 4))
  assert _max_rel_diff(got, _cpd_lars_reference(4, 2.0, 0.9, 0.5)) > 1e-3


def _optax_lars_reference(steps, lr, momentum, wd, no_decay, nesterov):
  """optax.lars as its documentation writes it (You et al. 2017), float64, per parameter:
  d = g + wd w (wd = 0 where `no_decay`); ratio = 0.001 ||w|| / ||d|| (1 where either norm is 0);
  u = -lr ratio d; buf = m buf + u; w += buf, or with Nesterov w += u + m buf."""
  w = _flat(_params())
  buf = {k: np.zeros_like(v) for k, v in w.items()}
  for g in _grads(steps):
    g = _flat(g)
    for k in w:
      d = g[k] + (0.0 if no_decay(k) else wd) * w[k]
      wn, dn = np.linalg.norm(w[k]), np.linalg.norm(d)
      ratio = 1.0 if wn == 0 or dn == 0 else 0.001 * wn / dn
      u = -lr * ratio * d
      buf[k] = momentum * buf[k] + u
      w[k] = w[k] + (u + momentum * buf[k] if nesterov else buf[k])
  return w


def _lars_recipe(**fields):
  """jlp.train.recipe.optimizer of a use_lars config (lr 2.0, weight decay 0.5) with `fields`."""
  from jlp.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from jlp.train import recipe  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.use_lars, c.lr, c.weight_decay = True, 2.0, 0.5
  c.update(fields)
  config_lib.validate(c)
  return recipe.optimizer(c, optax.constant_schedule(c.lr))


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_decay_mask_and_nesterov_match_the_formula(nesterov):
  """`lars`'s decay_mask and nesterov, and the runner's use_lars with wd_exclude and nesterov
  (issue 32 §6: both were dropped), against the float64 loop of optax's formula."""
  no_decay = lambda k: k.startswith("bn/") or k.endswith("bias")
  want = _optax_lars_reference(4, 2.0, 0.9, 0.5, no_decay, nesterov)
  for opt in (jt.lars(2.0, 0.9, weight_decay=0.5, nesterov=nesterov,
                      decay_mask=jt.decay_mask(no_decay)),
              _lars_recipe(wd_exclude="bn|bias", nesterov=nesterov)):
    got = _flat(_apply(opt, 4))
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=1e-8, err_msg=k)
  # Both settings matter: decaying every parameter, or the other momentum, moves them elsewhere.
  everything = _optax_lars_reference(4, 2.0, 0.9, 0.5, lambda k: False, nesterov)
  other = _optax_lars_reference(4, 2.0, 0.9, 0.5, no_decay, not nesterov)
  for k in ("bn/scale", "linear/bias"):
    assert _max_rel_diff({k: everything[k]}, {k: want[k]}) > 1e-3, k
  assert _max_rel_diff(other, want) > 1e-3
  assert _max_rel_diff({"conv/kernel": everything["conv/kernel"]},
                       {"conv/kernel": want["conv/kernel"]}) < 1e-12  # decayed in both


def test_zero_parameter_never_moves_under_cpd_lars():
  """A parameter initialised to 0 (BatchNorm beta) gets local_lr = 0 in CPD; optax's trust
  ratio falls back to 1 and moves it."""
  params = _params()
  params["bn"]["bias"] = jnp.zeros(4, jnp.float32)
  opt_cpd, opt_optax = jt.cpd_lars(2.0, weight_decay=0.1), jt.lars(2.0, weight_decay=0.1)
  g = _grads(1)[0]
  for opt, moves in ((opt_cpd, False), (opt_optax, True)):
    updates, _ = jax.jit(opt.update)(g, opt.init(params), params)
    assert bool(np.any(np.asarray(updates["bn"]["bias"]) != 0)) == moves


def test_cpd_resnet18_lr():
  """cpd.md §6.1 for W = 8 GPUs x 512: ipe = 13, warm-up 65 steps, decays after 520 and 1040;
  optax count c is CPD step c + 1."""
  def spec(step, ipe=13):
    warmup = 5 * ipe
    if step <= warmup:
      return 0.1 + 1.5 * step / warmup
    return 1.6 * (0.1 if step > 40 * ipe else 1) * (0.1 if step > 80 * ipe else 1)

  schedule = jax.jit(jt.cpd_resnet18_lr(8))
  counts = np.array([0, 1, 30, 63, 64, 65, 300, 519, 520, 521, 1039, 1040, 1220, 5000])
  got = np.asarray(jax.vmap(schedule)(jnp.asarray(counts)))
  want = np.array([spec(c + 1) for c in counts], np.float32)
  np.testing.assert_array_equal(got, want)
  assert math.isclose(float(got[counts.tolist().index(64)]), 1.6, rel_tol=1e-6)
  # 1 GPU emulating 8 nodes has the same iterations per epoch.
  np.testing.assert_array_equal(np.asarray(jax.vmap(jt.cpd_resnet18_lr(1, emulate_nodes=8))(
      jnp.asarray(counts))), want)


def test_decay_masks_on_model_paths():
  params = nnx.state(nnx.eval_shape(lambda: zoo.get_model("small_cnn", width=2)), nnx.Param)
  mask = _flat(jt.decay_mask(jt.is_bn_or_bias)(params))
  assert {k for k, v in mask.items() if v} == {"conv1/kernel", "conv2/kernel", "linear/kernel"}
  mask = _flat(jt.decay_mask(jt.path_contains("bn"))(params))
  assert {k for k, v in mask.items() if not v} == {"bn1/scale", "bn1/bias", "bn2/scale",
                                                    "bn2/bias"}


@pytest.mark.parametrize("make, field", [
    (lambda: jt.torch_sgd(-0.1), "learning_rate"),
    (lambda: jt.torch_sgd(0.1, nesterov=True), "nesterov"),
    (lambda: jt.torch_sgd(0.1, 0.9, weight_decay=-1.0), "weight_decay"),
    (lambda: jt.lars(0.1, momentum=-0.5), "momentum"),
    (lambda: jt.lars(0.1, nesterov=1), "nesterov"),
    (lambda: jt.warmup_step_schedule(0.1, 10, {5: 0.1}), "boundaries_and_scales"),
    (lambda: jt.warmup_step_schedule(0.1, -1), "warmup_steps"),
    (lambda: jt.cpd_resnet18_lr(0), "world_size"),
])
def test_bad_settings(make, field):
  with pytest.raises(ValueError, match=f"^{field}="):
    make()
