"""What a new user meets first (the entry points' devices, workdirs, data folders and errors):
--cpu_devices, a workdir that refuses a changed config, $JLP_DATA_DIR defaults, one-line errors."""

import json
import os
import shutil

import pytest

from jlp.data import config_kwargs
from jlp.train import loop, recipe, workdir as workdir_record
from jlp.train.metrics import read_metrics
from runs import small_digits

from entry_points import ROOT, entry_point, run_main


def small_config(**overrides):
  return small_digits(**{"max_steps": 4, "log_every": 2, "eval_every": 4, "checkpoint_every": 2,
                         **overrides})


# -- 1. devices on a CPU machine ------------------------------------------------------------------


_ONEBIT_ARGS = ["--config=configs/digits.py:local", "--config.max_steps=2", "--config.log_every=2",
                "--config.eval_every=0", "--config.compression.name=onebit", "--progress=lines"]


@pytest.mark.slow
def test_cpu_devices_emulates_devices(tmp_path):
  """Slow: a real process of its own, ~6 s. The default tier has --cpu_devices=2 making 2
  devices in experiments.sync_fit's real process, through the same cli.apply_cpu_devices
  (tests/experiments_test.py::test_sync_fit_writes_a_fit_the_runner_loads), onebit's wire
  bytes on several devices in tests/experiments_test.py's compression study, and no warning
  above 1 device in test_single_device_warning_only_where_a_sync_needs_devices."""
  # Two emulated devices: a sync as with eight, at a fraction of their compile time.
  many = entry_point("experiments.train", *_ONEBIT_ARGS, f"--workdir={tmp_path / 'two'}",
                     "--cpu_devices=2")
  assert many.returncode == 0, many.stderr[-2000:]
  assert read_metrics(str(tmp_path / "two"))[-1]["wire_bytes"] > 0
  assert "warning" not in many.stderr


def test_one_device_warns(tmp_path, monkeypatch):
  """What a shell with one CPU device gets: the run works (no wire bytes) and one warning line
  names --cpu_devices=N. The entry point in this process (run_main) on a data mesh of one of its
  devices, the mesh whose size the loop warns about; experiments.train's real process (exit
  status, streams) is test_a_device_error_says_how_to_get_more's."""
  import jax  # pylint: disable=g-import-not-at-top
  from jlp.train import data_parallel_loop, mesh  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(data_parallel_loop, "data_mesh", lambda: mesh.data_mesh(jax.devices()[:1]))
  status, _, stderr = run_main("experiments.train", *_ONEBIT_ARGS,
                               f"--workdir={tmp_path / 'one'}")
  assert status == 0, stderr[-2000:]
  assert read_metrics(str(tmp_path / "one"))[-1]["wire_bytes"] == 0
  warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
  assert len(warnings) == 1 and "1 device" in warnings[0] and "--cpu_devices=N" in warnings[0]


def test_a_device_error_says_how_to_get_more(tmp_path):
  r = entry_point("experiments.train", "--config=configs/sdpipe_resnet50.py:local",
                  f"--workdir={tmp_path}")
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) <= 3, r.stderr
  assert "1 devices" in r.stderr and "--cpu_devices=N" in r.stderr
  assert "experiments.cluster" in r.stderr


def test_single_device_warning_only_where_a_sync_needs_devices(capsys):
  assert recipe.warn_single_device(small_config(), 1) is None
  assert recipe.warn_single_device(small_config(emulate_nodes=4, grad_exp=4, grad_man=3), 1) is None
  assert recipe.warn_single_device(small_config(grad_exp=4, grad_man=3), 8) is None
  line = recipe.warn_single_device(small_config(grad_exp=4, grad_man=3), 1)
  assert "grad_format='e4m3'" in line and capsys.readouterr().err.strip() == line


# -- 2. a workdir refuses a changed config ------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("finished"))
  loop.train_and_evaluate(small_config(), workdir, progress=False)
  return workdir


def _snapshot(workdir):
  return {name: open(os.path.join(workdir, name)).read()
          for name in ("config.json", "metrics.jsonl")}


def test_a_finished_run_rerun_unchanged_says_so(finished_run, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished_run, workdir)
  before = _snapshot(workdir)
  result = loop.train_and_evaluate(small_config(), workdir, progress=False)
  out = capsys.readouterr().out.strip().splitlines()
  assert result["step"] == 4 and result["finished"]
  assert len(out) == 1 and "is finished" in out[0] and "max_steps" in out[0]
  assert _snapshot(workdir) == before


def test_a_changed_config_is_refused_before_anything_is_written(finished_run, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished_run, workdir)
  before = _snapshot(workdir)
  changed = small_config(log_every=1, checkpoint_every=1)
  changed.compression.name = "onebit"
  changed.lr = 0.05
  with pytest.raises(workdir_record.ConfigChangedError) as e:
    loop.train_and_evaluate(changed, workdir, progress=False)
  message = str(e.value)
  assert "\n" not in message
  assert "compression.name 'none' -> 'onebit'" in message and "lr 0.2 -> 0.05" in message
  assert "log_every" not in message.split(";")[0]  # a cadence field is not a change
  assert "--allow_config_change" in message and "--workdir" in message
  assert _snapshot(workdir) == before


