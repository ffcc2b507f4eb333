"""Flush schedules run by jlp.pipeline.Pipeline (jlp.pipeline.flush) on N = 2 pipelines x D = 4
devices (8 emulated devices). The reference of every schedule is the unpipelined model: jax.grad of
the mean loss over the mini-batch (each pipeline's rows; averaged over the pipelines with
sync="allreduce"), then the same optax update (GPipe's update, Huang et al. 2019; every flush
schedule must equal it). Float32 throughout: agreement to float32 rounding (the schedules sum the
micro-batches' gradients, the reference differentiates the mean)."""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from jlp.pipeline import Pipeline, Schedule, pipeline_mesh
from jlp.pipeline.flush import flush_tables
from jlp.pipeline.schedule_data import Action, bubble, peak_inflight

N, D = 2, 4
DIMS = (6, 8, 5, 7, 4, 9, 6, 7, 3)  # stage s maps DIMS[s] -> DIMS[s + 1]: 8 stages that differ
ROWS = 8  # rows per pipeline per mini-batch
TORCH_DUALPIPEV = pathlib.Path(__file__).parent / "data" / "dualpipev_4rank_10mb.csv"


def _stage(s, last):
  def apply(p, x):
    y = x @ p["w"] + p["b"]
    return y if s == last else jnp.tanh(y)
  return apply


def _model(num_stages, dims=DIMS, seed=0):
  dims = dims[:num_stages] + (dims[-1],)
  rng = np.random.default_rng(seed)
  params = [{"w": (rng.normal(size=(dims[s], dims[s + 1])) * 0.5).astype(np.float32),
             "b": (rng.normal(size=(dims[s + 1],)) * 0.1).astype(np.float32)}
            for s in range(num_stages)]
  return [_stage(s, num_stages - 1) for s in range(num_stages)], params


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _data(batches, rows=ROWS, seed=1):
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=(batches, N * rows, DIMS[0])).astype(np.float32)
  ys = rng.integers(0, DIMS[-1], size=(batches, N * rows)).astype(np.int32)
  return xs, ys


def _full_loss(params, x, y, stages):
  for stage, p in zip(stages, params, strict=True):
    x = stage(p, x)
  return loss_fn(x, y)


# jax.value_and_grad of the unpipelined model, jitted: one compile per model and shape instead of
# one per eager op (stages static).
_full_value_and_grad = jax.jit(jax.value_and_grad(_full_loss), static_argnums=3)


# The references' optimizer steps, jitted (optimizer and sync static): one compile per optimizer
# and model instead of one per eager op and parameter shape. The optimizers are module-level so
# that the tests that share one share its compiled steps.
SGD = optax.sgd(0.1)
SGD_MOMENTUM = optax.sgd(0.1, momentum=0.9)


@functools.partial(jax.jit, static_argnums=0)
def _reference_init(optimizer, params):
  return optimizer.init(params)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _reference_step(optimizer, sync, grads, opts, expected):
  """Every pipeline's optax update of one mini-batch (after the mean over the pipelines with
  sync="allreduce")."""
  if sync == "allreduce":
    grads = [jax.tree.map(lambda *g: sum(g) / N, *grads)] * N
  new_expected, new_opts = [], []
  for i in range(N):
    updates, opt = optimizer.update(grads[i], opts[i], expected[i])
    new_expected.append(optax.apply_updates(expected[i], updates))
    new_opts.append(opt)
  return new_expected, new_opts


def _reference(stages, params, xs, ys, optimizer, sync, rows=ROWS):
  """Per pipeline, the stage params after every mini-batch, and the mean losses."""
  expected = [params] * N
  opts = [_reference_init(optimizer, params)] * N
  losses = []
  for b in range(len(xs)):
    parts = [(xs[b][i * rows:(i + 1) * rows], ys[b][i * rows:(i + 1) * rows]) for i in range(N)]
    out = [_full_value_and_grad(expected[i], *parts[i], tuple(stages)) for i in range(N)]
    losses.append(np.mean([float(loss) for loss, _ in out]))
    expected, opts = _reference_step(optimizer, sync, [g for _, g in out], opts, expected)
  return expected, losses


def _assert_params(pipe, state, expected, rtol=2e-5, atol=2e-6):
  got = pipe.stage_params(state)
  for s in range(len(got)):
    for k in got[s]:
      for i in range(N):
        np.testing.assert_allclose(got[s][k][i], expected[i][s][k], rtol=rtol, atol=atol,
                                   err_msg=f"pipeline {i} stage {s} {k}")


