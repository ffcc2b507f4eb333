"""The data-parallel training loop: `train_and_evaluate(config, workdir)` for a config with
pipeline.schedule "none" (`jlp.train.loop.train_and_evaluate`, behind `python -m experiments.train`,
picks it).

One call runs (or resumes) an experiment config (jlp.train.config) in `workdir`:
  1. Checks the config, finds the data and sizes the batches against the devices: every bad value
     is a ValueError / FileNotFoundError before anything compiles.
  2. Builds the data pipelines, the model (with config.quant_rules, config.quant_recipe and the
     BFPsim preset, when set: jlp.train.loop_common.QuantPlan), the optimizer
     and the data-parallel step (jlp.train.TrainStep with the config's gradient all-reduce), or
     with config.diloco.period > 0 the DiLoCo step (jlp.train.diloco_step: every device a
     replica with its own parameters and optimizer state, the outer parameters evaluated).
  3. Restores the newest checkpoint of `workdir/checkpoints` if there is one (under the BFP
     preset it was written with; a preset switch due at that step follows), then trains to
     `max_steps`: metrics every `log_every` steps (metrics.jsonl + TensorBoard; train_loss and
     train_accuracy are the means over the steps since the previous row, throughput the examples
     per second of training since then, compilation and checkpoint saves left out and logged as
     compile_seconds and save_seconds: jlp.train.loop_common.LogWindow; `wire_bytes` is
     the bytes one device sent for that step's gradient sync, see jlp.train.step), evaluation
     every `eval_every` steps and at the end, a checkpoint every `checkpoint_every` steps and at
     the end. With `stop_at_accuracy`, the first evaluation that reaches it ends the run (with a
     checkpoint); running the workdir again then says it is finished.

Resume is bit-exact: the state (parameters, optimizer state, BatchNorm statistics, PRNG key data,
BFP widths, the compressed sync's per-device state and DiLoCo's per-replica state with its
outer parameters and outer optimizer state, saved sharded), the BFP controller's state
and the current preset are checkpointed; every batch is a pure function of (seed, step)
(jlp.data.Pipeline) and a compressor's random stream one of (config.seed, step), so a resumed run
logs, from the checkpoint on, exactly the rows the uninterrupted run logs (`time`,
`throughput`, `compile_seconds` and `save_seconds` aside; the checkpoint keeps the losses of the
steps since the last row). Ctrl-C (SIGINT) ends the current step, writes a checkpoint and returns
with `interrupted=True`; during the last step or the final evaluation the run completes and says
it finished. A second Ctrl-C aborts.

Progress: a tqdm bar (steps/s, ETA) on a terminal; plain log lines otherwise. In a multi-process
run (jlp.train.initialize first) every process runs this function; process 0 writes the metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jlp import sync_tuning
from jlp.nn import controller as bfp_controller, rules as nn_rules
from jlp.sync import SYNC_REPORT
from jlp.train import recipe
from jlp.train.checkpoint import Checkpointer
from jlp.train.diloco_step import DiLoCoStep, init_diloco_state
from jlp.train.config import validate
from jlp.train.loop_common import (CompileClock, HostStall, Interrupt, LogWindow, QuantPlan,
                                   check_finite_loss, checkpoint_due, close_run, log_line,
                                   progress as progress_bar, record_start,
                                   report_finished_on_interrupt, report_interrupt)
from jlp.train.mesh import batch_sharding, data_mesh, replicated
from jlp.train.metrics import MetricsWriter
from jlp.train.workdir import check_data, device_layout
from jlp.train.step import TrainState, TrainStep, init_train_state, merge_model, split_model

logger = logging.getLogger("jlp.train")

__all__ = ["Run", "from_saveable", "saveable", "setup", "train_and_evaluate"]


# -- checkpoints of typed PRNG keys -------------------------------------------------------------


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def saveable(state: TrainState) -> TrainState:
  """The state with typed PRNG keys as their uint32 key data (what orbax can write)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)


def from_saveable(saved: TrainState, like: TrainState) -> TrainState:
  """Inverse of `saveable`, taking the key implementations from `like`."""
  return jax.tree.map(
      lambda s, l: jax.random.wrap_key_data(s, impl=jax.random.key_impl(l)) if _is_key(l) else s,
      saved, like)


