"""Orbax checkpoints of a training run: the whole train state plus a small JSON record.

`Checkpointer(workdir)` keeps checkpoints under `workdir/checkpoints/<step>/` with two items:
`state` (any pytree of arrays: parameters, optimizer state, BatchNorm statistics, PRNG key data,
controller state) and `meta` (JSON: the step, the config it was written with, anything the loop
needs to continue exactly). Restoring takes an abstract target (`jax.ShapeDtypeStruct`s with
shardings, e.g. from `jax.eval_shape` of the initial state), so every array comes back with the
sharding the step expects. Saves are asynchronous (orbax's default); `wait()` blocks until the last
one is on disk, `close()` waits and releases the manager. Multi-process runs call every method on
every process (orbax coordinates them).

Checkpoints that cannot be half-written (issue 37). Orbax writes a checkpoint into a temporary
folder and renames it to its step when every process has written its part (its completion
marker: the name, `commit_success.txt` and `_CHECKPOINT_METADATA`). Right after the rename, process
0 seals the checkpoint: `jlp_manifest.json` lists every file's size and SHA-256 (written to a
temporary name, then renamed). `latest_step` / `Checkpointer.latest_step` return the newest
checkpoint that is complete and whose files match its manifest (a checkpoint without a manifest,
e.g. one written before seals existed, is taken on orbax's marker alone); when a newer one is
incomplete, truncated or corrupted they print one line saying so and fall back to the previous
complete one. Saving a step whose checkpoint is damaged replaces it. Two checkpoints are kept by
default, so that one damaged checkpoint always leaves a previous one.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "jlp_manifest.json"
COMPLETION_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")
# orbax's type handlers, its jax.Array one without replica-parallel saves: those split every
# replicated array into one slice per replica, each an eagerly compiled program (8 per leaf shape
# on 8 devices) at the first save of a process, to write the parts of an array that one host
# holds whole anyway. (orbax's global registry is left as it is.)
_REGISTRY = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store())),
    *((t, ocp.type_handlers.get_type_handler(t))
      for t in (int, float, bytes, np.number, np.ndarray, str)))
_said: set[tuple[str, int]] = set()  # (directory, step) whose fallback line was printed


def _digest(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _files(folder: str) -> list[str]:
  """The files under `folder` (relative paths, sorted), the manifest and its temporary aside."""
  out = []
  for root, _, names in os.walk(folder):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), folder)
      if not rel.startswith(MANIFEST):
        out.append(rel)
  return sorted(out)


def seal(folder: str) -> None:
  """Writes `folder/jlp_manifest.json`: every file's size and SHA-256 (atomically)."""
  files = {rel: {"size": os.path.getsize(os.path.join(folder, rel)),
                 "sha256": _digest(os.path.join(folder, rel))} for rel in _files(folder)}
  body = json.dumps({"files": files}, sort_keys=True, indent=0)
  record = json.dumps({"files": files, "sha256": hashlib.sha256(body.encode()).hexdigest()},
                      sort_keys=True, indent=0)
  temporary = os.path.join(folder, f"{MANIFEST}.tmp{os.getpid()}")
  with open(temporary, "w", encoding="utf-8") as f:
    f.write(record)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, os.path.join(folder, MANIFEST))


def damage(folder: str) -> str | None:
  """Why the checkpoint in `folder` cannot be restored (None when it is complete and its files
  match its manifest)."""
  try:
    for name in COMPLETION_FILES:
      if not os.path.isfile(os.path.join(folder, name)):
        return f"it is incomplete ({name} is missing)"
    with open(os.path.join(folder, "_CHECKPOINT_METADATA"), encoding="utf-8") as f:
      json.load(f)
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
      return None  # not sealed (an older jlp, or a kill right after orbax's rename)
    try:
      with open(path, encoding="utf-8") as f:
        record = json.load(f)
      body = json.dumps({"files": record["files"]}, sort_keys=True, indent=0)
      if hashlib.sha256(body.encode()).hexdigest() != record["sha256"]:
        raise ValueError
    except (ValueError, KeyError, TypeError):
      return f"its {MANIFEST} is corrupted"
    for rel, want in sorted(record["files"].items()):
      file = os.path.join(folder, rel)
      if not os.path.isfile(file):
        return f"{rel} is missing"
      size = os.path.getsize(file)
      if size != want["size"]:
        return f"{rel} has {size} bytes, {want['size']} expected"
      if _digest(file) != want["sha256"]:
        return f"{rel} is corrupted (its SHA-256 differs)"
    return None
  except (OSError, ValueError) as e:
    return f"it cannot be read ({type(e).__name__}: {e})"


