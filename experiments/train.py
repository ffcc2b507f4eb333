r"""Train an experiment config: python -m experiments.train --config=configs/NAME.py[:ARG] --workdir=DIR

  python -m experiments.train --config=configs/digits.py --workdir=/tmp/jlp/digits
  python -m experiments.train --config=configs/cpd_resnet18_cifar10.py:local --workdir=/tmp/r18 \
      --config.grad_exp=4 --config.grad_man=3 --config.use_aps

`--cpu_devices=8` emulates 8 CPU devices (data-parallel, compressed and pipelined configs need
several; without it XLA shows one). Running the same command on the same workdir resumes from its last checkpoint (bit-exact). Ctrl-C
writes a checkpoint and exits (status 130); a training loss that turns NaN or infinite stops
the run with one line (status 1); a bad config, a bad data file or a changed data set on resume is
one line with status 2. `--multiprocess` joins a multi-process run first
(jax.distributed: SLURM is detected under srun; else --coordinator, --num_processes, --process_id);
under the cluster launcher (`python -m experiments.cluster ... -- experiments.train ...`) it joins
without the flag.
The logic lives in jlp.train.loop.train_and_evaluate, which notebooks call directly.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jlp.train import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py[:ARG]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics, TensorBoard, checkpoints).")
_MULTIPROCESS = flags.DEFINE_bool("multiprocess", False, "Call jlp.train.initialize() first.")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of process 0 (explicit multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (explicit multi-process).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (explicit multi-process).")
_PROGRESS = flags.DEFINE_enum("progress", "auto", ["auto", "bar", "lines"],
                              "tqdm bar (auto: on a terminal) or plain log lines.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False,
    "Resume a workdir under a config that changes the training (recorded in its metrics and "
    "config history).")
flags.mark_flags_as_required(["config", "workdir"])
cli.define_cpu_devices()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  cli.apply_cpu_devices()
  from jlp.train import distributed  # pylint: disable=g-import-not-at-top
  if _MULTIPROCESS.value or distributed.launched():
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  from jlp.train import loop  # pylint: disable=g-import-not-at-top
  progress = {"auto": None, "bar": True, "lines": False}[_PROGRESS.value]
  try:
    result = loop.train_and_evaluate(cli.config_value(_CONFIG), _WORKDIR.value, progress=progress,
                                     allow_config_change=_ALLOW_CONFIG_CHANGE.value)
  except (ValueError, FileNotFoundError) as e:
    cli.fail(str(e))
  except loop.NonFiniteLossError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  if result["interrupted"]:
    sys.exit(130)


if __name__ == "__main__":
  cli.run(main)
