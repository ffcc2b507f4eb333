"""The runner's numbers are the run's numbers (jlp.train.loop, data-parallel): a resume at a BFP
preset switch, a device count or config changed on resume, a crash after an allowed change,
windowed train metrics, throughput without saves and compiles, the metrics file rewritten
safely, Ctrl-C during the final evaluation.

References: the uninterrupted run (resume), the per-step losses of a run logging every step
(window means, averaged here in float64), the checkpoint's own meta (config changes)."""

import json
import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest

from jlp.train import checkpoint, data_parallel_loop, loop, metrics as metrics_lib, \
    workdir as workdir_record
from jlp.train.metrics import read_metrics
from entry_points import entry_point
from runs import final_checkpoint, sigint_before, small_digits, stable


def preset_config(**fields):
  """1,437 digits / 480 = 2 steps per epoch: presets FB16, FB12, FB16 switch at steps 2 and 4;
  rows every 3 steps, so the checkpoint at 4 cuts the window (4, 6]."""
  c = small_digits(**{"batch_size": 480, "max_steps": 6, "log_every": 3, "eval_every": 6,
                      "checkpoint_every": 2, "schedule": {"name": "constant"}, **fields})
  c.bfp.schedule = {"0": "default_FB16", "1": "default_FB12", "2": "default_FB16"}
  return c


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
  """The run of preset_config(), its save after step 2 made slow by 2 s (for
  test_throughput_leaves_out_saves_and_compiles; a save's time is in no other row field the
  tests compare)."""
  workdir = str(tmp_path_factory.mktemp("presets"))
  save = checkpoint.Checkpointer.save

  def slow_save(self, step, *args, **kwargs):
    if step == 2:
      time.sleep(2.0)
    return save(self, step, *args, **kwargs)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoint.Checkpointer, "save", slow_save)
    loop.train_and_evaluate(preset_config(), workdir, progress=False)
  return workdir


