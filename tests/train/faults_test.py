"""Cluster runs that survive their faults without a person (issue 37).

Fast, on localhost (default tier): the launcher's restarts (`max_restarts`), a config error that
never restarts, a hung host named (stopped, or alive without heartbeats), a preempted host, the
SIGTERM handler of the training loops and JAX's heartbeat option.

The fault-injection table (docs/cluster.md, "Faults"), as root on 2 namespaced hosts x 2 devices at 1 Gbit/s
(the multi-host tier; skipped with a reason otherwise), each row a training run (onebit, digits,
30 steps, a checkpoint every 5) hit by one fault and compared, bit for bit, with the same run
uninterrupted: every metrics row and the final parameters and optimizer state. Each row measures
the steps lost, the seconds from the fault to the first training step after it, and the lines
the launcher printed for the fault (progress lines aside); with JLP_FAULT_TABLE=path the rows
are appended there as JSON. The rows are slow (`make test-slow`); in the default tier
cluster_test.py's test_two_hosts_train_as_one_process_through_kill_9_and_ctrl_c has a kill -9
restarted by the launcher (--max_restarts) in real training, resumed bit for bit."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jlp.train import cluster
from runs import VOLATILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEEDS_ROOT = pytest.mark.skipif(not cluster.can_make_namespaces(),
                                reason="needs root (or CAP_NET_ADMIN), iproute2 and unshare")
STEPS, EVERY = 30, 5
PROGRESS = re.compile(r"^step \d+/\d+ ")


def _script(tmp_path, body, name="host.py"):
  path = tmp_path / name
  path.write_text("import os, signal, sys, time\nHOST = int(os.environ['JLP_PROCESS_ID'])\n"
                  "BEAT = os.environ['JLP_HEARTBEAT']\n" + body)
  return str(path)


def _alive(pid):
  try:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


# -- fast: the launcher's decisions on localhost --------------------------------------------------


def test_a_dead_host_restarts_the_group_once(tmp_path):
  """Host 1 kills itself with -9 on the first start: one line, every host starts again, and the
  second start's success is the launcher's (it exited 1 naming host 1)."""
  marker = tmp_path / "died"
  script = _script(tmp_path, f"if HOST == 1 and not os.path.exists('{marker}'):\n"
                             f"  open('{marker}', 'w').close(); os.kill(os.getpid(), 9)\n"
                             "time.sleep(0.5); print('done', HOST)\n")
  said, starts = [], []
  code = cluster.launch(script, [], hosts=2, devices_per_host=1, bandwidth="none",
                        workdir=str(tmp_path / "w"), namespaces=False, max_restarts=2,
                        say=said.append, on_start=starts.append)
  assert code == 0 and said == ["host 1 died (signal 9); restart 1 of 2"]
  assert len(starts) == 2 and not any(_alive(p) for p in starts[0] + starts[1])
  log = (tmp_path / "w" / "host0.log").read_text()
  assert "restart 1 of 2" in log and log.count("done 0") == 1


def test_a_dead_host_without_restarts_fails_the_launch_with_status_1(tmp_path):
  """Host 1 kills itself with -9, host 0 would sleep: the launcher stops it within 30 s and
  names host 1 and its log (status 1: a signal, not an exit status)."""
  script = _script(tmp_path, "if HOST == 1: os.kill(os.getpid(), 9)\ntime.sleep(120)\n")
  begin = time.monotonic()
  with pytest.raises(cluster.ClusterError) as info:
    cluster.launch(script, [], hosts=2, devices_per_host=1, bandwidth="none",
                   workdir=str(tmp_path / "w"), namespaces=False)
  assert time.monotonic() - begin < 30
  assert str(info.value) == f"host 1 died (signal 9); see {tmp_path / 'w' / 'host1.log'}"
  assert info.value.code == 1


def test_restarts_run_out_and_a_config_error_never_restarts(tmp_path):
  said = []
  script = _script(tmp_path, "time.sleep(0.2); sys.exit(3 if HOST == 1 else 0)\n")
  with pytest.raises(cluster.ClusterError, match=r"host 1 exited with status 3; see .*host1.log"):
    cluster.launch(script, [], hosts=2, devices_per_host=1, bandwidth="none",
                   workdir=str(tmp_path / "w"), namespaces=False, max_restarts=2,
                   say=said.append)
  assert said == ["host 1 exited with status 3; restart 1 of 2",
                  "host 1 exited with status 3; restart 2 of 2"]
  said.clear()
  script = _script(tmp_path, "sys.exit(2 if HOST == 1 else 0)\n", name="config.py")
  with pytest.raises(cluster.ClusterError) as info:
    cluster.launch(script, [], hosts=2, devices_per_host=1, bandwidth="none",
                   workdir=str(tmp_path / "w2"), namespaces=False, max_restarts=2,
                   say=said.append)
  assert info.value.code == 2 and not said


@pytest.mark.parametrize("how, what", [
    ("os.kill(os.getpid(), signal.SIGSTOP)", "hung (stopped by a signal)"),
    ("time.sleep(600)", "hung (no progress for 2 s)"),
])
def test_a_hung_host_is_named_and_everything_stops(tmp_path, how, what):
  """Both hosts beat (touch JLP_HEARTBEAT) every 0.1 s; host 1 then stops (SIGSTOP) or sleeps
  without beating: the launcher names host 1 within the heartbeat timeout (+ its look every
  0.1 s), kills both (a stopped process too) and exits 1; nothing runs after it."""
  script = _script(tmp_path, "for k in range(100000):\n"
                             "  open(BEAT, 'w').write('0')\n"
                             "  time.sleep(0.1)\n"
                             f"  if HOST == 1 and k == 3: {how}\n")
  starts = []
  begin = time.monotonic()
  with pytest.raises(cluster.ClusterError) as info:
    cluster.launch(script, [], hosts=2, devices_per_host=1, bandwidth="none",
                   workdir=str(tmp_path / "w"), namespaces=False, heartbeat_timeout=2,
                   on_start=starts.append)
  assert time.monotonic() - begin < 1 + 2 + 15
  assert str(info.value) == f"host 1 {what}; see {tmp_path / 'w' / 'host1.log'}"
  assert info.value.code == 1 and not any(_alive(p) for p in starts[0])


def test_a_preempted_host_checkpoints_the_group_and_exits_143(tmp_path):
  """Host 1 takes a SIGTERM (its heartbeat file notes 15; every host exits 130 after the same
  step, as the training loops do): no restart without --max_restarts, exit 143 and one line; with
  restarts the group starts again."""
  marker = tmp_path / "preempted"
  script = _script(tmp_path, f"if not os.path.exists('{marker}'):\n"
                             "  time.sleep(0.3)\n"
                             f"  if HOST == 1: open('{marker}', 'w').close(); "
                             "open(BEAT, 'w').write('15')\n"
                             "  time.sleep(0.3); sys.exit(130)\n")
  with pytest.raises(cluster.ClusterError) as info:
    cluster.launch(script, [], hosts=2, devices_per_host=1, bandwidth="none",
                   workdir=str(tmp_path / "w"), namespaces=False)
  assert info.value.code == 143
  assert str(info.value) == ("host 1 got SIGTERM and checkpointed; every host checkpointed; run "
                             "the same command to resume")
  marker.unlink()
  said = []
  assert cluster.launch(script, [], hosts=2, devices_per_host=1, bandwidth="none",
                        workdir=str(tmp_path / "w"), namespaces=False, max_restarts=1,
                        say=said.append) == 0
  assert said == ["host 1 got SIGTERM and checkpointed; restart 1 of 1"]


def test_the_terminal_gets_progress_not_tracebacks():
  """Host 0's echo: progress lines and a progress bar's carriage-return updates pass; gloo's
  lines (even written in pieces), absl's log lines, and everything from a traceback on stay in
  the log only."""
  import io  # pylint: disable=g-import-not-at-top
  chunks = [b"[Gloo] Rank ", b"0 is connected to 1 peer ranks\nstep 1/2 loss=1\n",
            b"E1129 10:00:00.1 1 coordination_service.cc:1] missing heartbeats\nThe tasks\n",
            b"\r 50%|#####", b"\r100%|##########\n", b"ERROR:absl:Failed to json parse\nstep 2/2 loss=",
            b"0.5\nTraceback (most recent call last):\n  File x\nstep 3/2\n"]
  log, echo = io.BytesIO(), io.BytesIO()

  class Pipe:  # one write of the host per read
    def __init__(self):
      self.left = list(chunks)

    def read1(self, _):
      return self.left.pop(0) if self.left else b""
  cluster._tee(Pipe(), log, echo)  # pylint: disable=protected-access
  assert log.getvalue() == b"".join(chunks)
  assert echo.getvalue() == (b"step 1/2 loss=1\n\r 50%|#####\r100%|##########\n"
                             b"step 2/2 loss=0.5\n")


def test_sigterm_is_handled_as_ctrl_c_with_a_heartbeat(tmp_path):
  """The loops' Interrupt: a SIGTERM sets the flag (the loop checkpoints and returns) and notes
  the signal in the heartbeat file; each agreed() touches the file."""
  beat = tmp_path / "beat"
  code = ("import os, signal, time\n"
          "from jlp.train.loop_common import Interrupt\n"
          "with Interrupt() as stop:\n"
          "  assert not stop.agreed()\n"
          f"  first = os.stat('{beat}').st_mtime_ns\n"
          "  time.sleep(0.05)\n"
          "  os.kill(os.getpid(), signal.SIGTERM)\n"
          "  assert stop.agreed() and stop.signum == signal.SIGTERM\n"
          f"  assert os.stat('{beat}').st_mtime_ns > first\n"
          "print('flagged')\n")
  env = dict(os.environ, JLP_HEARTBEAT=str(beat), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0 and "flagged" in out.stdout, out.stderr[-2000:]
  assert beat.read_text().strip() == "15"


def test_the_heartbeat_timeout_reaches_jax(monkeypatch):
  from jlp.train import distributed  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  seen = {}
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: seen.update(kw))
  monkeypatch.setattr(jax.config, "update", lambda *a: None)
  monkeypatch.setenv("JLP_HEARTBEAT_TIMEOUT", "17")
  distributed.initialize("127.0.0.1:1234", 1, 0)
  assert seen["heartbeat_timeout_seconds"] == 17


# -- the fault-injection table on the namespaced cluster ------------------------------------------


def _train_args(run):
  return ["experiments.train", f"--config={REPO}/configs/digits.py:local", f"--workdir={run}",
          "--config.compression.name=onebit", f"--config.max_steps={STEPS}",
          f"--config.checkpoint_every={EVERY}", "--config.log_every=1", "--progress=lines"]


class Launcher:
  """`python -m experiments.cluster` on 2 hosts x 2 devices at 1 Gbit/s, its output lines kept
  with the time they came."""

  def __init__(self, work, run, *flags):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    self.work = work
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.cluster", "--hosts=2", "--devices_per_host=2",
         "--bandwidth=1gbit", f"--workdir={work}", *flags, "--", *_train_args(run)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self.lines: list[tuple[float, str]] = []
    self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                     for s in (self.proc.stdout, self.proc.stderr)]
    for r in self._readers:
      r.start()

  def _read(self, stream):
    for line in stream:
      self.lines.append((time.monotonic(), line.rstrip("\n")))

  def wait(self, timeout=600):
    code = self.proc.wait(timeout=timeout)
    for r in self._readers:
      r.join(timeout=10)
    return code

  def pid(self, host):
    return int((self.work / f"host{host}.pid").read_text().split()[0])

  def at_step(self, step, timeout=300):
    """Waits until host 0 has printed `step k/..` with k >= step; returns that k."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      done = [int(m.group(1)) for _, line in list(self.lines)
              for m in [re.match(r"^step (\d+)/", line)] if m]
      if done and done[-1] >= step:
        return done[-1]
      assert self.proc.poll() is None, self.lines[-20:]
      time.sleep(0.02)
    raise AssertionError(f"step {step} never came: {self.lines[-20:]}")

  def after(self, since):
    """The non-progress lines printed after `since`."""
    return [line for t, line in self.lines if t >= since and not PROGRESS.match(line)]

  def resumed(self, since):
    """When host 0's first training step after `since` was done: its heartbeat file (remade at
    every start, touched once per step) changed after a restart, or a progress line came."""
    steps = [t for t, line in self.lines if t > since and PROGRESS.match(line)]
    return steps[0] if steps else None


