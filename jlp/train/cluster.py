"""A cluster on one machine: H host processes, each in its own network namespace with its own
hostname, joined by a Linux bridge whose links are shaped with tbf, running one command that
joins JAX's multi-controller runtime (`jlp.train.distributed.initialize()` reads what the launcher
exports). `python -m experiments.cluster` is the command-line front end.

What it does to the machine (root or CAP_NET_ADMIN, iproute2, util-linux's `unshare`), all of it
named `jlp<run id>...` and removed on every exit path (success, failure, SIGINT, SIGTERM):
  * a bridge `jlp<id>br` (no address: the root namespace takes no part), and per host i a network
    namespace `jlp<id>h<i>` holding one end of a veth pair (`eth0`, 10.R.S.(i + 1)/24 in a private
    /24 picked per run) whose other end (`jlp<id>v<i>`) is on the bridge; no route, NAT or
    forwarding to anything outside: traffic stays among the run's hosts;
  * with a bandwidth, a tbf qdisc (`rate R burst 1mb latency 100ms`) on both ends of every veth,
    so each host's upload and download are shaped to R (tc has no netem here: bandwidth only);
  * `/etc/netns/jlp<id>h<i>/hosts`, which `ip netns exec` mounts over /etc/hosts: every host's
    name h<i> resolves to its namespace address (gloo connects to the address of the peer's
    hostname, so each host runs under `unshare --uts` with its own hostname).
After a `kill -9` of the launcher, `remove_leftovers()` (`python -m experiments.cluster --cleanup`)
removes whatever any launcher left.

Without root the hosts run on localhost, unshaped (`--bandwidth` other than none is then an
error).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["ClusterError", "HostSpec", "can_make_namespaces", "check_bandwidth", "launch",
           "remove_leftovers"]

PREFIX = "jlp"
COORDINATOR_PORT = 61234
ENV_COORDINATOR = "JLP_COORDINATOR"
ENV_NUM_PROCESSES = "JLP_NUM_PROCESSES"
ENV_PROCESS_ID = "JLP_PROCESS_ID"
ENV_HETERO = "JLP_HETERO"
ENV_PROGRESS_BAR = "JLP_PROGRESS_BAR"
STOP_GRACE_S = 20.0  # after one host fails: SIGTERM the others, SIGKILL after this


class ClusterError(RuntimeError):
  """The launcher's one-line failure (a host's exit, the network set-up)."""


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")


def check_bandwidth(bandwidth: str) -> str | None:
  """`bandwidth` as tc's rate ("100mbit", "1gbit"), or None for "none"; ValueError otherwise."""
  if bandwidth == "none":
    return None
  if not isinstance(bandwidth, str) or not _RATE.match(bandwidth.lower()) or \
      float(_RATE.match(bandwidth.lower()).group(1)) <= 0:
    raise ValueError(f"--bandwidth={bandwidth!r} is not allowed; expected 'none' or a positive "
                     "rate with a unit bit, kbit, mbit or gbit (e.g. 100mbit, 1gbit).")
  return bandwidth.lower()


def can_make_namespaces() -> bool:
  """Whether this process may create network namespaces (root with iproute2 and unshare)."""
  return (os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
          and shutil.which("unshare") is not None)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
  out = subprocess.run(argv, capture_output=True, text=True, check=False)
  if check and out.returncode:
    raise ClusterError(f"`{' '.join(argv)}` failed: {out.stderr.strip() or out.stdout.strip()}")
  return out


@dataclasses.dataclass
class HostSpec:
  """Host i of a launch: its namespace (None on localhost), hostname and address."""
  index: int
  namespace: str | None
  hostname: str
  address: str


