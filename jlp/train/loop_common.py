"""What both training loops (jlp.train.data_parallel_loop, jlp.train.pipeline_loop) share: the
model's quantization plan (config.quant_rules, config.quant_recipe, the BFPsim preset schedule and
the Simple controller), the Ctrl-C / SIGTERM handler (with the cluster launcher's heartbeat), the
checkpoint cadence, the progress bar, the log line and the closing of a run. Neither loop imports the other; `jlp.train.loop.train_and_evaluate` picks one.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from flax import nnx

from jlp.nn import bfpsim, controller as bfp_controller, recipes, rules as nn_rules
from jlp.train.checkpoint import Checkpointer
from jlp.train.config import quant_recipe, quant_rules
from jlp.train.metrics import MetricsWriter
from jlp.train.workdir import describe as describe_changes, record_config, record_data

__all__ = ["CompileClock", "Interrupt", "LogWindow", "NonFiniteLossError", "QuantPlan",
           "check_finite_loss", "checkpoint_due", "close_run", "log_line", "progress",
           "record_start", "report_finished_on_interrupt", "report_interrupt"]


class QuantPlan:
  """The model's quantization: config.quant_rules, then the rules of config.quant_recipe
  (`jlp.nn.recipe_rules`), then the BFPsim preset in force at each epoch (a recipe and a preset
  exclude each other), and the Simple controller (config.bfp). First match wins, so quant_rules
  override the recipe. Stochastic rounding streams come from nnx.Rngs(quant=config.seed + 2).

  `example`: a callable returning one model input (e.g. the first training batch's images),
  called only when the recipe traces the model ("nvfp4": its first and last GEMM layers).
  """

  def __init__(self, config: ml_collections.ConfigDict, steps_per_epoch: int,
               example: Callable[[], Any] | None = None):
    self.rules = quant_rules(config)
    self.recipe = quant_recipe(config)
    self.recipe_accumulator = config.get("quant_recipe_accumulator", True)
    self.example = example
    self.seed = int(config.seed)
    entries = dict(config.bfp.schedule) or ({0: config.bfp.preset} if config.bfp.preset else {})
    for preset in entries.values():
      if preset and preset not in bfpsim.PRESETS and not os.path.isfile(preset):
        raise ValueError(f"config.bfp preset {preset!r} is not allowed; expected a built-in "
                         f"preset ({', '.join(sorted(bfpsim.PRESETS))}) or the path of a BFPsim "
                         "JSON file.")
    self.schedule = bfp_controller.PrecisionSchedule(entries) if entries else None
    if config.bfp.controller and self.schedule is None:
      raise ValueError(f"config.bfp.controller={config.bfp.controller!r} needs a BFP preset "
                       "(config.bfp.preset or config.bfp.schedule).")
    self.controller_spec = config.bfp.controller
    self.window = config.bfp.window or steps_per_epoch
    self.controller: bfp_controller.SimpleController | None = None

  def recipe_rules(self, model: nnx.Module) -> list[nn_rules.QuantRule]:
    """The recipe's rules for `model` ([] without a recipe)."""
    if self.recipe is None:
      return []
    if self.recipe in recipes.FIRST_LAST_FLOAT32:
      if self.example is None:
        raise ValueError(f"config.quant_recipe={self.recipe!r} needs an example model input to "
                         "find the first and last GEMM layers; expected QuantPlan(..., "
                         "example=...).")
      return recipes.recipe_rules(self.recipe, model, self.example(),
                                  accumulator=self.recipe_accumulator)
    return recipes.recipe_rules(self.recipe, model, accumulator=self.recipe_accumulator)

  def preset_at(self, epoch: int) -> str | None:
    return None if self.schedule is None else self.schedule.at(epoch) or None

  def quantize(self, model: nnx.Module, preset: str | None) -> nn_rules.QuantReport | None:
    """Puts the config's rules, the recipe's, then `preset`'s on `model` in place (earlier ones
    removed)."""
    nn_rules.unquantize_model(model)
    rules = self.rules + self.recipe_rules(model) + (
        bfpsim.load_bfpsim_preset(preset) if preset else [])
    if not rules:
      return None
    report = nn_rules.quantize_model(model, rules, rngs=nnx.Rngs(quant=self.seed + 2))
    if self.controller_spec:
      bits = bfp_controller.bits_from_configs(dict(report))
      if self.controller is None:
        self.controller = bfp_controller.SimpleController.from_string(
            self.controller_spec, window=self.window, bits=bits)
      else:  # a preset switch: the new preset's widths, the controller's window state kept
        for layer, roles in bits.items():
          self.controller.add_layer(layer, roles)
    return report


# -- running a loop ------------------------------------------------------------------------------


class Interrupt:
  """SIGINT or SIGTERM (a preemption) sets a flag (the loop checkpoints and returns); a second one
  aborts as usual.

  Under the cluster launcher (JLP_HEARTBEAT names this host's heartbeat file) `agreed()`, which
  both loops call once per step, touches the file: the launcher names a host whose file stops
  changing for --heartbeat_timeout seconds. The file's one line is the signal that interrupted
  this process (0: none), so the launcher tells a preempted host from one stopped by its peers."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.event = threading.Event()
    self.signum = 0
    self._previous: dict[int, Any] = {}
    self._heartbeat = os.environ.get("JLP_HEARTBEAT") or None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.getsignal(s)
        signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.event.set()
    self.signum = self.signum or signum
    self._beat(note=True)
    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else
                  signal.SIG_DFL)

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _beat(self, note: bool = False) -> None:
    """Touches the heartbeat file (writes it when new, or with `note` the signal)."""
    if self._heartbeat is None:
      return
    try:
      if note or not os.path.exists(self._heartbeat):
        with open(self._heartbeat, "w", encoding="ascii") as f:
          f.write(f"{self.signum}\n")
      else:
        os.utime(self._heartbeat)
    except OSError:
      pass

  def agreed(self) -> bool:
    """Whether any process was interrupted: every process of a multi-process run stops after the
    same step (one host stopping alone would leave the others in a collective)."""
    self._beat()
    if jax.process_count() == 1:
      return self.event.is_set()
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = multihost_utils.process_allgather(np.int32(self.event.is_set()))
    return bool(np.any(flags))


class HostStall:
  """The cluster launcher's `--hetero h` (exported as JLP_HETERO): before every training step
  this process sleeps h wall-clock seconds with probability 0.1, SD-PIPE's `--hetero` made real
  (draws seeded by the process index)."""

  def __init__(self):
    self.seconds = float(os.environ.get("JLP_HETERO", "0") or 0)
    self._rng = random.Random(jax.process_index())

  def __call__(self) -> None:
    if self.seconds and self._rng.random() < 0.1:
      time.sleep(self.seconds)


def union_seconds(spans: list[tuple[float, float]], begin: float, end: float) -> float:
  """The length of the union of the (begin, end) `spans` within [begin, end]."""
  total, reach = 0.0, begin
  for first, last in sorted(spans):
    first, last = max(first, reach), min(last, end)
    if last > first:
      total += last - first
      reach = last
  return total


class CompileClock:
  """Wall-clock seconds the thread that entered it spent tracing, lowering and compiling JAX
  programs (`between(begin, end)`, times of time.perf_counter): the union of the spans of
  jax.monitoring's compile events (a program traced inside another's trace reports its own,
  overlapping span; a data loader's thread compiles without stopping training). What a run's
  throughput leaves out."""

  EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def __init__(self):
    self._spans: list[tuple[float, float]] = []
    self._thread = threading.current_thread()

  def _listen(self, event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event in self.EVENTS and threading.current_thread() is self._thread:
      end = time.perf_counter()
      self._spans.append((end - duration, end))

  def spans(self) -> list[tuple[float, float]]:
    """(begin, end) of every compile event so far."""
    return list(self._spans)

  def between(self, begin: float, end: float) -> float:
    """Seconds of compilation within [begin, end]."""
    return union_seconds(self._spans, begin, end)

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


class LogWindow:
  """What a metrics row reports about the steps since the previous row.

  `train_loss` and `train_accuracy` are the means of every step's batch loss and accuracy since
  the previous row (big_vision and the Flax examples do the same; a checkpoint between two rows
  keeps the window's values in its meta, `values()`, so a resumed run's rows equal the
  uninterrupted run's). `throughput` is the examples trained since the previous row per
  wall-clock second of training: the time spent compiling (`CompileClock`) and writing
  checkpoints (`saving()`) is left out and reported as `compile_seconds` and `save_seconds`;
  evaluation and logging fall between `close()` and `restart()`. `close()` waits for the device
  work of the steps it was given before it reads the clock (JAX dispatches steps asynchronously).
  """

  def __init__(self, clock: CompileClock, values: dict[str, list[float]] | None = None):
    self.clock = clock
    values = values or {}
    self.loss: list[Any] = list(values.get("loss", []))
    self.accuracy: list[Any] = list(values.get("accuracy", []))
    self.compile_seconds = 0.0
    self._saves: list[tuple[float, float]] = []  # since the previous row
    self.restart()

  def restart(self) -> None:
    """Starts the clock of the next row's throughput."""
    self._begin = time.perf_counter()
    self.examples = 0

  def add(self, loss: Any, accuracy: Any, examples: int) -> None:
    """One step's batch loss and accuracy (device scalars are fine) and its example count."""
    self.loss.append(loss)
    self.accuracy.append(accuracy)
    self.examples += examples

  def saving(self):
    """A context manager timing a checkpoint save (left out of the throughput)."""
    saves = self._saves

    class _Timer:
      def __enter__(self):
        self.begin = time.perf_counter()

      def __exit__(self, *exc):
        saves.append((self.begin, time.perf_counter()))
    return _Timer()

  def values(self) -> dict[str, list[float]]:
    """The losses and accuracies since the previous row, as floats (for a checkpoint's meta)."""
    return {"loss": [float(v) for v in self.loss], "accuracy": [float(v) for v in self.accuracy]}

  def compiled(self, begin: float, end: float) -> float:
    """Seconds compiling within [begin, end] outside checkpoint saves (orbax compiles too)."""
    return (union_seconds(self.clock.spans() + self._saves, begin, end) -
            union_seconds(self._saves, begin, end))

  def close(self, throughput: float | None = None) -> dict[str, float]:
    """The row's train_loss, train_accuracy, throughput, compile_seconds and save_seconds; empties
    the window (call `restart` once the row is written). `throughput`: the caller's own (the
    pipelined loop times each call and adds its compile time to `compile_seconds` itself)."""
    save_seconds = sum(end - begin for begin, end in self._saves)
    # Fetching the steps' values waits for the device work queued behind them (a step's outputs
    # are ready when its program ends), so the window ends when the steps end, not when the
    # host dispatched them: that work would otherwise fall into the evaluation after the row.
    loss, accuracy = jax.device_get((self.loss, self.accuracy))
    if throughput is None:
      now = time.perf_counter()
      compiled = self.compiled(self._begin, now)
      self.compile_seconds += compiled
      seconds = now - self._begin - compiled - union_seconds(self._saves, self._begin, now)
      throughput = self.examples / max(seconds, 1e-9)
    mean = lambda vs: float(np.mean(np.asarray(vs, np.float64))) if vs else float("nan")
    row = {"train_loss": mean(loss), "train_accuracy": mean(accuracy),
           "throughput": throughput, "compile_seconds": self.compile_seconds,
           "save_seconds": save_seconds}
    self.loss, self.accuracy, self._saves = [], [], []
    self.compile_seconds = 0.0
    return row


class NonFiniteLossError(RuntimeError):
  """The training loss became NaN or infinite: the run stopped (the row that shows it is
  written; no checkpoint of the diverged state is)."""


def check_finite_loss(row: dict[str, Any], step: int, checkpoints: Checkpointer) -> None:
  """Raises NonFiniteLossError when the row's train_loss is not finite."""
  loss = row.get("train_loss")
  if loss is None or np.isfinite(loss):
    return
  newest = checkpoints.latest_step()
  kept = f"the newest checkpoint is step {newest}" if newest else "no checkpoint was written"
  raise NonFiniteLossError(
      f"train_loss={loss} at step {step} (its row is in metrics.jsonl): the run stopped and "
      f"{kept}. Usual causes: labels outside the model's classes (a data set's label files), a "
      "learning rate too high, or a number format whose range overflows; fix the cause and "
      "resume, or start a new --workdir.")


def record_start(config: ml_collections.ConfigDict, workdir: str, start: int,
                 changes: dict[str, tuple], manifests: dict[str, list[str] | None],
                 data_changed: bool, writer: MetricsWriter) -> None:
  """What a (re)start leaves in `workdir`: config.json and the history of `changes`, the data
  sets' file lists (on a fresh start, or when their change was allowed), and the changes in the
  next metrics row."""
  record_config(config, workdir, start, changes)
  record_data(workdir, manifests, replace=not start or data_changed)
  if changes:
    writer.note(config_change=describe_changes(changes))


def checkpoint_due(config: ml_collections.ConfigDict, step: int, interrupted: bool) -> bool:
  """Whether the loop writes a checkpoint after `step`: every checkpoint_every steps, at the end
  and when interrupted."""
  return (bool(config.checkpoint_every) and step % config.checkpoint_every == 0) or \
      step == config.max_steps or interrupted


def close_run(bar, writer: MetricsWriter, checkpoints: Checkpointer) -> None:
  """Closes the progress bar, the metrics writer and the checkpointer (waiting for its saves)."""
  if bar is not None:
    bar.close()
  writer.close()
  checkpoints.close()


def report_interrupt(step: int, checkpoints: Checkpointer) -> None:
  print(f"interrupted at step {step}: checkpoint written to {checkpoints.directory}; run the "
        "same command again to resume.", flush=True)


def report_finished_on_interrupt(step: int, checkpoints: Checkpointer) -> None:
  print(f"finished at step {step} (Ctrl-C came during its last step or evaluation, which "
        f"completed): checkpoint written to {checkpoints.directory}.", flush=True)


def progress(enabled: bool | None, total: int, initial: int):
  if enabled is None:
    # Under the cluster launcher host 0's output reaches the terminal through a pipe.
    enabled = (sys.stderr.isatty() or os.environ.get("JLP_PROGRESS_BAR") == "1") and \
        jax.process_index() == 0
  if not enabled:
    return None
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def log_line(step: int, max_steps: int, row: dict[str, Any]) -> str:
  """One plain progress line: the step and the row's main metrics."""
  keys = [k for k in ("train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "eval_miou",
                      "learning_rate", "throughput") if k in row and row[k] is not None]
  return f"step {step}/{max_steps} " + " ".join(f"{k}={row[k]:.4g}" for k in keys)
