"""A cluster on one machine: H host processes, each in its own network namespace with its own
hostname, joined by a Linux bridge whose links are shaped with tbf, running one command that
joins JAX's multi-controller runtime (`jlp.train.distributed.initialize()` reads what the launcher
exports). `python -m experiments.cluster` is the command-line front end.

What it does to the machine (root or CAP_NET_ADMIN, iproute2, util-linux's `unshare`), all of it
named `jlp<run id>...` and removed on every exit path (success, failure, SIGINT, SIGTERM, SIGHUP;
a second signal during the teardown does not stop it):
  * a state file `/run/jlp-cluster/jlp<id>.json` (the launcher's pid and start time, written
    before anything else), so that `remove_leftovers()` removes only what launchers that are gone
    left;
  * a bridge `jlp<id>br` with no address at all (IPv6 off, as on the bridge ends of the veths):
    the root namespace takes no part, and a host reaches nothing of the machine's; per host i a
    network namespace `jlp<id>h<i>` holding one end of a veth pair (`eth0`, 10.R.S.(i + 1)/24 in a
    private /24 picked per run) whose other end (`jlp<id>v<i>`) is on the bridge; no route, NAT
    or forwarding to anything outside: traffic stays among the run's hosts;
  * with a bandwidth R, a tbf qdisc (`rate R burst B latency 100ms`, B the larger of R x 1 ms
    and four 1514-byte frames: `tbf_burst`) on both ends of every veth, so each host's upload and download are
    shaped to R, and a transfer of any size after an idle gap takes its bytes at R (a larger
    bucket lets the first B bytes through at line rate; tc has no netem here: bandwidth only);
  * `/etc/netns/jlp<id>h<i>/hosts`, which `ip netns exec` mounts over /etc/hosts: every host's
    name h<i> resolves to its namespace address (gloo connects to the address of the peer's
    hostname, so each host runs under `unshare --uts` with its own hostname).
Faults (issue 37, `launch`): a host that dies, exits non-zero, hangs (stopped, or its heartbeat
file DIR/host{i}.heartbeat, touched once per training step, untouched for `heartbeat_timeout`
seconds) or takes a SIGTERM alone stops every host; with `max_restarts` all of them start again
(one line each). Host 0's echo leaves tracebacks and log records in its log.
After a `kill -9` of the launcher, `remove_leftovers()` (`python -m experiments.cluster --cleanup`)
removes whatever launchers that no longer run left, and names what it left alone.

In the workdir (which no other user may write) each host writes host{i}.log (an earlier run's log
moves to host{i}.log.1, .2, ...) and host{i}.pid (its pid and start time, removed at exit); files
are opened without following symbolic links. Without root the hosts run on localhost, unshaped
(`--bandwidth` other than none is then an error), and the coordinator listens on 127.0.0.1 only,
on a port the launcher holds (SO_REUSEPORT) until the hosts exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["MAX_HOSTS", "ClusterError", "HostSpec", "can_make_namespaces", "check_bandwidth",
           "launch", "remove_leftovers", "tbf_burst"]

PREFIX = "jlp"
COORDINATOR_PORT = 61234
ENV_COORDINATOR = "JLP_COORDINATOR"
ENV_NUM_PROCESSES = "JLP_NUM_PROCESSES"
ENV_PROCESS_ID = "JLP_PROCESS_ID"
ENV_HETERO = "JLP_HETERO"
ENV_PROGRESS_BAR = "JLP_PROGRESS_BAR"
ENV_HEARTBEAT = "JLP_HEARTBEAT"  # host i touches DIR/host{i}.heartbeat once per training step
ENV_HEARTBEAT_TIMEOUT = "JLP_HEARTBEAT_TIMEOUT"  # JAX's heartbeat_timeout_seconds
STATE_DIR = "/run/jlp-cluster"
MAX_HOSTS = 254  # host i has address .(i + 1) of a /24
RATE_BOUNDS = (1e6, 100e9)  # bit/s: tbf's arithmetic holds in between
KEPT_LOGS = 9  # host{i}.log.1 .. .9


class ClusterError(RuntimeError):
  """The launcher's one-line failure (a host's exit, the network set-up); `code` is the exit
  status the launcher ends with."""

  def __init__(self, message: str, code: int = 1):
    super().__init__(message)
    self.code = code


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def check_bandwidth(bandwidth: str) -> str | None:
  """`bandwidth` as tc's rate ("100mbit", "1gbit"), or None for "none"; ValueError otherwise."""
  if bandwidth == "none":
    return None
  match = _RATE.match(bandwidth.lower()) if isinstance(bandwidth, str) else None
  low, high = RATE_BOUNDS
  if match is None or not low <= float(match.group(1)) * _UNIT[match.group(2)] <= high:
    raise ValueError(f"--bandwidth={bandwidth!r} is not allowed; expected 'none' or a rate from "
                     "1mbit to 100gbit with a unit bit, kbit, mbit or gbit (e.g. 100mbit, 1gbit).")
  return bandwidth.lower()


