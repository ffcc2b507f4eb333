r"""A cluster on one machine: hosts in network namespaces with shaped links, running one command.

  python -m experiments.cluster --hosts=4 --devices_per_host=2 --bandwidth=1gbit --workdir=DIR \
      -- experiments.train --config=configs/digits.py --config.compression.name=onebit

Starts --hosts processes, each in its own network namespace with --devices_per_host emulated CPU
devices and its own hostname, joined by a bridge whose links are shaped to --bandwidth (tc tbf;
`none`: unshaped), and runs the Python module (or script) after `--` with its arguments on every
host. The hosts join one JAX runtime: `jlp.train.distributed.initialize()` with no arguments reads
what the launcher exports, so `experiments.train` and every multi-device experiment run unchanged.
Each host writes DIR/host{i}.log and DIR/host{i}.pid; standard output shows host 0. If a host
fails, the others are stopped within 30 s and the launcher exits 1 with one line naming it; Ctrl-C
is passed to every host (a training run checkpoints and exits; the same command then resumes).
Everything it makes is removed on every exit path; after a `kill -9` of the launcher,
`python -m experiments.cluster --cleanup` removes what is left. Needs Linux, root (or
CAP_NET_ADMIN), iproute2 and unshare; without them the hosts run on localhost, unshaped.
What it does to the machine: `jlp.train.cluster`.
"""

import sys

from absl import app, flags

from jlp.train import cli

from jlp.train import cluster

_HOSTS = flags.DEFINE_integer("hosts", 2, "Host processes.")
_DEVICES = flags.DEFINE_integer("devices_per_host", 2, "Emulated CPU devices per host.")
_BANDWIDTH = flags.DEFINE_string("bandwidth", "none",
                                 "Each host's link: a tc rate (100mbit, 1gbit) or none.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the hosts' logs and pid files go (and, "
                               "usually, the command's own --workdir).")
_HETERO = flags.DEFINE_float("hetero", 0.0, "Before every training step each host sleeps this "
                             "many seconds with probability 0.1 (SD-PIPE's --hetero, real).")
_CLEANUP = flags.DEFINE_bool("cleanup", False, "Stop the hosts and remove the namespaces, links "
                             "and /etc/netns entries of every launcher (after a kill -9; run it "
                             "when no launcher runs) and exit.")


def main(argv):
  if _CLEANUP.value:
    removed = cluster.remove_leftovers()
    print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
    return
  command = argv[1:]
  if not command:
    raise app.UsageError("expected a command after `--`: a Python module or script and its "
                         "arguments (e.g. -- experiments.train --config=configs/digits.py ...).")
  if _WORKDIR.value is None:
    raise app.UsageError("--workdir is required (the hosts' logs go there).")
  namespaces = cluster.can_make_namespaces()
  if not namespaces:
    print("no network namespaces (needs root or CAP_NET_ADMIN, iproute2 and unshare): the hosts "
          "run on localhost, unshaped", file=sys.stderr)
  try:
    code = cluster.launch(command[0], command[1:], hosts=_HOSTS.value,
                          devices_per_host=_DEVICES.value, bandwidth=_BANDWIDTH.value,
                          workdir=_WORKDIR.value, hetero=_HETERO.value, namespaces=namespaces,
                          echo=sys.stdout.buffer)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except cluster.ClusterError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  sys.exit(code)


if __name__ == "__main__":
  cli.run(main)
