"""Comparisons that run several trainings of one config: the APS study of the main job and notebook,
the gradient-compression study and the pipelined-synchronisation study.

`aps_study(config, workdir)` trains `config` once per gradient all-reduce variant (float32, e4m3
and e3m0, each with and without APS; CPD's headline experiment, Han, Demmel, You, "Auto-Precision
Scaling for Distributed Deep Learning", arXiv:1911.08907) in `workdir/<variant>`, and returns one
row per run with the final test accuracy, its gap to float32 and the train loss of the last logged
window (the mean over its steps); `render_table` prints them and `jlp.plots.plot_runs` draws the
curves.

`compression_study(config, workdir)` trains `config` once with a float32 all-reduce and once per
compressor x CaSync topology (HiPress, Bai et al., SOSP 2021; docs/hipress.md) in
`workdir/<compressor>_<topology>`; its rows add the mean bytes one device sends per step for the
gradient sync (the runner's `wire_bytes` metric) and their ratio to float32's;
`render_compression_table` prints them. The float32 run uses the ring all-reduce by default
(2(W-1)/W x 4 bytes per float, the bandwidth-optimal all-reduce of NCCL and of HiPress's "Ring"
baseline); CPD's sequential all-reduce gathers every gradient, (W-1) x 4 bytes per float.

`pipeline_study(PipelineStudy(...))` trains the digits CNN pipelined (`jlp.pipeline`: N pipelines
x S stages, SD-PIPE's 1F1B by default; Miao et al., PVLDB 16(9) 2023, docs/sdpipe.md) once per sync
across the pipelines (AllReduce, PReduce, AD-PSGD, HetPipe) x stall length h of the virtual-time
cost model, with the executor directly (not the runner), and returns rows with the virtual
seconds to a target test accuracy, the final accuracy, PReduce's mean group size and the curves;
`render_pipeline_table` prints them as markdown.

`recipe_study(config, workdir)` trains `config` once in float32 and once per low-precision
training recipe (`config.quant_recipe`, `jlp.nn.recipes`: TransformerEngine's NVFP4BlockScaling,
arXiv:2509.25149; MXFP8BlockScaling; MXFP4 with stochastic rounding, arXiv:2502.20586;
DeepSeek-V3's 1x128 / 128x128 FP8 with promoted accumulation, arXiv:2412.19437 §3.3; TE's
per-tensor Float8CurrentScaling and DelayedScaling, arXiv:2209.05433) in `workdir/<recipe>`; its
rows hold the final test accuracy, its gap to float32, the last window's train loss and the wall
seconds per training step, and a recipe that `jlp.nn` names but does not build yet
(`jlp.nn.recipes.UNSUPPORTED`, empty at present) gets a row saying so; `render_recipe_table`
prints them as markdown.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from jlp.compression.casync import TOPOLOGIES
from jlp.nn.recipes import RECIPES, UNSUPPORTED
from jlp.train import run_timing
from jlp.train.config import base_config
from jlp.train.loop import train_and_evaluate
from jlp.train.metrics import read_metrics


@dataclasses.dataclass(frozen=True)
class Variant:
  """One gradient all-reduce setting: (grad_exp, grad_man) and APS on or off."""
  name: str
  grad_exp: int
  grad_man: int
  use_aps: bool


APS_VARIANTS = (
    Variant("float32", 8, 23, False),
    Variant("e4m3", 4, 3, False),
    Variant("e4m3_aps", 4, 3, True),
    Variant("e3m0", 3, 0, False),
    Variant("e3m0_aps", 3, 0, True),
)


def aps_study(config: ml_collections.ConfigDict, workdir: str,
              variants: Sequence[Variant] = APS_VARIANTS, *, fresh: bool = True,
              progress: bool | None = False) -> list[dict[str, float | str]]:
  """Trains `config` once per variant in workdir/<name>; rows of final metrics (module docstring).

  fresh: delete each variant's directory first (otherwise an existing run is resumed, or just
  read back when it is complete).
  """
  rows = []
  for v in variants:
    run_dir = os.path.join(workdir, v.name)
    if fresh and os.path.isdir(run_dir):
      shutil.rmtree(run_dir)
    cfg = ml_collections.ConfigDict(config.to_dict())
    cfg.grad_exp, cfg.grad_man, cfg.use_aps = v.grad_exp, v.grad_man, v.use_aps
    cfg.grad_format = f"e{v.grad_exp}m{v.grad_man}"
    print(f"== {v.name}: gradient all-reduce {cfg.grad_format}{' + APS' if v.use_aps else ''}",
          flush=True)
    train_and_evaluate(cfg, run_dir, progress=progress)
    final = [r for r in read_metrics(run_dir) if r.get("eval_accuracy") is not None][-1]
    rows.append({"run": v.name, "format": "float32" if v.grad_exp == 8 else cfg.grad_format,
                 "aps": "yes" if v.use_aps else "no", "test_accuracy": final["eval_accuracy"],
                 "train_loss": final["train_loss"], "step": final["step"]})
  base = next((r["test_accuracy"] for r in rows if r["run"] == "float32"), None)
  for r in rows:
    r["gap_to_float32"] = None if base is None else r["test_accuracy"] - base
  return rows


def render_table(rows: Sequence[dict[str, float | str]]) -> str:
  """The study's rows as a plain-text table (accuracies in percent)."""
  head = f"{'run':10s} {'all-reduce':10s} {'APS':4s} {'test acc %':>10s} {'vs fp32':>8s} {'train loss':>10s}"
  lines = [head, "-" * len(head)]
  for r in rows:
    gap = "" if r["gap_to_float32"] is None else f"{100 * r['gap_to_float32']:+.2f}"
    lines.append(f"{r['run']:10s} {r['format']:10s} {r['aps']:4s} {100 * r['test_accuracy']:10.2f} "
                 f"{gap:>8s} {r['train_loss']:10.4f}")
  return "\n".join(lines)