def tbf_burst(rate: str) -> int:
  """tbf's bucket in bytes for a tc rate: the larger of rate x 1 ms and four 1514-byte frames, so
  that an idle link lets at most that much through at line rate, while a qdisc whose refill
  timer runs late on busy cores still keeps the link busy. Measured between two idle hosts after
  an idle gap (0.25, 0.5, 1 and 16 MiB): 96-100 Mbit/s at 100mbit; at 1gbit 1.5, 1.2, 1.05 and
  0.94 Gbit/s (the 125 KB bucket is half of 0.25 MiB). A 250 us bucket kept every size within
  0.89-0.98 Gbit/s on idle hosts, but under the cluster study's load (8 processes on 2 cores) its
  float32 psum at 1gbit took 569 ms against 255 ms for the byte bound's 224 ms."""
  match = _RATE.match(rate)
  bits = float(match.group(1)) * _UNIT[match.group(2)]
  return max(int(bits / 8 / 1000), 4 * 1514)


def can_make_namespaces() -> bool:
  """Whether this process may create network namespaces (root with iproute2 and unshare)."""
  return (os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
          and shutil.which("unshare") is not None)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
  """argv, in a session of its own: a Ctrl-C at the terminal does not reach it."""
  out = subprocess.run(argv, capture_output=True, text=True, check=False,
                       start_new_session=True)
  if check and out.returncode:
    said = out.stderr.strip() or out.stdout.strip() or (
        f"killed by {signal.Signals(-out.returncode).name}" if out.returncode < 0
        else f"exit status {out.returncode}, nothing printed")
    raise ClusterError(f"`{' '.join(argv)}` failed: {said}")
  return out


