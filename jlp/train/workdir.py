"""A run directory's record of its config: what `experiments.train` checks before it resumes.

`config.json` always holds the config of the run that wrote the directory's checkpoints, and
`config_history.json` the changes made to it on resume, as a list of
``{"step": resumed step, "time": unix seconds, "changes": {field: [old, new]}}``.

On resume (`check_resume`), the new config is compared with `config.json`. Fields that only set
the loop's cadence or end (`CADENCE_FIELDS`) may change freely; any other difference changes the
training, so the run stops before anything is written (`ConfigChangedError`, exit 2 in
`experiments.train`) unless `allow_change` is set, in which case the change is recorded in the
history and in the first metrics row after the resume (`config_change`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ml_collections

__all__ = ["CADENCE_FIELDS", "ConfigChangedError", "check_resume", "config_changes",
           "record_config"]

CONFIG_FILE = "config.json"
HISTORY_FILE = "config_history.json"
#: Fields that change when and how long the run trains, logs, evaluates and checkpoints, not
#: what a step computes (pipeline.batches_per_call is a performance knob: bit-identical runs).
CADENCE_FIELDS = ("max_steps", "log_every", "eval_every", "checkpoint_every", "stop_at_accuracy",
                  "pipeline.batches_per_call")


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


def config_changes(saved: dict[str, Any], config: ml_collections.ConfigDict,
                   defaults: ml_collections.ConfigDict | None = None) -> dict[str, tuple]:
  """{field: (old, new)} for every training field that differs. A field the saved config lacks
  (written by an older jlp) counts as unchanged when the new value is its default."""
  new = _flat(_json(config))
  old = _flat(saved)
  base = _flat(_json(defaults)) if defaults is not None else {}
  changes = {}
  for key in sorted(set(new) | set(old)):
    if key in CADENCE_FIELDS:
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


def check_resume(config: ml_collections.ConfigDict, workdir: str, *,
                 allow_change: bool) -> dict[str, tuple]:
  """The changes of `config` against the workdir's config.json (none without one); raises
  ConfigChangedError, one line naming each change, when there are some and not `allow_change`."""
  from jlp.train.config import base_config  # pylint: disable=g-import-not-at-top
  saved = saved_config(workdir)
  if saved is None:
    return {}
  changes = config_changes(saved, config, base_config())
  if changes and not allow_change:
    listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    raise ConfigChangedError(
        f"the config changes the training of the run in {workdir}: {listed}; expected the "
        "saved config (only max_steps, log_every, eval_every, checkpoint_every, "
        "stop_at_accuracy and pipeline.batches_per_call may change): use a new --workdir, or "
        "--allow_config_change to continue this run under the new config (recorded in its "
        "metrics and config_history.json).")
  return changes


def record_config(config: ml_collections.ConfigDict, workdir: str, step: int,
                  changes: dict[str, tuple]) -> None:
  """Writes config.json, and appends `changes` (made when resuming at `step`) to the history."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  if not changes:
    return
  path = os.path.join(workdir, HISTORY_FILE)
  history = []
  if os.path.exists(path):
    with open(path) as f:
      history = json.load(f)
  history.append({"step": step, "time": time.time(),
                  "changes": {k: list(v) for k, v in changes.items()}})
  with open(path, "w") as f:
    json.dump(history, f, indent=1)


def describe(changes: dict[str, tuple]) -> str:
  """One line for the metrics row: "field: old -> new; ..."."""
  return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
