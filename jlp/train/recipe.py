"""Config -> the objects of a run: data pipelines, model (+ quantization rules), learning-rate
schedule, optimizer, gradient sync and loss. Each builder reads only the config fields it names
(jlp.train.config documents them), so notebooks can build one piece at a time.

Schedules (`config.schedule.name`), as functions of the optax update count c (0-based), with
E = steps per epoch of the training pipeline:
  constant          lr.
  cosine            linear warm-up 0 -> lr over `warmup_steps`, then cosine decay to 0 at max_steps.
  cosine_epochs     torch CosineAnnealingLR(T_max=`epochs`) stepped once per epoch (BFPsim):
                    lr * (1 + cos(pi * floor(c / E) / epochs)) / 2.
  cpd_resnet18      CPD ResNet18's rule (`jlp.train.cpd_resnet18_lr`: 0.1 -> 1.6 warm-up over 5
                    epochs, x0.1 after epochs 40 and 80); lr must be its peak, 1.6.
  piecewise_linear  DavidNet: lr * interp(c / E, `epochs`, `scales`), times (c + 1) / warmup_steps
                    while c + 1 <= `warmup_steps` (CPD's per-step warm-up factor).
  warmup_step       ResNet50: linear warm-up `init_lr` -> lr over `warmup_epochs`, then x0.1 (or
                    x`decay_factor`) after each of `decay_epochs`.
  poly              mmcv's poly: (lr - min_lr) * (1 - c / max_steps) ** power + min_lr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from jlp import data as jdata
from jlp import models
from jlp.compression import secopa
from jlp.train import optim
from jlp import sync_tuning
from jlp.train.config import (AUTOTUNE, CAST_SINGLE_MODEL, DEVICE_HINT, SECOPA, compressor,
                              grad_format)
from jlp.train.metrics import replace_file
from jlp.train.step import cross_entropy_loss
from jlp.sync import DiLoCo, GradSync

SCHEDULES = ("constant", "cosine", "cosine_epochs", "cpd_resnet18", "piecewise_linear",
             "warmup_step", "poly")
#: Weight of FCN's auxiliary head in the segmentation loss (mmseg's default).
AUX_LOSS_WEIGHT = 0.4
IGNORE_LABEL = 255


def _bad(field: str, value: Any, allowed: str) -> ValueError:
  return ValueError(f"config.{field}={value!r} is not allowed; expected {allowed}.")


# -- data ---------------------------------------------------------------------------------------


def eval_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
  """The options of data set `name`'s evaluation split from config.dataset.kwargs: the same, with
  augment=False for every data set that takes `augment` (digits, cifar10/100, imagenet,
  cityscapes), whatever kwargs say. Augmentation is for training only: the augmentation settings
  (crop, padding, pad_mode, flip, cutout; imagenet's scale, ratio; cityscapes' scale_range,
  cat_max_ratio, photometric) then act on nothing, and the evaluation transform (normalisation;
  imagenet's resize + centre crop; cityscapes' eval_scale) is the data set's own."""
  if "augment" in jdata.DATASETS[name].options:
    return {**kwargs, "augment": False}
  return dict(kwargs)


