"""Comparisons that run several trainings of one config: the APS study of the main job and notebook,
and the gradient-compression study.

`aps_study(config, workdir)` trains `config` once per gradient all-reduce variant (float32, e4m3
and e3m0, each with and without APS; CPD's headline experiment, Han, Demmel, You, "Auto-Precision
Scaling for Distributed Deep Learning", arXiv:1911.08907) in `workdir/<variant>`, and returns one
row per run with the final test accuracy, its gap to float32 and the final train loss;
`render_table` prints them and `jlp.plots.plot_runs` draws the curves.

`compression_study(config, workdir)` trains `config` once with a float32 all-reduce and once per
compressor x CaSync topology (HiPress, Bai et al., SOSP 2021; hipress.md §1-§2) in
`workdir/<compressor>_<topology>`; its rows add the mean bytes one device sends per step for the
gradient sync (the runner's `wire_bytes` metric) and their ratio to float32's;
`render_compression_table` prints them. The float32 run uses the ring all-reduce by default
(2(W-1)/W x 4 bytes per float, the bandwidth-optimal all-reduce of NCCL and of HiPress's "Ring"
baseline); CPD's sequential all-reduce gathers every gradient, (W-1) x 4 bytes per float.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

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


#: HiPress's five compressors (hipress.md §1), in the paper's order.
HIPRESS_COMPRESSORS = ("onebit", "tbq", "terngrad", "dgc", "graddrop")
CASYNC_TOPOLOGIES = ("ps", "ring")
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
                      topologies: Sequence[str] = CASYNC_TOPOLOGIES, *,
                      baseline_algorithm: str = "ring", fresh: bool = True,
                      progress: bool | None = False) -> list[dict[str, Any]]:
  """Trains `config` with a float32 all-reduce, then once per compressor x topology; rows of
  final metrics (module docstring).

  compressors: names of jlp.compression compressors (with their default fields), or
    (name, {field: value}) pairs. The rest of config.compression (min_size) is kept.
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
    cfg.compression.name = name
    cfg.compression.kwargs = ml_collections.ConfigDict(kwargs)
    if name == "dgc" and kwargs.get("momentum", 0.9) > 0:
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