#: HiPress's five compressors (docs/hipress.md#compressors), in the paper's order.
HIPRESS_COMPRESSORS = ("onebit", "tbq", "terngrad", "dgc", "graddrop")
#: A compressor of the study: its name, or (name, {field: value}).
CompressorEntry = str | tuple[str, Mapping[str, Any]]


def _compressor_entries(compressors: Sequence[CompressorEntry]) -> list[tuple[str, dict[str, Any]]]:
  out = []
  for entry in compressors:
    if isinstance(entry, str):
      out.append((entry, {}))
    elif (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
          and isinstance(entry[1], Mapping)):
      out.append((entry[0], dict(entry[1])))
    else:
      raise ValueError(f"compressors entry={entry!r} is not allowed; expected a compressor name "
                       "or a pair (name, {field: value}).")
    if out[-1][0] == "none":
      raise ValueError("compressors entry='none' is not allowed; expected a compressor name (the "
                       "float32 run is always part of the study).")
  return out


def _label(name: str, kwargs: Mapping[str, Any], sep: str | None = None) -> str:
  """"tbq" or "tbq(threshold=0.01)"; with `sep`, "tbq_threshold=0.01" (a directory name)."""
  if not kwargs:
    return name
  fields = [f"{k}={v}" for k, v in sorted(kwargs.items())]
  return sep.join([name] + fields) if sep else f"{name}({', '.join(fields)})"


def _final_row(run_dir: str) -> tuple[dict[str, Any], float]:
  """(the last evaluated metrics row, mean wire_bytes over the logged rows) of a finished run."""
  rows = read_metrics(run_dir)
  final = [r for r in rows if r.get("eval_accuracy") is not None][-1]
  wire = [r["wire_bytes"] for r in rows if r.get("wire_bytes") is not None]
  return final, (sum(wire) / len(wire) if wire else float("nan"))


