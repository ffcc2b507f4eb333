"""The pipelined training loop (SD-PIPE, docs/sdpipe.md): `train_and_evaluate` when
config.pipeline.schedule is not "none" (`jlp.train.loop.train_and_evaluate` picks it): GPipe,
SD-PIPE's 1F1B, or a flush schedule (1F1B-flush, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV, a torch
CSV; `jlp.pipeline.flush`).

One call runs (or resumes) the config in `workdir`:
  1. Checks the config (`jlp.train.config.validate`, then `pipeline_size` against the devices):
     N = pipeline.pipelines (0: devices / S) pipelines of S = pipeline.stages stages.
  2. Builds the data pipelines, the model (config.quant_rules, config.quant_recipe and a fixed
     bfp.preset applied), splits it into v * S stages (v stages per device: 1, or the flush
     schedule's; `jlp.pipeline.stages.split_model`,
     pipeline.boundaries or the stage rule's default) and builds `jlp.pipeline.Pipeline` on the
     first N*S devices with the config's optimizer (one state per pipeline and stage), sync
     (pipeline.sync; "allreduce" sums with the config's gradient sync, `recipe.grad_sync`, over
     the N pipelines) and virtual-time model (`Hetero`, `PReduce`, `HetPipe` from the pipeline.*
     knobs, seeded by config.seed).
  3. Restores the newest checkpoint of `workdir/checkpoints` (the whole `PipelineState`, sharded
     [N, S, ...]: weights, 1F1B's mini-batches in flight, virtual clocks), then trains to
     max_steps in calls of pipeline.batches_per_call mini-batches (`Pipeline.run`, the steps
     [k*C, min((k+1)*C, max_steps))), and flushes the pipeline after the last call. The calls
     change nothing but the cadence of evaluation and checkpoints: 1F1B stays full between calls,
     and the virtual time and the syncs' groups come from one timeline of the training
     (`jlp.pipeline.timeline`, seeded by config.seed). Global batch `step` of the training
     pipeline (config.batch_size rows) is mini-batch `step`; pipeline i trains on its rows
     [i*b, (i+1)*b), b = batch_size / N.

Rows of metrics.jsonl, for every log_every-th mini-batch once it has completed (its last update, at
stage 0, ran: 1F1B completes a mini-batch up to S - 1 calls' worth of ticks after it entered, so a
row may come a call later, or with the flush): train_loss and train_accuracy (means over the
pipelines and over the mini-batches completed since the previous row), learning_rate, throughput
(examples fed per wall-clock second over the call, compilation left out), compile_seconds and
save_seconds (spent compiling and writing checkpoints since the previous row), epoch, virtual_time
(virtual seconds at which the mini-batch's update finished), virtual_throughput (examples fed per
virtual second over the call), bubble_fraction (the idle share of the call's tick table), bubble
(GPipe and the flush schedules: the schedule's idle share with unit-cost F, I and W,
`Pipeline.bubble`; not with 1F1B),
idle_fraction (the devices' idle share of the call's virtual time), idle_slot_fraction (the device
slots of the call in which no stage ran, counted by the program), and with pipeline.sync="allreduce"
the gradient sync's wire_bytes, payload_bytes (per device, averaged over all devices) and nonfinite.
Evaluation (every eval_every steps and at the end, between calls): every pipeline's latest model
(its stages merged, eval mode) is evaluated on the whole eval split with `recipe.eval_sums` (data-
parallel on every device), and eval_loss / eval_accuracy, the means over the N pipelines (the seed
reduces validation over its pipelines, docs/sdpipe.md), join the row of that step when it is written
(the final evaluation follows the flush), with eval_virtual_time: the virtual seconds of the
evaluated weights (the pipeline's clock at the evaluation). With 1F1B the row's virtual_time is a
later update's, up to a call later; time to accuracy reads eval_virtual_time
(`jlp.plots.plot_runs(x="virtual_time")`).

Resume is bit-exact: a resumed run logs exactly the rows the uninterrupted one logs (`time`,
`throughput`, `compile_seconds` and `save_seconds` aside); the checkpoint's meta keeps the
evaluations still waiting for their row (eval_virtual_time included), the losses of the mini-batches
completed since the last row and how many rows were due. A checkpoint at max_steps that still has
mini-batches in flight (written under a larger max_steps, or on Ctrl-C) is not finished: a resume
flushes it, writes the rows the flush completes (without throughput or virtual_throughput: that call
feeds nothing), evaluates and replaces the checkpoint, as the last call of an uninterrupted run
would. Resuming a flushed checkpoint at max_steps does nothing (`jlp.train.loop` says the run is
finished). Ctrl-C ends the current call, writes a checkpoint and returns with `interrupted=True`;
during the last call or the final evaluation the run completes and says it finished. One process
only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jlp.data import Prefetcher
from jlp.pipeline import (HetPipe, Hetero, Pipeline, PipelineState, PReduce, StageSplit,
                          pipeline_mesh, split_model)
from jlp.sync import SYNC_REPORT
from jlp.train import recipe
from jlp.train.checkpoint import Checkpointer
from jlp.train.config import pipeline_parts, pipeline_schedule, pipeline_size, validate
from jlp.train.loop_common import (CompileClock, Interrupt, LogWindow, QuantPlan,
                                   check_finite_loss, checkpoint_due, close_run, log_line,
                                   progress as progress_bar, record_start,
                                   report_finished_on_interrupt, report_interrupt)
from jlp.train.mesh import batch_sharding, data_mesh, replicated
from jlp.train.metrics import MetricsWriter
from jlp.train.workdir import check_data, device_layout

__all__ = ["PipelineRun", "last_stage_loss", "needs_drain", "setup", "train_and_evaluate"]


def last_stage_loss(logits: jax.Array, labels: jax.Array
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The last stage's loss: mean softmax cross-entropy against integer labels, and the top-1
  accuracy (what `jlp.train.cross_entropy_loss` computes for the unpipelined model, images and
  BERT alike)."""
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
  return loss, {"accuracy": accuracy}