def datasets(config: ml_collections.ConfigDict) -> tuple[jdata.Dataset, jdata.Dataset]:
  """(train, eval) splits; a missing data folder raises here, showing the expected layout. The
  evaluation split is never augmented (`eval_kwargs`); a classification data set whose training
  images (after augmentation) and evaluation images differ in shape raises ValueError."""
  name = config.dataset.name
  if name not in jdata.DATASETS:
    raise _bad("dataset.name", name, f"one of {sorted(jdata.DATASETS)}")
  root = config.dataset.root or jdata.default_root(name)
  kwargs = dict(config.dataset.kwargs)
  options = jdata.dataset_options(name)
  unknown = sorted(set(kwargs) - set(options))
  if unknown:
    raise _bad(f"dataset.kwargs.{unknown[0]}", kwargs[unknown[0]],
               f"an option of {name!r} ({', '.join(sorted(options))}): the config's "
               "dataset.kwargs hold another data set's options; a config for "
               f"{name!r} sets dataset.kwargs = jlp.data.config_kwargs({name!r}, ...)")
  try:
    train = jdata.get_dataset(name, root, split="train", **kwargs)
    evaluation = jdata.get_dataset(name, root, split="eval", **eval_kwargs(name, kwargs))
  except FileNotFoundError as e:
    source = ("config.dataset.root" if config.dataset.root else
              f"the default of an empty config.dataset.root: ${jdata.DATA_DIR_ENV}/{name} or "
              f"data/{name}")
    raise FileNotFoundError(
        f"no {name} data in {os.path.abspath(root)!r} ({source}); put it there, or pass "
        f"--config.dataset.root=DIR (or set ${jdata.DATA_DIR_ENV}).\n{e}") from None
  if config.task == "classification" and train.image_shape != evaluation.image_shape:
    raise _bad("dataset.kwargs", kwargs,
               f"options that give training and evaluation images one shape (training "
               f"{train.image_shape}, evaluation {evaluation.image_shape}: the evaluation split "
               "is not augmented, so a crop must keep the image size, e.g. crop=32 with "
               "padding=4 on 32x32 images)")
  if config.dataset.get("verify", False):
    verify_files(name, root, {"train": train, "eval": evaluation})
  return train, evaluation


def verify_files(name: str, root: str, splits: dict[str, jdata.Dataset]) -> None:
  """config.dataset.verify: decodes every file of `splits` (Dataset.verify); prints one line when
  all can be used, else raises ValueError listing every one that cannot."""
  bad = {split: ds.verify() for split, ds in splits.items()}
  count = sum(len(v) for v in bad.values())
  if count:
    lines = [f"  {error}" for errors in bad.values() for error in errors]
    raise ValueError(f"config.dataset.verify: {count} files of {name} in "
                     f"{os.path.abspath(root)!r} cannot be used; remove or replace them (a resume "
                     "then refuses the changed file list unless --allow_config_change):\n" +
                     "\n".join(lines))
  sizes = ", ".join(f"{ds.size} {split}" for split, ds in splits.items())
  print(f"config.dataset.verify: every file of {name} ({sizes} examples) can be used.",
        flush=True)


def pipelines(config: ml_collections.ConfigDict, train: jdata.Dataset, evaluation: jdata.Dataset,
              *, global_train_batches: bool = False) -> tuple[jdata.Pipeline, jdata.Pipeline]:
  """The training pipeline (reshuffled every epoch, drop_last) and the evaluation one
  (sequential, last batch padded and masked); both pure functions of (seed, step), loaded by
  config.dataset.worker_processes worker processes (0: threads of this process). With
  `global_train_batches` every process loads the whole training batch (the pipelined runner
  feeds global mini-batches), else its own slice."""
  single = dict(process_index=0, process_count=1) if global_train_batches else {}
  workers = int(config.dataset.get("worker_processes", 0))
  train_pipe = jdata.Pipeline(train, config.batch_size, seed=config.seed,
                              worker_processes=workers, **single)
  eval_pipe = jdata.Pipeline(evaluation, config.eval_batch_size, seed=config.seed,
                             sampler="sequential", drop_last=False, worker_processes=workers)
  return train_pipe, eval_pipe


# -- model --------------------------------------------------------------------------------------