@pytest.fixture(scope="module")
def mesh():
  return pipeline_mesh(N, D)


def _stage_count(schedule):
  if isinstance(schedule, Schedule):
    return schedule.num_stages
  return 2 * D if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else D


# Each schedule against the unpipelined model. In the default tier: interleaved 1F1B (allreduce) and
# 1F1B-flush (none). The others run against the unpipelined model in default tests too:
# 1F1B-flush and ZB-H1 with M = 4 and allreduce in test_b_i_and_w_run_from_the_forwards_residuals
# (and test_w_is_a_real_split_and_i_plus_w_is_the_full_backward), ZB-V (a V: two stages per device,
# the turn on the device, I and W) in test_a_stage_used_twice_sums_its_gradients and
# test_stateful_quantized_stages_in_a_v_schedule, DualPipeV (overlapped F;B pairs, I and W, the V)
# as torch's in test_torchs_dualpipev_csv_runs_as_written.
@pytest.mark.parametrize("schedule,m,sync", [
    ("interleaved_1f1b", 4, "allreduce"), ("1f1b_flush", 2, "none"),
    *[pytest.param(s, m, y, marks=pytest.mark.slow) for s, m, y in (
        ("1f1b_flush", 4, "allreduce"), ("zb_h1", 4, "allreduce"), ("zbv", 4, "none"),
        ("dualpipev", 8, "allreduce"),
        ("interleaved_1f1b", 8, "none"), ("zb_h1", 8, "none"), ("zbv", 8, "allreduce"),
        ("dualpipev", 8, "none"), ("1f1b_flush", 8, "allreduce"))]])
def test_every_flush_schedule_equals_the_unpipelined_model(mesh, schedule, m, sync):
  stages, params = _model(_stage_count(schedule))
  optimizer = SGD_MOMENTUM
  xs, ys = _data(2)
  pipe = Pipeline(stages, loss_fn, optimizer, mesh, schedule=schedule, num_microbatches=m,
                  sync=sync)
  state, metrics = pipe.run(pipe.init(params), xs, ys)
  expected, losses = _reference(stages, params, xs, ys, optimizer, sync)
  _assert_params(pipe, state, expected)
  np.testing.assert_allclose(metrics["loss"], losses, rtol=1e-5)
  assert int(state.step) == 2 and list(metrics["batch"]) == [0, 1]
  assert metrics["bubble"] == pytest.approx(bubble(pipe.schedule_data))
  assert list(metrics["updates"]) == [2] * N
  # A second run continues from the state (the updates of mini-batches 2 and 3 at the new
  # weights); the same shapes, so it runs the program the first run compiled.
  state, metrics = pipe.run(state, xs, ys)
  expected, losses = _reference(stages, params, np.concatenate([xs, xs]),
                                np.concatenate([ys, ys]), optimizer, sync)
  _assert_params(pipe, state, expected)
  np.testing.assert_allclose(metrics["loss"], losses[2:], rtol=1e-5)
  assert int(state.step) == 4 and list(metrics["batch"]) == [2, 3]


def test_torchs_dualpipev_csv_runs_as_written(mesh):
  """torch's regression artifact (ScheduleDualPipeV, 4 ranks, 10 micro-batches) read from its CSV,
  placed at ticks from its per-rank orders (as torch runs a CSV), and run."""
  table = Schedule.from_torch_csv(TORCH_DUALPIPEV.read_text())
  table = Schedule.from_orders(table.orders()).validate()
  stages, params = _model(table.num_stages)
  xs, ys = _data(1, rows=10)
  pipe = Pipeline(stages, loss_fn, SGD, mesh, schedule=table, num_microbatches=10)
  state, metrics = pipe.run(pipe.init(params), xs, ys)
  expected, losses = _reference(stages, params, xs, ys, SGD, "allreduce", rows=10)
  _assert_params(pipe, state, expected)
  np.testing.assert_allclose(metrics["loss"], losses, rtol=1e-5)


