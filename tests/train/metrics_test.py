"""metrics.jsonl / TensorBoard writer and orbax checkpoints of the experiment runner."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jlp.train.checkpoint import Checkpointer
from jlp.train.mesh import data_mesh
from jlp.train.metrics import MetricsWriter, read_metrics


def test_rows_round_trip_float32_bits_and_resume_drops_later_rows(tmp_path):
  w = MetricsWriter(str(tmp_path))
  values = np.float32([0.1, 1 / 3, 2.5e-8])
  for step, v in enumerate(values, 1):
    w.write(step, {"train_loss": v, "eval_accuracy": jnp.float32(v)})
  w.close()
  rows = read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r, v in zip(rows, values, strict=True):
    assert np.float32(r["train_loss"]) == v and np.float32(r["eval_accuracy"]) == v
    assert abs(r["time"] - rows[0]["time"]) < 60
  w = MetricsWriter(str(tmp_path), resume_step=2)
  w.write(3, {"train_loss": 7.0})
  w.close()
  rows = read_metrics(str(tmp_path))
  assert [(r["step"], r["train_loss"]) for r in rows] == [(1, float(values[0])), (2, float(values[1])),
                                                          (3, 7.0)]
  events = os.listdir(tmp_path / "tensorboard")
  assert len(events) == 2  # the resumed writer must not overwrite the first event file


def test_non_scalar_metric_is_an_error_and_nan_is_null(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=False)
  with pytest.raises(ValueError, match="metric 'x' has shape"):
    w.write(1, {"x": np.zeros(3)})
  w.write(1, {"loss": float("nan")})
  assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["loss"] is None


def test_disabled_writer_writes_nothing(tmp_path):
  w = MetricsWriter(str(tmp_path / "run"), enabled=False)
  row = w.write(1, {"loss": 1.0})
  assert row["loss"] == 1.0 and not os.path.exists(tmp_path / "run")


def test_checkpoint_round_trip_keeps_values_and_shardings(tmp_path):
  mesh = data_mesh()
  rep = NamedSharding(mesh, P())
  state = {"w": jax.device_put(jnp.arange(12.0).reshape(3, 4), rep),
           "count": jax.device_put(jnp.int32(7), rep),
           "key": jax.random.key_data(jax.random.key(3))}
  ck = Checkpointer(str(tmp_path), max_to_keep=2)
  assert ck.latest_step() is None
  for step in (5, 10, 15):
    ck.save(step, jax.tree.map(lambda x: x + step if x.dtype == jnp.float32 else x, state),
            {"step": step, "note": "x"})
  ck.wait()
  assert ck.latest_step() == 15
  restored, meta = ck.restore(15, state)
  assert meta == {"step": 15, "note": "x"}
  np.testing.assert_array_equal(restored["w"], np.arange(12.0).reshape(3, 4) + 15)
  assert restored["w"].sharding == rep and int(restored["count"]) == 7
  np.testing.assert_array_equal(restored["key"], state["key"])
  ck.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "15"]  # max_to_keep


def test_checkpointer_rejects_bad_max_to_keep(tmp_path):
  with pytest.raises(ValueError, match="max_to_keep=0"):
    Checkpointer(str(tmp_path), max_to_keep=0)
