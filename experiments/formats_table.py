"""The main job until training exists: every format's range and its error on a tensor.

Run: python -m experiments.formats_table [--seed=0] [--size=49152]
"""

from absl import app, flags, logging

from jlp.train import cli

from jlp import explore

_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the test tensor.")
_SIZE = flags.DEFINE_integer("size", 48 * 1024, "Elements of the test tensor (a multiple of 48).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if _SIZE.value <= 0 or _SIZE.value % 48:
    raise app.UsageError(f"--size={_SIZE.value} is not allowed; expected a positive multiple of 48.")
  x = explore.demo_tensor(_SEED.value, _SIZE.value)
  print(f"Quantization of {x.size} values N(0,1) * 2^U(-4,4) (seed {_SEED.value}); "
        "BFP groups and MX blocks along rows of 48.\n")
  print(explore.render_table(explore.format_table(explore.demo_formats(), x)))


if __name__ == "__main__":
  cli.run(main)
