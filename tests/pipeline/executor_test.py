"""jlp.pipeline.Pipeline on N = 2 pipelines x S = 4 stages (8 emulated devices), stages that differ
in shape. References, none of which runs a pipeline:
  * GPipe: jax.grad of the unpipelined model on the whole mini-batch, then the same optax update;
  * 1F1B: the version-mixed oracle of sdpipe.md §1.1 -- mini-batch b (1-based) runs at stage s
    (0-based) with the weights after max(0, b - (S - s)) updates of that stage, its gradient is
    applied to the latest weights;
  * partial reduce / AD-PSGD: the oracle's local step followed by x_i <- sum_j mix[b,s,i,j] x_j
    (numpy); HetPipe: the parameter-server rule of sdpipe.md §3.2 written out in numpy.
Float32 throughout, so agreement is to float32 rounding (the pipeline sums the same terms in
another order).
"""

import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import ml_dtypes
from jax.sharding import PartitionSpec as P

import jlp.compression as jc
from jlp.pipeline import HetPipe, Hetero, Pipeline, PReduce, pipeline_mesh
from jlp.sync import GradSync, reduce_gradients
from draw_recorder import DrawRecorder

N, S = 2, 4
DIMS = (6, 8, 5, 7, 3)  # stage s maps DIMS[s] -> DIMS[s + 1] features
ROWS = 8  # rows per pipeline per mini-batch


def _stage(s):
  def apply(p, x):
    y = x @ p["w"] + p["b"]
    return jnp.tanh(y) if s < S - 1 else y
  return apply


STAGES = [_stage(s) for s in range(S)]


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return [{"w": (rng.normal(size=(DIMS[s], DIMS[s + 1])) * 0.5).astype(np.float32),
           "b": (rng.normal(size=(DIMS[s + 1],)) * 0.1).astype(np.float32)} for s in range(S)]


def _data(batches, seed=1, n=N):
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=(batches, n * ROWS, DIMS[0])).astype(np.float32)
  ys = rng.integers(0, DIMS[-1], size=(batches, n * ROWS)).astype(np.int32)
  return xs, ys


def _full_loss(stage_params, x, y, stages=tuple(STAGES)):
  for stage, p in zip(stages, stage_params, strict=True):
    x = stage(p, x)
  return loss_fn(x, y)


# The references' gradients of the unpipelined model, jitted: one compile per shape instead of one
# per eager op (the same jax.grad of _full_loss; stages are static).
_full_grad = jax.jit(jax.grad(_full_loss), static_argnums=3)
_full_value_and_grad = jax.jit(jax.value_and_grad(_full_loss), static_argnums=3)


def _plan(mix, batches):
  """A hand-made plan: what `Pipeline.run` reads of a jlp.pipeline.SyncPlan."""
  times = np.arange(1.0, batches + 1)
  return types.SimpleNamespace(mix=np.asarray(mix, np.float32), times=times,
                               finish=np.broadcast_to(times[:, None, None], (batches, N, S)))


def _train(pipe, state, xs, ys, plan=None):
  """`pipe.run` then `pipe.flush`: every mini-batch trained; the metrics of both, in order (the
  bubble fraction over all their ticks)."""
  state, first = pipe.run(state, xs, ys, plan=plan)
  state, rest = pipe.flush(state, plan=plan)
  metrics = {k: np.concatenate([v, rest[k]]) for k, v in first.items() if np.ndim(v)}
  ticks = first["ticks"] + rest["ticks"]
  for k in ("bubble_fraction", "idle_slot_fraction"):  # shares of all the ticks of both
    metrics[k] = (first[k] * first["ticks"] + (rest[k] * rest["ticks"] if rest["ticks"] else 0)
                  ) / ticks
  return state, metrics


def _rows(x, i):
  return x[i * ROWS:(i + 1) * ROWS]


def _oracle_1f1b(params, xs, ys, optimizer, sync, mix=None, pull_every=10, n=N,
                 stages=tuple(STAGES)):
  """Per-pipeline version-mixed oracle; returns [pipeline][stage] params after all batches."""
  N, S = n, len(stages)  # pylint: disable=redefined-outer-name
  hist = [[[params[s]] for s in range(S)] for _ in range(N)]  # [i][s] -> versions
  opt = [[optimizer.init(params[s]) for s in range(S)] for _ in range(N)]
  server = [params[s] for s in range(S)]
  for b in range(1, len(xs) + 1):
    grads = []
    for i in range(N):
      versions = [hist[i][s][max(0, b - (S - s))] for s in range(S)]
      grads.append(_full_grad(versions, _rows(xs[b - 1], i), _rows(ys[b - 1], i), stages))
    if sync == "allreduce":
      mean = jax.tree.map(lambda *g: sum(g) / N, *grads)
      grads = [mean] * N
    for s in range(S):
      new, deltas = [], []
      for i in range(N):
        updates, opt[i][s] = optimizer.update(grads[i][s], opt[i][s], hist[i][s][-1])
        deltas.append(updates)
        new.append(optax.apply_updates(hist[i][s][-1], updates))
      if sync in ("preduce", "adpsgd"):
        m = np.asarray(mix[b - 1, s], np.float64)
        new = [jax.tree.map(lambda *w, i=i: sum(m[i, j] * np.asarray(w[j], np.float64)
                                                  for j in range(N)).astype(np.float32), *new)
               for i in range(N)]
      if sync == "hetpipe":
        for i in range(N):
          server[s] = jax.tree.map(lambda w, d: w + d / N, server[s], deltas[i])
        if b % pull_every == 0:
          new = [server[s]] * N
      for i in range(N):
        hist[i][s].append(new[i])
  return [[hist[i][s][-1] for s in range(S)] for i in range(N)]


def _assert_close(pipe, state, expected, atol=2e-6):
  got = pipe.stage_params(state)
  for i in range(N):
    for s in range(S):
      for k in ("w", "b"):
        np.testing.assert_allclose(got[s][k][i], expected[i][s][k], rtol=2e-5, atol=atol,
                                   err_msg=f"pipeline {i} stage {s} {k}")


@pytest.fixture(scope="module")
def mesh():
  return pipeline_mesh(N, S)


