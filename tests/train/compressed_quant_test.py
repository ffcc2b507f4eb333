"""A HiPress compressor (jlp.compression) on the gradients of custom-precision layers (jlp.nn
quantization rules): the tiny small CNN with e4m3 forward operands and e5m2 backward operands in
every convolution and dense layer trains with a compressed gradient sync.

* Data-parallel (jlp.train.TrainStep, onebit with error feedback, CaSync-Ring on the three
  kernels, the biases and BatchNorm parameters by the float32 psum): on a fixed batch the loss
  falls at each of four steps and every parameter moves; at every step the summed gradient and
  every device's new compression state equal, bit for bit, `jlp.compression.sync` run directly
  (in a shard_map of its own) on the quantized model's per-device gradients, themselves computed
  by jax.grad outside the step. Reference: that direct call.
* Pipelined (jlp.pipeline.Pipeline, 2 pipelines x 4 stages, GPipe, the stage gradients summed by
  onebit over the pipelines): the loss falls, the parameters move, and the per-(pipeline, stage)
  compression state is non-zero after the first run and changes in the second.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jlp.compression as jc
import jlp.train as jt
from jlp.gemm import GemmQuant
from jlp.nn import QuantRule, quantize_model
from jlp.pipeline import Pipeline, pipeline_mesh, split_model
from runs import assert_trees_equal
from tiny_models import build

pytestmark = pytest.mark.usefixtures("fast_compile")

W = 8
#: Every conv and dense layer: e4m3 activations and weights, e5m2 gradients (both GEMMs).
RULES = [QuantRule(".*", GemmQuant(x="e4m3", w="e4m3", wgrad_dy="e5m2", dgrad_dy="e5m2"))]


def _quantized_model():
  model = build("small_cnn", dict(width=4))
  report = quantize_model(model, RULES)
  assert len(report) == 3 and all(cfg is not None for cfg in report.values())  # 2 convs, 1 dense
  model.train()
  return model


def _batch(rows, seed=0):
  rng = np.random.default_rng(seed)
  return {"image": rng.standard_normal((rows, 8, 8, 1)).astype(np.float32),
          "label": rng.integers(0, 10, rows).astype(np.int32)}


def _recording(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`optimizer`, after a transformation that keeps the last gradient it was given as its state."""
  record = optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda grads, state, params=None: (grads, grads))
  return optax.chain(record, optimizer)


def _device_grads(graphdef, mesh):
  """f(state, batch): every device's gradient of its own rows' mean loss / W (the step's
  convention), stacked on [W]: jax.grad of the merged quantized model, BatchNorm on the device's
  rows."""
  def body(params, stats, keys, rest, rows):
    def loss(p):
      model = nnx.merge(graphdef, p, stats, keys, rest, copy=True)
      return jt.cross_entropy_loss(model, rows)[0] / W
    return jax.tree.map(lambda g: g[None], jax.grad(loss)(params))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P(), P("data")),
                            out_specs=P("data"), check_vma=False))
  return lambda state, batch: f(state.params, state.batch_stats, state.rng_keys,
                                state.model_state, batch)


def _direct_sync(mesh, sync):
  """f(stacked gradients, stacked states): jlp.compression.sync on each device's row."""
  def body(grads, state):
    grads, state = jax.tree.map(lambda x: x[0], (grads, state))
    out, state = jc.sync(grads, "data", sync.compression, state, topology=sync.topology,
                         min_size=sync.min_size)
    return out, jax.tree.map(lambda x: x[None], state)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=(P(), P("data")), check_vma=False))


def test_data_parallel_quantized_model_trains_with_compression():
  mesh = jt.data_mesh()
  sync = jt.GradSync(compression="onebit", topology="ring", min_size=20)  # the 3 kernels
  optimizer = _recording(jt.torch_sgd(0.5, momentum=0.9))
  graphdef, state = jt.init_train_state(_quantized_model(), optimizer, mesh, sync)
  step = jt.TrainStep(graphdef, optimizer, mesh, sync)
  batch = jt.shard_batch(_batch(4 * W), mesh)
  device_grads, direct_sync = _device_grads(graphdef, mesh), _direct_sync(mesh, sync)
  first_params, losses = state.params, []
  for _ in range(4):
    grads = device_grads(state, batch)
    want_sum, want_state = direct_sync(grads, state.sync_state)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    assert_trees_equal(state.opt_state[0], want_sum)  # the summed gradient the step applied
    assert_trees_equal(state.sync_state, want_state)
    # Compressed: not the float32 sum of the per-device gradients.
    exact = jax.tree.map(lambda g: np.sum(np.asarray(g), 0), grads)
    assert any(np.any(np.asarray(g) != e) for g, e in
               zip(jax.tree.leaves(want_sum), jax.tree.leaves(exact), strict=True))
  assert all(np.isfinite(losses)) and losses[-1] < 0.95 * losses[0], losses
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  moved = [np.any(np.asarray(a) != np.asarray(b)) for a, b in
           zip(jax.tree.leaves(first_params), jax.tree.leaves(state.params), strict=True)]
  assert all(moved)
  # Every device holds its own non-zero compression state (error-feedback residuals).
  rows = np.concatenate([np.asarray(x).reshape(W, -1) for x in jax.tree.leaves(state.sync_state)],
                        axis=1)
  assert np.all(np.any(rows != 0, axis=1)) and len({r.tobytes() for r in rows}) == W


def _pipeline_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# Slow tier: the default tier runs GPipe with onebit over the pipelines (error-feedback state per
# (pipeline, stage), checkpointed and resumed bit for bit) in
# pipeline_loop_test.test_resume_is_bit_exact[gpipe_onebit], and a quantized stateful model
# (stochastic rounding) in GPipe stages in
# tests/pipeline/executor_test.py::test_quantized_zoo_model_trains_in_a_pipeline; the sync sees
# a stage's flat gradient whatever its layers' formats (the data-parallel test above keeps
# quantized + compressed in the default tier).
@pytest.mark.slow
def test_pipelined_quantized_model_trains_with_compression():
  n, s = 2, 4
  split = split_model(_quantized_model(), s)
  pipe = Pipeline(split.stages, _pipeline_loss, optax.sgd(1.0), pipeline_mesh(n, s),
                  schedule="gpipe", stateful=True,
                  grad_sync=jt.GradSync(compression="onebit", min_size=0))
  state = pipe.init(split.params, split.state)
  assert all(np.shape(x)[:2] == (n, s) for x in jax.tree.leaves(state.sync_state))
  assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(state.sync_state))
  batch = _batch(n * 8)
  xs, ys = (np.stack([batch[k]] * 3) for k in ("image", "label"))  # the same mini-batch 3 times
  first = pipe.stage_params(state)
  state, metrics = pipe.run(state, xs, ys)
  after_one = [np.asarray(x) for x in jax.tree.leaves(state.sync_state)]
  assert all(np.all(np.any(x.reshape(n * s, -1) != 0, axis=1)) for x in after_one)
  state, more = pipe.run(state, xs, ys)
  losses = np.concatenate([metrics["loss"], more["loss"]])
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
  assert np.all(np.diff(losses) < 0), losses
  assert all(np.any(np.asarray(x) != y)
             for x, y in zip(jax.tree.leaves(state.sync_state), after_one, strict=True))
  last = pipe.stage_params(state)
  for stage in range(s):
    for name, value in last[stage].items():
      assert np.any(value != first[stage][name]), (stage, name)
      np.testing.assert_array_equal(value[0], value[1], err_msg=name)  # one sum for both
