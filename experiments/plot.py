"""Training curves of several runs in one figure (loss and accuracy against step).

Run: python -m experiments.plot DIR [DIR ...] --out=curves.png [--labels=a,b,...] [--x=step]

--x=virtual_time draws time-to-accuracy in virtual seconds (pipelined runs, config.pipeline);
--x=epoch against epochs.
"""

from absl import flags

from jlp import plots
from jlp.train import cli

_OUT = flags.DEFINE_string("out", "curves.png", "Where to write the figure (PNG, PDF or SVG).")
_LABELS = flags.DEFINE_list("labels", None, "One legend label per run (default: directory names).")
_X = flags.DEFINE_enum("x", "step", sorted(plots.X_AXES),
                       "The x axis: step, epoch or virtual_time (pipelined runs' virtual seconds).")


def main(argv):
  workdirs = argv[1:]
  if not workdirs:
    cli.fail("no run directory given; expected python -m experiments.plot DIR [DIR ...] "
             "--out=FILE.png")
  try:
    plots.plot_runs(workdirs, _OUT.value, labels=_LABELS.value, x=_X.value)
  except (ValueError, OSError) as e:
    cli.fail(" ".join(str(e).split()))
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
