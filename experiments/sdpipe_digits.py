r"""SD-PIPE's synchronisations on digits in virtual time: AllReduce, PReduce, AD-PSGD, HetPipe.

  python -m experiments.sdpipe_digits [--workdir=out/sdpipe_digits] [--num_batches=240]
  python -m experiments.sdpipe_digits --quick        # a few updates: the tests' smoke run

Trains the digits CNN (`jlp.models.small_cnn`, cut by `jlp.pipeline.split_model`) with
SD-PIPE's 1F1B schedule and weight stashing on 8 emulated devices, once per sync across the
pipelines (AllReduce, PReduce, AD-PSGD, HetPipe; docs/sdpipe.md) and per stall length
h in {0, 0.1, 0.3} s (the seed's `--hetero h`: every op stalls h with probability 0.1), in
two layouts: 2 pipelines x 4 stages (the issue's) and 4 pipelines x 2 stages (more pipelines, so
that partial groups have room). Every run starts from the same model and sees the same
mini-batches; speed lives in virtual time (`jlp.pipeline.simulate`), evaluated after every
`Pipeline.run` call. Prints, per layout, a markdown table (virtual seconds to 90% test
accuracy, final accuracy, PReduce's mean group size, wall seconds) and the seed paper's reported
direction beside what this run measured, and writes WORKDIR/time_to_target.png (virtual
seconds to the target per sync and h) and WORKDIR/accuracy_vs_virtual_time.png.
(`jlp.studies.pipeline_study` runs one layout.) With 2 pipelines AD-PSGD's only matching is the
pair itself: both block as for AllReduce, so the two take the same virtual time.
"""

import os

from absl import flags, logging

from jlp.train import cli

#: (pipelines, stages) of the default mode; the quick mode runs the first.
LAYOUTS = ((2, 4), (4, 2))
#: Updates and updates per `run` call (one evaluation each) in quick mode.
QUICK_BATCHES, QUICK_BATCHES_PER_RUN = 24, 12
QUICK_HETEROS = (0.0, 0.3)

#: What the seed paper reports, in words only: its evaluation numbers were not retrievable.
PAPER_DIRECTION = (
    "Seed paper (SD-PIPE, Miao et al., PVLDB 16(9) 2023): PReduce ahead of AllReduce, AD-PSGD "
    "and HetPipe in time to accuracy under heterogeneity. Direction only: the paper's evaluation "
    "numbers could not be retrieved (only its abstract and appendix), so none are quoted.")


def define_flags() -> None:
  """The command-line flags, defined only when this runs as a program: the tests import this
  module beside the other experiments, which define flags of the same names."""
  flags.DEFINE_string("workdir", "out/sdpipe_digits", "Where the plots go.")
  flags.DEFINE_integer("num_batches", None, "Override the updates per run.")
  flags.DEFINE_bool("quick", False,
                    f"Smoke run: one layout, h in {QUICK_HETEROS}, {QUICK_BATCHES} updates.")