def test_gpipe_equals_the_unpipelined_model_on_the_whole_minibatch(mesh):
  optimizer = optax.sgd(0.1, momentum=0.9)
  params = _params()
  xs, ys = _data(3)
  def loss_and_accuracy(logits, labels):  # an aux metric, averaged like the loss
    return loss_fn(logits, labels), {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}

  pipe = Pipeline(STAGES, loss_and_accuracy, optimizer, mesh, schedule="gpipe",
                  num_microbatches=4)
  state, metrics = _train(pipe, pipe.init(params), xs, ys)
  expected, opt, losses, accuracies = params, optimizer.init(params), [], []
  for b in range(len(xs)):
    loss, grads = _full_value_and_grad(expected, xs[b], ys[b], tuple(STAGES))
    logits = xs[b]
    for s in range(S):
      logits = STAGES[s](expected[s], logits)
    accuracies.append(np.mean(np.argmax(logits, -1) == ys[b]))
    updates, opt = optimizer.update(grads, opt, expected)
    expected = optax.apply_updates(expected, updates)
    losses.append(loss)
  _assert_close(pipe, state, [expected] * N)
  np.testing.assert_allclose(metrics["loss"], losses, rtol=1e-5)
  np.testing.assert_allclose(metrics["accuracy"], accuracies, rtol=1e-6)
  assert metrics["bubble_fraction"] == pytest.approx(3 / 7)
  assert metrics["idle_slot_fraction"] == pytest.approx(3 / 7)  # counted by the devices
  assert int(state.step) == 3


