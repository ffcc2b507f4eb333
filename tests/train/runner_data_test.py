"""The runner and real data's mess (jlp.train.loop): a changed file list refused on resume,
`dataset.verify`, a bad file as a one-line error, a non-finite loss stopping the run."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from jlp.train import loop, workdir as workdir_record
from jlp.train.metrics import read_metrics
from runs import small_digits, stable
from entry_points import run_main


def image_folders(root, classes=2, per_class=6, size=20):
  """An ImageNet-style tree: train/ and val/ with `classes` class folders of small JPEGs."""
  rng = np.random.default_rng(0)
  for split in ("train", "val"):
    for c in range(classes):
      folder = os.path.join(root, split, f"n{c:08d}")
      os.makedirs(folder)
      for i in range(per_class):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"img{i}.JPEG"), quality=90)
  return str(root)


def folder_config(root, **fields):
  c = small_digits(**{"batch_size": 8, "eval_batch_size": 8, "max_steps": 2, "log_every": 1,
                      "eval_every": 0, "checkpoint_every": 1, "schedule": {"name": "constant"},
                      **fields})
  c.dataset.name, c.dataset.root = "imagenet", root
  c.dataset.kwargs = {"crop_size": 16, "resize_size": 16, "num_workers": 1}
  return c


def test_a_resume_on_changed_files_is_refused_and_recorded_when_allowed(tmp_path):
  root = image_folders(tmp_path / "data")
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(folder_config(root), workdir, progress=False)
  assert os.path.exists(os.path.join(workdir, workdir_record.DATA_FILE))
  os.remove(os.path.join(root, "train", "n00000001", "img3.JPEG"))
  with pytest.raises(workdir_record.ConfigChangedError) as e:
    loop.train_and_evaluate(folder_config(root, max_steps=4), workdir, progress=False)
  message = str(e.value)
  assert "\n" not in message and "1 removed (train/n00000001/img3.JPEG)" in message
  assert "dataset files (train)" in message and "--allow_config_change" in message
  loop.train_and_evaluate(folder_config(root, max_steps=4), workdir, progress=False,
                          allow_config_change=True)
  noted = [r["config_change"] for r in read_metrics(workdir) if "config_change" in r]
  assert len(noted) == 1 and "dataset files (train): '12 files' -> '11 files" in noted[0]
  history = json.load(open(os.path.join(workdir, workdir_record.HISTORY_FILE)))
  assert list(history[0]["changes"]) == ["dataset files (train)"]
  # The new list is the record now: the same files resume without a word.
  loop.train_and_evaluate(folder_config(root, max_steps=5), workdir, progress=False)
  assert len([r for r in read_metrics(workdir) if "config_change" in r]) == 1


def _truncate(path):
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])


def test_verify_lists_every_bad_file_before_training(tmp_path, capsys):
  root = image_folders(tmp_path / "data")
  c = folder_config(root)
  c.dataset.verify = True
  loop.train_and_evaluate(c, str(tmp_path / "good"), progress=False)
  assert "every file of imagenet (12 train, 12 eval examples) can be used" in capsys.readouterr().out
  bad = [os.path.join(root, "train", "n00000000", "img1.JPEG"),
         os.path.join(root, "val", "n00000001", "img5.JPEG")]
  for path in bad:
    _truncate(path)
  with pytest.raises(ValueError) as e:
    loop.train_and_evaluate(c, str(tmp_path / "bad"), progress=False)
  lines = str(e.value).splitlines()
  assert "2 files of imagenet" in lines[0]
  assert [line.split(":")[0].strip() for line in lines[1:]] == bad
  assert not os.path.exists(tmp_path / "bad" / "metrics.jsonl")


def test_a_bad_file_met_in_a_run_is_one_line_naming_it(tmp_path):
  """A truncated evaluation image (the final evaluation reads every one). The entry point runs
  in this process (run_main) on its 8 devices, with folder_config's model width and schedule
  name (programs much like those the tests above compiled); tests/train/first_hour_test.py and
  runner_numbers_test.py start it as a real process."""
  root = image_folders(tmp_path / "data")
  path = os.path.join(root, "val", "n00000001", "img2.JPEG")
  _truncate(path)
  config_file = tmp_path / "folders.py"
  config_file.write_text(
      "from configs import digits\nfrom jlp.data import config_kwargs\n\n\n"
      "def get_config():\n"
      "  c = digits.get_config()\n"
      "  c.dataset.name = 'imagenet'\n"
      "  c.dataset.kwargs = config_kwargs('imagenet', crop_size=16, resize_size=16)\n"
      "  return c\n")
  status, _, err = run_main(
      "experiments.train", f"--config={config_file}", f"--workdir={tmp_path / 'run'}",
      f"--config.dataset.root={root}", "--config.dataset.kwargs.num_workers=1",
      "--config.model.kwargs.width=8", "--config.schedule.name=constant", "--config.batch_size=8",
      "--config.eval_batch_size=8", "--config.max_steps=2", "--config.eval_every=0",
      "--config.checkpoint_every=0")
  assert status == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith(f"error: {path}: ")


def test_a_non_finite_loss_stops_the_run(tmp_path):
  """A learning rate of 1e30 overflows the parameters within a few steps: the run stops at the
  first row whose train_loss is not finite (written, as null), with no checkpoint of that state,
  exit status 1 and one line saying so (the entry point in this process, on its 8 devices)."""
  workdir = str(tmp_path / "run")
  status, _, err = run_main(
      "experiments.train", "--config=configs/digits.py:local", f"--workdir={workdir}",
      "--config.lr=1e30", "--config.schedule.name=constant", "--config.log_every=1",
      "--config.eval_every=0", "--config.checkpoint_every=1")
  assert status == 1 and len(err.strip().splitlines()) == 1, err
  rows = read_metrics(workdir)
  assert rows[-1]["train_loss"] is None and all(x["train_loss"] is not None for x in rows[:-1])
  assert f"train_loss=nan at step {rows[-1]['step']}" in err or \
      f"train_loss=inf at step {rows[-1]['step']}" in err
  checkpoints = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert max(checkpoints, default=0) < rows[-1]["step"] < 20


def test_worker_processes_train_on_the_same_bits(tmp_path):
  """dataset.worker_processes=1 (a Grain worker process) against the threads of this process:
  the same rows, and a run may switch between them on resume. One worker: each starts an
  interpreter importing jlp, for the train and the eval pipeline; how rows are shared among
  several is jlp.data.Pipeline's (tests/data_pipeline/pipeline_workers_test.py, 2 workers)."""
  root = image_folders(tmp_path / "data")
  threads, workers = str(tmp_path / "threads"), str(tmp_path / "workers")
  loop.train_and_evaluate(folder_config(root, max_steps=3, eval_every=3), threads, progress=False)
  c = folder_config(root, max_steps=3, eval_every=3)
  c.dataset.worker_processes = 1
  loop.train_and_evaluate(c, workers, progress=False)
  assert stable(read_metrics(workers)) == stable(read_metrics(threads))
