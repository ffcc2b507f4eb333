"""The data-parallel train step (jlp.train.TrainStep) on 8 emulated CPU devices, small CNN.

* Bad settings and batches raise ValueError naming the field, before anything is compiled.
* Emulation exactness: 1 device x 4 nodes and 2 devices x 2 nodes give bit for bit the state
  (params, optimizer state, BatchNorm statistics) and metrics of 4 devices x 1 node, after three
  steps (and a power-of-two loss scale changes nothing); also 1 x 4 = 2 x 2 for a model with
  stochastic-rounding fp8 GEMMs and an e4m3 APS gradient sync. (4 nodes, not 8: an unrolled
  program of 8 node copies takes twice as long to compile, and the claim does not depend on the
  count.)
  Reference: the 4-device run itself (the claim is equality between configurations).
* A float32 step equals a reference step computed without shard_map up to float32 rounding:
  per-node gradients and BatchNorm updates from plain `nnx.value_and_grad` on each micro-batch,
  then the sum over nodes, the mean of the statistics and the SGD update in float64 numpy
  (written from cpd.md §6.1).
* Repeated steps on one fixed batch lower its loss; quantized models (jlp.nn.quantize_model,
  fp8 GEMMs, also with stochastic rounding: then the node layout does not change the bits either)
  train through the same step.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jlp.train as jt
from jlp.formats import FloatFormat
from jlp.gemm.config import GemmQuant
from jlp.nn import QuantRule, quantize_model
from runs import assert_trees_equal
from tiny_models import build

pytestmark = pytest.mark.usefixtures("fast_compile")

WIDTH = 4
BATCH = 32


def _batch(seed=0, size=BATCH):
  rng = np.random.default_rng(seed)
  return {"image": rng.standard_normal((size, 8, 8, 1)).astype(np.float32),
          "label": rng.integers(0, 10, size).astype(np.int32)}


def _model():
  model = build("small_cnn", dict(width=WIDTH))
  model.train()
  return model


def _sgd(lr=0.1):
  return jt.torch_sgd(lr, momentum=0.9, weight_decay=1e-3,
                      decay_mask=jt.decay_mask(jt.is_bn_or_bias))


E4M3, E5M2 = FloatFormat(4, 3), FloatFormat(5, 2)
SR = dict(rounding="stochastic")
QUANT = {
    # fp8 GEMMs (e4m3 forward operands, e5m2 output gradients); the classifier's x and gradients
    # rounded stochastically, so the model holds a PRNG stream.
    "fp8_sr": [
        QuantRule("linear", GemmQuant(x=FloatFormat(4, 3, **SR), w=E4M3,
                                      dgrad_dy=FloatFormat(5, 2, **SR),
                                      wgrad_dy=FloatFormat(5, 2, **SR))),
        QuantRule(".*", GemmQuant(x=E4M3, w=E4M3, dgrad_dy=E5M2, wgrad_dy=E5M2)),
    ],
}


@functools.lru_cache(maxsize=None)
def _run(devices, sync, seeds, *, quant=None, loss_scale=1.0, lr=0.1):
  """(state, [metrics per step]) as numpy after one step per batch seed (cached: tests share).
  PRNG keys come back as their key data."""
  model = _model()
  if quant is not None:
    report = quantize_model(model, QUANT[quant], rngs=nnx.Rngs(quant=3))
    assert set(report.layers) == {"conv1", "conv2", "linear"}
  mesh = jt.data_mesh(jax.devices()[:devices])
  optimizer = _sgd(lr)
  graphdef, state = jt.init_train_state(model, optimizer, mesh)
  step = jt.TrainStep(graphdef, optimizer, mesh, sync, loss_scale=loss_scale)
  metrics = []
  for seed in seeds:
    state, m = step(state, _batch(seed))
    # The traffic depends on the device layout (1 device x 8 nodes sends nothing); it is checked
    # in compressed_step_test.test_wire_bytes.
    assert m.pop("wire_bytes").shape == m.pop("payload_bytes").shape == ()
    assert m.pop("nonfinite") == 0
    metrics.append(m)
  state = state._replace(rng_keys=jax.tree.map(jax.random.key_data, state.rng_keys))
  return jax.tree.map(np.asarray, (state, metrics))


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(algorithm="tree"), "algorithm"),
    (dict(fmt="e4m3x"), "fmt"),
    (dict(aps=True), "aps"),
    (dict(fmt="e4m3", aps="yes"), "aps"),
    (dict(emulate_nodes=0), "emulate_nodes"),
    (dict(emulate_nodes=2.0), "emulate_nodes"),
    (dict(form="tree"), "form"),
    (dict(kahan=1), "kahan"),
    (dict(node_map="pmap"), "node_map"),
    (dict(algorithm="psum", fmt="e4m3"), "algorithm"),
    (dict(algorithm="psum", kahan=True), "algorithm"),
    (dict(algorithm="psum", emulate_nodes=2), "algorithm"),
])
def test_bad_sync_settings(kwargs, field):
  with pytest.raises(ValueError, match=f"^{field}="):
    jt.GradSync(**kwargs)


def test_sync_is_hashable_and_normalises_the_format():
  a, b = jt.GradSync(fmt="e4m3", aps=True), jt.GradSync(fmt=FloatFormat(4, 3), aps=True)
  assert a == b and hash(a) == hash(b)


def test_bad_mesh_axis_and_batch_fail_before_compiling():
  model = _model()
  mesh = jt.data_mesh(jax.devices()[:2])
  optimizer = _sgd()
  graphdef, state = jt.init_train_state(model, optimizer, mesh)
  with pytest.raises(ValueError, match="^axis_name='batch'"):
    jt.TrainStep(graphdef, optimizer, mesh, jt.GradSync(axis_name="batch"))
  with pytest.raises(ValueError, match="^loss_scale=0"):
    jt.TrainStep(graphdef, optimizer, mesh, loss_scale=0.0)
  with pytest.raises(ValueError, match="^unscale_grads=1 "):
    jt.TrainStep(graphdef, optimizer, mesh, unscale_grads=1)
  step = jt.TrainStep(graphdef, optimizer, mesh, jt.GradSync(emulate_nodes=4))

  def must_not_run(*args):
    raise AssertionError("compiled/ran before validating")

  step.jitted = must_not_run
  with pytest.raises(ValueError, match="^emulate_nodes=4"):
    step(state, _batch(size=12))  # 6 rows per device
  with pytest.raises(ValueError, match="batch size=7"):
    step(state, _batch(size=7))
  bad = _batch(size=16)
  bad["label"] = bad["label"][:8]
  with pytest.raises(ValueError, match="leading dimensions"):
    step(state, bad)


def test_mesh_helpers():
  mesh = jt.data_mesh()
  assert mesh.axis_names == ("data",) and mesh.shape["data"] == 8
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
  batch = jt.shard_batch(_batch(size=16), mesh)
  assert batch["image"].sharding == jt.batch_sharding(mesh)
  np.testing.assert_array_equal(np.asarray(batch["label"]), _batch(size=16)["label"])
  with pytest.raises(ValueError, match="leading dimension=12"):
    jt.shard_batch(_batch(size=12), mesh)
  with pytest.raises(ValueError, match="^axis_name='model'"):
    jt.batch_sharding(mesh, "model")


# -- emulated nodes -----------------------------------------------------------------------------


def test_emulated_nodes_equal_devices():
  """4 devices x 1 node == 1 x 4 == 2 x 2 (flat form), float32 sequential sync, 3 steps. The
  2 x 2 run also has a power-of-two loss scale, which must change nothing (the gradient is
  scaled exactly and divided back exactly). (The low-precision sync: test_quantized_model_trains
  compares 2 x 2 with 1 x 4 under e4m3 + APS.)"""
  seeds = (0, 1, 2)
  want = _run(4, jt.GradSync(), seeds)
  assert_trees_equal(_run(1, jt.GradSync(emulate_nodes=4), seeds), want)
  assert_trees_equal(_run(2, jt.GradSync(emulate_nodes=2), seeds, loss_scale=1024.0), want)
  state, metrics = want
  assert state[0] == len(seeds)
  assert np.isfinite(metrics[-1]["loss"]) and metrics[0]["loss"] != metrics[-1]["loss"]


def _gradient_recorder() -> optax.GradientTransformation:
  """An optimizer that keeps the last gradient it was given as its state and never updates."""
  return optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def test_unscale_grads_false_hands_the_optimizer_the_scaled_gradient():
  """CPD DavidNet compat (cpd.md §4): with unscale_grads=False the loss scale is never divided
  out, so the optimizer receives loss_scale x the gradient it receives by default (a power of
  two: exactly 4x, bit for bit). Reference: the unscaled run's gradient times 4 in numpy."""
  def received(**kwargs):
    mesh = jt.data_mesh(jax.devices()[:2])
    optimizer = _gradient_recorder()
    graphdef, state = jt.init_train_state(_model(), optimizer, mesh)
    state, _ = jt.TrainStep(graphdef, optimizer, mesh, **kwargs)(state, _batch(0))
    return jax.tree.map(np.asarray, state.opt_state)

  want = received()
  assert any(np.any(g != 0) for g in jax.tree.leaves(want))
  assert_trees_equal(received(loss_scale=4.0, unscale_grads=False),
                      jax.tree.map(lambda g: g * np.float32(4), want))