@pytest.fixture(scope="module")
def split_backward_runs(mesh):
  """ZB-H1 (F, I, W) and 1F1B-flush (F, B), M = 4, with and without remat, on one mini-batch from
  the same weights: {(remat, schedule): (the pipeline's stage params after the update, the
  number of dots its compiled program holds)}, and the unpipelined model's update. Each program
  is compiled once (lowered with the run's own input layout, so the run reuses it)."""
  stages, params = _model(D)
  xs, ys = _data(1)
  optimizer = SGD_MOMENTUM
  expected, _ = _reference(stages, params, xs, ys, optimizer, "allreduce")
  placed = [jax.device_put(a, NamedSharding(mesh, P(None, "data"))) for a in (xs, ys)]
  runs = {}
  for remat in (False, True):
    for schedule in ("zb_h1", "1f1b_flush"):
      pipe = Pipeline(stages, loss_fn, optimizer, mesh, schedule=schedule, num_microbatches=4,
                      remat=remat)
      state = pipe.init(params)
      text = pipe.lower(state, *placed).compile().as_text()
      state, _ = pipe.run(state, *placed)
      runs[remat, schedule] = pipe.stage_params(state), len(re.findall(r" dot\(", text))
  return runs, expected


def test_w_is_a_real_split_and_i_plus_w_is_the_full_backward(mesh, split_backward_runs):
  """A schedule whose W's all run after every I (the weight gradients computed long after, from
  the kept inputs and output gradients, M of each alive at once) gives what B gives; and ZB-H1
  (I and W) gives 1F1B-flush's (B) update bit for bit: per micro-batch, I's input gradient and
  W's weight gradient are B's, summed in the same order."""
  M = 4
  orders = []
  for d in range(D):
    forwards = [Action("F", d, m) for m in range(M)]
    orders.append(forwards + [Action("I", d, m) for m in range(M)] +
                  [Action("W", d, m) for m in range(M)])
  late_w = Schedule.from_orders(orders).validate()
  stages, params = _model(D)
  xs, ys = _data(1)
  optimizer = SGD_MOMENTUM  # split_backward_runs's: ZB-H1 and 1F1B-flush run there
  shared, expected = split_backward_runs
  runs = {name: shared[False, name][0] for name in ("zb_h1", "1f1b_flush")}
  pipe = Pipeline(stages, loss_fn, optimizer, mesh, schedule=late_w, num_microbatches=M)
  state, _ = pipe.run(pipe.init(params), xs, ys)
  runs["late_w"] = pipe.stage_params(state)
  # Every output gradient kept until its W.
  assert pipe._tables.g_slots == M  # pylint: disable=protected-access
  for name, got in runs.items():
    for s in range(D):
      for k in ("w", "b"):
        np.testing.assert_allclose(got[s][k][0], expected[0][s][k], rtol=2e-5, atol=2e-6,
                                   err_msg=f"{name} stage {s} {k}")
  jax.tree.map(np.testing.assert_array_equal, runs["zb_h1"], runs["1f1b_flush"])


def test_a_stage_used_twice_sums_its_gradients():
  """ZB-V on 2 devices puts stages 0 and 3 on device 0; with shared_stages=[(0, 3)] they are one
  square layer used first and last (tied weights): jax.grad of the model that uses one weight
  twice sums both uses, and so must the pipeline (both copies equal after the step)."""
  mesh = pipeline_mesh(N, 2)
  dims = (5, 5, 6, 5, 5)
  stages, params = _model(4, dims=dims)
  params[3] = params[0]
  xs = np.random.default_rng(3).normal(size=(1, N * ROWS, 5)).astype(np.float32)
  ys = np.random.default_rng(4).integers(0, 5, size=(1, N * ROWS)).astype(np.int32)
  optimizer = optax.sgd(0.2)
  pipe = Pipeline(stages, loss_fn, optimizer, mesh, schedule="zbv", num_microbatches=4,
                  shared_stages=[(0, 3)])
  state, _ = pipe.run(pipe.init(params), xs, ys)
  got = pipe.stage_params(state)

  def tied_loss(p, x, y):
    return _full_loss([p[0], p[1], p[2], p[0]], x, y, stages)
  tied = [params[0], params[1], params[2]]
  tied_grad = jax.jit(jax.grad(tied_loss))
  grads = [tied_grad(tied, xs[0][i * ROWS:(i + 1) * ROWS], ys[0][i * ROWS:(i + 1) * ROWS])
           for i in range(N)]
  mean = jax.tree.map(lambda *g: sum(g) / N, *grads)
  expected = jax.tree.map(lambda p, g: p - 0.2 * g, tied, mean)
  for s, e in ((0, 0), (1, 1), (2, 2), (3, 0)):
    for k in ("w", "b"):
      np.testing.assert_allclose(got[s][k][0], expected[e][k], rtol=2e-5, atol=2e-6,
                                 err_msg=f"stage {s} {k}")
  jax.tree.map(np.testing.assert_array_equal, got[0], got[3])
  # Without the tie, stage 0 steps by its first use's gradient alone (the unpipelined model with 4
  # independent layers; no second ZB-V program): the check above can fail. That ZB-V leaves stages
  # on one device untied by default is test_stateful_quantized_stages_in_a_v_schedule's.
  untied_grad = jax.jit(jax.grad(_full_loss), static_argnums=3)
  untied = [untied_grad(params, xs[0][i * ROWS:(i + 1) * ROWS], ys[0][i * ROWS:(i + 1) * ROWS],
                        tuple(stages))[0]["w"] for i in range(N)]
  untied_w0 = params[0]["w"] - 0.2 * (sum(untied) / N)
  assert not np.allclose(untied_w0, got[0]["w"][0], atol=1e-6)