def _start_time(pid: int) -> str | None:
  """The start time of process `pid` (clock ticks since boot), None when it does not run: with
  the pid, what names a process across pid reuse."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(pid: int, started: str | None) -> bool:
  return started is not None and _start_time(pid) == started


def _no_ipv6(interface: str, namespace: str | None = None) -> None:
  """No IPv6 address on `interface` (no link-local either), where the kernel has IPv6."""
  path = f"/proc/sys/net/ipv6/conf/{interface}/disable_ipv6"
  prefix = ("ip", "netns", "exec", namespace) if namespace else ()
  if os.path.exists("/proc/sys/net/ipv6"):
    _run(*prefix, "sh", "-c", f'echo 1 > "$0"', path)


@dataclasses.dataclass
class HostSpec:
  """Host i of a launch: its namespace (None on localhost), hostname and address."""
  index: int
  namespace: str | None
  hostname: str
  address: str


class Network:
  """The bridge, namespaces, veths and hosts files of one launch (module docstring).

  stop_requested: polled after each thing the set-up makes; when it returns True the set-up
  removes what it made and raises KeyboardInterrupt. The launcher's signal handler only sets
  what it polls: an exception raised from the handler could land between a command that made
  a namespace and the line that records it, and leave the namespace behind."""

  def __init__(self, hosts: int, bandwidth: str | None,
               stop_requested: Callable[[], bool] = lambda: False):
    self.run_id = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
    self.name = f"{PREFIX}{self.run_id}"
    self.bridge = f"{self.name}br"
    subnet = random.Random(self.name).randrange(64, 250), random.randrange(1, 250)
    self.hosts = [HostSpec(i, f"{self.name}h{i}", f"h{i}", f"10.{subnet[0]}.{subnet[1]}.{i + 1}")
                  for i in range(hosts)]
    self.bandwidth = bandwidth
    self.state_file = os.path.join(STATE_DIR, f"{self.name}.json")
    self._stop_requested = stop_requested
    self._made: list[tuple[str, str]] = []  # what to remove, in reverse order

  def _made_one(self, kind: str, name: str) -> None:
    self._made.append((kind, name))
    if self._stop_requested():
      raise KeyboardInterrupt

  def __enter__(self) -> "Network":
    try:
      os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
      with _open_new(self.state_file, "w") as f:
        json.dump({"pid": os.getpid(), "started": _start_time(os.getpid())}, f)
      self._made_one("file", self.state_file)
      _run("ip", "link", "add", self.bridge, "type", "bridge")
      self._made_one("link", self.bridge)
      _no_ipv6(self.bridge)
      _run("ip", "link", "set", self.bridge, "up")
      hosts_file = "127.0.0.1 localhost\n" + "".join(
          f"{h.address} {h.hostname}\n" for h in self.hosts)
      for h in self.hosts:
        _run("ip", "netns", "add", h.namespace)
        self._made_one("netns", h.namespace)
        etc = f"/etc/netns/{h.namespace}"
        os.makedirs(etc, exist_ok=True)
        self._made_one("dir", etc)
        with _open_new(os.path.join(etc, "hosts"), "w") as f:
          f.write(hosts_file)
        outside, inside = f"{self.name}v{h.index}", f"{self.name}i{h.index}"
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        self._made_one("link", outside)
        _no_ipv6(outside)
        _run("ip", "link", "set", inside, "netns", h.namespace)
        _run("ip", "link", "set", outside, "master", self.bridge)
        _run("ip", "link", "set", outside, "up")
        ns = ("ip", "netns", "exec", h.namespace)
        _run(*ns, "ip", "link", "set", inside, "name", "eth0")
        _run(*ns, "ip", "addr", "add", f"{h.address}/24", "dev", "eth0")
        _run(*ns, "ip", "link", "set", "eth0", "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        if self.bandwidth is not None:
          shape = ("root", "tbf", "rate", self.bandwidth, "burst", str(tbf_burst(self.bandwidth)),
                   "latency", "100ms")
          _run("tc", "qdisc", "add", "dev", outside, *shape)
          _run(*ns, "tc", "qdisc", "add", "dev", "eth0", *shape)
    except BaseException as e:
      with _signals_held():
        left = self.close()
      if left:
        raise ClusterError(f"could not remove {' '.join(left)} after a failed set-up; run "
                           "`python -m experiments.cluster --cleanup`") from None
      if isinstance(e, ClusterError) and self._stop_requested():
        # A command that fails once a stop is requested is taken to fail because of it (a
        # Ctrl-C can reach it too: a full test run saw an `ip` fail that way, printing nothing);
        # the stop is what happened.
        raise KeyboardInterrupt from None
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> list[str]:
    """Removes everything this network made (each step on its own: one failure stops none);
    returns what could not be removed."""
    left = []
    while self._made:
      kind, name = self._made.pop()
      if kind == "link":
        if _run("ip", "link", "del", name, check=False).returncode and _link_exists(name):
          left.append(name)
      elif kind == "netns":
        if _run("ip", "netns", "del", name, check=False).returncode and name in _namespaces():
          left.append(name)
      elif kind == "dir":
        shutil.rmtree(name, ignore_errors=True)
        if os.path.exists(name):
          left.append(name)
      else:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(name)
    return left

  def command(self, host: HostSpec, argv: Sequence[str]) -> list[str]:
    """argv run as `host`: in its namespace, under its own hostname."""
    return ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', host.hostname, *argv]


def _namespaces() -> list[str]:
  return _run("ip", "netns", "list", check=False).stdout.split()


def _link_exists(name: str) -> bool:
  return not _run("ip", "link", "show", name, check=False).returncode


def _live_runs() -> set[str]:
  """The run names (jlp<id>) whose launcher still runs, by their state files."""
  live = set()
  if os.path.isdir(STATE_DIR):
    for entry in os.listdir(STATE_DIR):
      match = re.match(rf"^({PREFIX}\d{{6}})\.json$", entry)
      if not match:
        continue
      try:
        with _open_existing(os.path.join(STATE_DIR, entry)) as f:
          state = json.load(f)
      except (OSError, ValueError):
        continue
      if _alive(int(state.get("pid", -1)), state.get("started")):
        live.add(match.group(1))
  return live


def remove_leftovers() -> tuple[list[str], list[str]]:
  """Stops the hosts that launchers which no longer run left (e.g. after a kill -9) and removes
  every namespace, link, /etc/netns entry and state file of theirs; leaves those of running
  launchers alone. Returns (what was removed, what was left alone)."""
  live = _live_runs()
  removed, kept = [], []

  def owner(name: str) -> str:
    return name[:len(PREFIX) + 6]
  for name in _namespaces():
    if re.match(rf"^{PREFIX}\d{{6}}h\d+$", name):
      if owner(name) in live:
        kept.append(name)
        continue
      # The hosts of a killed launcher may still run inside: stop them first.
      for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
          os.kill(int(pid), signal.SIGKILL)
      _run("ip", "netns", "del", name, check=False)
      removed.append(name)
  for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
    match = re.match(rf"^\d+: ({PREFIX}\d{{6}}(?:br|v\d+))[@:]", line)
    if match:
      if owner(match.group(1)) in live:
        kept.append(match.group(1))
        continue
      _run("ip", "link", "del", match.group(1), check=False)
      removed.append(match.group(1))
  for folder, pattern in (("/etc/netns", rf"^{PREFIX}\d{{6}}h\d+$"),
                          (STATE_DIR, rf"^{PREFIX}\d{{6}}\.json$")):
    if not os.path.isdir(folder):
      continue
    for name in os.listdir(folder):
      if re.match(pattern, name):
        path = os.path.join(folder, name)
        if owner(name) in live:
          kept.append(path)
          continue
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path, ignore_errors=True)
        else:
          with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        removed.append(path)
  return removed, kept


def _python_argv(target: str, args: Sequence[str]) -> list[str]:
  """A module (experiments.train) or a script (path.py) with its arguments."""
  if target.endswith(".py") or os.sep in target:
    return [sys.executable, "-u", target, *args]
  return [sys.executable, "-u", "-m", target, *args]


# What a host's echo leaves out: from a traceback or a fatal log on, the rest of the attempt
# (it stays in the host's log), and single error / warning log lines (absl's, glog's).
_FATAL = re.compile(rb"^(Traceback \(most recent call last\)|F\d{4} |\*\*\* |Fatal Python error|"
                    rb"jax\.errors\.|jaxlib\.|.*XlaRuntimeError)")
_GLOG = re.compile(rb"^[EWIF]\d{4} \d\d:\d\d")
_NOISE = re.compile(rb"^((ERROR|WARNING|INFO):absl:|[EWI]\d{4} \d\d:\d\d|\[Gloo\] )")


def _tee(pipe, log, echo, quiet: threading.Event | None = None) -> None:
  """Copies a host's output to its log and, while it can, to `echo`: a closed or failing echo
  (`... | head -1`) stops the echo only, never the host or its log. The echo goes line by line
  (a progress bar's carriage-return updates at once) and leaves out tracebacks and fatal logs
  (from the first on, and everything once `quiet` is set: the launcher saw a failure), log lines
  of absl and gloo, and glog records (with the lines that came with them)."""
  muted, held = False, b""
  for chunk in iter(lambda: pipe.read1(4096), b""):
    log.write(chunk)
    log.flush()
    if echo is None or muted:
      continue
    if quiet is not None and quiet.is_set():
      muted = True
      continue
    lines = (held + chunk).splitlines(keepends=True)
    held = b""
    if lines and not lines[-1].endswith((b"\n", b"\r")) and not lines[-1].startswith(b"\r"):
      held = lines.pop()  # a line still being written
    kept = []
    for line in lines:
      if _FATAL.match(line):
        muted = True
        break
      if _GLOG.match(line):
        break  # a glog record: its continuation lines came in the same write
      if not _NOISE.match(line):
        kept.append(line)
    try:
      if kept:
        echo.write(b"".join(kept))
        echo.flush()
    except (OSError, ValueError):
      echo = None


def _open_new(path: str, mode: str):
  """`path` created or truncated for writing, never through a symbolic link."""
  flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
  try:
    fd = os.open(path, flags, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise ClusterError(f"{path} is a symbolic link; the launcher does not follow it") from None
    raise
  return os.fdopen(fd, mode)


def _open_existing(path: str):
  fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
  return os.fdopen(fd, "r")


def _rotate(path: str) -> None:
  """Keeps an earlier run's `path` as path.1 (and path.1 as path.2, ..., up to KEPT_LOGS)."""
  if not os.path.lexists(path):
    return
  for k in range(KEPT_LOGS - 1, 0, -1):
    if os.path.lexists(f"{path}.{k}"):
      os.replace(f"{path}.{k}", f"{path}.{k + 1}")
  os.replace(path, f"{path}.1")


def check_workdir(workdir: str) -> None:
  """ValueError unless `workdir` is (or can be made as) a directory that no other user can
  write: as root the launcher writes logs and pid files there."""
  if os.path.lexists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir} is not allowed; it is not a directory.")
  if not os.path.isdir(workdir):
    return
  info = os.stat(workdir)
  if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise ValueError(f"--workdir={workdir} is not allowed; another user can write it (owner uid "
                     f"{info.st_uid}, mode {stat.filemode(info.st_mode)}); expected a directory "
                     "of this user's that only it can write.")


