"""A run directory's record of its config: what `experiments.train` checks before it resumes.

Every checkpoint's meta holds the config it was written under and the device layout it ran on
(`device_layout`: devices and processes). `config.json` holds the config of the latest start (the
one the newest metrics rows were written under) and `config_history.json` the changes made on
resume, as a list of ``{"step": resumed step, "time": unix seconds, "changes": {field: [old,
new]}}``; both are written by process 0 only.

On resume (`check_resume`), the new config and this machine's device layout are compared with
those of the checkpoint the run resumes from (`config.json` only for a checkpoint written before
its meta held the config). Fields that only set the loop's cadence or end (`CADENCE_FIELDS`) may
change freely, except `max_steps` under a schedule whose horizon it is (`HORIZON_SCHEDULES`: the
learning rate of every later step moves); any other difference changes the training, so the run
stops before anything is written (`ConfigChangedError`, exit 2 in `experiments.train`) unless
`allow_change` is set, in which case the change is recorded in the history and in the first
metrics row after the resume (`config_change`). A resume from step s drops the history entries of
earlier resumes from s or later (their work after s was lost with the rows after s), so a resume
that crashed before its first checkpoint leaves no trace but the new one. A changed device count
cannot resume a run whose state is per device (a compressed sync's error feedback, DiLoCo's
replicas) or per pipeline, even when allowed; nor can a change of the layout of DiLoCo's state
(diloco.period switched between 0 and > 0, diloco.fragments, diloco.outer_optimizer.momentum
switched between 0 and > 0). The other diloco fields are training changes like any other.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from jlp.train.metrics import replace_file

__all__ = ["CADENCE_FIELDS", "HORIZON_SCHEDULES", "ConfigChangedError", "check_data",
           "check_resume", "config_changes", "describe", "device_layout", "record_config",
           "record_data"]

CONFIG_FILE = "config.json"
HISTORY_FILE = "config_history.json"
#: The data sets' file lists (Dataset.manifest) at the first start, by split.
DATA_FILE = "data_files.json.gz"
#: Fields that change when and how long the run trains, logs, evaluates and checkpoints, not
#: what a step computes (pipeline.batches_per_call is a performance knob: bit-identical runs).
CADENCE_FIELDS = ("max_steps", "log_every", "eval_every", "checkpoint_every", "stop_at_accuracy",
                  "pipeline.batches_per_call", "dataset.verify", "dataset.worker_processes")
#: Learning-rate schedules (config.schedule.name, jlp.train.recipe) that decay over max_steps:
#: under them max_steps changes the training.
HORIZON_SCHEDULES = ("cosine", "poly")
#: The pseudo-field naming a changed device layout in a change list.
DEVICES = "devices"


class ConfigChangedError(ValueError):
  """The config differs from the one that wrote the workdir's checkpoints."""


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(_flat(value, f"{prefix}{key}."))
    if not tree and prefix:
      out[prefix[:-1]] = {}
    return out
  return {prefix[:-1]: tree}


def _json(config: ml_collections.ConfigDict) -> dict[str, Any]:
  return json.loads(config.to_json_best_effort())


def device_layout() -> dict[str, int]:
  """{"devices": jax.device_count(), "processes": jax.process_count()}: what a checkpoint's meta
  records of the machines it ran on."""
  return {"devices": jax.device_count(), "processes": jax.process_count()}


def config_changes(saved: dict[str, Any], config: ml_collections.ConfigDict,
                   defaults: ml_collections.ConfigDict | None = None) -> dict[str, tuple]:
  """{field: (old, new)} for every training field that differs (max_steps too when either
  config's schedule is a HORIZON_SCHEDULES one). A field the saved config lacks (written by an
  older jlp) counts as unchanged when the new value is its default."""
  new = _flat(_json(config))
  old = _flat(saved)
  base = _flat(_json(defaults)) if defaults is not None else {}
  horizon = {old.get("schedule.name"), new.get("schedule.name")} & set(HORIZON_SCHEDULES)
  changes = {}
  for key in sorted(set(new) | set(old)):
    if key in CADENCE_FIELDS and not (key == "max_steps" and horizon):
      continue
    if key not in old and key in base and base[key] == new.get(key):
      continue
    if old.get(key, "<absent>") != new.get(key, "<absent>"):
      changes[key] = (old.get(key, "<absent>"), new.get(key, "<absent>"))
  return changes