# sync="none" in the slow tier: test_flush_completes_what_is_in_flight checks 1F1B with sync="none"
# against the same oracle (and the allreduce case here the table's bubble and idle slots).
@pytest.mark.parametrize("sync", ["allreduce", pytest.param("none", marks=pytest.mark.slow)])
def test_1f1b_follows_the_weight_version_rule(mesh, sync):
  # The optimizer and the run of 6 of test_equal_speeds_reduce_to_the_lockstep_numbers (and
  # test_runs_of_any_lengths_are_one_run): the same programs, compiled once.
  optimizer = optax.sgd(0.1, momentum=0.9)
  params = _params()
  xs, ys = _data(6)
  pipe = Pipeline(STAGES, loss_fn, optimizer, mesh, schedule="1f1b", sync=sync)
  state, metrics = _train(pipe, pipe.init(params), xs, ys)
  _assert_close(pipe, state, _oracle_1f1b(params, xs, ys, optimizer, sync))
  assert metrics["loss"].shape == (6,)
  # The table: 2 ops per mini-batch and stage in 2B + 2(S - 1) = 18 ticks. Counted by the
  # devices: the last stage's 6 forward ticks compute nothing (its backward runs the stage).
  assert metrics["bubble_fraction"] == pytest.approx(1 - 2 * 6 / 18)
  assert metrics["idle_slot_fraction"] == pytest.approx(1 - (2 * 6 * S - 6) / (S * 18))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_run_on_batches_of_known_shapes_traces_no_stage(mesh, schedule):
  """The stages are traced when a program is built, not at every run: on a small model, tracing
  their shapes again at each call cost as much as the compiled run. Counted by the Python calls
  of the stage functions: the second and third runs on batches of the first's shapes make none;
  1F1B's runs of 5, 6 and 7 mini-batches are one program (B is data of it: their tables pad to
  the same ticks and new mini-batches); a new batch shape traces again (its own layout and
  program), and the weights are still the unpipelined model's."""
  calls = [0] * S

  def counted(s):
    def apply(p, x):
      calls[s] += 1
      return STAGES[s](p, x)
    return apply

  optimizer = optax.sgd(0.1, momentum=0.9)  # 1F1B's programs: test_runs_of_any_lengths_are_one_run's
  params = _params()
  xs, ys = _data(3)
  pipe = Pipeline([counted(s) for s in range(S)], loss_fn, optimizer, mesh, schedule=schedule,
                  num_microbatches=1 if schedule == "1f1b" else 2)
  state, _ = pipe.run(pipe.init(params), xs[:1], ys[:1])
  traced = list(calls)
  assert all(traced), traced
  for b in (1, 2):
    state, _ = pipe.run(state, xs[b:b + 1], ys[b:b + 1])
  assert calls == traced, (calls, traced)
  if schedule == "1f1b":
    more_xs, more_ys = _data(18, seed=2)
    state, _ = pipe.run(state, more_xs[:5], more_ys[:5])
    traced = list(calls)
    for start, stop in ((5, 11), (11, 18)):
      state, _ = pipe.run(state, more_xs[start:stop], more_ys[start:stop])
    assert calls == traced, (calls, traced)
    state, _ = pipe.flush(state)  # another shape only after a flush
  state, _ = pipe.run(state, xs[:1, :N * ROWS // 2], ys[:1, :N * ROWS // 2])
  assert all(c > t for c, t in zip(calls, traced)), (calls, traced)
  if schedule == "1f1b":
    return  # its weights follow the version rule (test_1f1b_follows_the_weight_version_rule)
  expected, opt = params, optimizer.init(params)
  for x, y in ((xs[0], ys[0]), (xs[1], ys[1]), (xs[2], ys[2]),
               (xs[0, :N * ROWS // 2], ys[0, :N * ROWS // 2])):
    rows = len(x) // N
    grads = [_full_grad(expected, x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows],
                        tuple(STAGES)) for i in range(N)]
    updates, opt = optimizer.update(jax.tree.map(lambda *g: sum(g) / N, *grads), opt, expected)
    expected = optax.apply_updates(expected, updates)
  _assert_close(pipe, state, [expected] * N)


def _in_runs(pipe, state, xs, ys, lengths):
  """Runs of the given lengths, then the flush; (state, the metrics of every run joined). The
  pipeline's timeline starts afresh (it keeps its compiled programs)."""
  pipe._fill.clear()  # pylint: disable=protected-access
  parts, first = [], 0
  for n in lengths:
    state, metrics = pipe.run(state, xs[first:first + n], ys[first:first + n])
    parts.append(metrics)
    first += n
  state, metrics = pipe.flush(state)
  parts.append(metrics)
  keys = ("batch", "loss", "virtual_time", "group_sizes")
  return state, {k: np.concatenate([m[k] for m in parts]) for k in keys}


# Slow tier: 1F1B with sync="none" (its runs take the unaligned placement of preduce's and adpsgd's
# cases without their events; fill_test's runs, retries and flushes of sync="none" and its
# host-side test_a_pruned_fill_runs_and_drains_as_the_whole_one[none-...] cover the rest) and GPipe
# with "allreduce", "none" and "hetpipe" (GPipe keeps nothing in flight; preduce's and adpsgd's
# cases take the fill's decisions across GPipe's runs, hetpipe-1f1b the pulls counted over runs;
# timeline_test's test_decisions_do_not_depend_on_how_they_are_asked_for covers every GPipe sync's
# decisions).
#
# Also slow: allreduce with 1F1B. The splitting of 1F1B runs (what stays in flight, the run-length
# programs) is bit-checked by preduce's, adpsgd's and hetpipe's 1F1B cases; allreduce's own aligned
# placement over runs of 1 to 5 is fill_test's test_a_pruned_fill_runs_and_drains_as_the_whole_one
# [allreduce-...], and its chunks carried across runs, retries and flushes applied exactly once on
# the devices are fill_test's test_every_chunk_counts_once_through_retries_and_flushes[allreduce].
@pytest.mark.parametrize("sync,schedule", [
    pytest.param("allreduce", "1f1b", marks=pytest.mark.slow),
    pytest.param("none", "1f1b", marks=pytest.mark.slow),
    ("preduce", "1f1b"), ("adpsgd", "1f1b"), ("hetpipe", "1f1b"),
    pytest.param("allreduce", "gpipe", marks=pytest.mark.slow),
    pytest.param("none", "gpipe", marks=pytest.mark.slow),
    ("preduce", "gpipe"), ("adpsgd", "gpipe"),
    pytest.param("hetpipe", "gpipe", marks=pytest.mark.slow)])
def test_runs_of_any_lengths_are_one_run(mesh, schedule, sync):
  """6 mini-batches as one run, as 6 runs of 1 and as runs of 1 and 5, each followed by the
  flush, under stalls (0.05 virtual s with probability 0.3 per op): bit-identical parameters,
  optimizer states, losses, virtual times, groups and clocks. 1F1B's pipeline stays full
  between runs and the syncs' decisions come from one timeline of the fill."""
  # 6 mini-batches: the run of 6 is test_equal_speeds_reduce_to_the_lockstep_numbers's program (the
  # flush's too, but HetPipe's); the run of 5 starts with a mini-batch in flight.
  xs, ys = _data(6)
  pipe = Pipeline(STAGES, loss_fn, optax.sgd(0.1, momentum=0.9), mesh, schedule=schedule,
                  num_microbatches=2 if schedule == "gpipe" else 1, sync=sync,
                  hetero=Hetero(delay_s=0.05, probability=0.3),
                  hetpipe=HetPipe(pull_every=3, barrier=True))
  results = [_in_runs(pipe, pipe.init(_params()), xs, ys, lengths)
             for lengths in ([6], [1] * 6, [1, 5])]
  (state, metrics), others = results[0], results[1:]
  assert list(metrics["batch"]) == list(range(6))
  if sync in ("preduce", "adpsgd"):
    assert metrics["group_sizes"].size > 0
  for other_state, other_metrics in others:
    for k in metrics:  # every group reported once, by the run that made its update
      order = np.sort if k == "group_sizes" else np.asarray
      np.testing.assert_array_equal(order(other_metrics[k]), order(metrics[k]), err_msg=k)
    for a, b in zip(jax.tree.leaves(other_state), jax.tree.leaves(state), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flush_completes_what_is_in_flight(mesh):
  """1F1B with the state donated: a run of 6 leaves mini-batches 3..5 in flight (S = 4: the run
  ends where mini-batch 6 would enter); the flush completes them, and the weights then follow
  the version rule over all 6 (the oracle); flushing again does nothing; the next run fills the
  pipeline anew from the flushed weights (mini-batches 6 and 7 after a flush: the oracle of 2
  mini-batches from there)."""
  optimizer = optax.sgd(0.1)
  params = _params()
  xs, ys = _data(8)
  pipe = Pipeline(STAGES, loss_fn, optimizer, mesh, schedule="1f1b", sync="none", donate=True)
  state, metrics = pipe.run(pipe.init(params), xs[:6], ys[:6])
  assert list(metrics["batch"]) == [0, 1, 2]
  state, metrics = pipe.flush(state)
  assert list(metrics["batch"]) == [3, 4, 5]
  expected = _oracle_1f1b(params, xs[:6], ys[:6], optimizer, "none")
  _assert_close(pipe, state, expected)
  flushed = jax.tree.map(np.asarray, state)
  state, metrics = pipe.flush(state)
  assert metrics["batch"].size == 0
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(flushed), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)
  state, metrics = pipe.run(state, xs[6:], ys[6:])
  with pytest.raises(ValueError, match="while the pipeline holds mini-batches of shapes"):
    pipe.run(state, xs[:1, :N * 4], ys[:1, :N * 4])  # other rows while 6 and 7 are in flight
  state, rest = pipe.flush(state)
  assert list(metrics["batch"]) + list(rest["batch"]) == [6, 7]
  expected = [_oracle_1f1b(expected[i], xs[6:], ys[6:], optimizer, "none")[i] for i in range(N)]
  _assert_close(pipe, state, expected)
  # Empty again: mini-batches of other rows fill it anew (half the rows per pipeline).
  state, metrics = pipe.run(state, xs[:2, :N * ROWS // 2], ys[:2, :N * ROWS // 2])
  state, rest = pipe.flush(state)
  assert list(metrics["batch"]) + list(rest["batch"]) == [8, 9]


# Slow tier: test_flush_completes_what_is_in_flight trains a second 1F1B fill from the weights the
# first left against the same per-pipeline oracle; the runs' virtual times going on across runs
# are test_runs_of_any_lengths_are_one_run's (and fill_test's virtual spans).
@pytest.mark.slow
def test_1f1b_continues_across_runs_from_the_latest_weights(mesh):
  """Two runs of 3 mini-batches: the pipeline drains at the end of each run, so the second
  run's mini-batches restart the version rule from the weights the first one left."""
  optimizer = optax.sgd(0.1)
  params = _params()
  xs, ys = _data(6)
  pipe = Pipeline(STAGES, loss_fn, optimizer, mesh, schedule="1f1b", sync="none")
  state, first_metrics = _train(pipe, pipe.init(params), xs[:3], ys[:3])
  state, metrics = _train(pipe, state, xs[3:], ys[3:])
  # virtual time goes on from the first run (this pipeline's default plan: no stalls)
  assert np.all(np.diff(first_metrics["virtual_time"]) > 0)
  assert metrics["virtual_time"][0] > first_metrics["virtual_time"][-1]
  assert pipe.virtual_seconds(state) == pytest.approx(metrics["virtual_time"][-1], abs=1e-6)
  first = _oracle_1f1b(params, xs[:3], ys[:3], optimizer, "none")
  # every pipeline's stage weights after run 1 are the start of run 2 (per pipeline oracle)
  expected = []
  for i in range(N):
    per = _oracle_1f1b(first[i], xs[3:], ys[3:], optimizer, "none")
    expected.append(per[i])
  _assert_close(pipe, state, expected)
  assert int(state.step) == 6


# 6 mini-batches in the tests below: the programs of test_runs_of_any_lengths_are_one_run's run of 6
# (and test_equal_speeds_reduce_to_the_lockstep_numbers's flush), compiled once.
def test_partial_reduce_averages_models_with_the_plans_matrices(mesh):
  optimizer = optax.sgd(0.1, momentum=0.9)
  params = _params()
  xs, ys = _data(6)
  rng = np.random.default_rng(3)
  mix = np.broadcast_to(np.eye(N), (6, S, N, N)).copy()
  for b in range(6):
    for s in range(S):
      if rng.random() < 0.6:
        mix[b, s] = 1.0 / N
  pipe = Pipeline(STAGES, loss_fn, optimizer, mesh, schedule="1f1b", sync="preduce")
  state, _ = _train(pipe, pipe.init(params), xs, ys, plan=_plan(mix, 6))
  _assert_close(pipe, state, _oracle_1f1b(params, xs, ys, optimizer, "preduce", mix))


def test_four_pipelines_mix_with_rows_not_columns():
  """N = 4 pipelines x 2 stages with row-stochastic, asymmetric mixing matrices: pipeline i's
  new weights are sum_j mix[b, s, i, j] x_j. The oracle with the transposed matrices disagrees,
  so the test tells rows from columns (with N = 2 and group means, both are the same)."""
  n, stages = 4, (_stage(0), _stage(S - 1))  # tanh(x W + b), then the logits: 6 -> 8 -> 3
  rng = np.random.default_rng(5)
  params = [{"w": (rng.normal(size=(DIMS[0], DIMS[1])) * 0.5).astype(np.float32),
             "b": (rng.normal(size=(DIMS[1],)) * 0.1).astype(np.float32)},
            {"w": (rng.normal(size=(DIMS[1], DIMS[-1])) * 0.5).astype(np.float32),
             "b": (rng.normal(size=(DIMS[-1],)) * 0.1).astype(np.float32)}]
  xs, ys = _data(4, n=n)
  mix = rng.random((4, 2, n, n)) + np.eye(n)
  mix = (mix / mix.sum(-1, keepdims=True)).astype(np.float32)
  assert not np.allclose(mix, np.swapaxes(mix, -1, -2))
  optimizer = optax.sgd(0.1)
  pipe = Pipeline(list(stages), loss_fn, optimizer, pipeline_mesh(n, 2), schedule="1f1b",
                  sync="preduce")
  times = np.arange(1.0, 5.0)
  plan = types.SimpleNamespace(mix=mix, times=times,
                               finish=np.broadcast_to(times[:, None, None], (4, n, 2)))
  state, _ = _train(pipe, pipe.init(params), xs, ys, plan=plan)
  got = pipe.stage_params(state)
  expected = _oracle_1f1b(params, xs, ys, optimizer, "preduce", mix, n=n, stages=stages)
  transposed = _oracle_1f1b(params, xs, ys, optimizer, "preduce", np.swapaxes(mix, -1, -2), n=n,
                            stages=stages)
  for i in range(n):
    for s in range(2):
      for k in ("w", "b"):
        np.testing.assert_allclose(got[s][k][i], expected[i][s][k], rtol=2e-5, atol=2e-6)
  assert max(np.abs(got[s][k][i] - transposed[i][s][k]).max()
             for i in range(n) for s in range(2) for k in ("w", "b")) > 1e-3


def test_preduce_with_whole_groups_equals_allreduce_with_sgd(mesh):
  """sdpipe.md §9 (b): averaging linear local updates is averaging gradients."""
  optimizer = optax.sgd(0.1, momentum=0.9)
  params = _params()
  xs, ys = _data(6)
  full = np.full((6, S, N, N), 1.0 / N)
  runs = {}
  for sync in ("preduce", "allreduce"):
    pipe = Pipeline(STAGES, loss_fn, optimizer, mesh, schedule="1f1b", sync=sync)
    state, _ = _train(pipe, pipe.init(params), xs, ys, plan=_plan(full, 6))
    runs[sync] = pipe.stage_params(state)
  for s in range(S):
    np.testing.assert_allclose(runs["preduce"][s]["w"], runs["allreduce"][s]["w"], atol=2e-6)


def test_hetpipe_pulls_the_server_copy(mesh):
  optimizer = optax.sgd(0.1, momentum=0.9)
  params = _params()
  xs, ys = _data(6)
  pipe = Pipeline(STAGES, loss_fn, optimizer, mesh, schedule="1f1b", sync="hetpipe",
                  hetpipe=HetPipe(pull_every=2))
  state, _ = _train(pipe, pipe.init(params), xs, ys)
  _assert_close(pipe, state, _oracle_1f1b(params, xs, ys, optimizer, "hetpipe", pull_every=2))


# Slow tier: test_syncs_see_each_stages_own_gradient[aps_e4m3] runs a GradSync format (e4m3 with
# APS) inside the 1F1B pipeline and checks the update bit for bit against a direct
# reduce_gradients.
@pytest.mark.slow
def test_low_precision_allreduce_inside_the_pipeline(mesh):
  """GradSync(fmt="e5m2"): with lr 1 and zero biases the first update of a bias is minus the
  reduced gradient, so every updated bias is an e5m2 value (ml_dtypes) close to the float32 mean
  (one mini-batch: the 1F1B update uses the initial weights at every stage)."""
  params = [dict(p, b=np.zeros_like(p["b"])) for p in _params()]
  xs, ys = _data(1)
  pipe = Pipeline(STAGES, loss_fn, optax.sgd(1.0), mesh, schedule="1f1b",
                  grad_sync=GradSync(fmt="e5m2"))
  state, _ = _train(pipe, pipe.init(params), xs, ys)
  got = pipe.stage_params(state)
  grads = [jax.grad(_full_loss)(params, _rows(xs[0], i), _rows(ys[0], i)) for i in range(N)]
  for s in range(S):
    g = -got[s]["b"][0]
    assert np.all(g != 0)
    np.testing.assert_array_equal(g.astype(ml_dtypes.float8_e5m2).astype(np.float32), g)
    mean = (np.asarray(grads[0][s]["b"]) + np.asarray(grads[1][s]["b"])) / 2
    np.testing.assert_allclose(g, mean, rtol=0.3)
    assert np.any(g != mean)


def _counting_stage(s):
  """y = tanh(x @ w * (1 + c)) with c the number of forwards this stage has run (its state)."""
  def apply(p, x, state):
    y = x @ p["w"] * (1.0 + state["c"])
    return (jnp.tanh(y) if s < S - 1 else y), {"c": state["c"] + 1.0}
  return apply


def test_stateful_stages_recompute_with_the_stashed_state(mesh):
  optimizer = optax.sgd(0.1)
  params = [{"w": p["w"]} for p in _params()]
  xs, ys = _data(4)
  pipe = Pipeline([_counting_stage(s) for s in range(S)], loss_fn, optimizer, mesh,
                  schedule="1f1b", sync="none", stateful=True)
  state = pipe.init(params, [{"c": np.float32(0)} for _ in range(S)])
  state, _ = _train(pipe, state, xs, ys)
  for s in range(S):
    np.testing.assert_array_equal(pipe.stage_state(state)[s]["c"], [4.0] * N)

  def full(ps, x, y, b):  # mini-batch b (0-based) is the (b+1)-th forward of every stage
    for s in range(S):
      x = _counting_stage(s)(ps[s], x, {"c": b})[0]
    return loss_fn(x, y)

  full_grad = jax.jit(jax.grad(full))  # one compile, not one per eager op
  hist = [[[params[s]] for s in range(S)] for _ in range(N)]
  for b in range(1, 5):
    for i in range(N):
      versions = [hist[i][s][max(0, b - (S - s))] for s in range(S)]
      g = full_grad(versions, _rows(xs[b - 1], i), _rows(ys[b - 1], i), np.float32(b - 1))
      for s in range(S):
        hist[i][s].append(jax.tree.map(lambda w, g: w - 0.1 * g, hist[i][s][-1], g[s]))
  got = pipe.stage_params(state)
  for i in range(N):
    for s in range(S):
      np.testing.assert_allclose(got[s]["w"][i], hist[i][s][-1]["w"], rtol=2e-5, atol=2e-6)


def test_1f1b_runs_the_last_stage_once_per_minibatch(mesh):
  """Every stage but the last runs twice per mini-batch (its forward, then the backward's
  recomputation from the stashed input); the last stage's backward follows its forward with the
  same weights and state, so it runs once, in the backward. Counted at run time."""
  calls = []

  def counted(s):
    def apply(p, x):
      jax.debug.callback(lambda: calls.append(s))
      return STAGES[s](p, x)
    return apply

  xs, ys = _data(3)
  pipe = Pipeline([counted(s) for s in range(S)], loss_fn, optax.sgd(0.1), mesh,
                  schedule="1f1b", sync="none")
  jax.block_until_ready(_train(pipe, pipe.init(_params()), xs, ys))
  jax.effects_barrier()
  assert [calls.count(s) for s in range(S)] == [2 * N * 3] * (S - 1) + [N * 3]


# -- bad input, rejected before anything compiles ------------------------------------------------


def test_bad_configuration_is_rejected(mesh):
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match="len\\(stages\\)=3"):
    Pipeline(STAGES[:3], loss_fn, opt, mesh)
  with pytest.raises(ValueError, match="schedule='zb'"):
    Pipeline(STAGES, loss_fn, opt, mesh, schedule="zb")
  with pytest.raises(ValueError, match="sync='gossip'"):
    Pipeline(STAGES, loss_fn, opt, mesh, sync="gossip")
  with pytest.raises(ValueError, match="num_microbatches=4"):
    Pipeline(STAGES, loss_fn, opt, mesh, schedule="1f1b", num_microbatches=4)
  with pytest.raises(ValueError, match="mesh="):
    Pipeline(STAGES, loss_fn, opt, jax.make_mesh((8,), ("data",)))
  with pytest.raises(ValueError, match="grad_sync="):
    Pipeline(STAGES, loss_fn, opt, mesh, sync="none", grad_sync=GradSync(fmt="e4m3"))
  # The cost model and the scheduler against N = 2 pipelines x S = 4 stages.
  slow = Hetero(slowdown=((1.0,) * S,) * 3)
  with pytest.raises(ValueError, match=r"Hetero.slowdown=.* a \[num_pipelines=2\]\[num_stages=4\]"):
    Pipeline(STAGES, loss_fn, opt, mesh, hetero=slow)
  with pytest.raises(ValueError, match=r"PReduce.max_group=3 .* \[1, num_pipelines=2\]"):
    Pipeline(STAGES, loss_fn, opt, mesh, sync="preduce", preduce=PReduce(max_group=3))
  pipe = Pipeline(STAGES, loss_fn, opt, mesh)
  xs, ys = _data(1)
  with pytest.raises(ValueError, match="Hetero.slowdown="):
    pipe.run(pipe.init(_params()), xs, ys, hetero=slow)


def test_bad_inputs_are_rejected(mesh):
  pipe = Pipeline(STAGES, loss_fn, optax.sgd(0.1), mesh, schedule="gpipe", num_microbatches=4)
  params = _params()
  with pytest.raises(ValueError, match="stage_params"):
    pipe.init(params[:3])
  with pytest.raises(ValueError, match="dtype=float16"):
    pipe.init([jax.tree.map(lambda x: x.astype(np.float16), p) for p in params])
  state = pipe.init(params)
  xs, ys = _data(2)
  with pytest.raises(ValueError, match="rows=12"):
    pipe.run(state, xs[:, :12], ys[:, :12])
  with pytest.raises(ValueError, match="leading dimensions"):
    pipe.run(state, xs, ys[:1])
  with pytest.raises(ValueError, match=r"plan with mix \(1, 4, 2, 2\).* T >= 2"):
    pipe.run(state, xs, ys, plan=_plan(np.ones((1, S, N, N)), 1))
  bad = [dict(p) for p in params]
  bad[2] = {"w": np.zeros((4, 7), np.float32), "b": np.zeros((7,), np.float32)}
  with pytest.raises(ValueError, match="other structures or shapes"):
    pipe.init(bad)
  fresh = Pipeline(STAGES, loss_fn, optax.sgd(0.1), mesh, schedule="gpipe", num_microbatches=4)
  with pytest.raises(ValueError, match="stage 2 does not accept"):
    fresh.run(fresh.init(bad), xs, ys)
  with pytest.raises(ValueError, match="state.params"):
    other = {"w": np.zeros((6, 20), np.float32), "b": np.zeros((20,), np.float32)}
    fresh.run(Pipeline(STAGES, loss_fn, optax.sgd(0.1), mesh).init([other] * S), xs, ys)


# Slow tier: test_syncs_see_each_stages_own_gradient[onebit_ps] runs this GradSync (onebit, min_size
# 0) in the pipeline and checks the update and each stage's residual state bit for bit against a
# direct reduce_gradients; test_every_stage_draws_its_own_numbers carries a compressor's state
# across two updates.
@pytest.mark.slow
def test_compressed_allreduce_inside_the_pipeline(mesh):
  """GradSync(compression="onebit"): each stage's gradient (one flat buffer) goes through HiPress's
  onebit with error feedback; the residual state lives per (pipeline, stage) and the first update
  of a zero bias has the sign of the float32 mean gradient where that is large."""
  params = [dict(p, b=np.zeros_like(p["b"])) for p in _params()]
  xs, ys = _data(2)
  pipe = Pipeline(STAGES, loss_fn, optax.sgd(1.0), mesh, schedule="1f1b",
                  grad_sync=GradSync(compression="onebit", min_size=0))
  state = pipe.init(params)
  assert all(np.shape(x)[:2] == (N, S) for x in jax.tree.leaves(state.sync_state))
  state, metrics = _train(pipe, state, xs[:1], ys[:1])
  assert np.isfinite(metrics["loss"]).all()
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(state.sync_state))
  got = pipe.stage_params(state)
  grads = [jax.grad(_full_loss)(params, _rows(xs[0], i), _rows(ys[0], i)) for i in range(N)]
  mean = (np.asarray(grads[0][S - 1]["b"]) + np.asarray(grads[1][S - 1]["b"])) / 2
  large = np.abs(mean) > 0.5 * np.abs(mean).max()
  assert np.all(np.sign(-got[S - 1]["b"][0][large]) == np.sign(mean[large]))
  np.testing.assert_array_equal(got[S - 1]["b"][0], got[S - 1]["b"][1])  # one sum for both


# Each schedule with one rule in the default tier (5-35 s a case here); the rest in the slow one.
# Stochastic rounding runs with GPipe, whose backward also recomputes the forward from the stashed
# stage state (1F1B's stashed-state recomputation: test_stateful_stages_recompute_with_the_stashed_
# state; flush_test's V schedule runs it too): 1F1B with it compiles 3x longer than with BFP.
@pytest.mark.parametrize("schedule,rule", [
    ("1f1b", "bfp"), ("gpipe", "e4m3_stochastic"),
    *[pytest.param(s, r, marks=pytest.mark.slow)
      for s, r in (("gpipe", "e4m3"), ("1f1b", "e4m3"), ("1f1b", "e4m3_stochastic"),
                   ("gpipe", "bfp"))]])
def test_quantized_zoo_model_trains_in_a_pipeline(mesh, schedule, rule):
  """The digits CNN with quantized layers (jlp.nn rules: e4m3 weights; e4m3 inputs and weights
  with stochastic rounding, whose per-layer RNG counters live in the stage state; BFP inputs and
  weights), split into 4 stages (split_model), one mini-batch, GPipe with one micro-batch or 1F1B:
  each pipeline's update and BatchNorm statistics equal the unsplit quantized model's on the
  pipeline's rows (jax.grad through nnx, gradients averaged over the pipelines as
  sync="allreduce" says), to float32 rounding. With stochastic rounding a backward that drew
  other bits than its forward (or than the unsplit model) would be off by whole quantization
  steps; the counters advance once per forward, not per recomputation."""
  from flax import nnx
  from jlp.formats import BFPFormat, FloatFormat
  from jlp.gemm import GemmQuant
  from jlp.models import get_model
  from jlp.nn import QuantRule, quantize_model
  from jlp.pipeline import split_model

  model = get_model("small_cnn", num_classes=10, width=4, rngs=nnx.Rngs(0))
  if rule == "e4m3":
    cfg = GemmQuant(w="e4m3")
  elif rule == "e4m3_stochastic":
    fmt = FloatFormat.from_name("e4m3", rounding="stochastic")
    cfg = GemmQuant(x=fmt, w=fmt)
  else:  # blocks of 4 along the contracted (last) axis of the inputs, the input axis of kernels
    cfg = {"conv": GemmQuant(x=BFPFormat(4, (1, 1, 1, 4)), w=BFPFormat(4, (1, 1, 4, 1))),
           "linear": GemmQuant(x=BFPFormat(4, (1, 4)), w=BFPFormat(4, (4, 1)))}
  quantize_model(model, [QuantRule(".*", cfg)], rngs=nnx.Rngs(quant=3))
  model.train()
  split = split_model(model, S)
  pipe = Pipeline(split.stages, loss_fn, optax.sgd(0.1), mesh, schedule=schedule, stateful=True)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(1, N * ROWS, 8, 8, 1)).astype(np.float32)
  ys = rng.integers(0, 10, size=(1, N * ROWS)).astype(np.int32)
  state, _ = _train(pipe, pipe.init(split.params, split.state), xs, ys)

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit  # one compile for both pipelines' rows, not one per eager op
  def grad_and_stats(p, x, y):
    def loss(p):
      m = nnx.merge(graphdef, p, rest, copy=True)
      return loss_fn(m(x), y), nnx.split(m, nnx.Param, ...)[2]
    return jax.grad(loss, has_aux=True)(p)

  grads, stats = [], []
  for i in range(N):
    g, new_rest = grad_and_stats(params, _rows(xs[0], i), _rows(ys[0], i))
    grads.append(g)
    stats.append(new_rest)
  expected = jax.tree.map(lambda p, *g: p - 0.1 * (sum(g) / N), params, *grads)
  flat = dict(nnx.to_flat_state(expected))
  got = pipe.stage_params(state)
  checked = 0
  for s in range(S):
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
    for s in range(S):
      for name, value in got_state[s].items():
        if name.endswith(("mean", "var")):
          key = tuple(int(k) if k.isdigit() else k for k in name.split("/"))
          np.testing.assert_allclose(value[i], flat_stats[key][...], rtol=1e-5, atol=1e-6)
        if name.endswith("rng/count"):
          assert value[i] == 1, (name, value[i])


def test_every_stage_draws_its_own_numbers(mesh):
  """A compressor that draws (DrawRecorder keeps its last draw in its state) in every stage's
  sync: the S stages' flat gradients have the same layout, so only the stage index folded into
  the key tells their draws apart; every (pipeline, stage, partition) draw differs. The run
  reports the sync's bytes and non-finite count per mini-batch. One run of 5 mini-batches and no
  flush: it completes mini-batches 0 and 1 (S = 4), so one program, not a run's and a flush's."""
  xs, ys = _data(5)
  pipe = Pipeline(STAGES, loss_fn, optax.sgd(0.1), mesh, schedule="1f1b",
                  grad_sync=GradSync(compression=DrawRecorder(), min_size=0))
  state, metrics = pipe.run(pipe.init(_params()), xs, ys)
  assert list(metrics["batch"]) == [0, 1]
  draws = np.concatenate([np.asarray(x).reshape(-1) for x in jax.tree.leaves(state.sync_state)])
  assert draws.size == N * S * N and np.unique(draws).size == draws.size
  assert metrics["wire_bytes"].shape == (2,) and (metrics["wire_bytes"] > 0).all()
  assert (metrics["nonfinite"] == 0).all()



def _gradient_recorder() -> optax.GradientTransformation:
  """An optimizer that keeps the gradient it was given in its state and leaves the weights."""
  return optax.GradientTransformation(
      lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
      lambda g, state, params=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}))


_STAGE_SYNCS = {
    "onebit_ps": GradSync(compression="onebit", min_size=0),
    "onebit_ring": GradSync(compression="onebit", min_size=0, topology="ring"),
    "dgc_ps": GradSync(compression=jc.get("dgc", density=0.1), min_size=0),
    "terngrad_ring": GradSync(compression="terngrad", min_size=0, topology="ring"),
    "aps_e4m3": GradSync(fmt="e4m3", aps=True),
    "kahan_e5m2_ring": GradSync(fmt="e5m2", kahan=True, algorithm="ring"),
}


# DGC's top-k on every stage compiles for a minute here: slow tier (onebit stays).
# Also slow: onebit_ring and terngrad_ring (onebit_ps keeps the compressed path with its per-stage
# state and unpadded per-stage buffers; the pipeline has no topology-specific code, and
# tests/train/compressed_step_test.py::test_compressed_step_equals_a_direct_sync[terngrad-
# stochastic-ring] runs TernGrad's ring against a direct sync) and kahan_e5m2_ring (aps_e4m3 keeps
# the uncompressed format path; Kahan ring sums are tests/collectives').
_SLOW_STAGE_SYNCS = ("dgc_ps", "onebit_ring", "terngrad_ring", "kahan_e5m2_ring")


@pytest.fixture(scope="module")
def recorded_stage_gradients(mesh):
  """Per stage, each pipeline's gradient of one mini-batch (_data(1), _params()) as an
  unsynchronised 1F1B run of the pipeline computes it (recorded by its optimizer): the same for
  every case below, so it is run once."""
  xs, ys = _data(1)
  recorder = Pipeline(STAGES, loss_fn, _gradient_recorder(), mesh, schedule="1f1b", sync="none")
  recorded, _ = _train(recorder, recorder.init(_params()), xs, ys)
  opt_packer = recorder._require_init()[1]  # pylint: disable=protected-access
  host = {d: np.asarray(v) for d, v in recorded.opt_state.items()}
  return [opt_packer.unpack(s, {d: v[:, s] for d, v in host.items()})["g"] for s in range(S)]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c in _SLOW_STAGE_SYNCS else c for c in sorted(_STAGE_SYNCS)])