@contextlib.contextmanager
def _signals_held():
  """SIGINT, SIGTERM and SIGHUP ignored for the block (the teardown must finish)."""
  held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM,
                                                        signal.SIGHUP)}
  try:
    yield
  finally:
    for s, handler in held.items():
      signal.signal(s, handler)


def _reserve_port() -> socket.socket:
  """A localhost port held with SO_REUSEPORT: nobody else can take it while the coordinator
  (gRPC, which sets SO_REUSEPORT too) binds it."""
  held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
  held.bind(("127.0.0.1", 0))
  return held


def launch(target: str, args: Sequence[str], *, hosts: int, devices_per_host: int,
           bandwidth: str, workdir: str, hetero: float = 0.0, namespaces: bool | None = None,
           echo=None, on_start=None, max_restarts: int = 0, heartbeat_timeout: float = 60.0,
           say=None) -> int:
  """Runs `target args` on `hosts` host processes of `devices_per_host` CPU devices each (module
  docstring) and returns 0, or raises ClusterError naming the host that caused the failure (what
  happened and its log; `code` is its exit status, 1 for a signal, 143 for a SIGTERM it took as
  a preemption) after stopping the others. SIGINT, SIGTERM and SIGHUP to the launcher are passed
  to every host (SIGINT as SIGINT, the others as SIGTERM: a training run checkpoints after the
  same step on every host and exits); the launcher returns 130 / 143 / 129.

  Faults (issue 37): a host that dies, exits non-zero, takes a SIGTERM alone (a preemption: every
  host checkpoints) or hangs (stopped, or its heartbeat file untouched for `heartbeat_timeout`
  seconds) stops every host (SIGKILL, which also ends a stopped one); while `max_restarts`
  remain, all hosts start again with the same command (a training run resumes from its newest
  intact checkpoint) and `say` gets one line: `host 1 died (signal 9); restart 1 of 2 from step
  16`. A config error (status 2) never restarts. Host 0's tracebacks and fatal logs stay in its
  log (not echoed).

  namespaces: True / False / None (= whether this process can make them). echo: where host 0's
  output goes besides its log (e.g. sys.stdout.buffer). on_start(pids): called once every host
  runs, at every start (tests). say(line): the restart lines (default: standard error)."""
  for name, value, low, high in (("hosts", hosts, 1, MAX_HOSTS),
                                 ("devices_per_host", devices_per_host, 1, None),
                                 ("max_restarts", max_restarts, 0, None)):
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
        or (high is not None and value > high)):
      allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
      raise ValueError(f"--{name}={value!r} is not allowed; expected {allowed}.")
  if isinstance(hetero, bool) or not isinstance(hetero, (int, float)) or not hetero >= 0:
    raise ValueError(f"--hetero={hetero!r} is not allowed; expected seconds >= 0.")
  if (isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, (int, float))
      or not heartbeat_timeout >= 1):
    raise ValueError(f"--heartbeat_timeout={heartbeat_timeout!r} is not allowed; expected "
                     "seconds >= 1.")
  rate = check_bandwidth(bandwidth)
  check_workdir(workdir)
  if namespaces is None:
    namespaces = can_make_namespaces()
  if not namespaces and rate is not None:
    raise ValueError(f"--bandwidth={bandwidth} is not allowed without network namespaces (root, "
                     "iproute2 and unshare); expected none (the hosts then run on localhost, "
                     "unshaped).")
  if say is None:
    say = lambda line: print(line, file=sys.stderr, flush=True)
  os.makedirs(workdir, mode=0o755, exist_ok=True)
  env = dict(os.environ)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = " ".join(
      [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f] +
      [f"--xla_force_host_platform_device_count={devices_per_host}"])
  env["JAX_PLATFORMS"] = "cpu"
  # JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR, when set): a directory per
  # host, DIR/host{i}, as the hosts of a start compile at once and jax writes an entry in place,
  # without a lock. A restart, or the same command run again to resume, then loads what host 0
  # compiled before instead of compiling it again; jax writes entries from process 0 only, so the
  # other hosts compile again (about 4 s for a digits run).
  cache_dir = env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env[ENV_NUM_PROCESSES] = str(hosts)
  env[ENV_HEARTBEAT_TIMEOUT] = str(max(1, int(heartbeat_timeout)))
  if hetero:
    env[ENV_HETERO] = str(float(hetero))
  if echo is not None and hasattr(echo, "isatty") and echo.isatty():
    env[ENV_PROGRESS_BAR] = "1"

  signals = {"got": None}
  network = (Network(hosts, rate, stop_requested=lambda: signals["got"] is not None)
             if namespaces else None)

  def forward(signum, _frame):
    if signals["got"] is None:
      signals["got"] = signum

  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
  procs: list[subprocess.Popen] = []
  logs, pid_files = [], []
  held_port = None
  beats = [os.path.join(workdir, f"host{i}.heartbeat") for i in range(hosts)]
  try:
    try:
      if network is not None:
        network.__enter__()  # polls signals["got"] after each thing it makes
        specs = network.hosts
        coordinator = f"{specs[0].address}:{COORDINATOR_PORT}"
        with _open_new(os.path.join(workdir, "network.json"), "w") as f:
          json.dump({"bridge": network.bridge, "bandwidth": rate,
                     "burst_bytes": None if rate is None else tbf_burst(rate),
                     "hosts": [dataclasses.asdict(h) for h in specs]}, f, indent=1)
      else:
        held_port = _reserve_port()
        specs = [HostSpec(i, None, "localhost", "127.0.0.1") for i in range(hosts)]
        coordinator = f"127.0.0.1:{held_port.getsockname()[1]}"
      if signals["got"] is not None:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
      raise ClusterError("interrupted while setting up the network; what it made is removed",
                         code=128 + (signals["got"] or signal.SIGINT)) from None
    argv = _python_argv(target, args)
    for h in specs:
      path = os.path.join(workdir, f"host{h.index}.log")
      _rotate(path)
      logs.append(_open_new(path, "wb"))
    restarts = 0
    while True:
      outcome = _attempt(argv, specs, network, env, coordinator, workdir, logs, procs,
                         pid_files, beats, echo, on_start, signals, float(heartbeat_timeout),
                         restarts, cache_dir)
      if outcome is None:
        return 0
      if isinstance(outcome, int):
        return outcome
      if outcome.restartable and restarts < max_restarts and signals["got"] is None:
        restarts += 1
        resume = _resume_step(args)
        say(f"host {outcome.cause} {outcome.what}; restart {restarts} of {max_restarts}"
            + ("" if resume is False else f" from step {resume}" if resume is not None else
               " from the start"))
        for log in logs:
          log.write(f"\n--- launcher: host {outcome.cause} {outcome.what}; restart {restarts} "
                    f"of {max_restarts} ---\n".encode())
          log.flush()
        continue
      if signals["got"] is not None:
        return 128 + signals["got"]
      raise ClusterError("\n".join(outcome.lines), code=outcome.code)
  finally:
    failing = sys.exc_info()[0] is not None
    with _signals_held():
      _stop_all(procs)
      for log in logs:
        log.close()
      for path in pid_files + beats:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(path)
      if held_port is not None:
        held_port.close()
      left = network.close() if network is not None else []
      for s, handler in old.items():
        signal.signal(s, handler)
    if left:
      message = (f"could not remove {' '.join(left)}; run `python -m experiments.cluster "
                 "--cleanup`")
      if not failing:
        raise ClusterError(message)
      print(f"error: {message}", file=sys.stderr)


