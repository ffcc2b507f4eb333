"""Checkpoints that cannot be half-written (issue 37): the newest checkpoint is checked on
restore (orbax's completion marker plus jlp's manifest of sizes and SHA-256s); a truncated or
corrupted file, or a save killed before its end, falls back to the previous complete checkpoint
with one line, and a later save at that step replaces the damaged one."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from compiles import backend_compiles
from jlp.train import checkpoint
from jlp.train.checkpoint import Checkpointer


def _state(step):
  return {"w": jnp.arange(4096.0) + step, "b": jnp.full((3, 3), float(step))}


def _written(tmp_path, steps=(5, 10)):
  ck = Checkpointer(str(tmp_path))
  for step in steps:
    ck.save(step, _state(step), {"step": step})
  ck.close()
  return tmp_path / "checkpoints"


def _biggest_state_file(folder):
  files = [os.path.join(r, f) for r, _, fs in os.walk(folder / "state") for f in fs]
  return max(files, key=os.path.getsize)


def _restored_step(tmp_path):
  ck = Checkpointer(str(tmp_path))
  try:
    step = ck.latest_step()
    state, meta = ck.restore(step, _state(0))
    np.testing.assert_array_equal(state["w"], np.arange(4096.0) + step)
    assert meta == {"step": step}
    return step
  finally:
    ck.close()


def test_every_checkpoint_is_sealed_and_two_are_kept(tmp_path):
  folder = _written(tmp_path, (5, 10, 15))
  assert sorted(os.listdir(folder)) == ["10", "15"]
  for step in ("10", "15"):
    record = json.loads((folder / step / checkpoint.MANIFEST).read_text())
    assert "meta/metadata" in record["files"] and "commit_success.txt" in record["files"]
    assert checkpoint.damage(str(folder / step)) is None
  assert checkpoint.latest_step(str(tmp_path)) == 15


@pytest.mark.parametrize("how", ["truncate_state", "corrupt_state", "corrupt_meta",
                                 "truncate_orbax_metadata", "no_commit_marker", "corrupt_manifest"])
def test_a_damaged_latest_checkpoint_falls_back_with_one_line(tmp_path, capsys, how):
  folder = _written(tmp_path)
  newest = folder / "10"
  if how == "truncate_state":
    path = _biggest_state_file(newest)
    os.truncate(path, os.path.getsize(path) // 2)
  elif how == "corrupt_state":
    path = _biggest_state_file(newest)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
  elif how == "corrupt_meta":
    (newest / "meta" / "metadata").write_text('{"step": 11}')
  elif how == "truncate_orbax_metadata":
    os.truncate(newest / "_CHECKPOINT_METADATA", 10)
  elif how == "no_commit_marker":
    os.unlink(newest / "commit_success.txt")
  else:
    (newest / checkpoint.MANIFEST).write_text("{}")
  capsys.readouterr()
  assert checkpoint.latest_step(str(tmp_path)) == 5
  assert _restored_step(tmp_path) == 5
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"checkpoint 10 in {folder} is not used: ")
  assert lines[0].endswith("resuming from step 5.")


def test_a_save_killed_before_its_end_is_passed_over(tmp_path):
  """A host killed while orbax writes step 15 leaves its temporary folder (and, had it died
  during the rename's aftermath, a folder without the completion marker): step 10 is used."""
  folder = _written(tmp_path)
  (folder / "15.orbax-checkpoint-tmp").mkdir()
  (folder / "15.orbax-checkpoint-tmp" / "state").mkdir()
  (folder / "20").mkdir()
  (folder / "20" / "meta").mkdir()
  assert _restored_step(tmp_path) == 10


def test_a_save_at_a_damaged_step_replaces_it(tmp_path):
  folder = _written(tmp_path)
  os.truncate(_biggest_state_file(folder / "10"), 3)
  ck = Checkpointer(str(tmp_path))
  assert ck.latest_step() == 5
  ck.save(10, _state(10), {"step": 10})
  ck.close()
  assert checkpoint.damage(str(folder / "10")) is None
  assert _restored_step(tmp_path) == 10


def test_an_unsealed_checkpoint_is_taken_on_orbax_marker(tmp_path):
  """A checkpoint without jlp's manifest (an older jlp; a kill right after orbax's rename) is
  complete for orbax: it is used."""
  folder = _written(tmp_path)
  os.unlink(folder / "10" / checkpoint.MANIFEST)
  assert _restored_step(tmp_path) == 10


def test_every_checkpoint_damaged_starts_afresh(tmp_path, capsys):
  folder = _written(tmp_path)
  for step in ("5", "10"):
    os.unlink(folder / step / "commit_success.txt")
  assert checkpoint.latest_step(str(tmp_path)) is None
  assert "starting afresh" in capsys.readouterr().out


def _sharded_state():
  """Arrays replicated over the 8 devices (as a data-parallel step keeps its parameters) and one
  sharded over them."""
  mesh = jax.make_mesh((8,), ("data",))
  replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  return {"w": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7, replicated),
          "b": jax.device_put(np.arange(24).astype(jnp.bfloat16), replicated),
          "s": jax.device_put(np.arange(16, dtype=np.int32), sharded)}


def _abstract(state):
  """The restore target of `state`: its shapes, dtypes and shardings (as a run's eval_shape)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _same(got, expected):
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert g.sharding == e.sharding and g.dtype == e.dtype
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(e).view(np.uint8))


def test_a_save_compiles_nothing_and_restores_every_sharding(tmp_path):
  """Orbax's replica-parallel saves split each replicated array into a slice per device, each an
  eagerly compiled program (8 per leaf shape); jlp's checkpoints write each array whole."""
  state = _sharded_state()
  with backend_compiles() as compiled:
    ck = Checkpointer(str(tmp_path))
    ck.save(1, state, {"step": 1})
    ck.wait()
  assert compiled == []
  restored, meta = ck.restore(1, _abstract(state))
  ck.close()
  assert meta == {"step": 1}
  _same(restored, state)


def test_a_checkpoint_of_orbax_standard_handler_restores(tmp_path):
  """Checkpoints written before (orbax's StandardSave, replica-parallel) restore bit for bit."""
  state = _sharded_state()
  manager = ocp.CheckpointManager(str(tmp_path / checkpoint.CHECKPOINT_DIR),
                                  item_names=("state", "meta"))
  manager.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          meta=ocp.args.JsonSave({"step": 7})))
  manager.wait_until_finished()
  manager.close()
  ck = Checkpointer(str(tmp_path))
  assert ck.latest_step() == 7
  restored, meta = ck.restore(7, _abstract(state))
  ck.close()
  assert meta == {"step": 7}
  _same(restored, state)


def test_numpy_arrays_and_python_numbers_round_trip(tmp_path):
  """Leaves that are not jax arrays keep orbax's own handlers (numpy arrays, scalars)."""
  state = {"w": jnp.arange(6.0), "n": np.arange(5, dtype=np.int16), "i": 3, "f": 0.25}
  ck = Checkpointer(str(tmp_path))
  ck.save(2, state, {"step": 2})
  ck.wait()
  restored, _ = ck.restore(2, state)
  ck.close()
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert isinstance(restored["n"], np.ndarray) and restored["n"].dtype == np.int16
  np.testing.assert_array_equal(restored["n"], state["n"])
  assert (restored["i"], restored["f"]) == (3, 0.25)