def test_bubble_and_peak_activations_of_the_pipeline(mesh):
  stages4, _ = _model(D)
  stages8, _ = _model(2 * D)
  for M in (8, 16):
    gpipe = Pipeline(stages4, loss_fn, optax.sgd(0.1), mesh, schedule="gpipe", num_microbatches=M)
    flush = Pipeline(stages4, loss_fn, optax.sgd(0.1), mesh, schedule="1f1b_flush",
                     num_microbatches=M)
    zb = Pipeline(stages4, loss_fn, optax.sgd(0.1), mesh, schedule="zb_h1", num_microbatches=M)
    inter = Pipeline(stages8, loss_fn, optax.sgd(0.1), mesh, schedule="interleaved_1f1b",
                     num_microbatches=M)
    zbv = Pipeline(stages8, loss_fn, optax.sgd(0.1), mesh, schedule="zbv", num_microbatches=M)
    assert gpipe.bubble == pytest.approx((D - 1) / (M + D - 1))
    assert flush.bubble == pytest.approx((D - 1) / (M + D - 1))
    assert zb.bubble <= (D - 1) / (3 * M + D - 1) + 1e-12
    assert inter.bubble <= (D - 1) / (2 * M + D - 1) + 1e-12
    assert zbv.bubble <= zb.bubble
    assert max(gpipe.peak_inflight) == M
    assert max(flush.peak_inflight) == min(D, M) == max(zb.peak_inflight)
    if M == 16:
      assert max(flush.peak_inflight) * 4 == max(gpipe.peak_inflight)
  assert Pipeline(stages4, loss_fn, optax.sgd(0.1), mesh, schedule="zb_h1",
                  num_microbatches=8).bubble <= 0.12


def _temp_bytes(mesh, schedule, M, stages, params, micro_rows):
  pipe = Pipeline(stages, loss_fn, optax.sgd(0.1), mesh, schedule=schedule, num_microbatches=M)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(1, N * micro_rows * M, 4)).astype(np.float32)
  ys = rng.integers(0, 3, size=(1, N * micro_rows * M)).astype(np.int32)
  compiled = pipe.lower(pipe.init(params), xs, ys).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_buffers_are_sized_by_the_schedule_not_by_m(mesh):
  """Compiled temporary memory (XLA's memory analysis) of one mini-batch of M micro-batches of
  256 rows, 64 features between the stages: 1F1B-flush's stays flat from M = 4 to 16 (its rings
  hold about D inputs), GPipe's grows (M inputs)."""
  stages, params = _model(D, dims=(4, 64, 64, 64, 3))
  flush = {M: _temp_bytes(mesh, "1f1b_flush", M, stages, params, 256) for M in (4, 16)}
  gpipe = {M: _temp_bytes(mesh, Schedule.named("gpipe", D, M), M, stages, params, 256)
           for M in (4, 16)}
  assert flush[16] <= 1.5 * flush[4], flush
  assert gpipe[16] >= 1.5 * gpipe[4], (gpipe, flush)
  assert gpipe[16] >= 2 * flush[16], (gpipe, flush)