def steps(workdir: str) -> list[int]:
  """Every step with a checkpoint folder in `workdir` (complete or not), ascending."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def good_step(workdir: str, *, say: bool = True) -> tuple[int | None, dict[int, str]]:
  """(the newest step whose checkpoint is intact or None, {newer damaged step: why}); with `say`,
  prints one line per damaged checkpoint passed over (once per process)."""
  directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
  bad: dict[int, str] = {}
  found = None
  for step in reversed(steps(workdir)):
    why = damage(os.path.join(directory, str(step)))
    if why is None:
      found = step
      break
    bad[step] = why
  if say:
    for step, why in sorted(bad.items(), reverse=True):
      if (directory, step) not in _said:
        _said.add((directory, step))
        instead = f"resuming from step {found}" if found is not None else "starting afresh"
        print(f"checkpoint {step} in {directory} is not used: {why}; {instead}.", flush=True)
  return found, bad


def latest_step(workdir: str) -> int | None:
  """The newest intact checkpoint's step in `workdir` without opening a manager (None if there is
  none); a newer damaged one is passed over with one line (module docstring)."""
  return good_step(workdir)[0]


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
    max_to_keep: how many of the newest checkpoints to keep (at least two unless asked: a damaged
      newest one falls back to the previous).
  """

  def __init__(self, workdir: str, *, max_to_keep: int = 2):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep!r} is not allowed; expected an int >= 1.")
    self.workdir = workdir
    self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_REGISTRY),
                       "meta": ocp.JsonCheckpointHandler()})
    self._sealer: threading.Thread | None = None
    self._stop = threading.Event()

  def latest_step(self) -> int | None:
    """The newest intact checkpoint's step, or None (a newer damaged one is passed over with one
    line)."""
    self._join_sealer()
    return good_step(self.workdir)[0]

  def save(self, step: int, state: Any, meta: dict[str, Any], *, replace: bool = False) -> None:
    """Writes checkpoint `step` (asynchronously); an existing checkpoint at `step` is kept, or
    with `replace` (or when it is damaged) deleted first (not atomic: a crash in between leaves
    the older checkpoints)."""
    self._join_sealer()
    if step in self._manager.all_steps():
      damaged = damage(os.path.join(self.directory, str(step))) is not None
      if not replace and not damaged:
        return
      self._manager.wait_until_finished()
      self._manager.delete(step)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    if jax.process_index() == 0:
      self._sealer = threading.Thread(target=self._seal_when_done, args=(step,), daemon=True,
                                      name=f"jlp-seal-{step}")
      self._sealer.start()

  def _seal_when_done(self, step: int) -> None:
    """Seals checkpoint `step` once orbax has renamed it into place (polls; gives up on close)."""
    folder = os.path.join(self.directory, str(step))
    while not all(os.path.isfile(os.path.join(folder, n)) for n in COMPLETION_FILES):
      if self._stop.wait(0.02):
        if not all(os.path.isfile(os.path.join(folder, n)) for n in COMPLETION_FILES):
          return
        break
    try:
      seal(folder)
    except OSError:
      pass  # (deleted meanwhile by a newer save's max_to_keep) unsealed: taken on orbax's marker

  def _join_sealer(self) -> None:
    if self._sealer is not None:
      self._manager.wait_until_finished()
      self._stop.set()
      self._sealer.join()
      self._stop.clear()
      self._sealer = None

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Checkpoint `step` as (state shaped and sharded like `abstract_state`, meta)."""
    target = jax.tree.map(_restore_target, abstract_state)
    state = ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=state, meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def meta(self, step: int) -> dict[str, Any]:
    """The meta of checkpoint `step`, without reading its state."""
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def wait(self) -> None:
    self._manager.wait_until_finished()
    self._join_sealer()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._join_sealer()
    self._manager.close()


def _restore_target(x: Any) -> Any:
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x
