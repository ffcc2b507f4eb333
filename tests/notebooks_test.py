"""The notebooks execute top to bottom on the CPU (nbclient), in their quick mode; their set-up
cell clones, installs and finds jlp as notebooks/README.md says, tested without the network."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types

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
  outputs, images = execute("quickstart.ipynb", 6, tmp_path, monkeypatch)  # evaluated every 2
  assert "e3m0" in outputs and "test acc" in outputs  # the APS table
  assert len(images) >= 3  # formats explorer, the fp8 run's curves, the APS curves


@pytest.mark.slow  # 20-35 s; the compression tests cover what it calls
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
  assert len(images) >= 4  # error feedback, accuracy against bytes, PowerSGD, DiLoCo
  ranks = [w for w in map(str.split, outputs.splitlines()) if len(w) == 4 and w[0] in ("1", "4", "16")
           and w[3].endswith("x")]
  errors = [float(w[1]) for w in ranks]
  assert len(errors) == 3 and errors == sorted(errors, reverse=True)  # a higher rank, less error
  assert "H=  1:" in outputs and "H=  5:" in outputs


@pytest.mark.slow  # 20 s; the pipeline tests cover what it calls
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


# 15-17 s (12 s of CPU in its kernel); what it calls is covered by
# tests/numerics (nvfp4_test: every NVFP4 variant and the Hadamard transform; mx_test: MXFP8,
# MXFP4 and E2M1 stochastic rounding; block_scaled_test: the 1x128 and per-tensor FP8),
# tests/quantize_test.py and tests/gemm/promotion_test.py (promotion against K), and
# test_quickstart_executes keeps a notebook executing in the default tier.
@pytest.mark.slow
def test_formats_now_executes(tmp_path, monkeypatch):
  """notebooks/formats_now.ipynb: the error table of every format on every tensor, RHT on an
  outlier block, stochastic rounding's bias, promotion against K, and their plots."""
  outputs, images = execute("formats_now.ipynb", 0, tmp_path, monkeypatch)
  for name in ("NVFP4 1x16 (TE)", "NVFP4 16x16", "MXFP8 e4m3 /32", "MXFP4 /32",
               "FP8 1x128 (DeepSeek)", "FP8 per tensor", "e4m3 (no scale)"):
    assert f"| {name} | " in outputs, name
  assert "| one 100x value per block | yes |" in outputs
  sr = re.search(r"float4_e2m1fn 2.4: nearest 2.000000 \(bias -4.00e-01\); mean of 262144 "
                 r"stochastic casts \S+ \(bias ([-+]\S+)\)", outputs)
  assert sr and abs(float(sr.group(1))) < 0.01, outputs
  promotion = re.search(r"^\| 4096 \| (\S+) % \| (\S+) % \| (\S+) % \|$", outputs, re.M)
  assert promotion and float(promotion.group(2)) < float(promotion.group(1))
  assert len(images) >= 4  # error bars, RHT block, SR convergence, promotion against K


# ------------------------------------------------------------------ the set-up cell (no network)

NOTEBOOKS = ("quickstart.ipynb", "compression.ipynb", "pipeline.ipynb", "formats_now.ipynb")
URL_LINE = 'JLP_REPO_URL = ""  # @param {type:"string"}'


def setup_cell(name: str) -> str:
  """The first code cell of notebooks/<name>: the set-up cell."""
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  return next(c.source for c in nb.cells if c.cell_type == "code")


