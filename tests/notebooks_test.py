"""The notebooks execute top to bottom on the CPU (nbclient), in their quick mode."""

import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(name: str, steps: int, tmp_path, monkeypatch) -> tuple[str, list]:
  """Runs notebooks/<name> top to bottom in quick mode (JLP_NOTEBOOK_STEPS=steps) on 8 emulated
  CPU devices, with XLA's optimisation passes off (as the `fast_compile` fixture: the quick runs
  spend most of their time compiling); returns (all text outputs, the image outputs)."""
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  monkeypatch.setenv("JLP_NOTEBOOK_STEPS", str(steps))
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  return ("".join(o.get("text", "") for o in outputs),
          [o for o in outputs if "image/png" in o.get("data", {})])


def test_quickstart_executes(tmp_path, monkeypatch):
  outputs, images = execute("quickstart.ipynb", 12, tmp_path, monkeypatch)
  assert "e3m0" in outputs and "test acc" in outputs  # the APS table
  assert len(images) >= 3  # formats explorer, the fp8 run's curves, the APS curves


def test_compression_executes(tmp_path, monkeypatch):
  """notebooks/compression.ipynb in quick mode: every section runs; the PS and ring syncs agree on
  every rank; the study's table and the plots come out."""
  outputs, images = execute("compression.ipynb", 6, tmp_path, monkeypatch)
  names = ("onebit", "tbq", "terngrad", "dgc", "graddrop")
  sync_lines = [w for w in map(str.split, outputs.splitlines())
                if len(w) == 6 and w[0] in names and w[1] in ("ps", "ring")]
  assert len(sync_lines) == 10 and all(w[2] == "True" for w in sync_lines)  # same on every rank
  assert all(float(w[5]) < 0.1 for w in sync_lines)  # bytes: under a tenth of float32's ring
  assert "tbq without EF" in outputs and "N=16 ring" in outputs
  assert "x fp32" in outputs and "onebit     ring" in outputs  # the study's table
  assert len(images) >= 2  # error feedback, accuracy against bytes


def test_pipeline_executes(tmp_path, monkeypatch):
  """notebooks/pipeline.ipynb in quick mode: the schedule tables, GPipe against 1F1B, PReduce
  under stalls (the simulator's groups, the training table) and their plots come out."""
  outputs, images = execute("pipeline.ipynb", 12, tmp_path, monkeypatch)
  assert "1F1B: 18 ticks, bubble fraction 0.3333, (S-1)/(n+S-1) = 0.3333" in outputs
  assert "GPipe: 14 ticks, bubble fraction 0.4286" in outputs
  assert "gpipe  final test accuracy" in outputs and "1f1b   final test accuracy" in outputs
  assert "h=0: 400 groups, mean size 4.00" in outputs  # no stalls: every group is all 4
  assert "symmetric True | rows and columns sum to 1 True" in outputs
  assert "| allreduce | 0.1 |" in outputs and "| preduce | 0.1 |" in outputs
  assert len(images) >= 4  # schedule tables, loss curves, group sizes, accuracy vs virtual time