def test_syncs_see_each_stages_own_gradient(mesh, recorded_stage_gradients, case):
  """The stages hold 56, 45, 42 and 24 parameters, packed into buffers of 56. Each stage's sync
  gets its own gradient: the update, the report and the compression state (shaped for the
  stage's own length) are bit for bit a direct `reduce_gradients` over a 2-device mesh on the
  gradient / N that an unsynchronised run of the same pipeline computes (recorded by its
  optimizer); no padding in onebit's means, DGC's k, TernGrad's min and max or APS's shift."""
  sync = _STAGE_SYNCS[case]
  xs, ys = _data(1)
  params = _params()
  raw = recorded_stage_gradients

  pipe = Pipeline(STAGES, loss_fn, optax.sgd(1.0), mesh, schedule="1f1b", grad_sync=sync)
  state, metrics = _train(pipe, pipe.init(params), xs, ys)
  got, kept = pipe.stage_params(state), pipe.stage_sync_state(state)
  two = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("data",))
  flat = lambda tree: np.concatenate([np.ravel(v) for v in jax.tree.leaves(tree)])
  gs = [np.stack([flat(jax.tree.map(lambda v, i=i: v[i], raw[s])) for i in range(N)])
        for s in range(S)]
  fresh = [sync.init_state({"stage": jax.ShapeDtypeStruct((g.shape[1],), jnp.float32)}, N)
           for g in gs]

  def direct(*xs):  # every stage's reduce_gradients, each on its own: one program for all
    out = []
    for s, x in enumerate(xs):
      summed, new_state, report = reduce_gradients({"stage": x[0] * np.float32(1 / N)}, sync,
                                                   fresh[s], jnp.int32(0), stream=s)
      out.append((summed["stage"][None], jax.tree.map(lambda a: a[None], new_state), report))
    return out

  direct_out = jax.jit(jax.shard_map(
      direct, mesh=two, in_specs=(P("data"),) * S,
      out_specs=[(P("data"), P("data"), P())] * S, check_vma=False))(*gs)
  wire = 0.0
  for s in range(S):
    g = gs[s]
    assert g.shape == (N, flat(params[s]).size)
    summed, new_state, report = direct_out[s]
    wire += float(report["wire_bytes"])
    for i in range(N):
      np.testing.assert_array_equal(flat(jax.tree.map(lambda v, i=i: v[i], got[s])),
                                    flat(params[s]) - np.asarray(summed[i]),
                                    err_msg=f"stage {s} pipeline {i}")
      if kept is not None:
        jax.tree.map(lambda a, b, i=i: np.testing.assert_array_equal(a[i], np.asarray(b[i])),
                     kept[s], new_state)
  np.testing.assert_allclose(metrics["wire_bytes"][0], wire / S, rtol=1e-6)


