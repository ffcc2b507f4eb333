r"""A cluster on one machine: hosts in network namespaces with shaped links, running one command.

  python -m experiments.cluster --hosts=4 --devices_per_host=2 --bandwidth=1gbit --workdir=DIR \
      -- experiments.train --config=configs/digits.py --config.compression.name=onebit

Starts --hosts processes, each in its own network namespace with --devices_per_host emulated CPU
devices and its own hostname, joined by a bridge whose links are shaped to --bandwidth (tc tbf;
`none`: unshaped), and runs the Python module (or script) after `--` with its arguments on every
host. The hosts join one JAX runtime: `jlp.train.distributed.initialize()` with no arguments reads
what the launcher exports, so `experiments.train` and every multi-device experiment run unchanged.
Each host writes DIR/host{i}.log (an earlier run's moves to host{i}.log.1, ...) and DIR/host{i}.pid
(removed at exit); standard output shows host 0 (a closed standard output stops only the echo).
If a host fails, the others are stopped within 30 s and the launcher exits with that host's
status (1 for a signal) and one line naming it and its log; Ctrl-C is passed to every host (a
training run checkpoints and exits; the same command then resumes), SIGTERM and SIGHUP as SIGTERM;
the exit status is then 128 + the signal. Everything it makes is removed on every exit path, a
second Ctrl-C during the teardown included; after a `kill -9` of the launcher,
`python -m experiments.cluster --cleanup` removes what launchers that no longer run left (and
names what it leaves to running ones). Bad flags are one-line errors (exit 2) before anything is
made: --hosts from 1 to 254, --bandwidth from 1mbit to 100gbit, a --workdir that is a directory
no other user can write. Needs Linux, root (or CAP_NET_ADMIN), iproute2 and unshare; without them
the hosts run on localhost, unshaped.
What it does to the machine: `jlp.train.cluster`.
"""

import contextlib
import os
import signal
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
_CLEANUP = flags.DEFINE_bool("cleanup", False, "Stop the hosts and remove the namespaces, links, "
                             "/etc/netns entries and state files of launchers that no longer run "
                             "(after a kill -9), name what belongs to running ones, and exit.")


def main(argv):
  if _CLEANUP.value:
    removed, kept = cluster.remove_leftovers()
    print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
    if kept:
      print(f"left alone (their launchers still run): {' '.join(kept)}")
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
  # Signals that come after the launch's teardown (a terminal repeating Ctrl-C) must not cut
  # the exit short: launch() handles them while it runs and restores these handlers.
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, signal.SIG_IGN)
  try:
    code = cluster.launch(command[0], command[1:], hosts=_HOSTS.value,
                          devices_per_host=_DEVICES.value, bandwidth=_BANDWIDTH.value,
                          workdir=_WORKDIR.value, hetero=_HETERO.value, namespaces=namespaces,
                          echo=sys.stdout.buffer)
  except ValueError as e:
    code, message = 2, f"error: {e}"
  except cluster.ClusterError as e:
    code, message = e.code, f"error: {e}"
  else:
    message = None
  if message is not None:
    print(message, file=sys.stderr)
  # Out without the interpreter's finalisation, which restores the default handlers: a signal
  # still on its way (a terminal repeating Ctrl-C) would then end the process instead of this
  # status. The handlers stay ignored to the end.
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError):
      stream.flush()
  os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
  cli.run(main)