def test_stateful_quantized_stages_in_a_v_schedule():
  """The digits CNN with e4m3 stochastic-rounding layer inputs (per-layer RNG counters in the stage
  state; quantized weights too in executor_test's test_quantized_zoo_model_trains_in_a_pipeline)
  and BatchNorm, split into 4 stages on 2 devices in a V (ZB-V, 4 micro-batches): each pipeline's
  update and BatchNorm statistics equal the unsplit model's run over the micro-batches in order
  (statistics of each micro-batch, counters advancing once per micro-batch forward), gradients
  averaged over the pipelines."""
  from flax import nnx
  from jlp.formats import FloatFormat
  from jlp.gemm import GemmQuant
  from jlp.models import get_model
  from jlp.nn import QuantRule, quantize_model
  from jlp.pipeline import split_model

  M = 4
  model = get_model("small_cnn", num_classes=10, width=4, rngs=nnx.Rngs(0))
  fmt = FloatFormat.from_name("e4m3", rounding="stochastic")
  quantize_model(model, [QuantRule(".*", GemmQuant(x=fmt))], rngs=nnx.Rngs(quant=3))
  model.train()
  split = split_model(model, 4)
  mesh = pipeline_mesh(N, 2)
  pipe = Pipeline(split.stages, loss_fn, optax.sgd(0.1), mesh, schedule="zbv",
                  num_microbatches=M, stateful=True)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(1, N * ROWS, 8, 8, 1)).astype(np.float32)
  ys = rng.integers(0, 10, size=(1, N * ROWS)).astype(np.int32)
  state, _ = pipe.run(pipe.init(split.params, split.state), xs, ys)

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit  # one compile for every micro-batch, not one per eager op
  def micro_grad(p, rest, x, y):
    def micro_loss(p):
      m = nnx.merge(graphdef, p, rest, copy=True)
      return loss_fn(m(x), y) / M, nnx.split(m, nnx.Param, ...)[2]
    return jax.grad(micro_loss, has_aux=True)(p)

  grads, stats = [], []
  micro = ROWS // M
  for i in range(N):
    total, r = None, rest
    for m in range(M):
      rows = slice(i * ROWS + m * micro, i * ROWS + (m + 1) * micro)
      g, r = micro_grad(params, r, xs[0][rows], ys[0][rows])
      total = g if total is None else jax.tree.map(jnp.add, total, g)
    grads.append(total)
    stats.append(r)
  expected = jax.tree.map(lambda p, *g: p - 0.1 * (sum(g) / N), params, *grads)
  flat = dict(nnx.to_flat_state(expected))
  got = pipe.stage_params(state)
  checked = 0
  for s in range(4):
    for name, value in got[s].items():
      key = tuple(int(k) if k.isdigit() else k for k in name.split("/"))
      for i in range(N):
        np.testing.assert_allclose(value[i], flat[key][...], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} pipeline {i}")
      checked += 1
  assert checked == len(flat)
  got_state = pipe.stage_state(state)
  for i in range(N):
    flat_stats = dict(nnx.to_flat_state(stats[i]))
    for s in range(4):
      for name, value in got_state[s].items():
        key = tuple(int(k) if k.isdigit() else k for k in name.split("/"))
        if name.endswith(("mean", "var")):
          np.testing.assert_allclose(value[i], flat_stats[key][...], rtol=1e-5, atol=1e-6)
        if name.endswith("rng/count"):
          assert value[i] == M, (name, value[i])