def compression_study(config: ml_collections.ConfigDict, workdir: str,
                      compressors: Sequence[CompressorEntry] = HIPRESS_COMPRESSORS,
                      topologies: Sequence[str] = TOPOLOGIES, *,
                      baseline_algorithm: str = "ring", fresh: bool = True,
                      progress: bool | None = False) -> list[dict[str, Any]]:
  """Trains `config` with a float32 all-reduce, then once per compressor x topology; rows of
  final metrics (module docstring).

  compressors: names of jlp.compression compressors (with their default fields), or
    (name, {field: value}) pairs. The rest of config.compression (min_size) is kept for
    them; the float32 run gets the default compression fields (validation refuses
    compression.min_size, topology, kwargs or plan without a compressor).
  topologies: CaSync topologies, "ps" and/or "ring".
  baseline_algorithm: the float32 run's all-reduce (config.grad_algorithm): "ring" or
    "sequential" (module docstring).
  fresh: delete each run's directory first (otherwise an existing run is resumed, or just read
    back when it is complete).

  Rows: run, compressor ("none" for float32), label (the name, with the fields when given),
  topology (float32: baseline_algorithm), test_accuracy, gap_to_float32, train_loss, wire_bytes
  (mean per step over the logged rows), bytes_ratio (wire_bytes / float32's), step.
  """
  entries = _compressor_entries(compressors)
  runs = [("float32", "none", None, {})]
  runs += [(f"{_label(name, kwargs, '_')}_{topology}", name, topology, kwargs)
           for name, kwargs in entries for topology in topologies]
  rows = []
  for run, name, topology, kwargs in runs:
    run_dir = os.path.join(workdir, run)
    if fresh and os.path.isdir(run_dir):
      shutil.rmtree(run_dir)
    cfg = ml_collections.ConfigDict(config.to_dict())
    if name == "none":
      cfg.compression = base_config().compression
    cfg.compression.name = name
    cfg.compression.kwargs = ml_collections.ConfigDict(kwargs)
    if name == "dgc" and kwargs.get("momentum", 0.9) > 0 and cfg.optimizer == "sgd":
      cfg.momentum = 0.0  # DGC's momentum correction replaces the optimizer's (Lin et al. §3.2)
    if topology is not None:
      cfg.compression.topology = topology
    else:
      cfg.grad_algorithm = baseline_algorithm
    what = (f"float32 {baseline_algorithm} all-reduce" if name == "none" else
            f"{_label(name, kwargs)} over CaSync-{topology.upper()}")
    print(f"== {run}: gradient sync {what}", flush=True)
    train_and_evaluate(cfg, run_dir, progress=progress)
    final, wire = _final_row(run_dir)
    rows.append({"run": run, "compressor": name, "label": _label(name, kwargs),
                 "topology": topology or baseline_algorithm,
                 "test_accuracy": final["eval_accuracy"], "train_loss": final["train_loss"],
                 "wire_bytes": wire, "step": final["step"]})
  base = rows[0]
  for r in rows:
    r["gap_to_float32"] = r["test_accuracy"] - base["test_accuracy"]
    r["bytes_ratio"] = r["wire_bytes"] / base["wire_bytes"] if base["wire_bytes"] else float("nan")
  return rows


def _bytes(n: float) -> str:
  for unit, scale in (("MB", 1e6), ("kB", 1e3)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n:.0f} B"


def render_compression_table(rows: Sequence[dict[str, Any]]) -> str:
  """The compression study's rows as a plain-text table (accuracies in percent, bytes one device
  sends per step, their fraction of float32's)."""
  width = max([10] + [len(r.get("label", r["compressor"])) for r in rows])
  head = (f"{'compressor':{width}s} {'sync':5s} {'test acc %':>10s} {'vs fp32':>8s} "
          f"{'bytes/step':>10s} {'x fp32':>7s} {'train loss':>10s}")
  lines = [head, "-" * len(head)]
  for r in rows:
    gap = "" if r["compressor"] == "none" else f"{100 * r['gap_to_float32']:+.2f}"
    name = "float32" if r["compressor"] == "none" else r.get("label", r["compressor"])
    lines.append(f"{name:{width}s} {r['topology']:5s} {100 * r['test_accuracy']:10.2f} "
                 f"{gap:>8s} {_bytes(r['wire_bytes']):>10s} {r['bytes_ratio']:7.3f} "
                 f"{r['train_loss']:10.4f}")
  return "\n".join(lines)


#: SD-PIPE's synchronisations across pipelines compared by `pipeline_study`
#: (docs/sdpipe.md#syncs-across-pipelines), and the seed's `--hetero` stall lengths (seconds, with
#: probability 0.1 per op, docs/sdpipe.md#virtual-time).
SDPIPE_SYNCS = ("allreduce", "preduce", "adpsgd", "hetpipe")
SDPIPE_HETEROS = (0.0, 0.1, 0.3)