GOLDENS = os.path.join(os.path.dirname(__file__), "..", "data", "pipeline_equal_speeds.npz")
# The stored arrays that XLA computes from the model (its matmuls, tanh, softmax cross-entropy and
# the SGD-momentum update): the goldens were made with jax 0.11.2, and another XLA may fuse and round
# a float32 expression differently (jax 0.12.0.1 gave one loss 1 ulp off: 1.0542783737 against
# 1.0542782545). They are compared within rtol=1e-5, atol=1e-6 (some 100 float32 ulps); what a change
# of executor moves them by is far larger: a stage's mini-batch on another weight version, an update
# lost or doubled, or another schedule's gradient sums (1F1B against GPipe, one sync against another
# where equal speeds do not make them agree) all differ from these goldens by more than 1e-3.
# The rest (mini-batch order, the cost model's virtual times, group sizes) is host-side and exact.
XLA_COMPUTED = ("loss", "params", "opt_")
XLA_RTOL, XLA_ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("sync", ["allreduce", "none", "preduce", "adpsgd", "hetpipe"])
def test_equal_speeds_reduce_to_the_lockstep_numbers(mesh, schedule, sync):
  """With equal speeds and no stalls, pipelines that progress by their own clocks run in step:
  one run of 6 mini-batches and the flush give what the lockstep executor gave
  (tests/data/make_pipeline_goldens.py, made at the commit before the clocks drove progress): the
  schedule's numbers bit for bit, the model's within XLA_RTOL / XLA_ATOL (see XLA_COMPUTED)."""
  sys.path.insert(0, os.path.dirname(GOLDENS))
  import make_pipeline_goldens  # pylint: disable=g-import-not-at-top
  golden = np.load(GOLDENS)
  got = make_pipeline_goldens.run_case(schedule, sync, mesh)
  name = make_pipeline_goldens.case_name(schedule, sync)
  assert sorted(got) == sorted(k.split("/")[1] for k in golden.files if k.startswith(name + "/"))
  for k, v in got.items():
    want = golden[f"{name}/{k}"]
    if k.startswith(XLA_COMPUTED):
      assert v.dtype == want.dtype and v.shape == want.shape, (k, v.dtype, v.shape)
      np.testing.assert_allclose(v, want, rtol=XLA_RTOL, atol=XLA_ATOL, err_msg=k)
    else:
      np.testing.assert_array_equal(v, want, err_msg=k)