def _metrics(run):
  rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
  return [{k: v for k, v in row.items() if k not in VOLATILE} for row in rows]


def _final_state(run):
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(run, "checkpoints", str(STEPS), "state")
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                      is_leaf=lambda x: hasattr(x, "shape"))
  leaves = jax.tree_util.tree_flatten_with_path(checkpointer.restore(path, restore_args=args))[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def _netns():
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
  return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _left(work):
  """This launch's namespaces (work/network.json names them) that still exist."""
  made = {h["namespace"] for h in json.load(open(work / "network.json"))["hosts"]}
  return made & _netns()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The same cluster run without a fault: its metrics rows and final state."""
  work = tmp_path_factory.mktemp("uninterrupted")
  args = _train_args(work / "run")  # as Launcher runs it, from this process (~1.5 s less)
  assert cluster.launch(args[0], args[1:], hosts=2, devices_per_host=2, bandwidth="1gbit",
                        workdir=str(work)) == 0
  return _metrics(work / "run"), _final_state(work / "run")


def _same_as_uninterrupted(run, uninterrupted):
  rows, state = uninterrupted
  got = {r["step"]: r for r in _metrics(run)}
  assert sorted(got) == [r["step"] for r in rows]
  for row in rows:
    assert got[row["step"]] == row, row["step"]
  final = _final_state(run)
  assert sorted(final) == sorted(state)
  for key, value in state.items():
    assert final[key].dtype == value.dtype and final[key].tobytes() == value.tobytes(), key


def _record(row):
  print("FAULT ROW", json.dumps(row))
  path = os.environ.get("JLP_FAULT_TABLE")
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")


def _restart_step(lines):
  for line in lines:
    if re.search(r"restart \d+ of \d+ from the start", line):
      return 0
    m = re.search(r"restart \d+ of \d+ from step (\d+)", line)
    if m:
      return int(m.group(1))
  return None


def _reached(log, attempt):
  """The last step host 0 logged in start `attempt` (0, 1, ...) of a launch (the launcher marks
  each restart in the log)."""
  text = log.read_text(errors="replace").split("\n--- launcher: ")[attempt]
  return max(int(m) for m in re.findall(r"^step (\d+)/", text, re.M))


def _newest_checkpoint_folder(run):
  folder = run / "checkpoints"
  return folder / str(max(int(d) for d in os.listdir(folder) if d.isdigit()))


def _complete(run):
  """The newest complete checkpoint of `run` (0: none)."""
  from jlp.train import checkpoint  # pylint: disable=g-import-not-at-top
  return checkpoint.good_step(str(run), say=False)[0] or 0


def _fault(kind, launcher, run):
  """Injects fault `kind`; returns [(fault time, the newest complete checkpoint then)]."""
  if kind == "kill -9 of a host":
    launcher.at_step(12)
    t = time.monotonic()
    os.kill(launcher.pid(1), signal.SIGKILL)
    return [(t, _complete(run))]
  if kind == "SIGSTOP of a host":
    launcher.at_step(12)
    t = time.monotonic()
    os.kill(launcher.pid(1), signal.SIGSTOP)
    return [(t, _complete(run))]
  if kind == "kill -9 during a checkpoint save":
    launcher.at_step(11)
    folder = run / "checkpoints"
    deadline = time.monotonic() + 120
    while not [d for d in os.listdir(folder) if "tmp" in d]:
      assert time.monotonic() < deadline, "no save seen"
      time.sleep(0.001)
    os.kill(launcher.pid(1), signal.SIGKILL)
    return [(time.monotonic(), _complete(run))]
  if kind == "SIGTERM to one host":
    launcher.at_step(12)
    t = time.monotonic()
    os.kill(launcher.pid(1), signal.SIGTERM)
    return [(t, _complete(run))]
  if kind == "two faults in one run":
    launcher.at_step(8)
    t = time.monotonic()
    os.kill(launcher.pid(1), signal.SIGKILL)
    faults = [(t, _complete(run))]
    launcher.at_step(22)
    t = time.monotonic()
    os.kill(launcher.pid(0), signal.SIGSTOP)
    return faults + [(t, _complete(run))]
  raise ValueError(kind)


FAULTS = {  # kind: launcher flags
    "kill -9 of a host": ["--max_restarts=2"],
    "SIGSTOP of a host": ["--max_restarts=2", "--heartbeat_timeout=10"],
    "kill -9 during a checkpoint save": ["--max_restarts=2"],
    "SIGTERM to one host": ["--max_restarts=2"],
    "two faults in one run": ["--max_restarts=2", "--heartbeat_timeout=10"],
}


@NEEDS_ROOT
@pytest.mark.parametrize("kind", [
    pytest.param("kill -9 of a host", marks=pytest.mark.slow),
    pytest.param("SIGSTOP of a host", marks=pytest.mark.slow),
    pytest.param("kill -9 during a checkpoint save", marks=pytest.mark.slow),
    pytest.param("SIGTERM to one host", marks=pytest.mark.slow),
    pytest.param("two faults in one run", marks=pytest.mark.slow),
])
def test_a_fault_with_restarts_is_survived_bit_for_bit(tmp_path, uninterrupted, kind):
  """One launch with --max_restarts=2: the fault, one restart line (a hung host named within
  heartbeat_timeout + 15 s), the run completes and equals the uninterrupted run; steps lost are
  at most those since the last complete checkpoint; no namespace is left."""
  work, run = tmp_path / "cluster", tmp_path / "cluster" / "run"
  launcher = Launcher(work, run, *FAULTS[kind])
  faults = _fault(kind, launcher, run)
  assert launcher.wait() == 0, launcher.lines[-30:]
  _same_as_uninterrupted(run, uninterrupted)
  assert not _left(work)
  timeout = 10 if "heartbeat" in " ".join(FAULTS[kind]) else 60
  for k, (t, complete) in enumerate(faults):
    end = faults[k + 1][0] if k + 1 < len(faults) else float("inf")
    lines = [line for line in launcher.after(t) if launcher.lines and
             next(u for u, x in launcher.lines if x == line) < end]
    restart = [line for line in lines if re.search(r"; restart \d+ of \d+", line)]
    assert len(restart) == 1 and len(lines) <= 15, lines
    named = next(u for u, x in launcher.lines if x == restart[0])
    if "SIGSTOP" in kind or k == 1:
      assert "hung (stopped by a signal)" in restart[0] and named - t < timeout + 15
    resumed_from = _restart_step(restart)
    reached = _reached(work / "host0.log", k)
    lost = reached - resumed_from
    assert resumed_from >= complete and 0 <= lost <= reached - complete
    if "SIGTERM" in kind:
      assert lost == 0
    back = launcher.resumed(named)
    _record({"fault": kind if len(faults) == 1 else f"{kind} ({k + 1})", "steps_lost": lost,
             "named_s": round(named - t, 1), "resumed_s": round(back - t, 1),
             "lines": len(lines), "line": restart[0], "printed": lines})


@NEEDS_ROOT
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["a truncated latest checkpoint", "SIGTERM to the launcher"])
def test_a_fault_then_the_same_command_is_survived_bit_for_bit(tmp_path, uninterrupted, kind):
  """Without restarts: SIGTERM to the launcher (every host checkpoints after the same step, exit
  143), or a kill -9 followed by a truncated file in the newest checkpoint; the same command then
  resumes (from the previous checkpoint, with one line saying so) and equals the uninterrupted
  run."""
  work, run = tmp_path / "cluster", tmp_path / "cluster" / "run"
  launcher = Launcher(work, run)
  launcher.at_step(17)
  t = time.monotonic()
  if kind == "SIGTERM to the launcher":
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait() == 143, launcher.lines[-20:]
  else:
    os.kill(launcher.pid(1), signal.SIGKILL)
    assert launcher.wait() == 1
  lines = launcher.after(t)
  assert not _left(work)
  newest = _newest_checkpoint_folder(run)
  if kind == "a truncated latest checkpoint":
    files = [os.path.join(r, f) for r, _, fs in os.walk(newest / "state") for f in fs]
    os.truncate(max(files, key=os.path.getsize), 10)
  complete = _complete(run)
  again = Launcher(work, run)
  assert again.wait() == 0, again.lines[-20:]
  lines += again.after(0)
  _same_as_uninterrupted(run, uninterrupted)
  assert not _left(work)
  if kind == "a truncated latest checkpoint":
    fallback = [x for x in lines if x.startswith(f"checkpoint {newest.name} in ")]
    assert len(fallback) == 1 and "is not used" in fallback[0], lines
    resumed_from = int(re.search(r"resuming from step (\d+)", fallback[0]).group(1))
  else:
    resumed_from = int(newest.name)
  lines = [x for x in lines if not x.startswith("[Gloo]")]
  assert len(lines) <= 15, lines
  lost = _reached(work / "host0.log.1", 0) - resumed_from
  assert resumed_from == complete and lost >= 0
  if kind == "SIGTERM to the launcher":
    assert lost == 0
  _record({"fault": kind, "steps_lost": lost, "named_s": None,
           "resumed_s": round(again.resumed(0) - t, 1), "lines": len(lines),
           "line": (lines or [""])[-1], "printed": lines})
