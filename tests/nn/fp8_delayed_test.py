"""The "fp8_delayed" recipe: TE's DelayedScaling (jlp.gemm.fp8_delayed, jlp.nn.fp8_delayed).

References: a plain-numpy model of TE's rules written from TE's DelayedScaling docs and its
`amax_and_scale_update` kernel (ml_dtypes for the FP8 casts): q = fp8(clip(t · s, ±fp8_max)),
dequantized by fl32(1 / s); the history rolled by -1 with the step's amax at index 0; s' =
fp8_max / max(h') / 2^margin, the old s where that amax is 0 or not finite, float32 max where s'
overflows; first step s = 1, h = 0. For the data-parallel step: the same per-device computation
run device by device outside the step, then the max over devices.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jlp.train as jt
from jlp.gemm import qdot_general
from jlp.gemm.fp8_delayed import DelayedScaling, amax_update
from jlp.nn import quantize_model, recipe_gemm, recipe_rules
from jlp.nn.fp8_delayed import Fp8Meta, overwrite_fp8_meta

F32 = np.float32
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


# -- the numpy reference ---------------------------------------------------------------------------


def ref_qdq(t, s, name):
  dt = getattr(ml_dtypes, name)
  top = F32(ml_dtypes.finfo(dt).max)
  q = np.clip(np.asarray(t, F32) * F32(s), -top, top).astype(dt)
  return q.astype(F32) * (F32(1) / F32(s))


def ref_update(h, s, amax, name, margin=0, algo="max"):
  h2 = np.roll(np.asarray(h, F32), -1)
  h2[0] = amax
  a = h2.max() if algo == "max" else h2[0]
  scaled = F32(ml_dtypes.finfo(getattr(ml_dtypes, name)).max) * F32(2.0 ** -margin)
  s2 = F32(scaled / F32(a)) if (np.isfinite(a) and a > 0) else F32(s)
  if np.isinf(s2):
    s2 = np.finfo(F32).max
  return h2, F32(s2)


def metas_of(model):
  """{"x_scale": ..., ...} of a model with one fp8_delayed layer (numpy)."""
  state = nnx.state(model, Fp8Meta)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p).split("'")[-2]: np.asarray(v) for p, v in flat}


@nnx.jit  # one compile per model structure; eagerly, the fp8 casts and scale updates op by op
def train_step_single(model, x, c):
  """loss = sum(model(x) * c): gradients of the params, of x, and the Fp8Meta overwrite."""

  def loss(m, x):
    return jnp.sum(m(x) * c)

  diff = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))
  grads, dx = nnx.grad(loss, argnums=(diff, 1))(model, x)
  meta_grads, param_grads = nnx.split_state(grads, Fp8Meta, ...)
  nnx.update(model, overwrite_fp8_meta(nnx.state(model, Fp8Meta), meta_grads))
  return param_grads, dx


# -- tests ---------------------------------------------------------------------------------------


def test_the_recipe_is_te_s_delayed_scaling_defaults():
  cfg = recipe_gemm("fp8_delayed")
  assert cfg == DelayedScaling()
  assert (cfg.fp8_format, cfg.amax_history_len, cfg.amax_compute_algo, cfg.margin) == (
      "HYBRID", 1024, "max", 0)
  assert (cfg.dtype_name("x"), cfg.dtype_name("w"), cfg.dtype_name("dy")) == (E4M3, E4M3, E5M2)
  assert cfg.scaled_max("x") == 448.0 and cfg.scaled_max("dy") == 57344.0
  assert DelayedScaling(margin=2).scaled_max("x") == 112.0
  assert cfg.bwd_from_fwd and cfg.dgrad_w is None and cfg.wgrad_x is None


@pytest.mark.parametrize("kwargs, message", [
    ({"fp8_format": "E5M2"}, r"^fp8_format='E5M2' is not allowed; expected one of 'HYBRID'"),
    ({"amax_history_len": 0}, r"^amax_history_len=0 is not allowed; expected an int >= 1\.$"),
    ({"amax_compute_algo": "mean"}, r"^amax_compute_algo='mean' is not allowed"),
    ({"margin": -1}, r"^margin=-1 is not allowed; expected an int >= 0\.$"),
    ({"y": "e4m3"}, r"^y=.* is not allowed with DelayedScaling"),
])
def test_bad_fields_are_one_line_errors(kwargs, message):
  with pytest.raises(ValueError, match=message) as e:
    DelayedScaling(**kwargs)
  assert "\n" not in str(e.value)


def test_qdot_general_refuses_the_stateful_cfg():
  with pytest.raises(ValueError, match=r"^qdot_general: cfg=.* is not allowed: DelayedScaling "
                     r"keeps per-layer amax histories"):
    qdot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())), DelayedScaling())


_forward = nnx.jit(lambda m, x: m(x))


def test_a_dense_layer_matches_the_numpy_reference_for_three_steps():
  """Forward output, dx, dw and the histories / scales after each step, against the reference;
  step 1 saturates x (scale 1, |x| > 448) and underflows part of dy (E5M2 at scale 1)."""
  model = nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0))
  quantize_model(model, recipe_rules("fp8_delayed", model))
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal((5, 4)).astype(F32) * s for s in (300.0, 1.0, 0.01)]
  cs = [rng.standard_normal((5, 3)).astype(F32) * s for s in (1e-5, 1.0, 3.0)]
  w = np.asarray(model.kernel[...])
  L = 1024
  ref = {t: (np.zeros(L, F32), F32(1)) for t in ("x", "w", "dy")}
  got0 = metas_of(model)
  for t in ("x", "w", "dy"):
    np.testing.assert_array_equal(got0[f"{t}_amax_history"], np.zeros(L, F32))
    assert got0[f"{t}_scale"] == F32(1)
  for step, (x, c) in enumerate(zip(xs, cs)):
    xd = ref_qdq(x, ref["x"][1], E4M3)
    wd = ref_qdq(w, ref["w"][1], E4M3)
    dyd = ref_qdq(c, ref["dy"][1], E5M2)
    y = np.asarray(_forward(model, jnp.asarray(x)))
    # the quantized operands bit for bit: the same float32 GEMM of the reference operands
    y_same = jax.lax.dot(jnp.asarray(xd), jnp.asarray(wd), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(y, np.asarray(y_same), err_msg=f"step {step + 1}")
    np.testing.assert_allclose(y, xd.astype(np.float64) @ wd, rtol=1e-6, atol=1e-30)
    param_grads, dx = train_step_single(model, jnp.asarray(x), jnp.asarray(c))
    np.testing.assert_allclose(np.asarray(dx), dyd.astype(np.float64) @ wd.T, rtol=1e-6,
                               atol=1e-30)
    np.testing.assert_allclose(np.asarray(param_grads["kernel"][...]),
                               xd.T.astype(np.float64) @ dyd, rtol=1e-6, atol=1e-30)
    for t, v, name in (("x", x, E4M3), ("w", w, E4M3), ("dy", c, E5M2)):
      ref[t] = ref_update(ref[t][0], ref[t][1], np.abs(v).max(), name)
    got = metas_of(model)
    for t in ("x", "w", "dy"):
      np.testing.assert_array_equal(got[f"{t}_amax_history"], ref[t][0],
                                    err_msg=f"{t} history, step {step + 1}")
      assert got[f"{t}_scale"].dtype == F32
      assert got[f"{t}_scale"] == ref[t][1], (t, step + 1, got[f"{t}_scale"], ref[t][1])
  # the delayed scale: step 1's saturated x set the window's max, steps 2-3 keep it
  assert ref["x"][1] == F32(448) / F32(np.abs(xs[0]).max())
  assert (ref["x"][0][:1] == np.abs(xs[2]).max()).all() and ref["x"][0][-1] == np.abs(xs[1]).max()


def test_zero_and_nonfinite_amax_keep_the_scale():
  h0 = jnp.zeros(4, jnp.float32)
  h, s = amax_update(h0, jnp.float32(1), jnp.float32(0), 448.0)
  assert float(s) == 1.0 and not np.asarray(h).any()
  h = jnp.asarray([0, 0, 2, 0], jnp.float32)
  h1, s1 = amax_update(h, jnp.float32(7), jnp.float32(0), 448.0)
  np.testing.assert_array_equal(h1, [0, 2, 0, 0])
  assert float(s1) == 224.0  # the history still holds 2
  _, s2 = amax_update(h0, jnp.float32(7), jnp.float32(np.inf), 448.0)
  _, s3 = amax_update(h0, jnp.float32(7), jnp.float32(np.nan), 448.0)
  assert float(s2) == float(s3) == 7.0
  _, s4 = amax_update(h0, jnp.float32(7), jnp.float32(1e-37), 448.0)  # 448 / 1e-37 overflows
  assert float(s4) == np.finfo(F32).max
  _, s5 = amax_update(h0, jnp.float32(7), jnp.float32(2), 448.0 / 4)  # margin 2
  assert float(s5) == 56.0
  h6, s6 = amax_update(h, jnp.float32(7), jnp.float32(1), 448.0, "most_recent")
  assert float(s6) == 448.0 and np.asarray(h6).max() == 2.0
  for args in ((h, 7, 0.0, "e4"), (h, 7, 1.0, "e5"), (h, 7, np.inf, "e5")):
    want = ref_update(np.asarray(args[0]), args[1], args[2], E4M3 if args[3] == "e4" else E5M2)
    got = amax_update(args[0], jnp.float32(args[1]), jnp.float32(args[2]),
                      448.0 if args[3] == "e4" else 57344.0)
    np.testing.assert_array_equal(got[0], want[0])
    assert float(got[1]) == want[1]


def test_an_all_zero_input_keeps_scale_one_in_a_layer():
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  quantize_model(model, recipe_rules("fp8_delayed", model))
  train_step_single(model, jnp.zeros((2, 4)), jnp.ones((2, 3)))
  got = metas_of(model)
  assert got["x_scale"] == 1.0 and not got["x_amax_history"].any()
  assert got["w_scale"] != 1.0 and got["dy_scale"] == F32(57344)


class _TwoBranches(nnx.Module):
  """Two fp8_delayed layers; `use` picks the ones a call runs (a layer may run twice)."""

  def __init__(self):
    self.a = nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(0))
    self.b = nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(1))
    quantize_model(self, recipe_rules("fp8_delayed", self))

  def __call__(self, x, use=("a",)):
    for name in use:
      x = getattr(self, name)(x)
    return x


@functools.partial(nnx.jit, static_argnums=2)  # one compile per `use`, not op by op
def _meta_step(model, x, use):
  def loss(m, x):
    return jnp.sum(m(x, use) ** 2)

  meta_grads = nnx.grad(loss, argnums=nnx.DiffState(0, Fp8Meta))(model, x)
  nnx.update(model, overwrite_fp8_meta(nnx.state(model, Fp8Meta), meta_grads))


def _metas(layer):
  return {t: np.asarray(v) for t, v in metas_of(layer).items()}


def test_a_layer_not_called_keeps_its_state_and_the_called_one_updates():
  """TE updates only the modules that ran: after a step through a then one through b, a's
  histories hold one amax each (not zeros written by the step that skipped it)."""
  model = _TwoBranches()
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4)), jnp.float32)
  _meta_step(model, x, ("a",))
  after_a = _metas(model.a)
  assert all(after_a[f"{t}_amax_history"][0] > 0 for t in ("x", "w", "dy"))
  assert all(after_a[f"{t}_scale"] != 1 for t in ("x", "w", "dy"))
  untouched = _metas(model.b)
  assert all(not untouched[f"{t}_amax_history"].any() and untouched[f"{t}_scale"] == 1
             for t in ("x", "w", "dy"))
  _meta_step(model, x, ("b",))
  for t, v in _metas(model.a).items():
    np.testing.assert_array_equal(v, after_a[t], err_msg=t)
  assert _metas(model.b)["x_amax_history"][0] == F32(np.abs(np.asarray(x)).max())


def test_a_layer_called_twice_under_differentiation_is_refused_while_tracing():
  model = _TwoBranches()
  x = jnp.ones((3, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"^A layer quantized with DelayedScaling .* called twice "
                     r"in one differentiated function; this is not allowed") as e:
    _meta_step(model, x, ("a", "b", "a"))
  assert "\n" not in str(e.value)
  # Called twice without differentiation (evaluation), or once in each of two steps: allowed.
  jax.jit(lambda x: nnx.merge(*nnx.split(model))(x, ("a", "a")))(x)
  model(model(x))
  _meta_step(model, x, ("a",))
  _meta_step(model, x, ("a",))


# -- the data-parallel step on 8 devices --------------------------------------------------------


def _mlp():
  model = nnx.Sequential(nnx.Linear(6, 8, rngs=nnx.Rngs(1)), nnx.relu,
                         nnx.Linear(8, 3, rngs=nnx.Rngs(2)))
  quantize_model(model, recipe_rules("fp8_delayed", model))
  return model


@functools.partial(jax.jit, static_argnums=(0, 1))
def _device_meta_grads(graphdef, devices, metas, rest, part):
  """One device's overwrite gradients (loss / devices), jitted: one compile serves every device
  and step (the eager version compiled hundreds of tiny ops)."""

  def loss(metas):
    model = nnx.merge(graphdef, *rest[:3], metas, rest[3], copy=True)
    return jt.cross_entropy_loss(model, part)[0] / devices

  return jax.grad(loss)(metas)


def _reference_metas(graphdef, state, batch, devices):
  """The step's new Fp8Meta state computed device by device outside the step: each device's
  overwrite gradients (loss / devices), the max over devices, the scales from it."""
  old, others = nnx.split_state(state.model_state, Fp8Meta, ...)
  old = jax.tree.map(np.asarray, old)
  rest = jax.tree.map(np.asarray, (state.params, state.batch_stats, state.rng_keys, others))
  per_device = []
  rows = batch["image"].shape[0] // devices
  for d in range(devices):
    part = {k: v[d * rows:(d + 1) * rows] for k, v in batch.items()}
    per_device.append(_device_meta_grads(graphdef, devices, old, rest, part))
  hist = jax.tree.map(lambda *g: np.max(np.stack([np.asarray(x) for x in g]), axis=0),
                      *per_device)
  return overwrite_fp8_meta(old, hist)


def _flat(tree):
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_the_data_parallel_step_keeps_one_history_the_max_over_devices(fast_compile):
  """8 devices, each with its own data (device d's rows scaled by d + 1): after each of two
  steps every device holds the same histories and scales, equal to the max over the devices'
  own updates; SGD with momentum and weight decay never touches them."""
  assert jax.device_count() == 8
  model = _mlp()
  mesh = jt.data_mesh()
  opt = optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1, momentum=0.9))
  graphdef, state = jt.init_train_state(model, opt, mesh)
  assert not any("amax" in k or "scale" in k for k in _flat(state.opt_state))
  step = jt.TrainStep(graphdef, opt, mesh)
  rng = np.random.default_rng(3)
  first = None
  for i in range(2):
    image = rng.standard_normal((16, 6)).astype(F32) * np.repeat(np.arange(1, 9), 2)[:, None]
    batch = {"image": image, "label": rng.integers(0, 3, 16).astype(np.int32)}
    want = _flat(_reference_metas(graphdef, state, batch, 8))
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    got = _flat(nnx.split_state(state.model_state, Fp8Meta, ...)[0])
    assert got.keys() == want.keys() and len(got) == 12
    for k, v in got.items():
      shards = [np.asarray(s.data) for s in v.addressable_shards]
      assert len(shards) == 8
      for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0], err_msg=k)
      np.testing.assert_allclose(shards[0], np.asarray(want[k]), rtol=1e-6, err_msg=k)
    # exact where the amax is exact: the first layer's input (the whole batch) and the kernels
    hist = got["['layers'][0]['dot_general']['fp8']['x_amax_history'].value"]
    assert np.asarray(hist)[0] == np.abs(image).max()
    for layer in (0, 2):
      k = f"['layers'][{layer}]['dot_general']['fp8']['w_amax_history'].value"
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    if i == 1:  # the step-1 amax rolled to the end
      assert np.asarray(hist)[-1] == np.abs(first).max()
    first = image


def test_emulated_nodes_give_the_devices_state_bit_for_bit(fast_compile):
  """1 device x 8 emulated nodes and 2 devices x 4 give the histories, scales and parameters of 8
  devices x 1 node bit for bit (the per-device max over nodes, then the max over devices)."""
  rng = np.random.default_rng(5)
  batches = [{"image": rng.standard_normal((16, 6)).astype(F32) * (i + 1),
              "label": rng.integers(0, 3, 16).astype(np.int32)} for i in range(2)]

  def run(devices, nodes):
    mesh = jt.data_mesh(jax.devices()[:devices])
    opt = optax.sgd(0.1, momentum=0.9)
    graphdef, state = jt.init_train_state(_mlp(), opt, mesh)
    step = jt.TrainStep(graphdef, opt, mesh, jt.GradSync(emulate_nodes=nodes))
    for batch in batches:
      state, _ = step(state, batch)
    return jax.tree.map(np.asarray, (state.params, state.model_state))

  want = run(8, 1)
  assert any(np.asarray(v).any() for k, v in _flat(want[1]).items() if "dy_amax" in k)
  for devices, nodes in ((1, 8), (2, 4)):
    got = run(devices, nodes)
    assert _flat(got).keys() == _flat(want).keys()
    for k, v in _flat(want).items():
      np.testing.assert_array_equal(_flat(got)[k], v, err_msg=f"{devices}x{nodes} {k}")