def test_the_lockstep_goldens_tell_schedules_and_syncs_apart():
  """The tolerance of the test above still fails a wrong executor: the stored model numbers of a
  1F1B case and its GPipe case, and of syncs that equal speeds do not make agree, lie outside it."""
  golden = np.load(GOLDENS)
  close = lambda a, b, k: np.allclose(golden[f"{a}/{k}"], golden[f"{b}/{k}"], rtol=XLA_RTOL,
                                      atol=XLA_ATOL)
  for sync in ("allreduce", "none", "preduce", "adpsgd", "hetpipe"):
    for k in ("loss", "params"):
      assert not close(f"1f1b_{sync}", f"gpipe_{sync}", k), (sync, k)
  for schedule in ("1f1b", "gpipe"):
    for a, b in (("allreduce", "none"), ("none", "hetpipe"), ("allreduce", "hetpipe")):
      assert not close(f"{schedule}_{a}", f"{schedule}_{b}", "params"), (schedule, a, b)


# sync="none" in the slow tier: fill_test::test_idle_fraction_is_the_idle_share_of_virtual_time[none]
# runs 1F1B with pipeline 1 twice as slow and no sync (each pipeline by its own clock); hetpipe
# keeps the slow pipeline's updates, rows and reported mini-batches here. preduce in the slow tier
# too: the counting is the executor's, whatever the sync (hetpipe's case), and fill_test's
# test_a_run_again_from_an_earlier_state_does_what_it_did[preduce] and
# test_another_model_in_the_middle_of_a_fill_is_refused run PReduce's 1F1B on the devices under this
# slowdown (fill_test's SLOW), every mini-batch applied once at every stage through the flush.
@pytest.mark.parametrize("sync", [pytest.param("none", marks=pytest.mark.slow), "hetpipe",
                                  pytest.param("preduce", marks=pytest.mark.slow)])
