"""The experiment entry points in their quick mode: the compression study's table and plots, and
the whole-sync fit for autotune.

References: the table's structure (a float32 run, then every compressor x CaSync topology) and the
bytes a float32 ring all-reduce sends, 2(W-1) hops of ceil(n/W) floats per leaf of n floats, of
which every compressor must send a fraction.
"""

import os
import re
import subprocess
import sys

import jax
import pytest

from jlp import studies, sync_tuning
from entry_points import run_main


def leaf_sizes():
  """The digits CNN's parameter sizes (configs/digits.py, built abstractly)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from configs import digits  # pylint: disable=g-import-not-at-top
  from jlp.train import recipe  # pylint: disable=g-import-not-at-top
  config = digits.get_config()
  train, _ = recipe.datasets(config)
  model = nnx.eval_shape(lambda: recipe.model(config, train))
  return [x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def check_study(rows, labels, out, workdir, steps):
  expected = [("float32", "ring")] + [(l, t) for l in labels for t in ("ps", "ring")]
  assert [(r["run"] if r["compressor"] == "none" else r["label"], r["topology"])
          for r in rows] == expected
  assert all(r["step"] == steps for r in rows)
  assert all(0 <= r["test_accuracy"] <= 1 and r["train_loss"] > 0 for r in rows)
  w = jax.device_count()
  baseline = rows[0]
  # The float32 ring: every leaf in W chunks of ceil(n/W) floats, 2(W-1) hops of 4 bytes each.
  assert baseline["wire_bytes"] == 2 * (w - 1) * 4 * sum(-(-n // w) for n in leaf_sizes())
  for r in rows[1:]:
    assert 0 < r["wire_bytes"] < baseline["wire_bytes"] / 4, r  # every leaf compressed
    assert r["bytes_ratio"] == r["wire_bytes"] / baseline["wire_bytes"]
    assert r["gap_to_float32"] == r["test_accuracy"] - baseline["test_accuracy"]
  assert "x fp32" in out
  for label, topology in expected[1:]:
    assert re.search(rf"^{re.escape(label)}\s+{topology}\s", out, re.M), (label, topology)
  for name in ("curves.png", "tradeoff.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0


def test_compression_digits_quick_two_compressors(tmp_path, capsys, fast_compile):
  """Two compressors: onebit by name, TBQ as a (name, {field: value}) entry. The two cheapest of
  the table to compile (GradDrop's sampled threshold takes twice onebit's time); the slow test
  below runs every compressor, tests/compression/casync_test.py GradDrop's syncs."""
  from experiments import compression_digits  # pylint: disable=g-import-not-at-top
  rows = compression_digits.run(str(tmp_path), quick=True,
                                compressors=("onebit", ("tbq", {"threshold": 0.001})))
  check_study(rows, ("onebit", "tbq(threshold=0.001)"), capsys.readouterr().out, str(tmp_path),
              compression_digits.QUICK_STEPS)


@pytest.mark.slow
def test_compression_digits_quick(tmp_path, capsys):
  """The whole table (13 runs; ~90 s on the 2-core machine under load)."""
  from experiments import compression_digits  # pylint: disable=g-import-not-at-top
  rows = compression_digits.run(str(tmp_path), quick=True)
  check_study(rows, studies.HIPRESS_COMPRESSORS + ("tbq(threshold=0.001)",),
              capsys.readouterr().out, str(tmp_path), compression_digits.QUICK_STEPS)


def test_compression_study_rejects_bad_entries(tmp_path):
  from experiments import compression_digits  # pylint: disable=g-import-not-at-top
  config = compression_digits.study_config(quick=True)
  with pytest.raises(ValueError, match="compressors entry='none' is not allowed"):
    studies.compression_study(config, str(tmp_path), ["none"])
  with pytest.raises(ValueError, match="compressors entry=3 is not allowed"):
    studies.compression_study(config, str(tmp_path), [3])


def test_sync_fit_writes_a_fit_the_runner_loads(tmp_path):
  """`experiments.sync_fit` times whole syncs on 2 CPU devices (a real process: --cpu_devices)
  and writes a fit that `SyncFit.load` gives back for this cluster, compressor and device count
  (what the runner's compression.sync_fit reads); a bad size is refused before anything is
  timed (the entry point in this process: run_main). Two devices time 6 syncs a size (the
  float32 ring, psum, PS and ring at K = 1 and 2) where 8 time 8 larger ones: the same code in
  half the time."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "fits" / "onebit.json"  # a directory made by the entry point
  args = ["--compressor=onebit", f"--out={out}", "--repeats=1"]
  status, _, stderr = run_main("experiments.sync_fit", *args, "--sizes=1K,2X")
  assert status == 2 and not out.exists()
  assert stderr.startswith("error: --sizes='2X' is not allowed; expected a positive integer")
  run = subprocess.run([sys.executable, "-m", "experiments.sync_fit", *args, "--cpu_devices=2",
                        "--sizes=1K,2K"], cwd=repo, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  fit = sync_tuning.SyncFit.load(out, cluster="1 processes x 2 cpu", compressor="onebit",
                                 num_nodes=2)
  assert fit is not None and fit.psum is not None and set(fit.topologies) == {"ps", "ring"}
  assert sorted({size for _, size, _ in fit.samples}) == [1024, 2048]
  assert f"wrote {out} (onebit on 1 processes x 2 cpu, 12 syncs)" in run.stdout