def test_bad_flush_configurations_are_one_line_errors(mesh):
  stages4, params4 = _model(D)
  stages8, _ = _model(2 * D)
  sgd = optax.sgd(0.1)
  cases = [
      (dict(stages=stages8, schedule="dualpipev", num_microbatches=7), "even number >= 2D = 8"),
      (dict(stages=stages8, schedule="dualpipev", num_microbatches=6), "even number >= 2D = 8"),
      (dict(stages=stages8, schedule="interleaved_1f1b", num_microbatches=9),
       "multiple of the number of rounds"),
      (dict(stages=stages4, schedule="zbv", num_microbatches=4), "expected 8 (2 stage"),
      (dict(stages=stages8, schedule="zb_h1", num_microbatches=4), "expected 4 (1 stage"),
      (dict(stages=stages4, schedule="zb_h1", num_microbatches=4, sync="preduce"),
       "expected 'allreduce' or 'none'"),
      (dict(stages=stages4, schedule="zb_h1", num_microbatches=4, virtual_stages=2),
       "virtual_stages=2 is not allowed"),
      (dict(stages=stages4, schedule=Schedule.named("1f1b_flush", 2, 4), num_microbatches=4),
       "expected the mesh's 4"),
      (dict(stages=stages4, schedule=Schedule.named("1f1b_flush", D, 4), num_microbatches=2),
       "expected 4"),
      (dict(stages=stages8, schedule="zbv", num_microbatches=4, shared_stages=[(0, 1)]),
       "on one device"),
      (dict(stages=stages4, schedule="gpipe", num_microbatches=4, shared_stages=[(0, 1)]),
       "shared stages run in the flush schedules"),
      (dict(stages=stages4, schedule="zb_h2", num_microbatches=4), "schedule='zb_h2'"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
      Pipeline(loss_fn=loss_fn, optimizer=sgd, mesh=mesh, **kwargs)
    assert "\n" not in str(error.value)
  stages8, params8 = _model(2 * D)
  pipe = Pipeline(stages8, loss_fn, sgd, mesh, schedule="zbv", num_microbatches=8,
                  shared_stages=[(0, 7)])
  with pytest.raises(ValueError, match=r"stage_params\[0\] and stage_params\[7\] differ"):
    pipe.init(params8)
  with pytest.raises(ValueError, match="not allowed; expected a positive multiple"):
    flush = Pipeline(stages4, loss_fn, sgd, mesh, schedule="1f1b_flush", num_microbatches=4)
    flush.run(flush.init(params4), *_data(1, rows=6))


def test_b_i_and_w_run_from_the_forwards_residuals(mesh, split_backward_runs):
  """By default F keeps its forward's residuals (jax.vjp's) and B, I and W only run the backward
  (ZB-H1's I and W share no arithmetic: W reads what I kept); with remat=True they recompute the
  forward from the kept input. Both give the unpipelined model's update; the default compiles to
  fewer dots (no forward in B, I or W) and I + W still equals B bit for bit."""
  stages, _ = _model(D)
  optimizer = SGD_MOMENTUM
  runs, expected = split_backward_runs
  got = {key: stage_params for key, (stage_params, _) in runs.items()}
  dots = {key: count for key, (_, count) in runs.items()}
  for key, stage_params in got.items():
    for s in range(D):
      for k in stage_params[s]:
        for i in range(N):
          np.testing.assert_allclose(stage_params[s][k][i], expected[i][s][k], rtol=2e-5,
                                     atol=2e-6, err_msg=f"{key} pipeline {i} stage {s} {k}")
  # Per stage and micro-batch: F + I + W against F + (F + I) + (F + W), F + B against F + (F + B).
  assert dots[False, "zb_h1"] < dots[True, "zb_h1"], dots
  assert dots[False, "1f1b_flush"] < dots[True, "1f1b_flush"], dots
  jax.tree.map(np.testing.assert_array_equal, got[False, "zb_h1"], got[False, "1f1b_flush"])
  for schedule, remat in (("gpipe", False), ("1f1b_flush", "yes")):
    with pytest.raises(ValueError, match=rf"^remat={remat!r} is not allowed with schedule="):
      Pipeline(stages, loss_fn, optimizer, mesh, schedule=schedule, remat=remat)


def test_a_tick_issues_a_collective_only_on_the_shifts_it_sends_on(mesh):
  """Activations go one device down (shift 1), input gradients one up (shift D - 1). In GPipe's
  order F(s, m) runs at tick s + m and the backward mirrors it, so only ticks 0 .. M + D - 3 send
  an activation and only ticks M + D - 1 .. 2(M + D - 1) - 2 an input gradient: at the others the
  exchange skips that collective, and the update is still the unpipelined model's."""
  M = 4
  schedule = Schedule.named("gpipe", D, M)
  tables = flush_tables(schedule)
  assert tables.send_shifts == (1, D - 1)
  ticks = np.arange(tables.num_ticks)
  assert tables.num_ticks == 2 * (M + D - 1)
  np.testing.assert_array_equal(tables.sends[:, 0], ticks <= M + D - 3)
  np.testing.assert_array_equal(tables.sends[:, 1],
                                (ticks >= M + D - 1) & (ticks <= 2 * (M + D - 1) - 2))
  # Only the devices that send take part: no activation leaves the last device, no gradient the
  # first.
  assert tables.send_pairs == (tuple((d, d + 1) for d in range(D - 1)),
                               tuple((d, d - 1) for d in range(1, D)))
  # 1F1B-flush's steady state sends both ways at once.
  assert flush_tables(Schedule.named("1f1b_flush", D, M)).sends.all(axis=1).any()
  stages, params = _model(D)
  optimizer = SGD_MOMENTUM
  xs, ys = _data(2)
  pipe = Pipeline(stages, loss_fn, optimizer, mesh, schedule=schedule, num_microbatches=M)
  state, metrics = pipe.run(pipe.init(params), xs, ys)
  expected, losses = _reference(stages, params, xs, ys, optimizer, "allreduce")
  _assert_params(pipe, state, expected)
  np.testing.assert_allclose(metrics["loss"], losses, rtol=1e-5)