def test_a_pipeline_twice_as_slow_makes_about_half_the_updates(mesh, sync):
  """Pipeline 1 is 2x slower at every stage (virtual time): over 40 mini-batches in runs of 10 it
  completes 40-60 % of pipeline 0's updates (`updates`), takes fewer of the stream's rows, and
  the mini-batches reported are every N = 2 completions, all of them after the flush."""
  xs, ys = _data(40)
  pipe = Pipeline(STAGES, loss_fn, optax.sgd(0.05), mesh, schedule="1f1b", sync=sync,
                  hetero=Hetero(slowdown=((1.0,) * S, (2.0,) * S)))
  state = pipe.init(_params())
  updates, batches = np.zeros(N, np.int64), []
  for first in range(0, 40, 10):
    state, metrics = pipe.run(state, xs[first:first + 10], ys[first:first + 10])
    updates += metrics["updates"]
    batches += list(metrics["batch"])
    assert np.all(np.isfinite(metrics["loss"]))
  assert 0.4 <= updates[1] / updates[0] <= 0.6, updates
  state, metrics = pipe.flush(state)
  updates += metrics["updates"]
  batches += list(metrics["batch"])
  assert updates.sum() == 40 * N and batches == list(range(40))
  assert int(np.asarray(state.inflight["fed_start"]).sum()) == 40 * N
  assert np.asarray(state.inflight["fed_start"])[1] < 40


