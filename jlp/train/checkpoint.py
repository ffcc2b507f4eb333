"""Orbax checkpoints of a training run: the whole train state plus a small JSON record.

`Checkpointer(workdir)` keeps checkpoints under `workdir/checkpoints/<step>/` with two items:
`state` (any pytree of arrays: parameters, optimizer state, BatchNorm statistics, PRNG key data,
controller state) and `meta` (JSON: the step, the config it was written with, anything the loop
needs to continue exactly). Restoring takes an abstract target (`jax.ShapeDtypeStruct`s with
shardings, e.g. from `jax.eval_shape` of the initial state), so every array comes back with the
sharding the step expects. Saves are asynchronous (orbax's default); `wait()` blocks until the last
one is on disk, `close()` waits and releases the manager. Multi-process runs call every method on
every process (orbax coordinates them).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


def latest_step(workdir: str) -> int | None:
  """The newest checkpoint's step in `workdir` without opening a manager (None if there is none).
  Orbax renames a checkpoint's temporary folder to its step when the save completes."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    return None
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()]
  return max(steps) if steps else None


def read_meta(workdir: str, step: int) -> dict[str, Any]:
  """The meta of checkpoint `step` in `workdir`, without reading its state."""
  checkpoints = Checkpointer(workdir)
  try:
    return checkpoints.meta(step)
  finally:
    checkpoints.close()


class Checkpointer:
  """Saves and restores (state, meta) by step with orbax's CheckpointManager.

  Args:
    workdir: the run's directory (checkpoints go to `workdir/checkpoints`).
    max_to_keep: how many of the newest checkpoints to keep.
  """

  def __init__(self, workdir: str, *, max_to_keep: int = 2):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep!r} is not allowed; expected an int >= 1.")
    self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any], *, replace: bool = False) -> None:
    """Writes checkpoint `step` (asynchronously); an existing checkpoint at `step` is kept, or
    with `replace` deleted first (not atomic: a crash in between leaves the older checkpoints)."""
    if step in self._manager.all_steps():
      if not replace:
        return
      self._manager.wait_until_finished()
      self._manager.delete(step)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Checkpoint `step` as (state shaped and sharded like `abstract_state`, meta)."""
    target = jax.tree.map(_restore_target, abstract_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def meta(self, step: int) -> dict[str, Any]:
    """The meta of checkpoint `step`, without reading its state."""
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def _restore_target(x: Any) -> Any:
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x
