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
from jlp.train.config import resolved, validate
from jlp.train.loop_common import NonFiniteLossError

__all__ = ["NonFiniteLossError", "train_and_evaluate"]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       progress: bool | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
  """Trains (or resumes) `config` in `workdir` with the loop its pipeline.schedule picks; returns
  the last logged metrics row plus `step` and `interrupted`. `progress`: a tqdm bar (None: on a
  terminal, process 0 only).

  Before anything is built or written: the config is checked (`validate`), and a workdir that
  holds checkpoints is resumed only under the config and device layout that wrote its newest
  checkpoint (`jlp.train.workdir`: cadence fields aside; else `workdir.ConfigChangedError`, a
  ValueError, unless `allow_config_change`); the config is recorded as `resolved` gives it. A
  finished run (its checkpoint at max_steps; pipelined: flushed) says so and returns."""
  validate(config)
  config = resolved(config)  # what runs, as config.json, the checkpoints and a resume see it
  start = checkpoint.latest_step(workdir)
  changes = {}
  if start is not None:
    meta = checkpoint.read_meta(workdir, start)
    changes = workdir_record.check_resume(config, workdir, meta,
                                          allow_change=allow_config_change)
    # A pipelined checkpoint at max_steps with mini-batches in flight (written before the end,
    # under a larger max_steps or on Ctrl-C) is not finished: the loop flushes and evaluates it.
    drain = (start == config.max_steps and config.pipeline.schedule != "none" and
             pipeline_loop.needs_drain(meta, start))
    if start >= config.max_steps and not drain:
      how = "raise --config.max_steps to train on"
      if config.schedule.name in workdir_record.HORIZON_SCHEDULES:
        how = (f"to train on, raise --config.max_steps with --allow_config_change (schedule "
               f"{config.schedule.name!r} decays over max_steps: the learning rate from step "
               f"{start} on changes)")
      print(f"{workdir} is finished: its checkpoint is at step {start} of "
            f"max_steps={config.max_steps}; {how}, or use a new --workdir.", flush=True)
      return {"step": start, "interrupted": False, "finished": True}
  loop = data_parallel_loop if config.pipeline.schedule == "none" else pipeline_loop
  return loop.train_and_evaluate(config, workdir, progress=progress, config_changes=changes,
                                 allow_config_change=allow_config_change)
