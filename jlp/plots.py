"""Figures people look at: training curves of several runs, quantization error against value.

`plot_runs` reads each run's `metrics.jsonl` (jlp.train.metrics) and draws loss and accuracy
against step, one line per run, like CPD's `draw_curve.py`, or against another logged x value
(`x="virtual_time"`: time-to-accuracy in the virtual seconds of a pipelined run,
docs/sdpipe.md#virtual-time);
`plot_quantization_error` draws the relative error of `jlp.quantize` over a log-spaced range of
values for several formats (the notebook's formats explorer); `plot_accuracy_vs_bytes` draws the compression study's rows
(jlp.studies.compression_study): test accuracy against bytes sent per step. Each returns the
matplotlib Figure and optionally saves it. `plot_schedule` draws a pipeline schedule's table
(`jlp.pipeline.Schedule`: devices x ticks, cells coloured by F / I / W / B) into an Axes and
returns the Axes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from jlp.train.metrics import read_metrics

#: (metric in metrics.jsonl, axis title) drawn by `plot_runs`, where present.
CURVES = (("train_loss", "train loss"), ("eval_loss", "eval loss"),
          ("eval_accuracy", "eval accuracy"))
#: x axes of `plot_runs`: metrics.jsonl field -> axis label.
X_AXES = {"step": "step", "epoch": "epoch", "virtual_time": "virtual seconds"}


def plot_runs(workdirs: Sequence[str], out: str | None = None,
              labels: Sequence[str] | None = None, x: str = "step"):
  """Loss and accuracy against `x` (a key of X_AXES: "step", "epoch" or "virtual_time") for each
  run directory, one panel per metric; rows without the x value are skipped. Evaluation metrics
  are drawn at the row's `eval_<x>` where it has one (`eval_virtual_time`, the virtual second of
  the evaluated weights: docs/sdpipe.md#virtual-time).

  Raises:
    FileNotFoundError: a directory without metrics.jsonl (or with no rows).
    ValueError: an unknown x, or a run none of whose rows has it (e.g. virtual_time of a run that
      was not pipelined).
  """
  if labels is not None and len(labels) != len(workdirs):
    raise ValueError(f"labels has {len(labels)} entries; expected one per run ({len(workdirs)}).")
  if x not in X_AXES:
    raise ValueError(f"x={x!r} is not allowed; expected one of {sorted(X_AXES)}.")
  runs = []
  for d in workdirs:
    rows = read_metrics(d)
    if not rows:
      raise FileNotFoundError(f"{d!r} holds no metrics.jsonl rows; expected a jlp run directory "
                              "(python -m experiments.train --workdir=DIR ...).")
    if not any(r.get(x) is not None for r in rows):
      raise ValueError(f"x={x!r} is not allowed for {d!r}: none of its rows has {x!r} (virtual "
                       "time is logged by pipelined runs, config.pipeline.schedule).")
    runs.append(rows)
  names = list(labels) if labels is not None else [os.path.basename(os.path.normpath(d)) for d in workdirs]
  present = [(k, t) for k, t in CURVES if any(k in r for rows in runs for r in rows)]
  fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.8), squeeze=False)
  for ax, (key, title) in zip(axes[0], present):
    for name, rows in zip(names, runs):
      pts = [(_x_of(r, key, x), r[key]) for r in rows
             if r.get(key) is not None and _x_of(r, key, x) is not None]
      if pts:
        xs, values = zip(*pts)
        ax.plot(xs, values, label=name, marker="." if len(pts) < 30 else None)
    ax.set_xlabel(X_AXES[x])
    ax.set_title(title)
    if key.endswith("loss"):
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize="small")
  fig.tight_layout()
  if out:
    fig.savefig(out, dpi=120)
  return fig


def _x_of(row: dict, key: str, x: str):
  """The x of `row`'s `key`: an evaluation's own `eval_<x>` where the row has one (the pipelined
  loop joins an evaluation to a row written up to a call later, `eval_virtual_time`)."""
  if key.startswith("eval_") and row.get(f"eval_{x}") is not None:
    return row[f"eval_{x}"]
  return row.get(x)


def plot_quantization_error(formats: Sequence, lo: float = 2.0 ** -20, hi: float = 2.0 ** 20,
                            n: int = 4096, out: str | None = None):
  """|q(x) - x| / x for x log-spaced in [lo, hi], one line per FloatFormat.

  Overflow (q(x) = inf) and flush to zero (q(x) = 0, relative error 1) show as the right and
  left walls of each curve.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jlp.quantize import quantize  # pylint: disable=g-import-not-at-top
  x = np.geomspace(lo, hi, n).astype(np.float32)
  fig, ax = plt.subplots(figsize=(7, 4))
  for fmt in formats:
    q = np.asarray(quantize(jnp.asarray(x), fmt), np.float64)
    err = np.where(np.isfinite(q), np.abs(q - x) / x, np.nan)
    ax.plot(x, np.maximum(err, 2.0 ** -30), label=getattr(fmt, "name", str(fmt)))
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("x")
  ax.set_ylabel("relative error |q(x) - x| / x")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  if out:
    fig.savefig(out, dpi=120)
  return fig