@dataclasses.dataclass
class _Outcome:
  """Why an attempt failed: the host that caused it, what happened to it (`died (signal 9)`),
  the launcher's exit status, whether a restart may follow, and the lines to print."""
  cause: int
  what: str
  code: int
  restartable: bool
  lines: list[str]


def _stop_all(procs: list[subprocess.Popen]) -> None:
  """SIGKILL to every host still running (a stopped one too), and waits for each."""
  for p in procs:
    if p.poll() is None:
      _signal(p, signal.SIGKILL)
  for p in procs:
    p.wait()


def _state(pid: int) -> str:
  """The process state letter of `pid` (R, S, D, T = stopped, ...), "" when it is gone."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return ""


def _noted_signal(path: str) -> int:
  """The signal a host's heartbeat file says interrupted it (0: none, or no file)."""
  try:
    with open(path, encoding="ascii") as f:
      return int(f.read().strip() or 0)
  except (OSError, ValueError):
    return 0


def _resume_step(args: Sequence[str]):
  """The step a training command resumes from (its --workdir's newest intact checkpoint; None
  when there is none), or False when the command has no --workdir."""
  workdir = None
  for k, arg in enumerate(args):
    if arg.startswith("--workdir="):
      workdir = arg.split("=", 1)[1]
    elif arg == "--workdir" and k + 1 < len(args):
      workdir = args[k + 1]
  if workdir is None:
    return False
  from jlp.train import checkpoint  # pylint: disable=g-import-not-at-top
  return checkpoint.good_step(workdir, say=False)[0]


