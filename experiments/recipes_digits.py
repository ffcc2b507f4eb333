r"""Low-precision training recipes on digits (and BERT): accuracy, loss and speed beside float32.

  python -m experiments.recipes_digits [--workdir=out/recipes_digits] [--max_steps=N]
  python -m experiments.recipes_digits --bert        # also the `:local` BERT (slower: opt-in)
  python -m experiments.recipes_digits --quick --recipes=mxfp8,nvfp4   # the tests' smoke run

Trains the digits CNN (configs/digits.py: 300 steps, 8 emulated data-parallel workers, as the
slow test tests/train/quant_recipe_test.py) once in float32 and once per low-precision training
recipe of `jlp.nn.recipes` (`config.quant_recipe`):

  nvfp4         TransformerEngine's NVFP4BlockScaling (NVIDIA, "Pretraining Large Language
                Models with NVFP4", arXiv:2509.25149): 1x16 E2M1 blocks with E4M3 scales, 16x16
                weight tiles, stochastic rounding and random Hadamard transforms on the gradients,
                first and last layer in float32;
  mxfp8         TE's MXFP8BlockScaling: E4M3 with one E8M0 scale per 32 values;
  mxfp4         MXFP4 with stochastic rounding and the 3/4 scale on the backward (Tseng, Yu, Park,
                "Training LLMs with MXFP4", arXiv:2502.20586);
  deepseek_fp8  DeepSeek-V3's fine-grained FP8 (arXiv:2412.19437 §3.3): 1x128 activation and
                128x128 weight tiles, a 14-bit accumulator promoted to float32 every 128 products;
  fp8_current   TE's Float8CurrentScaling: one E4M3 (forward) / E5M2 (gradient) scale per tensor;
  fp8_delayed   TE's DelayedScaling: one E4M3 (forward) / E5M2 (gradient) scale per tensor from an
                amax history of 1024 steps kept in the model state (Micikevicius et al., "FP8
                Formats for Deep Learning", arXiv:2209.05433).

Prints a markdown table (final test accuracy, its difference to float32 in percent points, the
train loss averaged over the last logged window, wall seconds per training step) and writes it
to WORKDIR/table.md, with the training curves (loss and test accuracy against step) in
WORKDIR/curves.png. With --bert it does
the same for BERT on configs/hipress_bert_small.py's `:local` data (the bundled digits as 64-token
sentences, a 2-layer hidden-32 BERT, AdamW, no gradient compression, global batch 128) for
--bert_steps steps, in WORKDIR/bert/. The library side is `jlp.studies.recipe_study` (the notebooks call it too).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from absl import flags, logging

from jlp.train import cli

#: Steps per run in quick mode (the tests).
QUICK_STEPS = 4
#: BERT steps by default: the `:local` BERT's loss stays at ln 10 for its first ~100 steps.
BERT_STEPS = 300


def define_flags() -> None:
  """The command-line flags, defined only when this runs as a program: the tests import this
  module beside the other experiments, which define flags of the same names."""
  from jlp import studies  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", "out/recipes_digits", "Where the runs, the table and the plots go.")
  flags.DEFINE_integer("max_steps", None, "Override the digits config's max_steps.")
  flags.DEFINE_bool("quick", False, f"Smoke run: {QUICK_STEPS} steps per run.")
  flags.DEFINE_list("recipes", list(studies.STUDY_RECIPES),
                    "Recipes to run beside float32.")
  flags.DEFINE_bool("bert", False, "Also run the study on the `:local` BERT (a few minutes more "
                    "on a CPU).")
  flags.DEFINE_integer("bert_steps", BERT_STEPS, "Steps per BERT run.")


def check_recipes(recipes: Sequence[str]) -> tuple[str, ...]:
  """The --recipes list checked: a one-line ValueError naming the flag for an unknown name."""
  from jlp import studies  # pylint: disable=g-import-not-at-top
  recipes = tuple(recipes)
  allowed = ", ".join(studies.STUDY_RECIPES)
  if not recipes:
    raise ValueError(f"--recipes is empty; expected a comma-separated list of {allowed}.")
  for name in recipes:
    if name not in studies.STUDY_RECIPES:
      raise ValueError(f"--recipes={','.join(recipes)} is not allowed: {name!r} is not a recipe; "
                       f"expected a comma-separated list of {allowed}.")
  if len(set(recipes)) != len(recipes):
    raise ValueError(f"--recipes={','.join(recipes)} is not allowed; expected each recipe once.")
  return recipes


def digits_config(max_steps: int | None = None, quick: bool = False):
  """configs/digits.py (the slow recipe test's settings: 300 steps, lr 0.2, cosine); `quick`:
  QUICK_STEPS steps, one evaluation at the end, no periodic checkpoints."""
  from configs import digits  # pylint: disable=g-import-not-at-top
  config = digits.get_config()
  config.checkpoint_every = 0
  if quick:
    config.max_steps = QUICK_STEPS
    config.log_every = 1
    config.eval_every = 0
  if max_steps is not None:
    config.max_steps = max_steps
  return config


def bert_config(steps: int = BERT_STEPS):
  """configs/hipress_bert_small.py:local,compressor=none: the tiny BERT on the digits as sentences,
  AdamW at 1e-3, `steps` steps, evaluated five times, at a global batch of 128 (`:local` has 64):
  16 rows per device, as nvfp4's Hadamard transform on the weight-gradient operands needs a
  multiple of 16 rows, and the pooler's input is one [CLS] row per sentence."""
  from configs import hipress_bert_small  # pylint: disable=g-import-not-at-top
  if steps < 1:
    raise ValueError(f"--bert_steps={steps} is not allowed; expected a positive int.")
  config = hipress_bert_small.get_config("local,compressor=none")
  config.batch_size = 128
  config.max_steps = steps
  config.log_every = max(1, steps // 30)
  config.eval_every = max(1, steps // 5)
  config.checkpoint_every = 0
  return config


def study(config, workdir: str, recipes: Sequence[str], title: str) -> list[dict[str, Any]]:
  """One model's study (`config`, an ml_collections.ConfigDict): runs it, prints the table and
  writes WORKDIR/table.md and WORKDIR/curves.png."""
  import jax  # pylint: disable=g-import-not-at-top
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from jlp import plots, studies  # pylint: disable=g-import-not-at-top

  print(f"\n## {title}: {config.max_steps} steps, global batch {config.batch_size} on "
        f"{jax.device_count()} data-parallel workers ({jax.default_backend()})\n", flush=True)
  rows = studies.recipe_study(config, workdir, recipes)
  table = studies.render_recipe_table(rows)
  print("\n" + table)
  with open(os.path.join(workdir, "table.md"), "w", encoding="utf-8") as f:
    f.write(f"{title}: {config.max_steps} steps, global batch {config.batch_size}, "
            f"{jax.device_count()} {jax.default_backend()} devices.\n\n{table}\n")
  trained = [r for r in rows if r["supported"]]
  curves = os.path.join(workdir, "curves.png")
  fig = plots.plot_runs([os.path.join(workdir, r["run"]) for r in trained], curves,
                        labels=[r["run"] for r in trained])
  plt.close(fig)
  print(f"\ntable: {os.path.join(workdir, 'table.md')}\ncurves: {curves}", flush=True)
  return rows


def run(workdir: str, max_steps: int | None = None, quick: bool = False,
        recipes: Sequence[str] | None = None, bert: bool = False,
        bert_steps: int = BERT_STEPS) -> dict[str, list[dict[str, Any]]]:
  """Runs the digits study (and with `bert` the BERT one); returns {"digits": rows, "bert": rows}."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from jlp import studies  # pylint: disable=g-import-not-at-top

  recipes = check_recipes(studies.STUDY_RECIPES if recipes is None else recipes)
  configs = [("digits", digits_config(max_steps, quick), workdir, "digits CNN (configs/digits.py)")]
  if bert:
    configs.append(("bert", bert_config(QUICK_STEPS if quick else bert_steps),
                    os.path.join(workdir, "bert"),
                    "BERT (configs/hipress_bert_small.py:local,compressor=none)"))
  out = {}
  for name, config, folder, title in configs:
    os.makedirs(folder, exist_ok=True)
    out[name] = study(config, folder, recipes, title)
  return out


def main(argv):
  del argv
  cli.apply_cpu_devices()
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  if f.max_steps is not None and f.max_steps < 1:
    cli.fail(f"--max_steps={f.max_steps} is not allowed; expected a positive int.")
  try:
    recipes = check_recipes(f.recipes)
    if f.bert:
      bert_config(f.bert_steps)
  except ValueError as e:
    cli.fail(str(e))
  run(f.workdir, f.max_steps, f.quick, recipes, f.bert, f.bert_steps)


if __name__ == "__main__":
  define_flags()
  cli.define_cpu_devices(8)
  cli.run(main)
