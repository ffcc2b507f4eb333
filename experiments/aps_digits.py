r"""The main job: does APS make a low-precision gradient all-reduce train as well as float32?

  python -m experiments.aps_digits [--workdir=out/aps_digits] [--max_steps=300]

Trains the digits CNN (configs/digits.py) on 8 emulated data-parallel workers with a float32,
e4m3 and e3m0 gradient all-reduce (CPD's sequential sum in rank order, cast after every add), the
two low-precision ones with and without APS, prints the final test-accuracy table and writes the
training curves to WORKDIR/curves.png. CPD's claim (arXiv:1911.08907): with APS, 8-bit gradients
lose under 0.05% accuracy.
"""

import os

from absl import flags, logging

from jlp.train import cli

_WORKDIR = flags.DEFINE_string("workdir", "out/aps_digits", "Where the runs and the plot go.")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Override the config's max_steps.")


cli.define_cpu_devices(8)


def main(argv):
  del argv
  cli.apply_cpu_devices()
  logging.set_verbosity(logging.WARNING)
  import jax  # pylint: disable=g-import-not-at-top
  from configs import digits  # pylint: disable=g-import-not-at-top
  from jlp import plots, studies  # pylint: disable=g-import-not-at-top

  config = digits.get_config()
  if _MAX_STEPS.value is not None:
    config.max_steps = _MAX_STEPS.value
  print(f"digits CNN, {config.max_steps} steps, global batch {config.batch_size} on "
        f"{jax.device_count()} data-parallel workers ({jax.default_backend()})\n", flush=True)
  rows = studies.aps_study(config, _WORKDIR.value)
  print("\n" + studies.render_table(rows))
  out = os.path.join(_WORKDIR.value, "curves.png")
  plots.plot_runs([os.path.join(_WORKDIR.value, r["run"]) for r in rows], out,
                  labels=[f"{r['format']}{' + APS' if r['aps'] == 'yes' else ''}" for r in rows])
  print(f"\ncurves: {out}")


if __name__ == "__main__":
  cli.run(main)