@dataclasses.dataclass(frozen=True)
class PipelineStudy:
  """Settings of `pipeline_study`: the digits CNN (`jlp.models.small_cnn`) cut into num_stages
  stages (`jlp.pipeline.split_model`), num_pipelines pipelines on num_pipelines * num_stages
  devices, SGD as configs/digits.py (momentum, weight decay off BatchNorm and biases) at a
  constant learning rate.

  Attributes:
    num_pipelines, num_stages: N and S.
    batch_per_pipeline: rows of one mini-batch per pipeline (the global mini-batch is N times it).
    num_batches: mini-batches (updates of every stage) per run.
    batches_per_run: mini-batches per `Pipeline.run` call; the test accuracy is evaluated after
      each call (on the latest weights; 1F1B keeps flowing between calls, so the length changes
      only how often it is evaluated).
    learning_rate, momentum, weight_decay, width: the optimizer and the CNN's width.
    allreduce_beta_s: the virtual seconds an average or all-reduce costs per member beyond the
      first (`jlp.pipeline.Hetero.allreduce_beta_s`; with 1 ms per average on top): a smaller
      group costs less.
    target_accuracy: the test accuracy whose virtual time the study reports.
    schedule: "1f1b" (SD-PIPE's) or "gpipe".
    num_microbatches: GPipe's M.
    seed: the model's initialisation, the data order and the virtual-time simulation.
  """
  num_pipelines: int = 2
  num_stages: int = 4
  batch_per_pipeline: int = 32
  num_batches: int = 240
  batches_per_run: int = 12
  learning_rate: float = 0.05
  momentum: float = 0.9
  weight_decay: float = 5e-4
  width: int = 16
  allreduce_beta_s: float = 0.002
  target_accuracy: float = 0.9
  schedule: str = "1f1b"
  num_microbatches: int = 1
  seed: int = 0

  def __post_init__(self):
    for name in ("num_pipelines", "num_stages", "batch_per_pipeline", "num_batches",
                 "batches_per_run", "width", "num_microbatches"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; expected an integer >= 1.")
    if self.num_batches % self.batches_per_run:
      raise ValueError(f"num_batches={self.num_batches!r} is not allowed; expected a multiple of "
                       f"batches_per_run={self.batches_per_run}.")
    if self.batch_per_pipeline % self.num_microbatches:
      raise ValueError(f"batch_per_pipeline={self.batch_per_pipeline!r} is not allowed; expected "
                       f"a multiple of num_microbatches={self.num_microbatches}.")
    for name in ("learning_rate", "momentum", "weight_decay", "allreduce_beta_s"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r} is not allowed; expected a number >= 0.")
    if not 0 < self.target_accuracy <= 1:
      raise ValueError(f"target_accuracy={self.target_accuracy!r} is not allowed; expected a "
                       "number in (0, 1].")
    if self.schedule not in ("1f1b", "gpipe"):
      raise ValueError(f"schedule={self.schedule!r} is not allowed; expected '1f1b' or 'gpipe'.")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"seed={self.seed!r} is not allowed; expected an integer.")