def saved_config(workdir: str) -> dict[str, Any] | None:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _layout_changes(meta: dict[str, Any]) -> dict[str, tuple]:
  saved = meta.get("devices")
  if not isinstance(saved, dict):  # a checkpoint written before its meta held the layout
    return {}
  now = device_layout()
  changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
  if not changed:
    return {}
  describe_layout = lambda i: ", ".join(f"{changed[k][i]} {k}" for k in changed)
  return {DEVICES: (describe_layout(0), describe_layout(1))}


def check_resume(config: ml_collections.ConfigDict, workdir: str, meta: dict[str, Any], *,
                 allow_change: bool) -> dict[str, tuple]:
  """The changes of `config` and of the device layout against the checkpoint the run resumes
  from (`meta`, its meta; config.json when the meta holds no config); raises ConfigChangedError,
  one line naming each change, when there are some and not `allow_change`, or when the device
  layout changed under a per-device state."""
  from jlp.data import dataset_options  # pylint: disable=g-import-not-at-top
  from jlp.train.config import base_config  # pylint: disable=g-import-not-at-top
  saved = meta.get("config") or saved_config(workdir)
  defaults = base_config()
  try:  # a run recorded before every option was listed in the config
    defaults.dataset.kwargs = dataset_options(config.dataset.name)
  except ValueError:
    pass
  changes = config_changes(saved, config, defaults) if saved is not None else {}
  changes.update(_layout_changes(meta))
  if DEVICES in changes:
    per_device = ("the compressed sync's per-device error-feedback state"
                  if config.compression.name != "none" else
                  "DiLoCo's per-replica parameters and optimizer states"
                  if _diloco_on(config.get("diloco")) else
                  "the per-pipeline state of a pipelined run"
                  if config.pipeline.schedule != "none" else None)
    if per_device is not None:
      old, new = changes[DEVICES]
      raise ConfigChangedError(
          f"the run in {workdir} ran on {old} and this one has {new}: {per_device} cannot move "
          "to another device count; expected the same devices (--cpu_devices on a CPU machine, "
          "the same --hosts under the cluster launcher), or a new --workdir.")
  state_changes = _diloco_state_changes(changes)
  if state_changes:
    listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in state_changes.items())
    raise ConfigChangedError(
        f"the config changes the shape of the checkpointed state of the run in {workdir}: "
        f"{listed} (DiLoCo's per-replica state and outer optimizer state are laid out by "
        "diloco.period > 0, diloco.fragments and diloco.outer_optimizer.momentum > 0); expected "
        "the checkpoint's values, or a new --workdir (--allow_config_change cannot carry the "
        "state over).")
  if changes and not allow_change:
    listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    why = ""
    if "max_steps" in changes:
      why = (f" (schedule {config.schedule.name!r} decays the learning rate over max_steps, so "
             "a new max_steps changes every later step's)")
    if DEVICES in changes:
      why += " (each device's batch share, and so BatchNorm's statistics, change with the count)"
    raise ConfigChangedError(
        f"the config changes the training of the run in {workdir}: {listed}{why}; expected the "
        "checkpoint's config and devices (only max_steps, log_every, eval_every, "
        "checkpoint_every, stop_at_accuracy, pipeline.batches_per_call, dataset.verify and "
        "dataset.worker_processes may change, "
        f"max_steps not under a {' or '.join(HORIZON_SCHEDULES)} schedule): use a new --workdir, "
        "or --allow_config_change to continue this run under the new config (recorded in its "
        "metrics and config_history.json).")
  return changes


def _diloco_on(diloco: Any) -> bool:
  return bool(diloco is not None and diloco.get("period", 0))


