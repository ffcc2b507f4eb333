"""Figures: training curves of several runs (jlp.plots, experiments.plot) and the error plot."""

import json
import os

import numpy as np
import pytest
from PIL import Image

import jlp
from jlp import plots
from entry_points import entry_point, run_main


def fake_run(path, losses, accuracies):
  os.makedirs(path)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for i, (loss, acc) in enumerate(zip(losses, accuracies), 1):
      row = {"step": 10 * i, "time": 0.0, "train_loss": loss}
      if acc is not None:
        row.update(eval_loss=loss * 1.1, eval_accuracy=acc)
      f.write(json.dumps(row) + "\n")


def test_plot_runs_draws_one_line_per_run_and_metric(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  fake_run(a, [2.0, 1.0, 0.5], [None, 0.5, 0.9])
  fake_run(b, [2.0, 1.5, 1.2], [0.1, None, 0.6])
  out = str(tmp_path / "curves.png")
  fig = plots.plot_runs([a, b], out, labels=["fp32", "e4m3"])
  titles = [ax.get_title() for ax in fig.axes]
  assert titles == ["train loss", "eval loss", "eval accuracy"]
  train = fig.axes[0].get_lines()
  assert [l.get_label() for l in train] == ["fp32", "e4m3"]
  np.testing.assert_array_equal(train[1].get_ydata(), [2.0, 1.5, 1.2])
  np.testing.assert_array_equal(fig.axes[2].get_lines()[0].get_xdata(), [20, 30])  # rows with eval only
  assert Image.open(out).size[0] > 0


def test_plot_runs_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl rows"):
    plots.plot_runs([str(tmp_path)])
  fake_run(str(tmp_path / "a"), [1.0], [None])
  with pytest.raises(ValueError, match="labels has 2 entries"):
    plots.plot_runs([str(tmp_path / "a")], labels=["x", "y"])


def pipelined_run(path, rows):
  """A metrics.jsonl as the pipelined loop writes it: (step, virtual_time, accuracy or None)."""
  os.makedirs(path)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step, vt, acc in rows:
      row = {"step": step, "time": 0.0, "train_loss": 1.0 / step, "virtual_time": vt,
             "bubble_fraction": 0.75}
      if acc is not None:
        row.update(eval_loss=1.0, eval_accuracy=acc)
      f.write(json.dumps(row) + "\n")


def test_plot_runs_time_to_accuracy_in_virtual_seconds(tmp_path):
  """x="virtual_time": eval accuracy against the rows' virtual seconds, not steps."""
  fast, slow = str(tmp_path / "preduce"), str(tmp_path / "allreduce")
  pipelined_run(fast, [(10, 1.5, None), (20, 3.0, 0.4), (30, 4.5, 0.8)])
  pipelined_run(slow, [(10, 2.5, None), (20, 5.0, 0.5), (30, 7.5, 0.9)])
  out = str(tmp_path / "tta.png")
  fig = plots.plot_runs([fast, slow], out, x="virtual_time")
  accuracy = fig.axes[2]
  assert accuracy.get_title() == "eval accuracy" and accuracy.get_xlabel() == "virtual seconds"
  lines = accuracy.get_lines()
  np.testing.assert_array_equal(lines[0].get_xdata(), [3.0, 4.5])
  np.testing.assert_array_equal(lines[0].get_ydata(), [0.4, 0.8])
  np.testing.assert_array_equal(lines[1].get_xdata(), [5.0, 7.5])
  np.testing.assert_array_equal(fig.axes[0].get_lines()[1].get_xdata(), [2.5, 5.0, 7.5])
  assert Image.open(out).size[0] > 0
  fake_run(str(tmp_path / "unpipelined"), [1.0], [0.5])
  with pytest.raises(ValueError, match="none of its rows has 'virtual_time'"):
    plots.plot_runs([fast, str(tmp_path / "unpipelined")], x="virtual_time")
  with pytest.raises(ValueError, match="x='wall' is not allowed"):
    plots.plot_runs([fast], x="wall")
  status, _, err = run_main("experiments.plot", fast, slow, "--x=virtual_time",
                            f"--out={tmp_path / 'cli.png'}")
  assert status == 0, err
  assert (tmp_path / "cli.png").exists()


def test_quantization_error_plot_shows_flush_and_overflow():
  fig = plots.plot_quantization_error([jlp.FloatFormat(4, 3)], lo=2.0 ** -14, hi=2.0 ** 10, n=512)
  (line,) = fig.axes[0].get_lines()
  x, err = line.get_xdata(), line.get_ydata()
  assert np.all(err[x < 2.0 ** -11] == 1.0)  # below half the smallest subnormal: flushed to 0
  assert np.all(np.isnan(err[x >= 248]))     # overflow to inf (max 240 + half an ulp)
  mid = (x > 1) & (x < 200)
  assert np.all(err[mid] <= 2.0 ** -4)        # half an ulp of a 3-bit mantissa


def test_plot_cli(tmp_path):
  """A plot in this process (run_main), then a real process's exit status and one line."""
  fake_run(str(tmp_path / "run"), [1.0, 0.5], [0.2, 0.4])
  out = tmp_path / "c.png"
  status, stdout, err = run_main("experiments.plot", str(tmp_path / "run"), f"--out={out}")
  assert status == 0 and stdout == f"wrote {out}\n", err
  assert out.exists()
  r = entry_point("experiments.plot", "--out=x.png", timeout=120)
  assert r.returncode == 2 and "no run directory given" in r.stderr, r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_plot_accuracy_vs_bytes_draws_one_point_per_row(tmp_path):
  rows = [{"compressor": "none", "topology": "ring", "wire_bytes": 36000.0, "test_accuracy": 0.98},
          {"compressor": "onebit", "label": "onebit", "topology": "ps", "wire_bytes": 2100.0,
           "test_accuracy": 0.975},
          {"compressor": "tbq", "label": "tbq(threshold=0.001)", "topology": "ring",
           "wire_bytes": 2300.0, "test_accuracy": 0.8}]
  out = str(tmp_path / "tradeoff.png")
  fig = plots.plot_accuracy_vs_bytes(rows, out)
  ax = fig.axes[0]
  assert ax.get_xscale() == "log"
  points = [c.get_offsets()[0].tolist() for c in ax.collections]
  assert points == [[36000.0, 98.0], [2100.0, 97.5], [2300.0, 80.0]]
  assert [t.get_text() for t in ax.get_legend().get_texts()] == [
      "float32 / ring", "onebit / ps", "tbq(threshold=0.001) / ring"]
  assert Image.open(out).size[0] > 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b_flush", "zb_h1", "interleaved_1f1b", "zbv",
                                  "dualpipev"])
