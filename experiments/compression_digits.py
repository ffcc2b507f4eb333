r"""HiPress's compressors on the digits CNN: test accuracy and bytes on the wire, PS and ring.

  python -m experiments.compression_digits [--workdir=out/compression_digits] [--max_steps=N]
  python -m experiments.compression_digits --quick        # a few steps: the tests' smoke run

Trains the digits CNN (configs/digits.py) on 8 emulated data-parallel workers once with the
float32 ring all-reduce (the bandwidth-optimal baseline) and once per compressor (onebit, TBQ,
TernGrad, DGC, GradDrop; docs/hipress.md) and CaSync topology (PS and ring), every
gradient leaf compressed (compression.min_size=0: the CNN's leaves are far below HiPress's
262,144-float threshold), each compressor with its jlp defaults (HiPress's, docs/hipress.md), plus TBQ at a threshold of the
digits gradients' scale (HiPress's 1.0 is far above it: nothing but rare +-1 steps is sent).
Prints the final test accuracy, the bytes one device sends per step for the gradient sync (the
runner's `wire_bytes`) and their fraction of float32's, and writes WORKDIR/curves.png (training
curves) and WORKDIR/tradeoff.png (accuracy against bytes).
"""

import os

from absl import flags, logging

from jlp.train import cli

#: Steps per run in quick mode (the tests).
QUICK_STEPS = 4
#: The study's compressors: HiPress's five with their defaults, then TBQ at the digits scale.
COMPRESSORS = ("onebit", "tbq", "terngrad", "dgc", "graddrop", ("tbq", {"threshold": 0.001}))


def define_flags() -> None:
  """The command-line flags, defined only when this runs as a program: the tests import this
  module beside the other experiments, which define flags of the same names."""
  flags.DEFINE_string("workdir", "out/compression_digits", "Where the runs and plots go.")
  flags.DEFINE_integer("max_steps", None, "Override the config's max_steps.")
  flags.DEFINE_bool("quick", False, f"Smoke run: {QUICK_STEPS} steps per run.")


def study_config(max_steps: int | None = None, quick: bool = False):
  """configs/digits.py with every gradient leaf compressed; `quick`: QUICK_STEPS steps, one
  evaluation at the end, no periodic checkpoints."""
  from configs import digits  # pylint: disable=g-import-not-at-top
  config = digits.get_config()
  config.compression.min_size = 0
  if quick:
    config.max_steps = QUICK_STEPS
    config.log_every = 1
    config.eval_every = 0
    config.checkpoint_every = 0
  if max_steps is not None:
    config.max_steps = max_steps
  return config


def run(workdir: str, max_steps: int | None = None, quick: bool = False,
        compressors=COMPRESSORS):
  """Runs the study, prints the table and writes the plots; returns the rows."""
  import jax  # pylint: disable=g-import-not-at-top
  from jlp import plots, studies  # pylint: disable=g-import-not-at-top

  config = study_config(max_steps, quick)
  print(f"digits CNN, {config.max_steps} steps, global batch {config.batch_size} on "
        f"{jax.device_count()} data-parallel workers ({jax.default_backend()}), every gradient "
        "leaf compressed\n", flush=True)
  rows = studies.compression_study(config, workdir, compressors)
  print("\n" + studies.render_compression_table(rows))
  curves = os.path.join(workdir, "curves.png")
  plots.plot_runs([os.path.join(workdir, r["run"]) for r in rows], curves,
                  labels=[f"{'float32' if r['compressor'] == 'none' else r['label']} / "
                          f"{r['topology']}" for r in rows])
  tradeoff = os.path.join(workdir, "tradeoff.png")
  plots.plot_accuracy_vs_bytes(rows, tradeoff)
  print(f"\ncurves: {curves}\naccuracy against bytes: {tradeoff}")
  return rows


def main(argv):
  del argv
  cli.apply_cpu_devices()
  logging.set_verbosity(logging.WARNING)
  run(flags.FLAGS.workdir, flags.FLAGS.max_steps, flags.FLAGS.quick)


if __name__ == "__main__":
  define_flags()
  cli.define_cpu_devices(8)
  cli.run(main)