def test_scanned_nodes_equal_devices():
  """node_map="scan" (a loop over the nodes): 2 devices x 2 nodes == 1 x 4, and within float32
  rounding of the default ("unroll") 4 x 1 run."""
  seeds = (0, 1, 2)
  want = _run(2, jt.GradSync(emulate_nodes=2, node_map="scan"), seeds)
  assert_trees_equal(_run(1, jt.GradSync(emulate_nodes=4, node_map="scan"), seeds), want)
  unrolled_leaves = jax.tree.leaves(_run(4, jt.GradSync(), seeds))
  for got, unrolled in zip(jax.tree.leaves(want), unrolled_leaves, strict=True):
    np.testing.assert_allclose(got, unrolled, rtol=1e-5, atol=1e-7)


# -- against a reference step -------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _reference_step(batch_seed, nodes, lr, wd):
  """One step without shard_map: per-node loss, gradient and BatchNorm update from a plain
  jitted nnx.value_and_grad on each micro-batch; float64 numpy sum of the node gradients
  (each of loss / nodes), mean of the statistics, and SGD from cpd.md §6.1 (first step, so
  buf = d = g + wd*w, wd 0 on BN and biases; w -= lr*buf), from _model() on _batch(batch_seed)
  (cached: both node maps compare with one reference)."""
  model, batch = _model(), _batch(batch_seed)
  graphdef, params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)

  @jax.jit
  def node(params, mb):
    m = nnx.merge(graphdef, params, stats, rest, copy=True)

    def loss_fn(m):
      logits = m(mb["image"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, mb["label"]).mean()

    loss, g = nnx.value_and_grad(loss_fn)(m)
    return loss, nnx.state(g, nnx.Param), nnx.state(m, nnx.BatchStat)

  micro = BATCH // nodes
  outs = [node(params, {k: x[v * micro:(v + 1) * micro] for k, x in batch.items()})
          for v in range(nodes)]
  f64 = lambda tree: [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  grad = [sum(gs) / nodes for gs in zip(*[f64(o[1]) for o in outs])]
  stats_mean = [sum(ss) / nodes for ss in zip(*[f64(o[2]) for o in outs])]
  new = []
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(params)[0], grad):
    w = np.asarray(w, np.float64)
    decay = 0.0 if jt.is_bn_or_bias(jt.optim.param_path(path)) else wd
    new.append(w - lr * (g + decay * w))
  return new, stats_mean, np.mean([float(o[0]) for o in outs])


@pytest.mark.parametrize("node_map", ["unroll", "vmap"])
def test_float32_step_matches_reference(node_map):
  """Also node_map="vmap" (not bit-identical to devices, but as close to the reference)."""
  state, metrics = _run(4, jt.GradSync(emulate_nodes=2, node_map=node_map), (3,))
  params, stats, loss = _reference_step(3, 8, 0.1, 1e-3)
  for got, want in zip(jax.tree.leaves(state.params), params, strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
  for got, want in zip(jax.tree.leaves(state.batch_stats), stats, strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(metrics[0]["loss"], loss, rtol=1e-6)
  # The parameters moved by much more than the tolerance.
  start = jax.tree.leaves(nnx.state(_model(), nnx.Param))
  assert max(np.max(np.abs(a - np.asarray(b))) for a, b in zip(jax.tree.leaves(state.params),
                                                                start, strict=True)) > 1e-3


# -- training -----------------------------------------------------------------------------------


FIXED = (5,) * 6  # six steps on one batch


def test_steps_lower_the_loss_on_a_fixed_batch():
  _, metrics = _run(2, jt.GradSync(fmt="e4m3", aps=True, emulate_nodes=2), FIXED, lr=0.5)
  losses = [float(m["loss"]) for m in metrics]
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  assert losses[-1] < 0.9 * losses[0], losses


def test_quantized_model_trains():
  """fp8 GEMMs (stochastic rounding in the classifier) through the same step: finite, the loss
  goes down, the numbers differ from the float32 model's. The model carries a PRNG stream: node
  n draws from its key folded with n, so 1 device x 4 nodes equals 2 devices x 2 nodes bit for
  bit, and the stream's counter advances once per step."""
  quant = "fp8_sr"
  sync = jt.GradSync(fmt="e4m3", aps=True, emulate_nodes=2)
  q_state, q_metrics = _run(2, sync, FIXED, quant=quant, lr=0.5)
  _, f_metrics = _run(2, sync, FIXED, lr=0.5)
  q_losses = [float(m["loss"]) for m in q_metrics]
  assert np.all(np.isfinite(q_losses)) and q_losses[-1] < 0.9 * q_losses[0], q_losses
  assert q_losses != [float(m["loss"]) for m in f_metrics]
  counts = jax.tree.leaves(q_state.model_state)
  assert len(jax.tree.leaves(q_state.rng_keys)) == 1 and len(counts) == 1
  assert all(int(c) == len(FIXED) for c in counts)
  assert_trees_equal(
      _run(1, dataclasses.replace(sync, emulate_nodes=4), FIXED, quant=quant, lr=0.5),
      (q_state, q_metrics))