def test_plot_schedule_draws_every_action_in_its_cell(name):
  """plot_schedule: one patch per action at (tick, device), coloured by its kind, its micro-batch
  written in the cell; an overlapped F+B pair split in halves and framed; idle ticks empty."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.colors import to_rgba  # pylint: disable=g-import-not-at-top
  from jlp.pipeline import Schedule  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  schedule = Schedule.named(name, 4, 8)
  ax = plots.plot_schedule(schedule, title=name)
  assert ax.get_title() == name and ax.get_xlim() == (0, schedule.num_ticks)
  cells = {}
  for patch in ax.patches:
    if patch.get_fill():
      x, y = patch.get_xy()
      cells[int(x), float(y)] = (patch.get_label(), patch.get_facecolor(), patch.get_height())
  frames = {(int(p.get_x()), int(p.get_y())): p.get_label() for p in ax.patches
            if not p.get_fill()}
  texts = {(t.get_position()[0], t.get_position()[1]): t.get_text() for t in ax.texts}
  expected_cells, expected_frames, expected_texts = {}, {}, {}
  overlaps = 0
  for d, row in enumerate(schedule.ticks):
    for t, item in enumerate(row):
      if item is None:
        continue
      halves = item.leaves
      if len(halves) == 2:
        overlaps += 1
        expected_frames[t, d] = str(item)
      for k, action in enumerate(halves):
        height = 1.0 / len(halves)
        y = d + k * height
        expected_cells[t, y] = (str(action), to_rgba(plots.SCHEDULE_COLOURS[action.kind]), height)
        expected_texts[t + 0.5, y + height / 2] = str(action.microbatch)
  assert cells == expected_cells
  assert frames == expected_frames and (overlaps > 0) == (name == "dualpipev")
  assert texts == expected_texts
  kinds = {a.kind for row in schedule.ticks for item in row if item for a in item.leaves}
  assert kinds == ({"F", "B"} if name in ("gpipe", "1f1b_flush", "interleaved_1f1b") else
                   {"F", "I", "W"} if name in ("zb_h1", "zbv") else {"F", "B", "I", "W"})
  plt.close(ax.figure)