def colab_setup():
  """notebooks/colab_setup.py as a module (the notebooks import it from a checkout's root)."""
  spec = importlib.util.spec_from_file_location(
      "colab_setup_under_test", os.path.join(ROOT, "notebooks", "colab_setup.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def git(*args, cwd):
  subprocess.run(["git", "-c", "user.name=jlp", "-c", "user.email=jlp@localhost",
                  "-c", "init.defaultBranch=main", *args], cwd=cwd, check=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def source_repo(tmp_path):
  """A git repository standing in for jlp's URL: this checkout's set-up module, constraints and
  packaging files, and stub `jlp`, `configs` and `experiments` packages that say where they are."""
  if shutil.which("git") is None:
    pytest.skip("git is not installed")
  repo = tmp_path / "origin"
  for path in ("notebooks/colab_setup.py", "constraints.txt", "setup.cfg", "pyproject.toml"):
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(ROOT, path), repo / path)
  for package in ("jlp", "configs", "experiments"):
    (repo / package).mkdir()
    (repo / package / "__init__.py").write_text("ORIGIN = 'the clone'\n")
  git("init", "-q", ".", cwd=repo)
  git("add", "-A", cwd=repo)
  git("commit", "-q", "-m", "stand-in", cwd=repo)
  return repo


@pytest.fixture
def fake_pip(tmp_path):
  """A `pip` package that shadows the real one (PYTHONPATH comes first): `python -m pip ...`
  records its arguments and folder in pip.jsonl and exits with $FAKE_PIP_STATUS (default 0)."""
  root = tmp_path / "fake_pip"
  (root / "pip").mkdir(parents=True)
  (root / "pip" / "__init__.py").write_text("")
  (root / "pip" / "__main__.py").write_text(
      "import json, os, sys\n"
      "with open(os.environ['FAKE_PIP_LOG'], 'a') as f:\n"
      "  f.write(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd()}) + '\\n')\n"
      "status = int(os.environ.get('FAKE_PIP_STATUS', '0'))\n"
      "if status:\n"
      "  print('ERROR: No matching distribution found for jax==0.11.2', file=sys.stderr)\n"
      "sys.exit(status)\n")
  return root


def run_setup_cell(url: str, workdir, fake_pip, pip_status: int = 0, then: str = ""):
  """Runs quickstart's set-up cell with JLP_REPO_URL = url in a plain Python started in workdir
  (no checkout there, as on Colab), then `then`; returns (the process, the pip calls)."""
  source = setup_cell("quickstart.ipynb")
  assert source.startswith(URL_LINE + "\n")
  source = source.replace(URL_LINE, f"JLP_REPO_URL = {url!r}", 1) + "\n" + then
  log = workdir.parent / "pip.jsonl"
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FAKE_PIP_STATUS")}
  env.update(PYTHONPATH=str(fake_pip), FAKE_PIP_LOG=str(log), FAKE_PIP_STATUS=str(pip_status))
  workdir.mkdir(exist_ok=True)
  # -S: no site-packages, so no jlp install or checkout of this machine is in sight (the cell
  # needs only the standard library).
  proc = subprocess.run([sys.executable, "-S", "-c", source], cwd=workdir, env=env, text=True,
                        capture_output=True, timeout=300)
  calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
  return proc, calls


def test_setup_cell_is_the_same_in_every_notebook():
  """One set-up cell: the URL variable on its first line, the logic in notebooks/colab_setup.py."""
  cells = [setup_cell(name) for name in NOTEBOOKS]
  assert all(cell == cells[0] for cell in cells)
  assert cells[0].startswith(URL_LINE + "\n")
  assert "colab_setup.setup(" in cells[0] and "import jax" not in cells[0]


@pytest.mark.parametrize("form", ["file_url", "path"])
def test_setup_cell_clones_and_installs(source_repo, fake_pip, tmp_path, form):
  """No checkout in the folder (Colab): the cell clones the URL into ./jlp_src, installs it with
  the constraints file, and `jlp`, `configs` and `experiments` import from the clone."""
  url = source_repo.as_uri() if form == "file_url" else str(source_repo)
  proc, calls = run_setup_cell(
      url, tmp_path / "content", fake_pip,
      then="import jlp, configs, experiments\n"
           "print('imported', jlp.ORIGIN, configs.ORIGIN, experiments.ORIGIN, configs.__file__)")
  assert proc.returncode == 0, proc.stderr
  clone = os.path.realpath(tmp_path / "content" / "jlp_src")
  assert os.path.isfile(os.path.join(clone, "notebooks", "colab_setup.py"))
  assert len(calls) == 1 and calls[0]["cwd"] == clone
  argv = calls[0]["argv"]
  assert argv[:5] == ["install", "-q", "-c", "constraints.txt", "-e"] and argv[5] in (".", ".[gpu]")
  assert f"installing jlp from {clone}" in proc.stdout
  assert "imported the clone the clone the clone " + os.path.join(clone, "configs") in proc.stdout


def test_setup_cell_without_url_says_where_to_set_it(fake_pip, tmp_path):
  proc, calls = run_setup_cell("", tmp_path / "content", fake_pip)
  assert proc.returncode != 0 and not calls
  assert ("No jlp checkout here: set JLP_REPO_URL at the top of this cell to jlp's git URL "
          "(or a local folder), then run the cell again.") in proc.stderr


def test_setup_cell_names_a_failed_clone(source_repo, fake_pip, tmp_path):
  missing = str(tmp_path / "no_such_repo")
  proc, calls = run_setup_cell(missing, tmp_path / "content", fake_pip)
  assert proc.returncode != 0 and not calls
  assert f"`git clone --quiet {missing} jlp_src` failed with exit status 128" in proc.stderr


def test_setup_cell_names_a_failed_install(source_repo, fake_pip, tmp_path):
  """A failing pip stops the cell with the command, its exit status and the end of its output."""
  proc, calls = run_setup_cell(str(source_repo), tmp_path / "content", fake_pip, pip_status=1)
  assert proc.returncode != 0 and len(calls) == 1
  assert "SetupError: `" in proc.stderr
  assert "-m pip install -q -c constraints.txt -e ." in proc.stderr
  assert "failed with exit status 1 (in " in proc.stderr
  assert "ERROR: No matching distribution found for jax==0.11.2" in proc.stderr


def test_run_checks_exit_status(tmp_path):
  module = colab_setup()
  assert module.run([sys.executable, "-c", "print('fine')"]) == "fine\n"
  with pytest.raises(module.SetupError, match=r"^`\S+ -c import sys; print\('bad'\); "
                     r"sys.exit\(3\)` failed with exit status 3 \(in .*\):\nbad$"):
    module.run([sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"], cwd=str(tmp_path))
  with pytest.raises(module.SetupError, match="^`no-such-program-jlp --x` could not start: "):
    module.run(["no-such-program-jlp", "--x"])


def fake_distribution(site, name: str, version: str, **files: str):
  """A <name>-<version>.dist-info folder in `site` holding METADATA and the given files."""
  info = site / f"{name}-{version}.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
  for filename, text in files.items():
    (info / filename.replace("_txt", ".txt").replace("_json", ".json")).write_text(text)


def test_setup_installs_a_clone_once(tmp_path, monkeypatch):
  """install=True skips pip when this Python's jlp is already an editable install of the clone
  (the cell run again after a restart); install=False (a checkout of your own) never installs."""
  module = colab_setup()
  clone = tmp_path / "jlp_src"
  clone.mkdir()
  (clone / "constraints.txt").write_text("")
  site = tmp_path / "site"
  fake_distribution(site, "jlp", "0.1.0", direct_url_json=json.dumps(
      {"url": clone.as_uri(), "dir_info": {"editable": True}}))
  monkeypatch.setattr(sys, "path", [str(site)] + sys.path)
  assert module.installed_from() == os.path.realpath(clone)
  monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
  assert module.setup(str(clone), install=True) == os.path.realpath(clone)
  assert sys.path[0] == os.path.realpath(clone)
  assert module.setup(str(clone), install=False) == os.path.realpath(clone)
  with pytest.raises(module.SetupError, match="is not a jlp checkout"):
    module.setup(str(tmp_path), install=False)


def test_setup_says_when_to_restart(tmp_path, monkeypatch):
  """A module imported before the install whose installed version changed: RestartRequired."""
  module = colab_setup()
  clone = tmp_path / "jlp_src"
  clone.mkdir()
  (clone / "constraints.txt").write_text("")
  site = tmp_path / "site"
  fake_distribution(site, "jlp_fake_dep", "2.0", top_level_txt="jlp_fake_dep\n")
  monkeypatch.setattr(sys, "path", [str(site)] + sys.path)
  old = types.ModuleType("jlp_fake_dep")
  old.__version__ = "1.0"
  monkeypatch.setitem(sys.modules, "jlp_fake_dep", old)
  assert "jlp_fake_dep 1.0 (installed now: 2.0)" in module.stale_modules()
  calls = []
  monkeypatch.setattr(module, "run", lambda cmd, cwd=None: calls.append((cmd, cwd)) or "")
  with pytest.raises(module.RestartRequired, match=r"jlp_fake_dep 1\.0 \(installed now: 2\.0\)\. "
                     r"Restart the runtime \(Colab: Runtime > Restart session\)"):
    module.setup(str(clone), install=True, gpu=False)
  assert calls == [(module.pip_install_command(str(clone), False), os.path.realpath(clone))]
  monkeypatch.setitem(sys.modules, "jlp_fake_dep", types.SimpleNamespace(__version__="2.0"))
  assert module.setup(str(clone), install=True, gpu=True) == os.path.realpath(clone)
  assert calls[-1][0][-1] == ".[gpu]"


def test_kernel_started_in_notebooks_imports_configs_and_experiments(monkeypatch):
  """Jupyter started inside notebooks/ (its kernel's folder), nothing on PYTHONPATH: the set-up
  cell finds the checkout above, installs nothing, and configs, experiments and jlp import from
  this checkout."""
  nbclient = pytest.importorskip("nbclient")
  monkeypatch.delenv("PYTHONPATH", raising=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.v4.new_notebook(cells=[
      nbformat.v4.new_code_cell(setup_cell("quickstart.ipynb")),
      nbformat.v4.new_code_cell("import configs, experiments, jlp\n"
                                "for m in (configs, experiments, jlp):\n"
                                "  print('from', m.__file__)")])
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}})
  client.execute()
  text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
  root = os.path.realpath(ROOT)
  assert f"jlp checkout: {root} (first on sys.path; nothing installed)" in text
  for package in ("configs", "experiments", "jlp"):
    assert f"from {os.path.join(root, package, '__init__.py')}" in text
