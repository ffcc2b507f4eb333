"""The training entry point behind `python -m experiments.train`, which notebooks call too:
`train_and_evaluate(config, workdir)` runs (or resumes) an experiment config (jlp.train.config) in
`workdir`: data parallel (`jlp.train.data_parallel_loop`) when config.pipeline.schedule is "none",
pipelined data parallelism (SD-PIPE, `jlp.train.pipeline_loop`) for "gpipe" and "1f1b". Each
loop's module docstring says what it logs, checkpoints and resumes (bit-exactly).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from jlp.train import checkpoint, data_parallel_loop, pipeline_loop, workdir as workdir_record
from jlp.train.config import validate

__all__ = ["train_and_evaluate"]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       progress: bool | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
  """Trains (or resumes) `config` in `workdir` with the loop its pipeline.schedule picks; returns
  the last logged metrics row plus `step` and `interrupted`. `progress`: a tqdm bar (None: on a
  terminal, process 0 only).

  Before anything is built or written: the config is checked (`validate`), and a workdir that
  holds checkpoints is resumed only under the config that wrote them (`jlp.train.workdir`:
  cadence fields aside; else `workdir.ConfigChangedError`, a ValueError, unless
  `allow_config_change`). A finished run (its checkpoint at max_steps; pipelined: flushed) says
  so and returns."""
  validate(config)
  start = checkpoint.latest_step(workdir)
  changes = {}
  if start is not None:
    changes = workdir_record.check_resume(config, workdir, allow_change=allow_config_change)
    # A pipelined checkpoint at max_steps with mini-batches in flight (written before the end,
    # under a larger max_steps or on Ctrl-C) is not finished: the loop flushes and evaluates it.
    drain = (start == config.max_steps and config.pipeline.schedule != "none" and
             pipeline_loop.needs_drain(workdir, start))
    if start >= config.max_steps and not drain:
      print(f"{workdir} is finished: its checkpoint is at step {start} of "
            f"max_steps={config.max_steps}; raise --config.max_steps to train on, or use a new "
            "--workdir.", flush=True)
      return {"step": start, "interrupted": False, "finished": True}
  loop = data_parallel_loop if config.pipeline.schedule == "none" else pipeline_loop
  return loop.train_and_evaluate(config, workdir, progress=progress, config_changes=changes)
