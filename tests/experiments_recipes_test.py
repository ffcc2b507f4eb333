"""experiments.recipes_digits in quick mode, and jlp.studies.recipe_study's input checks.

References: the study's structure (float32 first, then each recipe in the order given, an
unsupported recipe as a row that trains nothing: none is unsupported at present, so the tests
name a hypothetical one, "fp8_future"), the gap to float32 as the difference of the
two accuracies, and seconds per step as the logged windows' steps over their throughput.
"""

import os
import re
import subprocess
import sys

import pytest

from jlp import studies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_study(out_rows, recipes, out, workdir):
  """float32 first, then the recipes in order; the table, the curves and the run directories."""
  from experiments import recipes_digits  # pylint: disable=g-import-not-at-top
  rows = out_rows["digits"]
  assert list(out_rows) == ["digits"]
  assert [(r["run"], r["recipe"]) for r in rows] == [("float32", "none")] + [(n, n) for n in recipes]
  base = rows[0]
  with open(os.path.join(workdir, "table.md"), encoding="utf-8") as f:
    table = f.read()
  assert table.splitlines()[2] == "| recipe | test acc % | vs float32 | train loss, last window | s/step |"
  assert table.split("\n\n", 1)[1].strip() in out
  assert re.search(r"^\| float32 \| \d+\.\d\d \|  \| \d+\.\d{4} \| \d+\.\d{4} \|$", table, re.M)
  for r in rows:
    if r["recipe"] == "fp8_future":
      assert not r["supported"] and r["test_accuracy"] is None and "not built" in r["note"]
      assert not os.path.exists(os.path.join(workdir, "fp8_future"))
      assert "| fp8_future | not supported yet | | | |" in table
      continue
    assert r["supported"] and r["step"] == recipes_digits.QUICK_STEPS
    assert 0 <= r["test_accuracy"] <= 1 and r["train_loss"] > 0 and r["sec_per_step"] > 0
    assert r["gap_to_float32"] == r["test_accuracy"] - base["test_accuracy"]
    assert os.path.isfile(os.path.join(workdir, r["run"], "metrics.jsonl"))
    if r["recipe"] != "none":
      assert r["train_loss"] != base["train_loss"]  # the recipe changed the run
      assert re.search(rf"^\| {r['run']} \| \d+\.\d\d \| [+-]\d+\.\d\d \|", table, re.M)
  assert os.path.getsize(os.path.join(workdir, "curves.png")) > 0


@pytest.fixture
def future_recipe(monkeypatch):
  """A recipe named but not built ("fp8_future"), as `jlp.nn.recipes.UNSUPPORTED` lists them."""
  monkeypatch.setattr(studies, "UNSUPPORTED", {"fp8_future": "not built in this test"})
  monkeypatch.setattr(studies, "STUDY_RECIPES", studies.STUDY_RECIPES + ("fp8_future",))


def test_recipes_digits_quick_writes_the_table_and_the_plot(tmp_path, capsys, fast_compile,
                                                           future_recipe):
  """The entry point with float32 and an unsupported recipe only (one training run)."""
  from experiments import recipes_digits  # pylint: disable=g-import-not-at-top
  out_rows = recipes_digits.run(str(tmp_path), quick=True, recipes=("fp8_future",))
  check_study(out_rows, ("fp8_future",), capsys.readouterr().out, str(tmp_path))


@pytest.mark.slow
def test_recipes_digits_quick_two_recipes(tmp_path, capsys, fast_compile, future_recipe):
  """float32, two trained recipes (mxfp8, fp8_delayed) and an unsupported one (~30 s of CPU;
  over a minute on the shared 2-core machine)."""
  from experiments import recipes_digits  # pylint: disable=g-import-not-at-top
  names = ("mxfp8", "fp8_delayed", "fp8_future")
  out_rows = recipes_digits.run(str(tmp_path), quick=True, recipes=names)
  check_study(out_rows, names, capsys.readouterr().out, str(tmp_path))


def test_recipe_study_rejects_bad_entries(tmp_path):
  from experiments import recipes_digits  # pylint: disable=g-import-not-at-top
  config = recipes_digits.digits_config(quick=True)
  with pytest.raises(ValueError, match="recipes entry='none' is not allowed"):
    studies.recipe_study(config, str(tmp_path), ["none"])
  with pytest.raises(ValueError, match="recipes entry='fp4' is not allowed; expected one of "
                     "'nvfp4', .*'fp8_delayed'"):
    studies.recipe_study(config, str(tmp_path), ["fp4"])
  with pytest.raises(ValueError, match="recipes='nvfp4' is not allowed"):
    studies.recipe_study(config, str(tmp_path), "nvfp4")
  with pytest.raises(ValueError, match=r"^--recipes=mxfp8,fp4 is not allowed: 'fp4' is not a "
                     r"recipe; expected a comma-separated list of nvfp4, .*fp8_delayed\.$"):
    recipes_digits.check_recipes(["mxfp8", "fp4"])
  with pytest.raises(ValueError, match="^--bert_steps=0 is not allowed"):
    recipes_digits.bert_config(0)
  assert not os.listdir(tmp_path)


def test_bad_flag_is_one_line_naming_it(tmp_path):
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "experiments.recipes_digits", "--recipes=nvfp5",
                         f"--workdir={tmp_path}"], cwd=ROOT, env=env, text=True,
                        capture_output=True, timeout=300)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "error: --recipes=nvfp5 is not allowed: 'nvfp5' is not a recipe; expected a "
      "comma-separated list of nvfp4, mxfp8, mxfp4, deepseek_fp8, fp8_current, fp8_delayed."]
  assert not os.listdir(tmp_path)