def _what(code: int, noted: int) -> str:
  if code < 0:
    return f"died (signal {-code})"
  if noted:
    return f"got {signal.Signals(noted).name} and checkpointed"
  return f"exited with status {code}"


def _attempt(argv, specs, network, env, coordinator, workdir, logs, procs, pid_files, beats,
             echo, on_start, signals, timeout, restarts, cache_dir):
  """Starts every host, watches them to the end: None when all exit 0, an exit status after a
  signal to the launcher, else an _Outcome."""
  procs.clear()
  threads = []
  quiet = threading.Event()
  for path in beats:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)
  started = time.time()
  for h in specs:
    host_env = dict(env, **{ENV_COORDINATOR: coordinator, ENV_PROCESS_ID: str(h.index),
                            ENV_HEARTBEAT: beats[h.index]})
    if cache_dir is not None:
      host_env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cache_dir, f"host{h.index}")
    command = network.command(h, argv) if network is not None else argv
    proc = subprocess.Popen(command, env=host_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(proc)
    pid_file = os.path.join(workdir, f"host{h.index}.pid")
    with _open_new(pid_file, "w") as f:
      f.write(f"{proc.pid} {_start_time(proc.pid)}\n")
    if pid_file not in pid_files:
      pid_files.append(pid_file)
    thread = threading.Thread(target=_tee, args=(proc.stdout, logs[h.index],
                                                 echo if h.index == 0 else None, quiet),
                              daemon=True)
    thread.start()
    threads.append(thread)
  if on_start is not None:
    on_start([p.pid for p in procs])
  forwarded = graceful_until = None
  exited: list[int] = []  # hosts in the order they were seen to exit
  stopped_since: dict[int, float] = {}
  cause = hung = None
  stopped = False
  while True:
    now = time.time()
    if signals["got"] is not None and forwarded is None:
      forwarded = signals["got"]
      for p in procs:
        _signal(p, signal.SIGINT if forwarded == signal.SIGINT else signal.SIGTERM)
      graceful_until = now + 60.0  # time to write a checkpoint
    codes = [p.poll() for p in procs]
    # Among hosts seen exiting at the same look, one killed by a signal (not an abort) first.
    new = sorted((i for i, c in enumerate(codes) if c is not None and i not in exited),
                 key=lambda i: (not (codes[i] < 0 and codes[i] != -signal.SIGABRT), i))
    exited += new
    for i, p in enumerate(procs):
      if codes[i] is None and _state(p.pid) in ("T", "t"):
        stopped_since.setdefault(i, now)
      else:
        stopped_since.pop(i, None)
    done = all(c is not None for c in codes)
    if forwarded is None and cause is None:
      failed = [i for i in exited if codes[i] != 0]
      hung = next((i for i, t in sorted(stopped_since.items()) if now - t > timeout), None)
      if hung is None:
        fresh = {}
        for i, path in enumerate(beats):
          with contextlib.suppress(OSError):
            mtime = os.stat(path).st_mtime
            if mtime >= started and codes[i] is None:
              fresh[i] = mtime
        stale = {i: t for i, t in fresh.items() if now - t > timeout}
        if stale:
          hung = min(stale, key=stale.get)  # of those silent too long, the one silent longest
      if (failed or hung is not None) and stopped_since:
        hung = min(stopped_since)  # a stopped host is the cause (its peers wait, or aborted)
      noted = [i for i in range(len(procs)) if _noted_signal(beats[i])]
      if hung is not None:
        cause, stopped = hung, hung in stopped_since
      elif failed and noted:
        cause = noted[0]  # a preempted host: every host checkpoints after the same step
        graceful_until = now + 60.0
      elif failed:
        cause = failed[0]
      if cause is not None and graceful_until is None and not done:
        quiet.set()
        _stop_all(procs)
        continue
    if done:
      break
    if graceful_until is not None and now > graceful_until:
      quiet.set()
      _stop_all(procs)
    time.sleep(0.1)
  for thread in threads:
    thread.join(timeout=5)
  if forwarded is not None:
    return 128 + forwarded
  if cause is None:
    return None
  log = lambda i: os.path.join(workdir, f"host{i}.log")
  code = procs[cause].returncode
  noted = _noted_signal(beats[cause])
  if hung is not None:
    what = ("hung (stopped by a signal)" if stopped else
            f"hung (no progress for {timeout:g} s)")
    status, restartable = 1, True
  else:
    what = _what(code, noted)
    status = 128 + noted if noted else code if 0 < code < 256 else 1
    restartable = code != 2 and noted != signal.SIGINT
  lines = [f"host {cause} {what}; see {log(cause)}"]
  if noted and hung is None:
    resume = _resume_step(argv)
    lines = [f"host {cause} {what}; every host checkpointed"
             + (f" at step {resume}" if not isinstance(resume, bool) and resume is not None
                else "")
             + "; run the same command to resume"]
  elif hung is not None or code < 0:
    for i in exited:
      if i != cause and codes[i] not in (0, None) and codes[i] != -signal.SIGKILL:
        lines.insert(0, f"host {i} stopped: its peer host {cause} "
                        f"{'hung' if hung is not None else 'died' if code < 0 else 'failed'}; "
                        f"see {log(i)}")
  return _Outcome(cause, what, status, restartable, lines)


def _signal(proc: subprocess.Popen, signum: int) -> None:
  """Sends signum to proc's process group (the host and what it started)."""
  try:
    os.killpg(proc.pid, signum)
  except ProcessLookupError:
    pass
