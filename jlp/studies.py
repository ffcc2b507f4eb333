"""Comparisons that run several trainings of one config: the APS study of the main job and notebook.

`aps_study(config, workdir)` trains `config` once per gradient all-reduce variant (float32, e4m3
and e3m0, each with and without APS; CPD's headline experiment, Han, Demmel, You, "Auto-Precision
Scaling for Distributed Deep Learning", arXiv:1911.08907) in `workdir/<variant>`, and returns one
row per run with the final test accuracy, its gap to float32 and the final train loss;
`render_table` prints them and `jlp.plots.plot_runs` draws the curves.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence

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