def _digits_minibatches(images: np.ndarray, labels: np.ndarray, rows: int, count: int,
                        seed: int) -> tuple[np.ndarray, np.ndarray]:
  """`count` mini-batches of `rows` examples, [count, rows, ...]: epochs of a seeded permutation,
  the incomplete last mini-batch of each epoch dropped."""
  rng = np.random.default_rng(seed)
  per_epoch = len(labels) // rows
  order = np.concatenate([rng.permutation(len(labels))[:per_epoch * rows]
                          for _ in range(-(-count // per_epoch))])[:count * rows]
  return (images[order].reshape((count, rows) + images.shape[1:]),
          labels[order].reshape(count, rows))


class _PipelineAccuracy:
  """Test accuracy of every pipeline's model (its stages merged, BatchNorm in eval mode with the
  pipeline's running statistics), averaged over the pipelines as the seed reduces its validation
  over the last-stage devices)."""

  def __init__(self, split: Any, images: np.ndarray, labels: np.ndarray):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    self._split, self._nnx = split, nnx
    model = split.merge(split.params, split.state)
    model.eval()
    self._graphdef = nnx.graphdef(model)
    device = jax.devices()[0]
    self._images = jax.device_put(images, device)
    self._labels = jax.device_put(labels, device)

    @jax.jit
    def accuracy(variables, x, y):
      logits = nnx.merge(self._graphdef, variables)(x)
      return jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(jnp.float32))

    self._accuracy = accuracy

  def __call__(self, pipe: Any, state: Any) -> float:
    params, stage_state = pipe.stage_params(state), pipe.stage_state(state)
    accuracies = []
    for i in range(pipe.num_pipelines):
      take = lambda trees, i=i: [{k: v[i] for k, v in tree.items()} for tree in trees]
      model = self._split.merge(take(params), take(stage_state))
      model.eval()
      accuracies.append(float(self._accuracy(self._nnx.state(model), self._images,
                                             self._labels)))
    return float(np.mean(accuracies))


def pipeline_study(study: PipelineStudy = PipelineStudy(),
                   syncs: Sequence[str] = SDPIPE_SYNCS,
                   heteros: Sequence[float] = SDPIPE_HETEROS, *,
                   progress: bool = False) -> list[dict[str, Any]]:
  """Trains the digits CNN pipelined (`jlp.pipeline.Pipeline`, `study.schedule`) once per sync x
  hetero, each from the same initial model on the same mini-batches, and returns one row per run.

  syncs: `jlp.pipeline` syncs across the pipelines ("allreduce", "preduce", "adpsgd", "hetpipe",
    "none").
  heteros: stall lengths h in seconds: every forward and backward op stalls h with probability
    0.1 in virtual time (`jlp.pipeline.Hetero(delay_s=h, allreduce_beta_s=study's)`, its other
    costs at their defaults: 10 ms forward, 20 ms backward, 1 ms transfers, 1 ms per average;
    docs/sdpipe.md#virtual-time).
  progress: print a line per evaluation.

  Rows: sync, hetero, num_pipelines, num_stages, virtual_s_to_target (virtual seconds at the
  first evaluation whose test accuracy reached study.target_accuracy; None if none did),
  updates_to_target (mini-batches fed by then), final_accuracy, final_loss (mean train loss of
  the mini-batches completed in the last call and the flush), virtual_s (whole run),
  mean_group_size (the mean size of the groups the PReduce scheduler formed, over all stages;
  None for other syncs), real_s (wall seconds of the run: compile, training and evaluation),
  curve (one (mini-batches fed, virtual seconds of the latest update, test accuracy, mean train
  loss of the mini-batches completed in the call) per evaluation, the untrained model first at
  (0, 0.0, accuracy, nan)), losses (float64 [num_batches]: every update's train loss, the mean
  over the pipelines).

  The calls do not change the training: 1F1B's pipeline stays full from one call to the next,
  and the virtual time and the syncs' groups come from one timeline of the whole training
  (`jlp.pipeline.timeline`); the last call is followed by the flush.

  Every run with the same sync shares one compiled program: the hetero only changes the cost
  model of the virtual time (`Pipeline.run(..., hetero=)`).
  """
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jlp.pipeline as jp  # pylint: disable=g-import-not-at-top
  from jlp.data import get_dataset  # pylint: disable=g-import-not-at-top
  from jlp.models import small_cnn  # pylint: disable=g-import-not-at-top
  from jlp.train.optim import (  # pylint: disable=g-import-not-at-top
      decay_mask, is_bn_or_bias, torch_sgd)

  if not isinstance(study, PipelineStudy):
    raise ValueError(f"study={study!r} is not allowed; expected a jlp.studies.PipelineStudy.")
  syncs, heteros = list(syncs), list(heteros)
  for sync in syncs:
    if sync not in jp.SYNC_MODES:
      raise ValueError(f"syncs entry={sync!r} is not allowed; expected one of {jp.SYNC_MODES}.")
  for h in heteros:
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not h >= 0:
      raise ValueError(f"heteros entry={h!r} is not allowed; expected seconds >= 0.")
  if not syncs or not heteros:
    raise ValueError("syncs and heteros must each hold at least one entry; expected e.g. "
                     f"{SDPIPE_SYNCS} and {SDPIPE_HETEROS}.")

  N, S, B = study.num_pipelines, study.num_stages, study.batches_per_run
  train = get_dataset("digits", split="train")
  test = get_dataset("digits", split="test")
  train_xy = train.get(np.arange(train.size), {})
  test_xy = test.get(np.arange(test.size), {})
  xs_all, ys_all = _digits_minibatches(train_xy["image"], train_xy["label"],
                                       N * study.batch_per_pipeline, study.num_batches, study.seed)
  split = jp.split_model(small_cnn(width=study.width, rngs=nnx.Rngs(study.seed)), S)
  accuracy = _PipelineAccuracy(split, test_xy["image"], test_xy["label"])
  mesh = jp.pipeline_mesh(N, S)
  optimizer = torch_sgd(study.learning_rate, momentum=study.momentum,
                        weight_decay=study.weight_decay, decay_mask=decay_mask(is_bn_or_bias))

  def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  rows = []
  for sync in syncs:
    pipe = jp.Pipeline(split.stages, loss_fn, optimizer, mesh, schedule=study.schedule,
                       num_microbatches=study.num_microbatches, sync=sync, stateful=True,
                       seed=study.seed)
    for h in heteros:
      start = time.perf_counter()
      state = pipe.init(split.params, split.state)
      curve = [(0, 0.0, accuracy(pipe, state), float("nan"))]
      groups: list[np.ndarray] = []
      losses: list[np.ndarray] = []
      # A run's cost model: one compile for all h.
      hetero = jp.Hetero(delay_s=float(h), allreduce_beta_s=study.allreduce_beta_s)
      for first in range(0, study.num_batches, B):
        state, metrics = pipe.run(state, xs_all[first:first + B], ys_all[first:first + B],
                                  hetero=hetero)
        if first + B == study.num_batches:
          state, drained = pipe.flush(state, hetero=hetero)
          metrics = {k: np.concatenate([metrics[k], drained[k]])
                     for k in ("loss", "group_sizes")}
        groups.append(np.asarray(metrics["group_sizes"]))
        losses.append(np.asarray(metrics["loss"], np.float64))
        curve.append((first + B, pipe.virtual_seconds(state), accuracy(pipe, state),
                      float(np.mean(metrics["loss"]))))
        if progress:
          print(f"  {sync:9s} h={h:<4g} updates {first + B:4d}  virtual {curve[-1][1]:7.2f} s  "
                f"loss {curve[-1][3]:.4f}  test acc {curve[-1][2]:.4f}", flush=True)
      real = time.perf_counter() - start
      reached = [c for c in curve if c[2] >= study.target_accuracy]
      sizes = np.concatenate(groups)
      rows.append({
          "sync": sync, "hetero": float(h), "num_pipelines": N, "num_stages": S,
          "virtual_s_to_target": reached[0][1] if reached else None,
          "updates_to_target": reached[0][0] if reached else None,
          "final_accuracy": curve[-1][2], "final_loss": curve[-1][3],
          "virtual_s": curve[-1][1],
          "mean_group_size": float(np.mean(sizes)) if sync == "preduce" and sizes.size else None,
          "real_s": real, "curve": curve, "losses": np.concatenate(losses)})
      print(f"== {sync} h={h:g}: test accuracy {curve[-1][2]:.4f} after {study.num_batches} "
            f"updates, {curve[-1][1]:.1f} virtual s, {real:.1f} real s", flush=True)
  return rows


def render_pipeline_table(rows: Sequence[dict[str, Any]], target_accuracy: float = 0.9) -> str:
  """The pipeline study's rows as a markdown table (accuracies in percent; "-" = target not
  reached), with each run's virtual time to target relative to AllReduce's at the same h."""
  base = {r["hetero"]: r["virtual_s_to_target"] for r in rows if r["sync"] == "allreduce"}
  head = (f"| sync | h (s) | virtual s to {100 * target_accuracy:g}% | vs allreduce | "
          "updates to target | final test acc % | virtual s (run) | mean group size | real s |")
  lines = [head, "|" + " --- |" * (head.count("|") - 1)]
  for r in rows:
    t = r["virtual_s_to_target"]
    b = base.get(r["hetero"])
    ratio = f"{t / b:.2f}x" if t is not None and b else "-"
    group = "-" if r["mean_group_size"] is None else f"{r['mean_group_size']:.2f}"
    lines.append(f"| {r['sync']} | {r['hetero']:g} | {'-' if t is None else f'{t:.2f}'} | "
                 f"{ratio} | {r['updates_to_target'] or '-'} | {100 * r['final_accuracy']:.2f} | "
                 f"{r['virtual_s']:.2f} | {group} | {r['real_s']:.1f} |")
  return "\n".join(lines)


#: The recipe study's runs after float32: every recipe `jlp.nn` builds, then those it names but
#: refuses (a row "not supported yet").
STUDY_RECIPES = RECIPES + tuple(UNSUPPORTED)


def _check_recipes(recipes: Sequence[str]) -> tuple[str, ...]:
  allowed = ", ".join(repr(r) for r in STUDY_RECIPES)
  if isinstance(recipes, str) or not recipes:
    raise ValueError(f"recipes={recipes!r} is not allowed; expected a non-empty list of {allowed}.")
  for name in recipes:
    if name == "none":
      raise ValueError("recipes entry='none' is not allowed; expected a recipe name (the float32 "
                       "run is always part of the study).")
    if name not in STUDY_RECIPES:
      raise ValueError(f"recipes entry={name!r} is not allowed; expected one of {allowed}.")
  if len(set(recipes)) != len(recipes):
    raise ValueError(f"recipes={list(recipes)!r} is not allowed; expected each recipe once.")
  return tuple(recipes)


def _seconds_per_step(rows: Sequence[Mapping[str, Any]], batch_size: int) -> float:
  """`jlp.train.run_timing.seconds_per_step` after the first logged window (its warm-up), or over
  that window when it is the only one."""
  logged = [r["step"] for r in rows if r.get("throughput")]
  if not logged:
    return float("nan")
  return run_timing.seconds_per_step(rows, batch_size, logged[0] if len(logged) > 1 else 0)


def recipe_study(config: ml_collections.ConfigDict, workdir: str,
                 recipes: Sequence[str] = STUDY_RECIPES, *, fresh: bool = True,
                 progress: bool | None = False) -> list[dict[str, Any]]:
  """Trains `config` in float32 (quant_recipe "none"), then once per recipe; rows of final
  metrics (module docstring).

  recipes: names from `jlp.nn.RECIPES` (trained) and `jlp.nn.recipes.UNSUPPORTED` (none at
    present: a row saying it is not supported yet, nothing trained). config.quant_rules are kept
    (they override the recipe layer by layer).
  fresh: delete each run's directory first (otherwise an existing run is resumed, or just read
    back when it is complete).

  Rows: run (the directory under workdir), recipe ("none" for float32), supported, and for the
  trained runs test_accuracy, gap_to_float32, train_loss, sec_per_step (the median after the first logged window, `jlp.train.run_timing`), step;
  these are None for an unsupported recipe, whose `note` says why.
  """
  recipes = _check_recipes(recipes)
  rows = []
  for name in ("none",) + recipes:
    run = "float32" if name == "none" else name
    if name in UNSUPPORTED:
      print(f"== {run}: not supported yet ({UNSUPPORTED[name]})", flush=True)
      rows.append({"run": run, "recipe": name, "supported": False, "test_accuracy": None,
                   "gap_to_float32": None, "train_loss": None, "sec_per_step": None,
                   "step": None, "note": f"not supported yet: {UNSUPPORTED[name]}"})
      continue
    run_dir = os.path.join(workdir, run)
    if fresh and os.path.isdir(run_dir):
      shutil.rmtree(run_dir)
    cfg = ml_collections.ConfigDict(config.to_dict())
    cfg.quant_recipe = name
    print(f"== {run}: " + ("float32 GEMMs" if name == "none" else f"quant_recipe={name!r}"),
          flush=True)
    train_and_evaluate(cfg, run_dir, progress=progress)
    metrics = read_metrics(run_dir)
    final = [r for r in metrics if r.get("eval_accuracy") is not None][-1]
    rows.append({"run": run, "recipe": name, "supported": True,
                 "test_accuracy": final["eval_accuracy"], "train_loss": final["train_loss"],
                 "sec_per_step": _seconds_per_step(metrics, cfg.batch_size),
                 "step": final["step"], "note": ""})
  base = rows[0]["test_accuracy"]
  for r in rows:
    if r["supported"]:
      r["gap_to_float32"] = r["test_accuracy"] - base
  return rows


def render_recipe_table(rows: Sequence[dict[str, Any]]) -> str:
  """The recipe study's rows as a markdown table (accuracies and their gap to float32 in percent
  points, wall seconds per step); an unsupported recipe's row says "not supported yet"."""
  head = "| recipe | test acc % | vs float32 | train loss, last window | s/step |"
  lines = [head, "| --- | ---: | ---: | ---: | ---: |"]
  for r in rows:
    name = "float32" if r["recipe"] == "none" else r["recipe"]
    if not r["supported"]:
      lines.append(f"| {name} | not supported yet | | | |")
      continue
    gap = "" if r["recipe"] == "none" else f"{100 * r['gap_to_float32']:+.2f}"
    lines.append(f"| {name} | {100 * r['test_accuracy']:.2f} | {gap} | {r['train_loss']:.4f} | "
                 f"{r['sec_per_step']:.4f} |")
  return "\n".join(lines)