@dataclasses.dataclass
class PipelineRun:
  """Everything the pipelined `train_and_evaluate` builds; notebooks can build one with `setup`."""
  config: ml_collections.ConfigDict
  pipe: Pipeline
  split: StageSplit
  train_pipe: Any
  eval_pipe: Any
  lr: optax.Schedule
  num_pipelines: int
  num_stages: int
  eval_mesh: jax.sharding.Mesh
  eval_fn: Any = None

  @property
  def steps_per_epoch(self) -> int:
    return max(1, self.train_pipe.steps_per_epoch)

  def calls(self, start: int, stop: int):
    """(first, end, xs, ys) of every `Pipeline.run` call over the steps [start, stop): xs, ys
    [end - first, batch_size, ...] stacked global batches (images and labels)."""
    size = self.config.pipeline.batches_per_call
    first = start
    while first < stop:
      end = min(stop, (first // size + 1) * size)
      batches = [self.train_pipe.batch(k) for k in range(first, end)]
      xs = np.stack([b["image"] for b in batches])
      ys = np.stack([b["label"] for b in batches])
      yield first, end, xs, ys
      first = end

  def pipeline_models(self, state: PipelineState) -> list[tuple[list[Any], list[Any]]]:
    """(stage params, stage state) of every pipeline, host arrays (`StageSplit.merge` inputs)."""
    params, states = self.pipe.stage_params(state), self.pipe.stage_state(state)
    pick = lambda trees, i: [{k: v[i] for k, v in t.items()} for t in trees]
    return [(pick(params, i), pick(states, i)) for i in range(self.num_pipelines)]

  def compile_eval(self) -> None:
    config, split = self.config, self.split
    task, classes = config.task, self.train_pipe.dataset.num_classes

    def eval_step(params, state, batch):
      model = split.merge(params, state)
      model.eval()
      return recipe.eval_sums(model, batch, task, classes)

    rep = replicated(self.eval_mesh)
    self.eval_fn = jax.jit(eval_step, in_shardings=(rep, rep, batch_sharding(self.eval_mesh)),
                           out_shardings=rep)

  def evaluate(self, state: PipelineState) -> dict[str, float]:
    """eval_loss / eval_accuracy: the mean over the pipelines of each pipeline's model's metrics
    over the whole evaluation split."""
    if self.eval_fn is None:
      self.compile_eval()
    pipe = self.eval_pipe
    rep = replicated(self.eval_mesh)
    models = [jax.device_put(m, rep) for m in self.pipeline_models(state)]
    totals: list[dict[str, np.ndarray]] = [{} for _ in models]
    steps = -(-pipe.dataset.size // pipe.global_batch_size)
    with pipe.prefetch(0, steps, sharding=batch_sharding(self.eval_mesh)) as batches:
      for batch in batches:
        for i, (params, model_state) in enumerate(models):
          for k, v in self.eval_fn(params, model_state, batch).items():
            totals[i][k] = totals[i].get(k, 0.0) + np.asarray(v, np.float64)
    per = [recipe.eval_metrics(t, self.config.task, pipe.dataset.num_classes) for t in totals]
    return {k: float(np.mean([m[k] for m in per])) for k in per[0]}


def setup(config: ml_collections.ConfigDict) -> PipelineRun:
  """Checks the config (devices included) and builds data, model, stages and the Pipeline;
  compiles nothing yet."""
  validate(config)
  p = config.pipeline
  num_pipelines, num_stages = pipeline_size(config, jax.device_count())
  train_ds, eval_ds = recipe.datasets(config)
  # Every process feeds the global mini-batches (each device takes its pipeline's rows).
  train_pipe, eval_pipe = recipe.pipelines(config, train_ds, eval_ds, global_train_batches=True)
  spe = max(1, train_pipe.steps_per_epoch)
  lr = recipe.schedule(config, spe, train_ds.size)
  grad_sync = recipe.grad_sync(config, num_pipelines) if p.sync == "allreduce" else None
  quant = QuantPlan(config, spe, example=lambda: train_pipe.batch(0)["image"])
  model = recipe.model(config, train_ds)
  quant.quantize(model, quant.preset_at(0))
  # v parts per device with the flush schedules that hold several stages per device.
  split = split_model(model, pipeline_parts(config), boundaries=tuple(p.boundaries) or None)
  hetero = Hetero(delay_s=float(p.hetero), probability=float(p.hetero_probability),
                  slowdown=tuple(tuple(float(v) for v in row) for row in p.slowdown) or None)
  pipe = Pipeline(split.stages, last_stage_loss, recipe.optimizer(config, lr),
                  pipeline_mesh(num_pipelines, num_stages), schedule=pipeline_schedule(config),
                  num_microbatches=p.microbatches,
                  virtual_stages=(p.virtual_stages or None) if p.schedule == "interleaved_1f1b"
                  else None, sync=p.sync, stateful=True,
                  grad_sync=grad_sync, hetero=hetero,
                  preduce=PReduce(max_group=p.max_group or None, connect_every=p.connect_every),
                  hetpipe=HetPipe(pull_every=p.pull_every, barrier=p.barrier),
                  seed=config.seed, donate=True)
  return PipelineRun(config, pipe, split, train_pipe, eval_pipe, lr, num_pipelines, num_stages,
                     data_mesh())


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       progress: bool | None = None,
                       config_changes: dict[str, tuple] | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
  """Trains (or resumes) a pipelined `config` in `workdir`; returns the last logged metrics row
  plus `step` and `interrupted` (module docstring)."""
  run = setup(config)
  manifests = {"train": run.train_pipe.dataset.manifest(), "eval": run.eval_pipe.dataset.manifest()}
  os.makedirs(workdir, exist_ok=True)
  checkpoints = Checkpointer(workdir)
  start = checkpoints.latest_step() or 0
  data_changes = check_data(workdir, manifests, resuming=bool(start),
                            allow_change=allow_config_change)
  config_changes = {**(config_changes or {}), **data_changes}
  example = run.train_pipe.batch(0)
  state = run.pipe.init(run.split.params, run.split.state,
                        batch=(example["image"], example["label"]))
  # Evaluations of the weights at the end of a call, waiting for the row of their step (1F1B:
  # written when that step's mini-batch completes, a call or the flush later).
  pending: dict[int, dict[str, float]] = {}
  completed = start  # mini-batches whose row is due or written: the fed ones, less those in flight
  meta: dict[str, Any] = {}
  if start:
    state, meta = checkpoints.restore(start, state)
    pending = {int(k): v for k, v in (meta.get("pending_eval") or {}).items()}
    completed = int(meta.get("completed", start))
  writer = MetricsWriter(workdir, resume_step=completed if start else None,
                         enabled=jax.process_index() == 0)
  record_start(config, workdir, start, config_changes, manifests, bool(data_changes), writer)
  # A resume whose config changed the model of the 1F1B fill in flight (hetero, slowdown, seed,
  # the syncs' knobs): the pipeline drains under the fill's own model first, and the new model
  # starts a fill of its own (a run under it mid-fill would be refused, jlp.pipeline.fill).
  early = None
  changed = run.pipe.model_changed(state) if start else []
  if changed:
    state, early = run.pipe.flush(state)
    writer.note(fill_flushed=f"the pipeline's {', '.join(changed)} changed on resume: the "
                             "mini-batches in flight were drained under the fill's own model")

  spe = run.steps_per_epoch
  bar = progress_bar(progress, config.max_steps, start)
  row: dict[str, Any] = {}
  interrupted = False
  step = start
  try:
    with CompileClock() as clock, Interrupt() as stop, \
        Prefetcher(run.calls(start, config.max_steps), size=1) as calls:
      window = LogWindow(clock, meta.get("window") if start else None)
      call_begin = time.perf_counter()
      for first, end, xs, ys in _with_drain(calls, start, config.max_steps, completed):
        before = run.pipe.virtual_seconds(state)
        if xs is None:  # a resume at max_steps with mini-batches in flight: only the flush
          state, metrics = run.pipe.flush(state)
        else:
          state, metrics = run.pipe.run(state, xs, ys)
          if end == config.max_steps:
            state, drained = run.pipe.flush(state)
            metrics = _joined(metrics, drained)
        if early is not None:  # the drain at a resume under a changed model: its rows come first
          metrics, early = _joined(early, metrics), None
        jax.block_until_ready(metrics)  # the call's device work ends inside its own seconds
        now = time.perf_counter()
        compiled = window.compiled(call_begin, now)
        window.compile_seconds += compiled
        examples = (end - first) * config.batch_size
        throughput = examples / max(now - call_begin - compiled, 1e-9)
        span = run.pipe.virtual_seconds(state) - before
        virtual_throughput = examples / span if span > 0 else float("nan")
        if (config.eval_every and end % config.eval_every == 0) or end == config.max_steps:
          # The weights at the end of the call (after the flush at max_steps), and the virtual
          # second at which they existed: 1F1B writes the row of step `end` up to a call later.
          pending[end] = {**run.evaluate(state),
                          "eval_virtual_time": run.pipe.virtual_seconds(state)}
        for k, batch in enumerate(metrics["batch"]):
          step = int(batch) + 1
          window.add(metrics["loss"][k], metrics["accuracy"][k], 0)
          if not (step % config.log_every == 0 or step == config.max_steps or step in pending):
            continue
          row = {**window.close(throughput),
                 "learning_rate": float(run.lr(step - 1)),
                 "epoch": step / spe,
                 "virtual_time": float(metrics["virtual_time"][k]),
                 "virtual_throughput": virtual_throughput,
                 "bubble_fraction": float(metrics["bubble_fraction"]),
                 "idle_fraction": float(metrics["idle_fraction"]),
                 "idle_slot_fraction": float(metrics["idle_slot_fraction"])}
          if not np.isnan(run.pipe.bubble):  # GPipe and the flush schedules
            row["bubble"] = run.pipe.bubble
          for name in SYNC_REPORT:  # sync="allreduce" only
            if name in metrics:
              row[name] = metrics[name][k].item()
          if not examples:  # the drain of a resume at max_steps fed nothing: no speeds
            del row["throughput"], row["virtual_throughput"]
          row.update(pending.pop(step, {}))
          row = writer.write(step, row)
          check_finite_loss(row, step, checkpoints)
          if bar is None:
            print(log_line(step, config.max_steps, row) +
                  f" virtual_time={row['virtual_time']:.4g}", flush=True)
        if len(metrics["batch"]):
          completed = int(metrics["batch"][-1]) + 1
        step = end
        if bar is not None:
          bar.update(end - first)
          if row:
            bar.set_postfix(loss=f"{row['train_loss']:.4f}", refresh=False)
        # Ctrl-C during the last call or the final evaluation: the run is complete.
        interrupted = stop.agreed() and end < config.max_steps
        if checkpoint_due(config, end, interrupted):
          meta = {"step": end, "completed": completed,
                  "virtual_time": run.pipe.virtual_seconds(state),
                  "pending_eval": {str(k): v for k, v in pending.items()},
                  "window": window.values(),
                  "config": json.loads(config.to_json_best_effort()),
                  "devices": device_layout()}
          # The drain at a resume replaces the checkpoint it started from (same step, in flight).
          with window.saving():
            checkpoints.save(end, state, meta, replace=xs is None)
        if interrupted:
          break
        call_begin = time.perf_counter()
  finally:
    close_run(bar, writer, checkpoints)
  if interrupted:
    report_interrupt(step, checkpoints)
  elif stop.event.is_set():
    report_finished_on_interrupt(step, checkpoints)
  return {**row, "step": step, "interrupted": interrupted}


def _with_drain(calls, start: int, stop: int, completed: int):
  """The calls, then (stop, stop, None, None) when there are none and mini-batches are in flight
  at `stop` (a resume at max_steps from a checkpoint written before the end: its pipeline still
  needs the flush, the rows of the mini-batches it completes and the final evaluation)."""
  yield from calls
  if start == stop and completed < stop:
    yield stop, stop, None, None


def needs_drain(meta: dict[str, Any], step: int) -> bool:
  """Whether the pipelined checkpoint `step` with meta `meta` holds mini-batches in flight (fed,
  not completed): written before the run's end (every checkpoint_every steps or on Ctrl-C), so a
  resume with max_steps = `step` still flushes and evaluates. False after the flush at
  max_steps."""
  return int(meta.get("completed", step)) < step


def _joined(first: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
  """The metrics of a run followed by those of a flush: the slot shares over both's ticks, the
  virtual-time idle share over both's virtual spans."""
  out = {k: np.concatenate([v, rest[k]]) for k, v in first.items()
         if np.ndim(v) and k != "updates"}
  out["updates"] = first["updates"] + rest["updates"]

  def weighted(k: str, weight: str) -> float:
    total = first[weight] + rest[weight]
    if not total > 0:
      return float("nan")
    return sum(part[k] * part[weight] for part in (first, rest) if part[weight] > 0) / total
  for k in ("bubble_fraction", "idle_slot_fraction"):
    out[k] = weighted(k, "ticks")
  out["idle_fraction"] = weighted("idle_fraction", "virtual_span")
  return dict(out, ticks=first["ticks"] + rest["ticks"],
              virtual_span=first["virtual_span"] + rest["virtual_span"])
