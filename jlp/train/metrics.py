"""Metrics of a training run: `metrics.jsonl` (one JSON object per logged step) and TensorBoard.

Every row has `step` and `time` (wall-clock Unix seconds when the step finished) plus the scalars
the loop logged (train_loss, learning_rate, throughput, eval metrics, zero-setting errors, chosen
precisions). Floats are written with Python's shortest round-trip repr, so a value read back is the
float32 value logged, bit for bit: that is what makes "a resumed run's metrics equal the
uninterrupted run's" checkable on the file.

Resuming at step s drops the rows after s (the interrupted run logged them after its last
checkpoint; the resumed run writes them again), in metrics.jsonl (rewritten through a temporary
file and a rename, so a crash meanwhile loses nothing) and in TensorBoard (`purge_step`).
TensorBoard files come from tensorboardX (no TensorFlow dependency).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _scalar(name: str, value: Any) -> float | int | str:
  if isinstance(value, str):
    return value
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric {name!r} has shape {arr.shape}; expected a scalar.")
  v = arr.reshape(()).item()
  return v if isinstance(v, (int, bool)) else float(v)


def replace_file(path: str, write: Callable[[IO[str]], Any],
                 opener: Callable[..., IO[str]] = open) -> None:
  """Writes `path` with write(f) through a temporary file, flushed to disk, and a rename: a crash
  leaves the old file whole. `opener` (e.g. gzip.open) opens the temporary file for text."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with opener(tmp, "wt") as f:
    write(f)
    f.flush()
  with open(tmp, "rb") as f:
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The rows of `workdir/metrics.jsonl` (an empty list when there is none)."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
  """Writes metrics.jsonl and TensorBoard event files for one run (only on process 0).

  Args:
    workdir: the run's directory.
    resume_step: the step the run restarted from (None for a fresh run): rows with a larger step
      are removed from metrics.jsonl and purged from TensorBoard.
    enabled: False on every process but the first of a multi-process run.
    tensorboard: also write TensorBoard event files under `workdir/tensorboard`.
  """

  def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool = True,
               tensorboard: bool = True):
    self.path = os.path.join(workdir, METRICS_FILE)
    self.enabled = enabled
    self._note: dict[str, Any] = {}
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if resume_step is None:
      rows = []
    else:
      rows = [r for r in read_metrics(workdir) if r["step"] <= resume_step]
    # Through a temporary file and a rename: a crash while rewriting keeps every earlier row.
    replace_file(self.path, lambda f: f.writelines(json.dumps(r) + "\n" for r in rows))
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      purge = None if resume_step is None else resume_step + 1
      # A distinct suffix: event file names carry only the second and the host, so a resumed run
      # started within the same second would otherwise overwrite the earlier file.
      self._tb = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR), purge_step=purge,
                               filename_suffix=f".{os.getpid()}.{time.time_ns()}")

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Appends one row (step, time, metrics); returns it. Non-finite floats are written as null."""
    row: dict[str, Any] = {"step": int(step), "time": time.time()}
    metrics = {**metrics, **self._note}
    self._note = {}
    for name, value in metrics.items():
      row[name] = _scalar(name, value)
    if not self.enabled:
      return row
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    with open(self.path, "a") as f:
      f.write(json.dumps(clean) + "\n")
    if self._tb is not None:
      for name, value in row.items():
        # Non-finite values are null in metrics.jsonl and left out here (tensorboardX warns).
        if name not in ("step", "time") and isinstance(value, (int, float)) and \
            math.isfinite(value):
          self._tb.add_scalar(name, value, global_step=int(step), walltime=row["time"])
    return row

  def note(self, **fields: Any) -> None:
    """Adds `fields` (e.g. a string) to the next row written."""
    self._note.update(fields)

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None