# Slow tier: test_runs_of_any_lengths_are_one_run[preduce-1f1b] splits PReduce's 1F1B runs under
# stalls (pipelines at different progress), and fill_test's
# test_a_pruned_fill_runs_and_drains_as_the_whole_one[preduce-UNEVEN...] cuts a fill under a
# persistent slowdown into runs of every length.
@pytest.mark.slow
def test_runs_by_the_clock_are_one_run_under_a_slowdown(mesh):
  """A persistent slowdown makes the pipelines take different mini-batches at different ticks;
  runs of [9], [4, 5] and [1] * 9 still give bit-identical states (PReduce, whose groups then
  average models of different progress)."""
  xs, ys = _data(9)
  pipe = Pipeline(STAGES, loss_fn, optax.sgd(0.1, momentum=0.9), mesh, schedule="1f1b",
                  sync="preduce", hetero=Hetero(slowdown=((1.0,) * S, (1.7,) * S)))
  results = [_in_runs(pipe, pipe.init(_params()), xs, ys, lengths)
             for lengths in ([9], [4, 5], [1] * 9)]
  (state, metrics), others = results[0], results[1:]
  for other_state, other_metrics in others:
    for k in metrics:
      order = np.sort if k == "group_sizes" else np.asarray
      np.testing.assert_array_equal(order(other_metrics[k]), order(metrics[k]), err_msg=k)
    for a, b in zip(jax.tree.leaves(other_state), jax.tree.leaves(state), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