def model(config: ml_collections.ConfigDict, dataset: jdata.Dataset) -> nnx.Module:
  """The zoo model with the dataset's class count (and input channels where the model takes them)."""
  kwargs = dict(config.model.kwargs)
  for key, value in kwargs.items():
    if isinstance(value, list):
      kwargs[key] = tuple(value)
  channels = dataset.image_shape[-1]
  if config.model.name == "small_cnn" or (config.model.name == "fcn" and channels != 3):
    kwargs.setdefault("in_channels", channels)
  if config.model.name == "mlp":
    kwargs.setdefault("in_features", int(np.prod(dataset.image_shape)))
  vocab = getattr(dataset, "vocab_size", None)
  if vocab is not None and config.model.name == "bert_small" and kwargs.get("vocab", 30522) < vocab:
    raise _bad("model.kwargs.vocab", kwargs.get("vocab", 30522),
               f"at least the dataset's vocabulary size {vocab} (token ids past the embedding "
               "table would be clamped)")
  rngs = nnx.Rngs(config.seed, dropout=config.seed + 1, quant=config.seed + 2)
  return models.get_model(config.model.name, num_classes=dataset.num_classes, rngs=rngs, **kwargs)


# -- schedule and optimizer ---------------------------------------------------------------------


def schedule(config: ml_collections.ConfigDict, steps_per_epoch: int,
             train_size: int) -> optax.Schedule:
  """The learning rate as a function of the optax update count (module docstring)."""
  s = config.schedule
  name, lr = s.name, float(config.lr)
  spe = steps_per_epoch
  if name == "constant":
    return optax.constant_schedule(lr)
  if name == "cosine":
    warmup = int(s.get("warmup_steps", 0))
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(config.max_steps, warmup + 1))
  if name == "cosine_epochs":
    epochs = int(s.epochs)
    return lambda c: lr * (1 + jnp.cos(jnp.pi * (c // spe) / epochs)) / 2
  if name == "cpd_resnet18":
    if lr != 1.6:
      raise _bad("lr", lr, "1.6 with schedule 'cpd_resnet18' (the rule's fixed peak)")
    return optim.cpd_resnet18_lr(1, config.batch_size, 1, train_size)
  if name == "piecewise_linear":
    epochs = np.asarray(s.epochs, np.float32)
    values = np.asarray(s.scales, np.float32) * lr
    warmup = int(s.get("warmup_steps", 0))

    def piecewise(c):
      value = jnp.interp(c / spe, epochs, values)
      if warmup:
        value = value * jnp.where(c + 1 <= warmup, (c + 1) / warmup, 1.0)
      return value
    return piecewise
  if name == "warmup_step":
    warm = int(s.warmup_epochs) * spe
    bounds = {int(e) * spe: float(s.get("decay_factor", 0.1)) for e in s.decay_epochs}
    return optim.warmup_step_schedule(lr, warm, bounds, warmup_init=float(s.init_lr))
  if name == "poly":
    return optax.polynomial_schedule(lr, float(s.min_lr), float(s.power), config.max_steps)
  raise _bad("schedule.name", name, f"one of {SCHEDULES}")


def optimizer(config: ml_collections.ConfigDict, lr: optax.Schedule) -> optax.GradientTransformation:
  """torch-style SGD (momentum, Nesterov, decoupled mask for wd_exclude), optax LARS (momentum,
  Nesterov, weight decay masked by wd_exclude; the trust ratio on every parameter), or
  optax.adamw (optimizer="adamw": decoupled weight decay masked by wd_exclude)."""
  mask = None
  if config.wd_exclude:
    pattern = re.compile(config.wd_exclude)
    mask = optim.decay_mask(lambda path: bool(pattern.search(path)))
  if config.use_lars:
    return optim.lars(lr, config.momentum, weight_decay=config.weight_decay,
                      decay_mask=True if mask is None else mask, nesterov=bool(config.nesterov))
  if config.optimizer == "adamw":
    return optax.adamw(lr, b1=float(config.adam_b1), b2=float(config.adam_b2),
                       eps=float(config.adam_eps), weight_decay=float(config.weight_decay),
                       mask=mask)
  return optim.torch_sgd(lr, config.momentum, nesterov=config.nesterov,
                         weight_decay=config.weight_decay, decay_mask=mask)


def grad_sync(config: ml_collections.ConfigDict, num_devices: int | None = None) -> GradSync:
  """The gradient sync: the CPD all-reduce of grad_format, use_aps, aps_mode, use_kahan, ...,
  or, with config.compression.name set, HiPress's compressed sync (compressor built from
  compression.kwargs, topology, min_size, the plan of a SeCoPa plan file, config.seed).

  compression.plan="secopa" plans per model (`plan_sync`, once the model exists); with
  `num_devices` the device count is checked against the seed cost model's here."""
  fmt = grad_format(config)
  aps: bool | str = bool(config.use_aps)
  if aps and config.aps_mode == "cpd":
    aps = "cpd"
  compressed = {}
  codec = compressor(config)
  if codec is not None:
    c = config.compression
    plan = None
    if c.plan == SECOPA:
      if num_devices is not None and num_devices not in secopa.SEED_COEFFICIENTS.nodes:
        raise _bad("compression.plan", c.plan, f"a plan file, or 'secopa' on "
                   f"{secopa.SEED_COEFFICIENTS.nodes} devices (the seed cost model's node counts; "
                   f"this run has {num_devices})")
    elif c.plan and c.plan != AUTOTUNE:  # autotune_sync chooses once the workdir is known
      plan = {e.name: (e.compress, e.partitions) for e in secopa.read_plan(c.plan)}
    compressed = dict(compression=codec, topology=c.topology, min_size=int(c.min_size),
                      plan=plan, seed=int(config.seed))
  return GradSync(fmt=fmt, algorithm=config.grad_algorithm, kahan=bool(config.use_kahan), aps=aps,
                  emulate_nodes=int(config.emulate_nodes), form=config.emulate_form,
                  node_map=config.emulate_node_map,
                  cast_single=(config.emulate_form == "cpd"
                               and config.model.name == CAST_SINGLE_MODEL),
                  **compressed)


def plan_sync(config: ml_collections.ConfigDict, sync: GradSync, params: Any,
              num_devices: int) -> GradSync:
  """`sync` with SeCoPa's plan for gradients shaped like `params` on `num_devices` devices
  (HiPress's seed cost model, `jlp.compression.plan_for_tree`, each partition priced with the
  compressor's own payload size) when config.compression.plan is "secopa"; `sync` itself
  otherwise."""
  if sync.compression is None or config.compression.plan != SECOPA:
    return sync
  plan = secopa.plan_for_tree(params, num_nodes=num_devices, topology=sync.topology,
                              compressor=sync.compression)
  return dataclasses.replace(sync, plan=plan)


#: Where an autotuned run keeps its choice (compression.plan="autotune").
SYNC_PLAN_FILE = "sync_plan.json"


def autotune_sync(config: ml_collections.ConfigDict, sync: GradSync, params: Any, mesh: Any,
                  workdir: str, timer: Any = None) -> GradSync:
  """With compression.plan="autotune", the sync `jlp.sync_tuning.autotune` finds fastest for
  gradients shaped like `params` on `mesh` (ranked by compression.sync_fit when given), written
  with its timings to WORKDIR/sync_plan.json; a later start of the run (a resume) reuses that
  choice without timing again when it was made for the same compressor, devices and gradient
  shapes. `sync` itself otherwise. Prints one line. `timer(syncs, tree) -> [ms]` times the
  candidates (default: each sync alone, `jlp.sync_tuning.time_syncs_ms`; the data-parallel loop
  times them as its train step)."""
  if sync.compression is None or config.compression.plan != AUTOTUNE:
    return sync
  path = os.path.join(workdir, SYNC_PLAN_FILE)
  key = {"compressor": config.compression.name, "min_size": int(sync.min_size),
         "devices": int(mesh.size),
         "cluster": sync_tuning.cluster_key(list(mesh.devices.flat)),
         "gradients": sync_tuning.tree_digest(params)}
  chosen = None
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    if saved.get("key") == key:
      chosen = sync_tuning.Autotuned.from_dict(saved["choice"])
      how = f"reused from {path}"
  if chosen is None:
    fit = None
    if config.compression.sync_fit:
      fit = sync_tuning.SyncFit.load(config.compression.sync_fit,
                                     compressor=config.compression.name, num_nodes=int(mesh.size))
      if fit is None:
        raise _bad("compression.sync_fit", config.compression.sync_fit,
                   f"a fit made for compressor {config.compression.name!r} on {mesh.size} devices")
    start = time.perf_counter()
    chosen = sync_tuning.autotune(params, sync.compression, fit=fit, min_size=sync.min_size,
                                  mesh=mesh, axis=mesh.axis_names[0], seed=sync.seed,
                                  timer=timer)
    how = (f"timed now in {time.perf_counter() - start:.1f} s" if chosen.measured_ms else
           f"from {config.compression.sync_fit}")
    if jax.process_index() == 0:
      replace_file(path, lambda f: json.dump({"key": key, "choice": chosen.to_dict()}, f,
                                             indent=1))
  timings = ", ".join(f"{label} {ms:.1f} ms" for label, ms in chosen.measured_ms.items()) or (
      f"predicted {chosen.plan.predicted_ms:.1f} ms, no other candidate within "
      f"{sync_tuning.DROP_ABOVE:g}x of it: none timed")
  if jax.process_index() == 0:
    print(f"autotune: {chosen.plan.label} ({timings}; {how})", flush=True)
  return chosen.plan.grad_sync(sync.compression, seed=sync.seed)


def diloco(config: ml_collections.ConfigDict, inner: optax.GradientTransformation,
           params: Any = None) -> DiLoCo | None:
  """The run's DiLoCo (config.diloco, None when diloco.period is 0): `inner` (the config's
  optimizer) per replica, torch-style SGD outer optimizer (diloco.outer_optimizer), fragments,
  overlap, alpha, outer_format, average_state, and the gradient-sync fields as its outer_sync
  (None, a float32 mean, at their defaults). With `params`, the fragment count is checked against
  the parameter leaves (ValueError naming diloco.fragments)."""
  d = config.get("diloco")
  if d is None or not d.period:
    return None
  o = d.outer_optimizer
  outer = optim.torch_sgd(float(o.lr), float(o.momentum), nesterov=bool(o.nesterov))
  sync = grad_sync(config)
  plain = GradSync()
  outer_sync = None if (sync.fmt, sync.algorithm, sync.kahan, sync.aps) == (
      plain.fmt, plain.algorithm, plain.kahan, plain.aps) else sync
  out = DiLoCo(inner, outer, int(d.period), fragments=int(d.fragments), overlap=int(d.overlap),
               alpha=float(d.alpha), outer_sync=outer_sync, outer_format=d.outer_format or None,
               average_state=bool(d.average_state))
  if params is not None:
    leaves = len(jax.tree.leaves(params))
    if d.fragments > leaves:
      raise _bad("diloco.fragments", d.fragments,
                 f"at most the model's {leaves} parameter leaves (fragments are whole leaves)")
  return out


# -- loss and evaluation ------------------------------------------------------------------------


def _masked_cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of per-pixel cross-entropies over pixels whose label is not IGNORE_LABEL, their count)."""
  valid = labels != IGNORE_LABEL
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
  return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid).astype(jnp.float32)


def segmentation_loss(model: nnx.Module, batch: dict[str, jax.Array]
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-pixel cross-entropy (label 255 ignored) + 0.4 x the auxiliary head's, as mmseg's FCN;
  aux: {"accuracy": pixel accuracy}."""
  out = model(batch["image"], return_aux=True)
  logits, aux_logits = out if isinstance(out, tuple) else (out, None)
  total, count = _masked_cross_entropy(logits, batch["label"])
  count = jnp.maximum(count, 1.0)
  loss = total / count
  if aux_logits is not None:
    loss = loss + AUX_LOSS_WEIGHT * _masked_cross_entropy(aux_logits, batch["label"])[0] / count
  valid = batch["label"] != IGNORE_LABEL
  correct = jnp.sum(jnp.where(valid, jnp.argmax(logits, -1) == batch["label"], False))
  return loss, {"accuracy": correct / count}


def loss_fn(config: ml_collections.ConfigDict):
  return segmentation_loss if config.task == "segmentation" else cross_entropy_loss


def eval_sums(model: nnx.Module, batch: dict[str, jax.Array], task: str,
              num_classes: int) -> dict[str, jax.Array]:
  """Sums over the valid examples of one (padded) evaluation batch: loss, correct, count and,
  for segmentation, the confusion matrix (true class x predicted class) for the mIoU."""
  logits = model(batch["image"])
  labels, mask = batch["label"], batch["mask"]
  if task == "segmentation":
    valid = (labels != IGNORE_LABEL) & mask[:, None, None]
  else:
    valid = mask
  safe = jnp.where(valid, labels, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
  pred = jnp.argmax(logits, -1)
  out = {"loss": jnp.sum(jnp.where(valid, ce, 0.0)),
         "correct": jnp.sum(jnp.where(valid, pred == labels, False)).astype(jnp.float32),
         "count": jnp.sum(valid).astype(jnp.float32)}
  if task == "segmentation":
    flat = jnp.where(valid, safe * num_classes + pred, num_classes * num_classes).reshape(-1)
    out["confusion"] = jnp.zeros(num_classes * num_classes + 1, jnp.float32).at[flat].add(1.0)[:-1]
  return out


def eval_metrics(sums: dict[str, np.ndarray], task: str, num_classes: int) -> dict[str, float]:
  """eval_loss, eval_accuracy (pixel accuracy for segmentation) and eval_miou from summed counts."""
  count = max(float(sums["count"]), 1.0)
  out = {"eval_loss": float(sums["loss"]) / count, "eval_accuracy": float(sums["correct"]) / count}
  if task == "segmentation":
    conf = np.asarray(sums["confusion"], np.float64).reshape(num_classes, num_classes)
    inter = np.diag(conf)
    union = conf.sum(0) + conf.sum(1) - inter
    present = union > 0
    out["eval_miou"] = float(np.mean(inter[present] / union[present])) if present.any() else 0.0
  return out


def check_batch_sizes(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Batch sizes that split over the devices (and emulated nodes), before anything compiles."""
  nodes = num_devices * config.emulate_nodes
  if config.batch_size % nodes:
    raise _bad("batch_size", config.batch_size,
               f"a multiple of {num_devices} devices x emulate_nodes={config.emulate_nodes} = "
               f"{nodes} ({DEVICE_HINT})")
  if config.eval_batch_size % num_devices:
    raise _bad("eval_batch_size", config.eval_batch_size,
               f"a multiple of {num_devices} devices ({DEVICE_HINT})")


def warn_single_device(config: ml_collections.ConfigDict, num_devices: int) -> str | None:
  """One warning line (printed to stderr, and returned) when a data-parallel run's gradient sync
  needs several devices but the run has one: it then exchanges nothing (wire_bytes 0)."""
  if num_devices > 1 or config.emulate_nodes > 1:
    return None
  what = []
  if config.compression.name != "none":
    what.append(f"compression.name={config.compression.name!r}")
  fmt = grad_format(config)
  if fmt is not None:
    what.append(f"grad_format={config.grad_format!r}")
  if config.use_kahan:
    what.append("use_kahan")
  if not what:
    return None
  line = (f"warning: this run has 1 device, so its gradient sync ({', '.join(what)}) exchanges "
          f"nothing and every step logs wire_bytes 0; {DEVICE_HINT}.")
  print(line, file=sys.stderr, flush=True)
  return line
