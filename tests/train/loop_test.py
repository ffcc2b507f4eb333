"""The experiment runner (jlp.train.loop): resume exactness, Ctrl-C, bad configs before compile."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jlp.data import config_kwargs
from jlp.train import loop, recipe
from jlp.train.metrics import read_metrics
from runs import final_checkpoint, small_digits, stable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_config(**overrides):
  # A low-precision all-reduce with APS.
  return small_digits(**{"max_steps": 12, "log_every": 2, "eval_every": 6, "checkpoint_every": 4,
                         "grad_exp": 4, "grad_man": 3, "use_aps": True, **overrides})


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  result = loop.train_and_evaluate(small_config(), workdir, progress=False)
  return workdir, result


def test_uninterrupted_run_logs_every_field(reference_run):
  workdir, result = reference_run
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
  for r in rows:
    assert {"step", "time", "train_loss", "learning_rate", "throughput"} <= set(r)
    assert np.isfinite(r["train_loss"])
  assert [r["step"] for r in rows if "eval_accuracy" in r] == [6, 12]
  assert rows[-1]["train_loss"] < rows[0]["train_loss"]
  assert result["step"] == 12 and not result["interrupted"]
  assert os.path.exists(os.path.join(workdir, "config.json"))
  assert os.listdir(os.path.join(workdir, "tensorboard"))


def test_resume_after_a_lost_tail_is_bit_exact(reference_run, tmp_path):
  """A run that died after its step-8 checkpoint (rows 10 and 12 logged, checkpoint 12 lost)
  resumes from step 8: its metrics and final state equal the uninterrupted run's."""
  ref_dir, _ = reference_run
  workdir = str(tmp_path / "run")
  shutil.copytree(ref_dir, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "12"))
  rows_before = read_metrics(workdir)
  result = loop.train_and_evaluate(small_config(), workdir, progress=False)
  assert result["step"] == 12
  rows = read_metrics(workdir)
  assert stable(rows) == stable(read_metrics(ref_dir))
  assert rows[-1]["time"] > rows_before[-1]["time"]  # rows 10 and 12 were written again
  ref_step, ref_state = final_checkpoint(ref_dir)
  step, state = final_checkpoint(workdir)
  assert step == ref_step == 12 and state.keys() == ref_state.keys()
  for k in ref_state:
    np.testing.assert_array_equal(state[k], ref_state[k], err_msg=k)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT handlers need the main thread")
def test_ctrl_c_checkpoints_and_the_resumed_run_is_bit_exact(reference_run, tmp_path):
  ref_dir, _ = reference_run
  workdir = str(tmp_path / "run")

  def interrupt_after_first_row():
    deadline = time.time() + 120
    while time.time() < deadline and not read_metrics(workdir):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)

  killer = threading.Thread(target=interrupt_after_first_row)
  killer.start()
  first = loop.train_and_evaluate(small_config(), workdir, progress=False)
  killer.join()
  assert first["interrupted"] and 2 <= first["step"] < 12
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(first["step"])))
  second = loop.train_and_evaluate(small_config(), workdir, progress=False)
  assert second["step"] == 12 and not second["interrupted"]
  assert stable(read_metrics(workdir)) == stable(read_metrics(ref_dir))
  _, ref_state = final_checkpoint(ref_dir)
  _, state = final_checkpoint(workdir)
  for k in ref_state:
    np.testing.assert_array_equal(state[k], ref_state[k], err_msg=k)


def test_stop_at_accuracy_ends_the_run_at_the_first_evaluation_that_reaches_it(
    reference_run, tmp_path, capsys):
  """The uninterrupted run's step-6 accuracy as the target: the run stops there with a
  checkpoint and the reference's rows up to step 6; running the workdir again says it is
  finished and trains nothing."""
  ref_dir, _ = reference_run
  ref_rows = read_metrics(ref_dir)
  target = next(r["eval_accuracy"] for r in ref_rows if r["step"] == 6)
  assert target > 0
  workdir = str(tmp_path)
  result = loop.train_and_evaluate(small_config(stop_at_accuracy=target), workdir, progress=False)
  assert result["step"] == 6 and not result["interrupted"]
  assert "reached config.stop_at_accuracy" in capsys.readouterr().out
  rows = read_metrics(workdir)
  assert stable(rows) == stable([r for r in ref_rows if r["step"] <= 6])
  assert final_checkpoint(workdir)[0] == 6
  again = loop.train_and_evaluate(small_config(stop_at_accuracy=target), workdir, progress=False)
  assert again["step"] == 6 and again["eval_accuracy"] == target
  assert "is finished" in capsys.readouterr().out
  assert len(read_metrics(workdir)) == len(rows)