# -- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """Everything `train_and_evaluate` builds; notebooks can build one with `setup` and step it."""
  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  train_pipe: Any
  eval_pipe: Any
  model: nnx.Module
  optimizer: Any
  lr: Any
  sync: Any
  quant: QuantPlan
  report: nn_rules.QuantReport | None = None
  preset: str | None = None
  step_fn: TrainStep | None = None
  eval_fn: Any = None
  graphdef: Any = None
  diloco: Any = None  # jlp.sync.DiLoCo when config.diloco.period > 0

  @property
  def steps_per_epoch(self) -> int:
    return max(1, self.train_pipe.steps_per_epoch)

  def train_step(self, sync: Any) -> TrainStep:
    """The data-parallel train step of the model's current graph with gradient sync `sync`."""
    config = self.config
    return TrainStep(split_model(self.model)[0], self.optimizer, self.mesh, sync,
                     loss_fn=recipe.loss_fn(config), loss_scale=float(config.loss_scale),
                     unscale_grads=config.unscale_grads, donate=True,
                     zse_report=self.report if self.quant.schedule is not None else None)

  def compile_step(self, step_fn: TrainStep | None = None) -> None:
    """(Re)builds the train and eval functions for the model's current graph (after a preset
    switch); `step_fn`: a train step already built for it (`train_step(self.sync)`)."""
    config = self.config
    self.model.eval()
    eval_graphdef = split_model(self.model)[0]
    self.model.train()
    graphdef = split_model(self.model)[0]
    self.graphdef = graphdef
    if self.diloco is not None:
      self.step_fn = DiLoCoStep(graphdef, self.diloco, self.mesh, loss_fn=recipe.loss_fn(config),
                                loss_scale=float(config.loss_scale),
                                unscale_grads=config.unscale_grads, donate=True)
    else:
      self.step_fn = step_fn or self.train_step(self.sync)
    task, classes = config.task, self.train_pipe.dataset.num_classes
    # DiLoCo: the outer params (the global model) with the replicas' mean BatchNorm statistics.
    view = self.step_fn.global_state if self.diloco is not None else lambda state: state

    def eval_step(state, batch):
      return recipe.eval_sums(merge_model(eval_graphdef, view(state)), batch, task, classes)

    self.eval_fn = jax.jit(eval_step,
                           in_shardings=(self.step_fn.state_shardings, batch_sharding(self.mesh)),
                           out_shardings=replicated(self.mesh))

  def evaluate(self, state: TrainState) -> dict[str, float]:
    """Metrics over the whole evaluation split (padded last batch masked out)."""
    pipe = self.eval_pipe
    steps = -(-pipe.dataset.size // pipe.global_batch_size)
    totals: dict[str, np.ndarray] = {}
    with pipe.prefetch(0, steps, sharding=batch_sharding(self.mesh)) as batches:
      for batch in batches:
        for k, v in self.eval_fn(state, batch).items():
          totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
    return recipe.eval_metrics(totals, self.config.task, pipe.dataset.num_classes)

  def switch_preset(self, state: TrainState, preset: str | None) -> TrainState:
    """Re-quantizes the model with `preset`, keeping parameters, statistics and optimizer state."""
    self.model = merge_model(self.graphdef, state)
    self.report = self.quant.quantize(self.model, preset)
    self.preset = preset
    _, params, stats, keys, model_state = split_model(self.model)
    self.compile_step()
    return TrainState(state.step, params, stats, keys, model_state, state.opt_state,
                      state.sync_state)


def setup(config: ml_collections.ConfigDict) -> Run:
  """Checks the config and builds data, model, optimizer and mesh; compiles nothing yet."""
  validate(config)
  train_ds, eval_ds = recipe.datasets(config)
  mesh = data_mesh()
  recipe.check_batch_sizes(config, mesh.size)
  recipe.warn_single_device(config, mesh.size)
  sync = recipe.grad_sync(config, mesh.size)
  train_pipe, eval_pipe = recipe.pipelines(config, train_ds, eval_ds)
  spe = max(1, train_pipe.steps_per_epoch)
  lr = recipe.schedule(config, spe, train_ds.size)
  quant = QuantPlan(config, spe, example=lambda: train_pipe.batch(0)["image"])
  model = recipe.model(config, train_ds)
  params = split_model(model)[1]
  sync = recipe.plan_sync(config, sync, params, mesh.size)
  optimizer = recipe.optimizer(config, lr)
  return Run(config, mesh, train_pipe, eval_pipe, model, optimizer, lr, sync, quant,
             diloco=recipe.diloco(config, optimizer, params))


def _host(tree: Any) -> Any:
  return jax.tree.map(lambda x: np.asarray(x).item(), tree)


def _bfp_metrics(run: Run, zse: dict[str, dict[str, float]] | None) -> dict[str, float]:
  out: dict[str, float] = {}
  if zse:
    for key in ("fw", "bwo", "biw"):
      vals = [d[key] for d in zse.values() if key in d]
      if vals:
        out[f"zse_{key}"] = float(np.mean(vals))
  if run.quant.controller is not None:
    for role in bfp_controller.CONTROLLED_ROLES:
      bits = [r[role] for r in run.quant.controller.bits.values() if role in r]
      if bits:
        out[f"bits_{role}"] = float(np.mean(bits))
  return out


class _StepTimer:
  """compression.plan="autotune"'s timer (`jlp.sync_tuning.autotune`'s `timer`): each candidate
  sync timed as this run's train step, on the run's first batch, each from its own copy of the
  initial state (what the steps compute is thrown away: the run itself starts from the initial
  state with the chosen sync, as a run configured with that sync would). The steps are timed in
  rounds (`jlp.sync_tuning.time_in_rounds`). A sync timed apart from the step can misjudge it:
  on 8 emulated devices with configs/digits_wide.py under glibc's malloc, the float32 ring
  all-reduce alone took 50-70 ms against 67-88 ms for onebit's PS, but a run with it trained at
  475 examples/s against 686 (docs/hipress.md). The chosen sync's step, compiled here, is the
  run's."""

  def __init__(self, run: Run, repeats: int = 3):
    self.run, self.repeats = run, repeats
    self.built: dict[Any, TrainStep] = {}

  def __call__(self, syncs: Any, tree: Any) -> list[float]:
    del tree  # the run's own gradients
    run = self.run
    with run.train_pipe.prefetch(0, 1, sharding=batch_sharding(run.mesh)) as batches:
      batch = next(iter(batches))
    states, steps = [], []
    for sync in syncs:
      if sync not in self.built:
        self.built[sync] = run.train_step(sync)
      steps.append(self.built[sync])
      states.append(init_train_state(run.model, run.optimizer, run.mesh, sync)[1])

    def call(i: int) -> None:
      states[i] = steps[i](states[i], batch)[0]
      jax.block_until_ready(states[i])
    for i in range(len(syncs)):  # compiles
      call(i)
    times = sync_tuning.time_in_rounds([lambda i=i: call(i) for i in range(len(syncs))],
                                       self.repeats, drop_above=sync_tuning.DROP_ABOVE)
    return [float(np.median(t)) for t in times]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       progress: bool | None = None,
                       config_changes: dict[str, tuple] | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
  """Trains (or resumes) the data-parallel `config` in `workdir`; returns the last logged metrics
  row plus `interrupted` (see the module docstring)."""
  if config.pipeline.schedule != "none":
    raise ValueError(f"config.pipeline.schedule={config.pipeline.schedule!r} is not allowed here; "
                     "expected 'none' (jlp.train.loop.train_and_evaluate runs pipelined configs).")
  run = setup(config)
  manifests = {"train": run.train_pipe.dataset.manifest(), "eval": run.eval_pipe.dataset.manifest()}
  os.makedirs(workdir, exist_ok=True)
  checkpoints = Checkpointer(workdir)
  start = checkpoints.latest_step() or 0
  data_changes = check_data(workdir, manifests, resuming=bool(start),
                            allow_change=allow_config_change)
  config_changes = {**(config_changes or {}), **data_changes}
  spe = run.steps_per_epoch
  saved_meta = checkpoints.meta(start) if start else {}
  # The state is restored under the preset it was written with (the per-layer BFP widths in
  # model_state have the same shapes under every preset); the loop then switches to the preset
  # the config puts at this step, as the uninterrupted run did at the epoch boundary.
  run.preset = saved_meta.get("preset", run.quant.preset_at(start // spe)) if start else \
      run.quant.preset_at(0)
  run.report = run.quant.quantize(run.model, run.preset)
  run.model.train()
  # compression.plan="autotune": the sync (and so the compression state's layout) is chosen here,
  # by timing the candidates' train steps, or read back on a resume, before the state is made.
  timer = _StepTimer(run)
  run.sync = recipe.autotune_sync(config, run.sync, split_model(run.model)[1], run.mesh, workdir,
                                  timer=timer)
  if run.diloco is not None:  # graphdef: compile_step
    _, state = init_diloco_state(run.model, run.diloco, run.mesh)
  else:
    _, state = init_train_state(run.model, run.optimizer, run.mesh, run.sync)
  if start:
    saved, _ = checkpoints.restore(start, saveable(state))  # its meta is saved_meta
    if saved_meta.get("reached_accuracy"):
      checkpoints.close()
      print(f"{workdir} is finished: eval_accuracy={saved_meta['reached_accuracy']:.4g} reached "
            f"config.stop_at_accuracy at step {start}.", flush=True)
      return {"step": start, "interrupted": False,
              "eval_accuracy": saved_meta["reached_accuracy"]}
    state = from_saveable(saved, state)
    if run.quant.controller is not None and saved_meta.get("controller"):
      run.quant.controller.load_state_dict(saved_meta["controller"])
    logger.info("resumed %s from step %d", workdir, start)
  run.compile_step(timer.built.get(run.sync))
  timer.built.clear()
  writer = MetricsWriter(workdir, resume_step=start or None, enabled=jax.process_index() == 0)
  record_start(config, workdir, start, config_changes, manifests, bool(data_changes), writer)

  bar = progress_bar(progress, config.max_steps, start)
  stall = HostStall()
  row: dict[str, Any] = {}
  interrupted = False
  reached = None  # eval_accuracy once it reaches config.stop_at_accuracy
  step = start
  try:
    with CompileClock() as clock, Interrupt() as stop, run.train_pipe.prefetch(
        start, config.max_steps - start, sharding=batch_sharding(run.mesh)) as batches:
      window = LogWindow(clock, saved_meta.get("window"))
      for batch in batches:
        if step == start or (step % spe == 0 and run.quant.schedule is not None):
          preset = run.quant.preset_at(step // spe)
          if preset != run.preset:
            state = run.switch_preset(state, preset)
        stall()
        state, metrics = run.step_fn(state, batch)
        step += 1
        window.add(metrics["loss"], metrics.get("accuracy", np.nan), config.batch_size)
        zse = metrics.pop("zse", None)
        if zse is not None:
          zse = _host(zse)
        if run.quant.controller is not None and zse:
          if run.quant.controller.update(zse):
            model = merge_model(run.graphdef, state)
            nn_rules.set_widths(model, run.report, run.quant.controller.bits)
            state = state._replace(model_state=split_model(model)[4])
        if bar is not None:
          bar.update(1)
        logged = step % config.log_every == 0 or step == config.max_steps
        evaluated = (config.eval_every and step % config.eval_every == 0) or step == config.max_steps
        if logged or evaluated:
          row = {**window.close(),
                 "learning_rate": float(run.lr(step - 1)),
                 "epoch": step / spe,
                 **{name: metrics[name].item() for name in SYNC_REPORT},
                 **_bfp_metrics(run, zse)}
          if run.quant.schedule is not None:
            row["bfp_preset"] = run.preset
          if evaluated:
            row.update(run.evaluate(state))
            if config.stop_at_accuracy and row["eval_accuracy"] >= config.stop_at_accuracy:
              reached = row["eval_accuracy"]
          row = writer.write(step, row)
          check_finite_loss(row, step, checkpoints)
          window.restart()
          if bar is not None:
            bar.set_postfix(loss=f"{row['train_loss']:.4f}", refresh=False)
          else:
            print(log_line(step, config.max_steps, row), flush=True)
        # Ctrl-C during the last step or the final evaluation: the run is complete.
        interrupted = stop.agreed() and step < config.max_steps and not reached
        if checkpoint_due(config, step, interrupted) or reached:
          with window.saving():
            _save(checkpoints, step, state, run, config, window, reached)
        if interrupted or reached:
          break
  finally:
    close_run(bar, writer, checkpoints)
  if interrupted:
    report_interrupt(step, checkpoints)
  elif reached is not None:
    print(f"eval_accuracy={reached:.4g} reached config.stop_at_accuracy="
          f"{config.stop_at_accuracy:g} at step {step}: stopped.", flush=True)
  elif stop.event.is_set():
    report_finished_on_interrupt(step, checkpoints)
  return {**row, "step": step, "interrupted": interrupted}


def _save(checkpoints: Checkpointer, step: int, state: TrainState, run: Run,
          config: ml_collections.ConfigDict, window: LogWindow,
          reached_accuracy: float | None = None) -> None:
  meta = {"step": step, "preset": run.preset, "reached_accuracy": reached_accuracy,
          "config": json.loads(config.to_json_best_effort()), "devices": device_layout(),
          "window": window.values(),
          "controller": run.quant.controller.state_dict() if run.quant.controller else None}
  checkpoints.save(step, saveable(state), meta)


