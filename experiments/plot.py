"""Training curves of several runs in one figure (loss and accuracy against step).

Run: python -m experiments.plot DIR [DIR ...] --out=curves.png [--labels=a,b,...]
"""

from absl import app, flags

from jlp import plots

_OUT = flags.DEFINE_string("out", "curves.png", "Where to write the figure (PNG, PDF or SVG).")
_LABELS = flags.DEFINE_list("labels", None, "One legend label per run (default: directory names).")


def main(argv):
  workdirs = argv[1:]
  if not workdirs:
    raise app.UsageError("expected one or more run directories: python -m experiments.plot DIR ... --out=FILE.png")
  plots.plot_runs(workdirs, _OUT.value, labels=_LABELS.value)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