def plot_accuracy_vs_bytes(rows: Sequence[dict], out: str | None = None):
  """Test accuracy against the bytes one device sends per step (log scale), one point per row of
  `jlp.studies.compression_study`: a marker per topology, a colour per compressor setting."""
  fig, ax = plt.subplots(figsize=(7, 4.2))
  markers = {"ps": "o", "ring": "s"}
  colours = {}
  for r in rows:
    name = r.get("label", r["compressor"])
    colour = colours.setdefault(name, f"C{len(colours)}")
    baseline = r["compressor"] == "none"
    label = f"{'float32' if baseline else name} / {r['topology']}"
    marker = "*" if baseline else markers.get(r["topology"], "^")
    ax.scatter(r["wire_bytes"], 100 * r["test_accuracy"], color=colour, label=label,
               marker=marker, s=90 if baseline else 45)
  ax.set_xscale("log")
  ax.set_xlabel("bytes sent per device per step (gradient sync)")
  ax.set_ylabel("test accuracy %")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="x-small", ncol=2)
  fig.tight_layout()
  if out:
    fig.savefig(out, dpi=120)
  return fig


#: Face colour of a schedule cell by action kind (`plot_schedule`).
SCHEDULE_COLOURS = {"F": "#4c72b0", "B": "#c44e52", "I": "#dd8452", "W": "#55a868"}
SCHEDULE_KINDS = {"F": "forward (F)", "B": "full backward (B)", "I": "input gradient (I)",
                  "W": "weight gradient (W)"}


def plot_schedule(schedule, ax=None, title: str | None = None):
  """Draws `schedule` (a `jlp.pipeline.Schedule`) as a table: ticks along x, devices along y
  (device 0 on top), one unit cell per tick, coloured by the action's kind (SCHEDULE_COLOURS: F
  blue, B red, I orange, W green; idle white) with its micro-batch number written in it. A device
  holding several stages (v > 1) marks its later chunks' cells with hatching (stage i's chunk:
  its rank among the device's stages). An overlapped F+B pair (torch's OVERLAP_F_B) fills the
  cell's upper half with its F and the lower half with its B, framed in black. Every cell's
  patch carries the action as its label (`str(action)`, e.g. "0F3", "7W0"). Returns the Axes
  (a new figure where `ax` is None)."""
  from matplotlib.patches import Patch, Rectangle  # pylint: disable=g-import-not-at-top
  if ax is None:
    _, ax = plt.subplots(figsize=(max(6.0, 0.28 * schedule.num_ticks + 1.5),
                                  0.5 * schedule.num_devices + 1.2))
  chunk = {}
  for d in range(schedule.num_devices):
    mine = [s for s, dev in enumerate(schedule.placement) if dev == d]
    chunk.update({s: i for i, s in enumerate(mine)})
  kinds = set()

  def cell(action, t, y, height):
    kinds.add(action.kind)
    ax.add_patch(Rectangle((t, y), 1, height, facecolor=SCHEDULE_COLOURS[action.kind],
                           edgecolor="white", linewidth=0.5, label=str(action),
                           hatch="//" if chunk[action.stage] else None))
    ax.text(t + 0.5, y + height / 2, str(action.microbatch), ha="center", va="center",
            color="white", fontsize=7 if height == 1 else 5)

  for d, row in enumerate(schedule.ticks):
    for t, item in enumerate(row):
      if item is None:
        continue
      if len(item.leaves) == 1:
        cell(item, t, d, 1.0)
      else:  # an Overlap: F on top, B below, one frame
        cell(item.forward, t, d, 0.5)
        cell(item.backward, t, d + 0.5, 0.5)
        ax.add_patch(Rectangle((t, d), 1, 1, fill=False, edgecolor="black", linewidth=1.2,
                               label=str(item)))
  ax.set_xlim(0, schedule.num_ticks)
  ax.set_ylim(schedule.num_devices, 0)
  ax.set_yticks(np.arange(schedule.num_devices) + 0.5,
                [f"device {d}" for d in range(schedule.num_devices)])
  ax.set_xlabel("tick")
  handles = [Patch(facecolor=SCHEDULE_COLOURS[k], label=SCHEDULE_KINDS[k])
             for k in "FBIW" if k in kinds]
  if any(chunk.values()):
    handles.append(Patch(facecolor="grey", hatch="//", label="later chunk"))
  if any(item is not None and len(item.leaves) == 2 for row in schedule.ticks for item in row):
    handles.append(Patch(facecolor="none", edgecolor="black", label="overlapped F+B"))
  ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="x-small",
            frameon=False)
  if title is not None:
    ax.set_title(title)
  return ax
