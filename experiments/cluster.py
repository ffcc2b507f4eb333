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
If a host fails (dies, exits non-zero, or hangs: stopped, or no training step for
--heartbeat_timeout seconds), the others are stopped at once (SIGKILL) and, while --max_restarts
remain, every host starts again with the same command (a training run resumes from its newest
intact checkpoint; one line per restart: `host 1 died (signal 9); restart 1 of 2 from step 16`);
then the launcher exits with that host's status (1 for a signal) and a few lines naming it, what
happened and its log (tracebacks stay in the logs). A config error (status 2) never restarts.
Ctrl-C is passed to every host (a training run checkpoints and exits; the same command then
resumes), SIGTERM as SIGTERM (handled as Ctrl-C: every host checkpoints after the same step) and
SIGHUP as SIGTERM; the exit status is then 128 + the signal. A SIGTERM to one host alone (a
preempted node) checkpoints every host too, and restarts the group with --max_restarts (else the
launcher exits 143). Everything it makes is removed on every exit path, a
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
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 0, "When a host fails (dies, hangs, or takes "
                                     "a SIGTERM alone), stop every host and start them all again "
                                     "with the same command, up to this many times (a training "
                                     "run resumes from its newest intact checkpoint); a config "
                                     "error (status 2) never restarts.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_float("heartbeat_timeout", 60.0, "Seconds after which a host "
                                        "that is alive but makes no progress (stopped, or no "
                                        "training step) is named as hung and every host is "
                                        "stopped; also JAX's coordination heartbeat timeout.")
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
                          echo=sys.stdout.buffer, max_restarts=_MAX_RESTARTS.value,
                          heartbeat_timeout=_HEARTBEAT_TIMEOUT.value)
  except ValueError as e:
    code, message = 2, f"error: {e}"
  except cluster.ClusterError as e:
    lines = str(e).splitlines()  # what the peers saw, then the cause
    code, message = e.code, "\n".join(lines[:-1] + [f"error: {lines[-1]}"])
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