def _diloco_state_changes(changes: dict[str, tuple]) -> dict[str, tuple]:
  """The changes among `changes` that change the layout of DiLoCo's checkpointed state: DiLoCo
  switched on or off, another fragment count, outer momentum switched on or off."""
  def on(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
  out = {}
  for key, (old, new) in changes.items():
    if key in ("diloco.period", "diloco.outer_optimizer.momentum"):
      absent = {"diloco.period": 0, "diloco.outer_optimizer.momentum": 0.9}[key]
      old_v = absent if old == "<absent>" else old
      if on(old_v) != on(new):
        out[key] = (old, new)
    elif key == "diloco.fragments":
      out[key] = (old, new)
  return out  # (with diloco.period 0 the other diloco fields keep their defaults: validate)


def record_config(config: ml_collections.ConfigDict, workdir: str, step: int,
                  changes: dict[str, tuple]) -> None:
  """On process 0: writes config.json, and records `changes` (made when resuming at `step`) in
  the history after dropping the entries of earlier resumes at `step` or later."""
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  replace_file(os.path.join(workdir, CONFIG_FILE),
               lambda f: f.write(config.to_json_best_effort(indent=2)))
  path = os.path.join(workdir, HISTORY_FILE)
  history = []
  if os.path.exists(path):
    with open(path) as f:
      history = json.load(f)
  kept = [h for h in history if h["step"] < step]
  if changes:
    kept.append({"step": step, "time": time.time(),
                 "changes": {k: list(v) for k, v in changes.items()}})
  if not kept:
    if os.path.exists(path):
      os.remove(path)
  elif kept != history:
    replace_file(path, lambda f: json.dump(kept, f, indent=1))


def _files_change(old: list[str], new: list[str]) -> str:
  old_set, new_set = set(old), set(new)
  removed = [f for f in old if f not in new_set]
  added = [f for f in new if f not in old_set]
  parts = []
  for what, files in (("removed", removed), ("added", added)):
    if files:
      more = ", ..." if len(files) > 3 else ""
      parts.append(f"{len(files)} {what} ({', '.join(files[:3])}{more})")
  if not parts:
    parts.append("the same files in another order (the batches change)"
                 if sorted(old) == sorted(new) else "entries edited")
  return "; ".join(parts)


def check_data(workdir: str, manifests: Mapping[str, list[str] | None], *, resuming: bool,
               allow_change: bool) -> dict[str, tuple]:
  """The changes of the data sets' file lists (`manifests`, by split: Dataset.manifest()) against
  those recorded when the run started (DATA_FILE; nothing to compare for a fresh run or one
  started before the record existed): {"dataset files (split)": (old count, new count and what
  changed)}; raises ConfigChangedError, one line naming the files, when there are some and not
  `allow_change` (every batch is a function of the file list)."""
  path = os.path.join(workdir, DATA_FILE)
  if not resuming or not os.path.exists(path):
    return {}
  with gzip.open(path, "rt") as f:
    recorded = json.load(f)
  changes = {}
  for split, files in manifests.items():
    old = recorded.get(split)
    if old is not None and files is not None and old != files:
      changes[f"dataset files ({split})"] = (f"{len(old)} files",
                                             f"{len(files)} files: {_files_change(old, files)}")
  if changes and not allow_change:
    listed = "; ".join(f"{k}: {new}" for k, (_, new) in changes.items())
    raise ConfigChangedError(
        f"the data set's files changed since the run in {workdir} started: {listed}; every "
        "batch is a function of the file list, so the resumed run would train on other data: "
        "restore the files, use a new --workdir, or --allow_config_change to continue on the new "
        "files (recorded in its metrics and config_history.json).")
  return changes


def record_data(workdir: str, manifests: Mapping[str, list[str] | None], *,
                replace: bool) -> None:
  """On process 0: writes the data sets' file lists (DATA_FILE), when there are any, if there is
  no record yet or `replace` (a fresh start, or a resume that allowed a change of files)."""
  kept = {split: files for split, files in manifests.items() if files is not None}
  path = os.path.join(workdir, DATA_FILE)
  if jax.process_index() != 0 or not kept or (os.path.exists(path) and not replace):
    return
  os.makedirs(workdir, exist_ok=True)
  replace_file(path, lambda f: json.dump(kept, f), opener=gzip.open)


def describe(changes: dict[str, tuple]) -> str:
  """One line for the metrics row: "field: old -> new; ..."."""
  return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