class Network:
  """The bridge, namespaces, veths and hosts files of one launch (module docstring)."""

  def __init__(self, hosts: int, bandwidth: str | None):
    self.run_id = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
    self.name = f"{PREFIX}{self.run_id}"
    self.bridge = f"{self.name}br"
    subnet = random.Random(self.name).randrange(64, 250), random.randrange(1, 250)
    self.hosts = [HostSpec(i, f"{self.name}h{i}", f"h{i}", f"10.{subnet[0]}.{subnet[1]}.{i + 1}")
                  for i in range(hosts)]
    self.bandwidth = bandwidth
    self._made: list[tuple[str, str]] = []  # what to remove, in reverse order

  def __enter__(self) -> "Network":
    try:
      _run("ip", "link", "add", self.bridge, "type", "bridge")
      self._made.append(("link", self.bridge))
      _run("ip", "link", "set", self.bridge, "up")
      hosts_file = "127.0.0.1 localhost\n" + "".join(
          f"{h.address} {h.hostname}\n" for h in self.hosts)
      for h in self.hosts:
        _run("ip", "netns", "add", h.namespace)
        self._made.append(("netns", h.namespace))
        etc = f"/etc/netns/{h.namespace}"
        os.makedirs(etc, exist_ok=True)
        self._made.append(("dir", etc))
        with open(os.path.join(etc, "hosts"), "w") as f:
          f.write(hosts_file)
        outside, inside = f"{self.name}v{h.index}", f"{self.name}i{h.index}"
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        self._made.append(("link", outside))
        _run("ip", "link", "set", inside, "netns", h.namespace)
        _run("ip", "link", "set", outside, "master", self.bridge)
        _run("ip", "link", "set", outside, "up")
        ns = ("ip", "netns", "exec", h.namespace)
        _run(*ns, "ip", "link", "set", inside, "name", "eth0")
        _run(*ns, "ip", "addr", "add", f"{h.address}/24", "dev", "eth0")
        _run(*ns, "ip", "link", "set", "eth0", "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        if self.bandwidth is not None:
          shape = ("root", "tbf", "rate", self.bandwidth, "burst", "1mb", "latency", "100ms")
          _run("tc", "qdisc", "add", "dev", outside, *shape)
          _run(*ns, "tc", "qdisc", "add", "dev", "eth0", *shape)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Removes everything this network made (each step on its own: one failure stops none)."""
    while self._made:
      kind, name = self._made.pop()
      if kind == "link":
        _run("ip", "link", "del", name, check=False)
      elif kind == "netns":
        _run("ip", "netns", "del", name, check=False)
      else:
        shutil.rmtree(name, ignore_errors=True)

  def command(self, host: HostSpec, argv: Sequence[str]) -> list[str]:
    """argv run as `host`: in its namespace, under its own hostname."""
    return ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', host.hostname, *argv]


def remove_leftovers() -> list[str]:
  """Stops the hosts a launcher left running (e.g. after its kill -9) and removes every
  namespace, link and /etc/netns entry it left; returns their names."""
  removed = []
  names = _run("ip", "netns", "list", check=False).stdout.split()
  for name in names:
    if re.match(rf"^{PREFIX}\d{{6}}h\d+$", name):
      # The hosts of a killed launcher may still run inside: stop them first.
      for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        try:
          os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
          pass
      _run("ip", "netns", "del", name, check=False)
      removed.append(name)
  links = _run("ip", "-o", "link", "show", check=False).stdout.splitlines()
  for line in links:
    match = re.match(rf"^\d+: ({PREFIX}\d{{6}}(?:br|v\d+))[@:]", line)
    if match:
      _run("ip", "link", "del", match.group(1), check=False)
      removed.append(match.group(1))
  if os.path.isdir("/etc/netns"):
    for name in os.listdir("/etc/netns"):
      if re.match(rf"^{PREFIX}\d{{6}}h\d+$", name):
        shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
        removed.append(f"/etc/netns/{name}")
  return removed


def _python_argv(target: str, args: Sequence[str]) -> list[str]:
  """A module (experiments.train) or a script (path.py) with its arguments."""
  if target.endswith(".py") or os.sep in target:
    return [sys.executable, "-u", target, *args]
  return [sys.executable, "-u", "-m", target, *args]


def _tee(pipe, log, echo) -> None:
  for chunk in iter(lambda: pipe.read1(4096), b""):
    log.write(chunk)
    log.flush()
    if echo is not None:
      echo.write(chunk)
      echo.flush()


def launch(target: str, args: Sequence[str], *, hosts: int, devices_per_host: int,
           bandwidth: str, workdir: str, hetero: float = 0.0, namespaces: bool | None = None,
           echo=None, on_start=None) -> int:
  """Runs `target args` on `hosts` host processes of `devices_per_host` CPU devices each (module
  docstring) and returns 0, or raises ClusterError naming the first host that failed (its exit
  status and log) after stopping the others. SIGINT / SIGTERM to the launcher are passed to every
  host (a training run then checkpoints and exits 130); the launcher returns 130 / 143.

  namespaces: True / False / None (= whether this process can make them). echo: where host 0's
  output goes besides its log (e.g. sys.stdout.buffer). on_start(pids): called once every host
  runs (tests)."""
  for name, value, low in (("hosts", hosts, 1), ("devices_per_host", devices_per_host, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"--{name}={value!r} is not allowed; expected an integer >= {low}.")
  if isinstance(hetero, bool) or not isinstance(hetero, (int, float)) or not hetero >= 0:
    raise ValueError(f"--hetero={hetero!r} is not allowed; expected seconds >= 0.")
  rate = check_bandwidth(bandwidth)
  if namespaces is None:
    namespaces = can_make_namespaces()
  if not namespaces and rate is not None:
    raise ValueError(f"--bandwidth={bandwidth} is not allowed without network namespaces (root, "
                     "iproute2 and unshare); expected none (the hosts then run on localhost, "
                     "unshaped).")
  os.makedirs(workdir, exist_ok=True)
  env = dict(os.environ)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = " ".join(
      [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f] +
      [f"--xla_force_host_platform_device_count={devices_per_host}"])
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # hosts compile at once: no shared cache
  env[ENV_NUM_PROCESSES] = str(hosts)
  if hetero:
    env[ENV_HETERO] = str(float(hetero))
  if echo is not None and hasattr(echo, "isatty") and echo.isatty():
    env[ENV_PROGRESS_BAR] = "1"

  network = Network(hosts, rate) if namespaces else None
  signals = {"got": None}

  def forward(signum, _frame):
    signals["got"] = signum

  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  procs: list[subprocess.Popen] = []
  threads = []
  logs = []
  try:
    if network is not None:
      network.__enter__()
      specs = network.hosts
      coordinator = f"{specs[0].address}:{COORDINATOR_PORT}"
      with open(os.path.join(workdir, "network.json"), "w") as f:
        json.dump({"bridge": network.bridge, "bandwidth": rate,
                   "hosts": [dataclasses.asdict(h) for h in specs]}, f, indent=1)
    else:
      import socket  # pylint: disable=g-import-not-at-top
      with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
      specs = [HostSpec(i, None, "localhost", "127.0.0.1") for i in range(hosts)]
      coordinator = f"127.0.0.1:{port}"
    argv = _python_argv(target, args)
    for h in specs:
      host_env = dict(env, **{ENV_COORDINATOR: coordinator, ENV_PROCESS_ID: str(h.index)})
      command = network.command(h, argv) if network is not None else argv
      path = os.path.join(workdir, f"host{h.index}.log")
      log = open(path, "wb")  # pylint: disable=consider-using-with
      logs.append(log)
      proc = subprocess.Popen(command, env=host_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
      procs.append(proc)
      with open(os.path.join(workdir, f"host{h.index}.pid"), "w") as f:
        f.write(f"{proc.pid}\n")
      thread = threading.Thread(target=_tee, args=(proc.stdout, log, echo if h.index == 0
                                                   else None), daemon=True)
      thread.start()
      threads.append(thread)
    if on_start is not None:
      on_start([p.pid for p in procs])
    failed = forwarded = kill_at = None
    while True:
      if signals["got"] is not None and forwarded is None:
        forwarded = signals["got"]
        for p in procs:
          _signal(p, signal.SIGINT if forwarded == signal.SIGINT else signal.SIGTERM)
        kill_at = time.monotonic() + 60.0  # time to write a checkpoint
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes):
        break
      if failed is None and forwarded is None:
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
          for p in procs:
            if p.poll() is None:
              _signal(p, signal.SIGTERM)
          kill_at = time.monotonic() + STOP_GRACE_S
      if kill_at is not None and time.monotonic() > kill_at:
        for p in procs:
          if p.poll() is None:
            _signal(p, signal.SIGKILL)
      time.sleep(0.1)
    for thread in threads:
      thread.join(timeout=5)
    if forwarded is not None:
      return 130 if forwarded == signal.SIGINT else 143
    if failed is not None:
      code = procs[failed].returncode
      status = f"signal {-code}" if code < 0 else f"status {code}"
      raise ClusterError(f"host {failed} exited with {status}; see "
                         f"{os.path.join(workdir, f'host{failed}.log')}")
    return 0
  finally:
    for p in procs:
      if p.poll() is None:
        _signal(p, signal.SIGKILL)
        p.wait()
    for log in logs:
      log.close()
    if network is not None:
      network.close()
    for s, handler in old.items():
      signal.signal(s, handler)


def _signal(proc: subprocess.Popen, signum: int) -> None:
  """Sends signum to proc's process group (the host and what it started)."""
  try:
    os.killpg(proc.pid, signum)
  except ProcessLookupError:
    pass