def test_a_longer_run_under_a_decaying_schedule_is_a_change(finished_run, tmp_path, capsys):
  """configs/digits.py's cosine schedule decays to 0 at max_steps: raising max_steps moves the
  learning rate of every later step, so it is refused, and recorded when allowed."""
  workdir = str(tmp_path / "run")
  shutil.copytree(finished_run, workdir)
  loop.train_and_evaluate(small_config(), workdir, progress=False)
  assert "--allow_config_change" in capsys.readouterr().out  # the finished run's hint
  with pytest.raises(workdir_record.ConfigChangedError, match=r"max_steps 4 -> 6 \(schedule 'cosine'"):
    loop.train_and_evaluate(small_config(max_steps=6), workdir, progress=False)
  loop.train_and_evaluate(small_config(max_steps=6), workdir, progress=False,
                          allow_config_change=True)
  rows = read_metrics(workdir)
  assert [r.get("config_change") for r in rows if r["step"] > 4][0] == "max_steps: 4 -> 6"
  history = json.load(open(os.path.join(workdir, workdir_record.HISTORY_FILE)))
  assert history[0]["changes"] == {"max_steps": [4, 6]}


def test_cadence_changes_resume_and_allowed_changes_are_recorded(tmp_path):
  workdir = str(tmp_path / "run")
  constant = {"schedule": {"name": "constant"}}
  loop.train_and_evaluate(small_config(**constant), workdir, progress=False)
  longer = small_config(max_steps=6, log_every=1, eval_every=3, **constant)
  result = loop.train_and_evaluate(longer, workdir, progress=False)
  assert result["step"] == 6
  assert not os.path.exists(os.path.join(workdir, workdir_record.HISTORY_FILE))
  changed = small_config(max_steps=8, **constant)
  changed.compression.name = "onebit"
  loop.train_and_evaluate(changed, workdir, progress=False, allow_config_change=True)
  config = json.load(open(os.path.join(workdir, "config.json")))
  assert config["compression"]["name"] == "onebit" and config["max_steps"] == 8
  history = json.load(open(os.path.join(workdir, workdir_record.HISTORY_FILE)))
  assert [h["step"] for h in history] == [6]
  assert history[0]["changes"] == {"compression.name": ["none", "onebit"]}
  rows = read_metrics(workdir)
  noted = [r for r in rows if "config_change" in r]
  assert len(noted) == 1 and noted[0]["step"] == 8
  assert noted[0]["config_change"] == "compression.name: 'none' -> 'onebit'"


def test_the_entry_point_exits_2_with_one_line(finished_run, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished_run, workdir)
  c = small_config()
  overrides = [f"--config.{k}={c[k]}" for k in ("batch_size", "max_steps", "log_every",
                                                  "eval_every", "checkpoint_every")]
  status, _, err = run_main("experiments.train", "--config=configs/digits.py",
                            f"--workdir={workdir}", "--config.model.kwargs.width=8", *overrides,
                            "--config.grad_exp=4")
  assert status == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith("error: the config changes the training") and "grad_exp 8 -> 4" in err


# -- 3. data where the user keeps it --------------------------------------------------------------


def test_an_empty_root_defaults_to_jlp_data_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("JLP_DATA_DIR", str(tmp_path))
  c = small_config()
  c.dataset.name, c.dataset.kwargs = "cifar10", config_kwargs("cifar10")
  with pytest.raises(FileNotFoundError) as e:
    recipe.datasets(c)
  first = str(e.value).splitlines()[0]
  assert repr(str(tmp_path / "cifar10")) in first and "--config.dataset.root" in first
  assert "cifar-10-batches-py" in str(e.value)  # the expected layout follows


def test_no_config_hard_codes_a_data_folder():
  import importlib  # pylint: disable=g-import-not-at-top
  for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
    if name.endswith(".py") and name != "__init__.py":
      config = importlib.import_module(f"configs.{name[:-3]}").get_config()
      assert config.dataset.root == "", name


# -- 4. one-line errors --------------------------------------------------------------------------


# `process`: the case runs as a real process (entry_point), else in this process (run_main): one
# case per entry point that no other test starts as a process (tests/plots_test.py starts
# experiments.plot, tests/compression/secopa_test.py experiments.secopa, and
# test_a_device_error_says_how_to_get_more above experiments.train, exiting 2 in <= 3 lines).
@pytest.mark.parametrize("module, args, expected, process", [
    ("experiments.train", ["--config=configs/digits.py", "--workdir=W", "--config.grad_exps=4"],
     "--config.grad_exps=4 is not allowed: the config has no field 'grad_exps'; did you mean "
     "'grad_exp'?", False),
    ("experiments.train", ["--config=configs/digits.py", "--workdir=W", "--config.lr=abc"],
     "--config.lr=abc", False),
    ("experiments.train", ["--config=configs/nope.py", "--workdir=W"], "--config=configs/nope.py",
     False),
    ("experiments.train", ["--config=configs/digits.py:loca", "--workdir=W"],
     "config argument 'loca' is not allowed", False),
    ("experiments.train", ["--config=configs/digits.py"], "--workdir", False),
    ("experiments.plot", ["nowhere", "--out=x.png"], "nowhere", False),
    ("experiments.plot", ["--x=time"], "--x=time", False),
    ("experiments.secopa", ["--nnodes=x"], "--nnodes=x", False),
    ("experiments.aps_digits", ["--cpu_devices=0"], "--cpu_devices=0", True),
])
def test_mistakes_are_at_most_three_lines_with_status_2(module, args, expected, process, tmp_path):
  args = [a.replace("=W", f"={tmp_path}") for a in args]
  if process:
    r = entry_point(module, *args, timeout=120)
    status, stderr = r.returncode, r.stderr
  else:
    status, _, stderr = run_main(module, *args)
  lines = stderr.strip().splitlines()
  assert status == 2 and 1 <= len(lines) <= 3, stderr[-3000:]
  assert lines[0].startswith("error: ") and expected in lines[0], stderr
