r"""Fit SeCoPa from whole syncs timed on this cluster, for the runner's autotune.

  python -m experiments.sync_fit --compressor=onebit --out=fits/onebit.json --cpu_devices=8
  python -m experiments.train --config=configs/digits_wide.py --cpu_devices=8 --workdir=DIR \
      --config.compression.name=onebit --config.compression.plan=autotune \
      --config.compression.sync_fit=fits/onebit.json

times whole syncs of one gradient of each --sizes element count on every device (each topology
the compressor runs at K in {1, N/2, N} partitions, the float32 ring, XLA's psum:
`jlp.sync_tuning.fit_sync_costs`) and writes the fit as JSON. With it, the runner's
`compression.plan=autotune` times only the plans predicted within 2x of the fastest, and none
when one is left (docs/hipress.md, "Planning on a live cluster"). Make it once per cluster,
device count and compressor: `SyncFit.load` refuses a fit made on another. Under the cluster
launcher (`python -m experiments.cluster ... -- experiments.sync_fit ...`) or with
--multiprocess, every process times and process 0's timings are the fit.

Bad flags print one line and exit with status 2.
"""

import os

from absl import flags, logging

from jlp.train import cli

_COMPRESSOR = flags.DEFINE_string("compressor", None, "A registered compressor name "
                                  "(jlp.compression.COMPRESSORS), e.g. onebit, tbq, dgc.")
_OUT = flags.DEFINE_string("out", None, "Where the fit is written (JSON).")
_SIZES = flags.DEFINE_list("sizes", ["64K", "1M", "4M"], "Gradient elements per device to "
                           "time (K/M suffixes; at least two; include the largest leaf planned).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Rounds of timing (the median is fitted; "
                                "default jlp.sync_tuning.FIT_REPEATS).", lower_bound=1)
_CLUSTER = flags.DEFINE_string("cluster", None, "Names the cluster in the fit (default: "
                               "processes x devices x kind); add what the devices do not tell, "
                               "such as the link's shaping.")
_MULTIPROCESS = flags.DEFINE_bool("multiprocess", False, "Call jlp.train.initialize() first.")
flags.mark_flags_as_required(["compressor", "out"])
cli.define_cpu_devices()


def main(argv):
  if len(argv) > 1:
    cli.fail(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  sizes = tuple(cli.elements(text, "sizes") for text in _SIZES.value)
  if len(set(sizes)) < 2:
    cli.fail(f"--sizes={','.join(_SIZES.value)} is not allowed; expected at least two distinct "
             "sizes.")
  from jlp.compression import base  # pylint: disable=g-import-not-at-top
  if _COMPRESSOR.value not in base.COMPRESSORS:
    cli.fail(f"--compressor={_COMPRESSOR.value!r} is not allowed; expected one of "
             f"{sorted(base.COMPRESSORS)}.")
  try:  # before the timing: a fit that cannot be written is refused first
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  except OSError as e:
    cli.fail(f"--out={_OUT.value} is not allowed: its directory cannot be made ({e.strerror}).")
  cli.apply_cpu_devices()
  from jlp.train import distributed  # pylint: disable=g-import-not-at-top
  if _MULTIPROCESS.value or distributed.launched():
    distributed.initialize()
  import jax  # pylint: disable=g-import-not-at-top
  from jlp import sync_tuning  # pylint: disable=g-import-not-at-top
  repeats = sync_tuning.FIT_REPEATS if _REPEATS.value is None else _REPEATS.value
  try:
    fit = sync_tuning.fit_sync_costs(_COMPRESSOR.value, sizes=sizes, repeats=repeats,
                                     cluster=_CLUSTER.value)
  except ValueError as e:
    cli.fail(str(e), cli.DEVICE_HINT)
  if jax.process_index() == 0:
    fit.save(_OUT.value)
    for label, size, ms in fit.samples:
      print(f"{label:>10} {size:>9} elements: {ms:9.2f} ms")
    print(f"wrote {_OUT.value} ({fit.compressor} on {fit.cluster}, {len(fit.samples)} syncs)")


if __name__ == "__main__":
  cli.run(main)
