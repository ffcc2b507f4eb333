"""The training entry point behind `python -m experiments.train`, which notebooks call too:
`train_and_evaluate(config, workdir)` runs (or resumes) an experiment config (jlp.train.config) in
`workdir`: data parallel (`jlp.train.data_parallel_loop`) when config.pipeline.schedule is "none",
pipelined data parallelism (SD-PIPE, `jlp.train.pipeline_loop`) for "gpipe" and "1f1b". Each
loop's module docstring says what it logs, checkpoints and resumes (bit-exactly).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from jlp.train import data_parallel_loop, pipeline_loop

__all__ = ["train_and_evaluate"]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       progress: bool | None = None) -> dict[str, Any]:
  """Trains (or resumes) `config` in `workdir` with the loop its pipeline.schedule picks; returns
  the last logged metrics row plus `step` and `interrupted`. `progress`: a tqdm bar (None: on a
  terminal, process 0 only)."""
  if config.pipeline.schedule == "none":
    return data_parallel_loop.train_and_evaluate(config, workdir, progress=progress)
  return pipeline_loop.train_and_evaluate(config, workdir, progress=progress)