@pytest.mark.parametrize("overrides, message", [
    ({"lr": -0.1}, r"config.lr=-0.1 is not allowed"),
    ({"grad_format": "e9m2"}, r"config.grad_format='e9m2' does not parse"),
    ({"grad_exp": 8, "grad_man": 23, "use_aps": True}, r"config.use_aps=True .* APS needs"),
    ({"model": {"name": "resnet7", "kwargs": {}}}, r"config.model.name='resnet7'"),
    ({"batch_size": 100}, r"config.batch_size=100 .* multiple of 8 devices"),
    ({"emulate_nodes": 3}, r"emulate_nodes=3 = 24"),
    ({"bfp": {"preset": "FB13", "schedule": {}, "controller": "", "window": 0}},
     r"preset 'FB13' is not allowed"),
    ({"quant_rules": ((".*", {"xx": "e4m3"}),)}, r"quant_rules\[0\].*no role 'xx'"),
    ({"schedule": {"name": "linear"}}, r"config.schedule.name='linear'"),
    ({"unscale_grads": None}, r"config.unscale_grads=None is not allowed; expected True or False"),
    ({"stop_at_accuracy": 1.5}, r"config.stop_at_accuracy=1.5 is not allowed; expected a fraction"),
    ({"stop_at_accuracy": 0.9, "task": "segmentation"},
     r"config.stop_at_accuracy=0.9 .* task='classification'"),
])
def test_bad_config_fails_before_the_model_is_built(overrides, message, monkeypatch, tmp_path):
  def no_model(*args, **kwargs):
    raise AssertionError("the model was built before the config was checked")
  monkeypatch.setattr(recipe, "model", no_model)
  c = small_config()
  c.unlock()
  for k, v in overrides.items():
    c[k] = v
  with pytest.raises(ValueError, match=message):
    loop.train_and_evaluate(c, str(tmp_path), progress=False)
  assert not os.path.exists(tmp_path / "checkpoints")


def test_missing_data_directory_shows_the_expected_layout(monkeypatch, tmp_path):
  monkeypatch.setattr(recipe, "model", lambda *a, **k: pytest.fail("model built"))
  c = small_config()
  c.dataset.name, c.dataset.root = "cifar10", str(tmp_path / "nowhere")
  c.dataset.kwargs = config_kwargs("cifar10")
  with pytest.raises(FileNotFoundError, match="cifar-10-batches-py") as e:
    loop.train_and_evaluate(c, str(tmp_path / "run"), progress=False)
  assert "data_batch_1" in str(e.value)


def run_cli(*args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_cli_rejects_an_unknown_field(tmp_path):
  r = run_cli("--config=configs/digits.py", f"--workdir={tmp_path}", "--config.grad_expo=4")
  assert r.returncode != 0 and "grad_expo" in r.stderr


# The default tier runs experiments.train's exit 2 on a config that fails validation in
# pipeline_loop_test.test_cli_takes_the_pipeline_fields (and config.lr's message in
# test_bad_config_fails_before_the_model_is_built); a subprocess costs ~2 s.
@pytest.mark.slow
def test_cli_rejects_a_bad_value(tmp_path):
  r = run_cli("--config=configs/digits.py:local", f"--workdir={tmp_path}", "--config.lr=-1")
  assert r.returncode == 2 and "config.lr=-1" in r.stderr and "Traceback" not in r.stderr


# The default tier trains a preset schedule (FB16 -> FB12 -> FB16 by epoch, at batch 480) in
# runner_numbers_test.test_a_resume_at_a_preset_switch_runs_the_new_preset (each row's
# bfp_preset checked); the controller's run below stays in it.
@pytest.mark.slow
def test_bfp_schedule_switches_presets(tmp_path, fast_compile):
  """Epoch-keyed presets (2 steps per epoch: 1,437 digits / 480) switch FB16 -> FB12 at step 2
  with training continuing."""
  c = small_config(batch_size=480, max_steps=4, log_every=1, eval_every=4, checkpoint_every=0)
  c.bfp.schedule = {"0": "default_FB16", "1": "default_FB12"}
  rows_dir = str(tmp_path / "schedule")
  loop.train_and_evaluate(c, rows_dir, progress=False)
  rows = read_metrics(rows_dir)
  assert [r["bfp_preset"] for r in rows] == ["default_FB16"] * 2 + ["default_FB12"] * 2
  assert all(np.isfinite(r["train_loss"]) and r["zse_fw"] >= 0 for r in rows)


def test_bfp_controller_moves_widths(tmp_path, fast_compile):
  """A controller with lo = hi = 0 moves every layer whose weight ZSE is above 0 one step up the
  ladder 4 -> 8 -> 16 at the end of every 1-step window (at 4 bits every layer flushes some
  weights; at 8 bits only some do)."""
  c = small_config(max_steps=3, log_every=1, eval_every=3, checkpoint_every=0)
  c.bfp.preset = "default_FB12"
  c.bfp.controller = "Simple/0/0/0/0"
  c.bfp.window = 1
  ctrl_dir = str(tmp_path / "controller")
  loop.train_and_evaluate(c, ctrl_dir, progress=False)
  rows = read_metrics(ctrl_dir)
  assert rows[0]["bits_w"] == 8.0 and 8.0 < rows[1]["bits_w"] <= rows[2]["bits_w"] <= 16.0
  assert rows[0]["bits_x"] == 8.0  # x moves with w (BFPsim's fi with fw)
  assert rows[0]["zse_fw"] > rows[2]["zse_fw"] >= 0  # wider mantissas flush fewer weights