def test_a_resume_at_a_preset_switch_runs_the_new_preset(preset_run, tmp_path):
  """The checkpoint at step 4 was written under FB12 (epoch 1); epoch 2 switches to FB16. The
  resumed run restores FB12's state and switches as the uninterrupted run did: the same rows
  (zero-setting errors, the window's mean loss) and the same final state, bit for bit."""
  rows = read_metrics(preset_run)
  assert [(r["step"], r["bfp_preset"]) for r in rows] == [(3, "default_FB12"),
                                                         (6, "default_FB16")]
  workdir = str(tmp_path / "resumed")
  shutil.copytree(preset_run, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  assert checkpoint.read_meta(workdir, 4)["preset"] == "default_FB12"
  loop.train_and_evaluate(preset_config(), workdir, progress=False)
  assert stable(read_metrics(workdir)) == stable(rows)
  _, want = final_checkpoint(preset_run)
  _, got = final_checkpoint(workdir)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_train_metrics_are_means_over_the_logging_window(preset_run, tmp_path):
  """Reference: the same run logging every step (each row one batch's loss and accuracy): the
  rows every 3 steps hold the float64 mean of the 3 batch values."""
  every = str(tmp_path / "every_step")
  loop.train_and_evaluate(preset_config(log_every=1), every, progress=False)
  per_step = {r["step"]: r for r in read_metrics(every)}
  for row in read_metrics(preset_run):
    steps = range(row["step"] - 2, row["step"] + 1)
    for name in ("train_loss", "train_accuracy"):
      assert row[name] == np.mean([per_step[s][name] for s in steps], dtype=np.float64), name


def test_throughput_leaves_out_saves_and_compiles(preset_run):
  """Each preset switch recompiles, inside a window (steps 2 and 4): its compile_seconds is
  logged. A save made slow by 2 s (after step 2, in preset_run) is logged as save_seconds and
  left out of the throughput: the window's training time is below the sleep."""
  rows = read_metrics(preset_run)
  assert all(r["compile_seconds"] > 0 for r in rows)
  row = rows[0]
  assert row["step"] == 3 and row["save_seconds"] >= 2.0
  assert 3 * 480 / row["throughput"] < 2.0


def two_step_config():
  """Two steps, a checkpoint at 2, a constant schedule: as the entry point's flags give it from
  configs/digits.py (test_the_entry_point_refuses_another_device_count)."""
  c = small_digits(max_steps=2, log_every=1, eval_every=0, checkpoint_every=2)
  c.schedule.name = "constant"
  return c


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
  """two_step_config() trained on this process's devices (read, not changed, by its tests)."""
  workdir = str(tmp_path_factory.mktemp("two_steps"))
  loop.train_and_evaluate(two_step_config(), workdir, progress=False)
  return workdir


def test_the_device_layout_is_recorded_and_a_change_refused(two_step_run):
  """A checkpoint records the devices it ran on; a resume on another count is refused in one
  line naming it, recorded when allowed, and refused even then under a per-device state."""
  workdir = two_step_run
  c = two_step_config()
  meta = checkpoint.read_meta(workdir, 2)
  assert meta["devices"] == {"devices": jax.device_count(), "processes": 1}
  meta["devices"]["devices"] = 2
  with pytest.raises(workdir_record.ConfigChangedError) as e:
    workdir_record.check_resume(c, workdir, meta, allow_change=False)
  assert "devices '2 devices' -> '8 devices'" in str(e.value) and "\n" not in str(e.value)
  changes = workdir_record.check_resume(c, workdir, meta, allow_change=True)
  assert changes == {"devices": ("2 devices", "8 devices")}
  c.compression.name = "onebit"
  with pytest.raises(workdir_record.ConfigChangedError, match="error-feedback state cannot move"):
    workdir_record.check_resume(c, workdir, meta, allow_change=True)


def test_the_entry_point_refuses_another_device_count(two_step_run, tmp_path):
  """The run made on this process's 8 devices, resumed for 2 more steps by the entry point on 2
  (--cpu_devices) with the same config: exit status 2 and one line naming the device change."""
  workdir = str(tmp_path / "run")
  shutil.copytree(two_step_run, workdir)
  c = two_step_config()
  r = entry_point("experiments.train", "--config=configs/digits.py", f"--workdir={workdir}",
                  "--cpu_devices=2", "--config.model.kwargs.width=8",
                  "--config.schedule.name=constant", "--config.max_steps=4",
                  *[f"--config.{k}={c[k]}" for k in ("batch_size", "log_every", "eval_every",
                                                     "checkpoint_every")], timeout=300)
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert f"devices '{jax.device_count()} devices' -> '2 devices'" in r.stderr


def _crashed_after_an_allowed_change(tmp_path):
  """A run to step 4 under lr 0.2, resumed with lr 0.05 --allow_config_change, which crashed
  before its next checkpoint (its checkpoint 6 removed): config.json, the history and the rows
  say lr 0.05, the checkpoint at 4 was written under 0.2."""
  c = small_digits(max_steps=4, log_every=1, eval_every=0, checkpoint_every=2,
                   schedule={"name": "constant"})
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(c, workdir, progress=False)
  changed = small_digits(max_steps=6, log_every=1, eval_every=0, checkpoint_every=2, lr=0.05,
                         schedule={"name": "constant"})
  loop.train_and_evaluate(changed, workdir, progress=False, allow_config_change=True)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  assert json.load(open(os.path.join(workdir, "config.json")))["lr"] == 0.05
  return workdir, c, changed


def test_a_crash_after_an_allowed_change_resumes_against_the_checkpoint(tmp_path):
  workdir, original, changed = _crashed_after_an_allowed_change(tmp_path)
  retry = str(tmp_path / "retry")
  shutil.copytree(workdir, retry)
  # The original command resumes: the checkpoint was written under it; the lost change leaves no
  # history and no config_change row.
  loop.train_and_evaluate(_longer(original), workdir, progress=False)
  assert not os.path.exists(os.path.join(workdir, workdir_record.HISTORY_FILE))
  assert not [r for r in read_metrics(workdir) if "config_change" in r]
  assert json.load(open(os.path.join(workdir, "config.json")))["lr"] == 0.2
  # The changed command is a change again: refused without the flag, recorded once with it.
  with pytest.raises(workdir_record.ConfigChangedError, match="lr 0.2 -> 0.05"):
    loop.train_and_evaluate(changed, retry, progress=False)
  loop.train_and_evaluate(changed, retry, progress=False, allow_config_change=True)
  history = json.load(open(os.path.join(retry, workdir_record.HISTORY_FILE)))
  assert [(h["step"], h["changes"]) for h in history] == [(4, {"lr": [0.2, 0.05]})]
  noted = [r for r in read_metrics(retry) if "config_change" in r]
  assert [(r["step"], r["config_change"]) for r in noted] == [(5, "lr: 0.2 -> 0.05")]


def _longer(c):
  c = c.copy_and_resolve_references()
  c.max_steps = 6
  return c


def test_config_history_is_written_by_process_zero_only(tmp_path, monkeypatch):
  c = small_digits()
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  workdir_record.record_config(c, str(tmp_path), 4, {"lr": (0.2, 0.05)})
  assert os.listdir(tmp_path) == []
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  workdir_record.record_config(c, str(tmp_path), 4, {"lr": (0.2, 0.05)})
  assert sorted(os.listdir(tmp_path)) == ["config.json", "config_history.json"]


def test_a_crash_while_rewriting_the_metrics_keeps_every_row(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=False)
  for step in range(1, 6):
    writer.write(step, {"train_loss": 1.0 / step})
  writer.close()
  before = read_metrics(workdir)
  calls = []

  def dumps_then_crash(obj, *args, **kwargs):
    calls.append(obj)
    if len(calls) == 2:
      raise KeyboardInterrupt  # killed while rewriting the kept rows
    return json.JSONEncoder().encode(obj)
  monkeypatch.setattr(metrics_lib.json, "dumps", dumps_then_crash)
  with pytest.raises(KeyboardInterrupt):
    metrics_lib.MetricsWriter(workdir, resume_step=3, tensorboard=False)
  monkeypatch.undo()
  assert read_metrics(workdir) == before


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT handlers need the main thread")
def test_ctrl_c_during_the_final_evaluation_finishes_the_run(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(data_parallel_loop.Run, "evaluate", sigint_before(data_parallel_loop.Run.evaluate))
  c = small_digits(max_steps=2, log_every=1, eval_every=0, checkpoint_every=0,
                   schedule={"name": "constant"})
  result = loop.train_and_evaluate(c, str(tmp_path), progress=False)
  out = capsys.readouterr().out
  assert not result["interrupted"] and result["step"] == 2 and "eval_accuracy" in result
  assert "finished at step 2" in out and "interrupted" not in out
  loop.train_and_evaluate(c, str(tmp_path), progress=False)
  assert "is finished" in capsys.readouterr().out