def study_settings(num_pipelines: int, num_stages: int, num_batches: int | None = None,
                   quick: bool = False):
  """The study's settings for one layout: `jlp.studies.PipelineStudy`'s defaults with the global
  mini-batch of 64 rows split over the pipelines; `quick`: QUICK_BATCHES updates."""
  from jlp import studies  # pylint: disable=g-import-not-at-top
  fields = dict(num_pipelines=num_pipelines, num_stages=num_stages,
                batch_per_pipeline=64 // num_pipelines)
  if quick:
    fields.update(num_batches=QUICK_BATCHES, batches_per_run=QUICK_BATCHES_PER_RUN)
  if num_batches is not None:
    fields["num_batches"] = num_batches
  return studies.PipelineStudy(**fields)


def compare(rows) -> list[str]:
  """Per h > 0: PReduce's virtual time to target against each other sync's (ratio < 1: PReduce
  ahead), and whether that is the seed's direction."""
  lines = []
  for h in sorted({r["hetero"] for r in rows if r["hetero"] > 0}):
    at = {r["sync"]: r["virtual_s_to_target"] for r in rows if r["hetero"] == h}
    mine = at.get("preduce")
    if mine is None:
      lines.append(f"  h={h:g}: PReduce did not reach the target" if "preduce" in at else
                   f"  h={h:g}: no PReduce run")
      continue
    parts = []
    for sync in ("allreduce", "adpsgd", "hetpipe"):
      if sync in at:
        other = at[sync]
        parts.append(f"vs {sync} " + ("(not reached)" if other is None else
                                      f"{mine / other:.2f}x" + (" ahead" if mine < other else
                                                                " not ahead")))
    lines.append(f"  h={h:g}: PReduce " + ", ".join(parts))
  return lines


def plot(rows_by_layout, workdir: str) -> tuple[str, str]:
  """Writes the two figures (module docstring); returns their paths."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  os.makedirs(workdir, exist_ok=True)
  layouts = list(rows_by_layout)
  fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4), squeeze=False)
  for ax, layout in zip(axes[0], layouts):
    rows = rows_by_layout[layout]
    syncs = list(dict.fromkeys(r["sync"] for r in rows))
    heteros = list(dict.fromkeys(r["hetero"] for r in rows))
    width = 0.8 / len(syncs)
    for k, sync in enumerate(syncs):
      values = [next((r["virtual_s_to_target"] for r in rows
                      if r["sync"] == sync and r["hetero"] == h), None) for h in heteros]
      x = np.arange(len(heteros)) + (k - (len(syncs) - 1) / 2) * width
      ax.bar(x, [np.nan if v is None else v for v in values], width, label=sync)
    ax.set_xticks(np.arange(len(heteros)), [f"h = {h:g} s" for h in heteros])
    ax.set_ylabel("virtual seconds to target")
    ax.set_title(f"{layout[0]} pipelines x {layout[1]} stages")
    ax.grid(alpha=0.3, axis="y")
  axes[0][0].legend(fontsize="small")
  fig.tight_layout()
  bars = os.path.join(workdir, "time_to_target.png")
  fig.savefig(bars, dpi=120)
  plt.close(fig)

  heteros = list(dict.fromkeys(r["hetero"] for rows in rows_by_layout.values() for r in rows))
  fig, axes = plt.subplots(len(layouts), len(heteros), figsize=(4.5 * len(heteros),
                                                                3.5 * len(layouts)),
                           squeeze=False)
  for row_axes, layout in zip(axes, layouts):
    for ax, h in zip(row_axes, heteros):
      for r in rows_by_layout[layout]:
        if r["hetero"] == h:
          curve = np.asarray(r["curve"])
          ax.plot(curve[:, 1], 100 * curve[:, 2], marker=".", label=r["sync"])
      ax.set_title(f"{layout[0]}x{layout[1]}, h = {h:g} s")
      ax.set_xlabel("virtual seconds")
      ax.set_ylabel("test accuracy %")
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize="small")
  fig.tight_layout()
  curves = os.path.join(workdir, "accuracy_vs_virtual_time.png")
  fig.savefig(curves, dpi=120)
  plt.close(fig)
  return bars, curves


def run(workdir: str, num_batches: int | None = None, quick: bool = False,
        layouts=LAYOUTS, syncs=None, heteros=None):
  """Runs the study per layout, prints the tables and the comparison, writes the plots; returns
  {(pipelines, stages): rows}."""
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jlp import studies  # pylint: disable=g-import-not-at-top

  syncs = studies.SDPIPE_SYNCS if syncs is None else tuple(syncs)
  heteros = (QUICK_HETEROS if quick else studies.SDPIPE_HETEROS) if heteros is None else heteros
  layouts = layouts[:1] if quick else tuple(layouts)
  start = time.perf_counter()
  rows_by_layout = {}
  for n, s in layouts:
    settings = study_settings(n, s, num_batches, quick)
    print(f"\n## {n} pipelines x {s} stages: digits CNN, {settings.schedule}, "
          f"{settings.num_batches} updates of {n} x {settings.batch_per_pipeline} rows, "
          f"evaluated every {settings.batches_per_run}; {jax.device_count()} "
          f"{jax.default_backend()} devices\n", flush=True)
    rows = studies.pipeline_study(settings, syncs, heteros)
    rows_by_layout[(n, s)] = rows
    print("\n" + studies.render_pipeline_table(rows, settings.target_accuracy))
    print("\nThis run (virtual time to target, PReduce / other):")
    print("\n".join(compare(rows)) or "  (no h > 0)")
  print("\n" + PAPER_DIRECTION)
  bars, curves = plot(rows_by_layout, workdir)
  print(f"\nvirtual time to target: {bars}\naccuracy against virtual time: {curves}\n"
        f"wall time: {time.perf_counter() - start:.0f} s")
  return rows_by_layout


def main(argv):
  del argv
  cli.apply_cpu_devices()
  logging.set_verbosity(logging.WARNING)
  run(flags.FLAGS.workdir, flags.FLAGS.num_batches, flags.FLAGS.quick)


if __name__ == "__main__":
  define_flags()
  cli.define_cpu_devices(8)
  cli.run(main)
