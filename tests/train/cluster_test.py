"""The cluster launcher (`python -m experiments.cluster`, `jlp.train.cluster`): argument checks,
the network it makes and removes, and (as root, with iproute2: the multi-host tier, which CI runs)
data-parallel training with onebit on 2 hosts x 2 devices over shaped links, bit for bit the
single-process run on 4 devices, through a Ctrl-C and a `kill -9` of a host, each followed by a
resume with the same command."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jlp.train import cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEEDS_ROOT = pytest.mark.skipif(not cluster.can_make_namespaces(),
                                reason="needs root (or CAP_NET_ADMIN), iproute2 and unshare")


@pytest.mark.parametrize("bandwidth, ok", [("none", None), ("1gbit", "1gbit"),
                                           ("100MBIT", "100mbit"), ("2.5mbit", "2.5mbit")])
def test_bandwidth_is_a_tc_rate(bandwidth, ok):
  assert cluster.check_bandwidth(bandwidth) == ok


@pytest.mark.parametrize("bandwidth", ["fast", "100", "0mbit", "1 gbit", "-1gbit"])
def test_bad_bandwidth_names_the_flag(bandwidth):
  with pytest.raises(ValueError, match=r"--bandwidth=.* is not allowed; expected 'none' or"):
    cluster.check_bandwidth(bandwidth)


def test_shaping_without_namespaces_is_an_error(tmp_path):
  with pytest.raises(ValueError, match=r"--bandwidth=1gbit is not allowed without network "):
    cluster.launch("experiments.train", [], hosts=2, devices_per_host=1, bandwidth="1gbit",
                   workdir=str(tmp_path), namespaces=False)
  with pytest.raises(ValueError, match=r"--hosts=0 is not allowed"):
    cluster.launch("experiments.train", [], hosts=0, devices_per_host=1, bandwidth="none",
                   workdir=str(tmp_path), namespaces=False)


def test_a_failing_host_is_named_with_its_log_on_localhost(tmp_path):
  """Without namespaces the hosts run on localhost; host 1 fails at once, host 0 would sleep:
  the launcher stops it and names host 1, its status and its log, in one line."""
  script = tmp_path / "fail.py"
  script.write_text("import os, sys, time\n"
                    "if os.environ['JLP_PROCESS_ID'] == '1': sys.exit(3)\n"
                    "time.sleep(120)\n")
  start = time.monotonic()
  with pytest.raises(cluster.ClusterError) as info:
    cluster.launch(str(script), [], hosts=2, devices_per_host=1, bandwidth="none",
                   workdir=str(tmp_path / "w"), namespaces=False)
  assert time.monotonic() - start < 30
  assert str(info.value) == (f"host 1 exited with status 3; see {tmp_path / 'w' / 'host1.log'}")
  assert (tmp_path / "w" / "host0.pid").read_text().strip().isdigit()


def _netns() -> set[str]:
  return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=False).stdout.split())


@NEEDS_ROOT
def test_the_network_is_made_shaped_and_removed():
  with cluster.Network(2, "100mbit") as network:
    names = {h.namespace for h in network.hosts}
    assert names <= {n for n in _netns()}
    qdisc = subprocess.run(["ip", "netns", "exec", network.hosts[0].namespace, "tc", "qdisc",
                            "show", "dev", "eth0"], capture_output=True, text=True, check=True)
    assert "tbf" in qdisc.stdout and "100Mbit" in qdisc.stdout
    hosts = open(f"/etc/netns/{network.hosts[1].namespace}/hosts").read()
    assert f"{network.hosts[0].address} h0" in hosts
    routes = subprocess.run(["ip", "netns", "exec", network.hosts[0].namespace, "ip", "route"],
                            capture_output=True, text=True, check=True).stdout
    assert "default" not in routes  # nothing leaves the run's /24
  assert not names & _netns()
  assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


def _metrics(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [{k: v for k, v in row.items() if k not in ("time", "throughput")} for row in rows]


def _train_args(workdir, steps=20):
  return ["experiments.train", "--config=configs/digits.py:local", f"--workdir={workdir}",
          "--config.compression.name=onebit", f"--config.max_steps={steps}",
          "--config.checkpoint_every=5", "--progress=lines"]


def _launcher(workdir, args, **kwargs):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen([sys.executable, "-m", "experiments.cluster", "--hosts=2",
                           "--devices_per_host=2", "--bandwidth=1gbit", f"--workdir={workdir}",
                           "--", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for(path, text, timeout=120):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path) and text in open(path, errors="replace").read():
      return
    time.sleep(0.2)
  raise AssertionError(f"{text!r} never appeared in {path}")


@NEEDS_ROOT
def test_two_hosts_train_as_one_process_through_ctrl_c_and_kill_9(tmp_path):
  """onebit data-parallel training on 2 namespaced hosts x 2 devices at 1 Gbit/s: interrupted
  with Ctrl-C (exit 130, checkpoint), resumed, a host killed with -9 (the launcher names it and
  exits 1 within 30 s), resumed again to the end: the metrics equal, bit for bit, one process
  with 4 devices running the same config without interruption (the evaluation loss, a psum, to
  float32 rounding); no namespace is left behind."""
  reference = tmp_path / "one_process"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  subprocess.run([sys.executable, "-m", *_train_args(reference, 20)], cwd=REPO, env=env,
                 check=True, capture_output=True)
  work, run = tmp_path / "cluster", tmp_path / "cluster" / "run"

  def made():  # this launch's namespaces (DIR/network.json names them)
    return {h["namespace"] for h in json.load(open(work / "network.json"))["hosts"]}

  launcher = _launcher(work, _train_args(run, 20))
  _wait_for(work / "host0.log", "step 5/20")
  assert made() <= _netns()
  launcher.send_signal(signal.SIGINT)
  out, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 130, err[-2000:]
  assert not made() & _netns()

  launcher = _launcher(work, _train_args(run, 20))
  _wait_for(work / "host0.log", "step 15/20")
  os.kill(int((work / "host1.pid").read_text()), signal.SIGKILL)
  killed = time.monotonic()
  out, err = launcher.communicate(timeout=120)
  assert time.monotonic() - killed < 30
  assert launcher.returncode == 1
  assert err.strip().splitlines()[-1] == (
      f"error: host 1 exited with signal 9; see {work / 'host1.log'}")
  assert not made() & _netns()

  launcher = _launcher(work, _train_args(run, 20))
  out, err = launcher.communicate(timeout=300)
  assert launcher.returncode == 0, err[-2000:]
  assert "step 20/20" in out
  _rows_match(run, reference)  # a resumed run rewrote the rows after its checkpoint


def _rows_match(got_dir, expected_dir):
  """The metrics of `got_dir` equal those of `expected_dir` bit for bit, the evaluation loss (a
  psum, whose float32 order depends on the device layout) to float32 rounding."""
  by_step = {r["step"]: r for r in _metrics(got_dir)}
  expected = _metrics(expected_dir)
  assert expected and sorted(by_step) == [r["step"] for r in expected]
  for row in expected:
    mine = dict(by_step[row["step"]])
    mine.pop("virtual_throughput", None)
    row = {k: v for k, v in row.items() if k != "virtual_throughput"}
    if "eval_loss" in row:
      assert mine.pop("eval_loss") == pytest.approx(row.pop("eval_loss"), rel=1e-6)
    assert mine == row


@NEEDS_ROOT
def test_a_pipeline_spans_both_hosts(tmp_path):
  """1F1B with partial reduce under virtual stalls, 2 pipelines x 2 stages on 2 hosts x 2 devices:
  stage s of every pipeline runs on host s (activations cross the shaped link, each stage's
  average stays on its host); the metrics equal one process with 4 devices."""
  args = ["--config=configs/digits.py:local", "--config.max_steps=10",
          "--config.pipeline.schedule=1f1b", "--config.pipeline.stages=2",
          "--config.pipeline.sync=preduce", "--config.pipeline.hetero=0.1", "--progress=lines"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  reference = tmp_path / "one_process"
  subprocess.run([sys.executable, "-m", "experiments.train", *args, f"--workdir={reference}"],
                 cwd=REPO, env=env, check=True, capture_output=True)
  work = tmp_path / "cluster"
  launcher = _launcher(work, ["experiments.train", *args, f"--workdir={work / 'run'}"])
  out, err = launcher.communicate(timeout=300)
  assert launcher.returncode == 0, err[-2000:]
  _rows_match(work / "run", reference)


@NEEDS_ROOT
def test_a_packed_wire_allreduce_across_hosts(tmp_path):
  """An e4m3 ring all-reduce (Kahan, APS) over 2 hosts x 2 devices at 100 Mbit/s: the packed wire
  (1-byte codes) and the float32 wire give the same bits, and the same as 4 devices of this
  process."""
  sys.path.insert(0, os.path.dirname(__file__))
  import cluster_allreduce_driver as driver  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  code = cluster.launch(driver.__file__, [str(tmp_path)], hosts=2, devices_per_host=2,
                        bandwidth="100mbit", workdir=str(tmp_path / "w"))
  assert code == 0
  got = np.load(tmp_path / "allreduce.npz")
  expected = driver.reduce_all(jax.devices()[:4])
  assert np.array_equal(got["packed"].view(np.uint32), got["float32"].view(np.uint32))
  assert np.array_equal(got["packed"].view(np.uint32), expected["packed"].view(np.uint32))


def test_sync_timing_rows_on_this_processes_devices(fast_compile):
  """time_syncs over the 8 devices of this process: one row per case, positive times, and the
  syncs' own byte counts (the packed e4m3 ring a quarter of the float32 ring's)."""
  from jlp.train import sync_timing  # pylint: disable=g-import-not-at-top
  cases = [c for c in sync_timing.CASES if c[0] in ("float32 psum", "float32 ring",
                                                    "e4m3 ring, packed wire", "onebit PS")]
  rows = {r["case"]: r for r in sync_timing.time_syncs(4096, repeats=2, cases=cases)}
  assert sorted(rows) == sorted(name for name, _ in cases)
  assert all(r["ms"] > 0 and len(r["ms_all"]) == 2 for r in rows.values())
  assert rows["float32 ring"]["wire_bytes"] == 2 * 7 * 4 * 512
  assert rows["e4m3 ring, packed wire"]["wire_bytes"] == rows["float32 ring"]["wire_bytes"] / 4
  assert rows["float32 psum"]["wire_bytes"] == rows["float32 ring"]["wire_bytes"]
  assert 0 < rows["onebit PS"]["wire_bytes"] < rows["float32 ring"]["wire_bytes"] / 16


@pytest.mark.slow
@NEEDS_ROOT
def test_the_cluster_study_writes_its_table(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-m", "experiments.cluster_study", "--hosts=2",
                        "--devices_per_host=2", "--bandwidths=1gbit", "--size=16K",
                        "--repeats=1", "--accuracy_bandwidths=1gbit", "--target=0.5",
                        "--train_steps=10", "--train_override=--config.model.kwargs.hidden=(32,32,32)",
                        f"--workdir={tmp_path}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-2000:]
  table = (tmp_path / "sync_time.md").read_text()
  assert "| float32 psum | " in table and "| dgc ring | " in table and "1gbit" in table
  assert (tmp_path / "sync_time.png").stat().st_size > 0
  rows = json.load(open(tmp_path / "1gbit.json"))["rows"]
  assert len(rows) == 13 and rows[0]["case"] == "float32 psum"
  for row in rows[10:]:  # the syncs SeCoPa plans with each compressor's fitted cost model
    assert row["case"].endswith("SeCoPa plan") and row["secopa_ms"] > 0 and row["ms"] > 0
    assert row["plan"].split(",")[0] in ("PS", "ring") and ", K=" in row["plan"]
  assert "| onebit SeCoPa plan | " in table
  steps = (tmp_path / "step_time.md").read_text()
  assert "| data parallel, float32 ring | " in steps and "| 1F1B | " in steps
  accuracy = (tmp_path / "time_to_accuracy.md").read_text()
  assert accuracy.count("| 1gbit | ") == 3 and "not reached" not in accuracy
  assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0


def test_hetero_sleeps_with_probability_one_tenth(monkeypatch):
  """--hetero=h (JLP_HETERO): before a step the host sleeps h seconds with probability 0.1."""
  from jlp.train import loop_common  # pylint: disable=g-import-not-at-top
  slept = []
  monkeypatch.setattr(loop_common.time, "sleep", slept.append)
  monkeypatch.setenv("JLP_HETERO", "0.25")
  stall = loop_common.HostStall()
  for _ in range(2000):
    stall()
  assert set(slept) == {0.25} and 150 <= len(slept) <= 250
  monkeypatch.delenv("JLP_HETERO")
  slept.clear()
  stall = loop_common.HostStall()
  for _ in range(100):
    stall()
  assert not slept
