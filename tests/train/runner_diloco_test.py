"""DiLoCo in the data-parallel runner (config.diloco, jlp.train.diloco_step): period 1 with inner
SGD and outer SGD lr 1 without momentum trains as the data-parallel run; a Streaming DiLoCo run
(fragments, overlap, alpha, outer_format, inner momentum, BatchNorm statistics per replica)
interrupted and resumed equals the uninterrupted run bit for bit; wire_bytes on the sync steps
only; fields that do not apply refused before anything runs; resume with changed diloco fields.

References: the plain data-parallel run (period 1: DiLoCo's special case, equal up to float32
rounding, since p - (p - lr*g) is not lr*g in float32), the uninterrupted run (resume), the
parameter count of the checkpoint (wire bytes: (W - 1) bytes per e4m3 element)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from jlp.train import config as config_lib, loop, recipe, workdir as workdir_record
from jlp.train.metrics import read_metrics
from runs import final_checkpoint, small_digits, stable

W = 8  # tests/conftest.py's emulated devices


def _params(flat, prefix):
  """{path: array} of the checkpoint's leaves under `prefix` (e.g. "['params']")."""
  return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def test_period_one_with_sgd_and_outer_lr_one_is_the_data_parallel_run(tmp_path):
  fields = dict(max_steps=3, log_every=1, eval_every=3, checkpoint_every=0, momentum=0.0,
                schedule={"name": "constant"})
  plain = str(tmp_path / "plain")
  loop.train_and_evaluate(small_digits(**fields), plain, progress=False)
  c = small_digits(**fields)
  c.diloco.period = 1
  c.diloco.outer_optimizer.lr = 1.0
  c.diloco.outer_optimizer.momentum = 0.0
  c.diloco.outer_optimizer.nesterov = False
  diloco = str(tmp_path / "diloco")
  loop.train_and_evaluate(c, diloco, progress=False)

  want_rows, got_rows = read_metrics(plain), read_metrics(diloco)
  assert [r["step"] for r in got_rows] == [1, 2, 3]
  for got, want in zip(got_rows, want_rows, strict=True):
    for name in ("train_loss", "train_accuracy", "eval_loss", "eval_accuracy"):
      if name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  _, want = final_checkpoint(plain)
  _, got = final_checkpoint(diloco)
  want_params = _params(want, "['params']")
  replicas = _params(got, "['params']")
  outer = _params(got, "['opt_state']['outer_params']")
  assert want_params and replicas.keys() == want_params.keys() == outer.keys()
  n = 0
  for k, w in want_params.items():
    n += w.size
    assert replicas[k].shape == (W,) + w.shape
    for r in range(W):  # every replica continues from exactly the outer params
      np.testing.assert_array_equal(replicas[k][r], outer[k][0], err_msg=k)
    np.testing.assert_allclose(outer[k][0], w, rtol=1e-5, atol=1e-6, err_msg=k)
  # A float32 outer sync every step: (W - 1) * 4 bytes per parameter, as the plain all-reduce.
  assert [r["wire_bytes"] for r in got_rows] == [(W - 1) * 4 * n] * 3
  assert [r["wire_bytes"] for r in got_rows] == [r["wire_bytes"] for r in want_rows]


def streaming_config(**fields):
  """Period 4, 2 fragments (offsets 0 and 2: fragment 1 syncs after steps 2 and 6, fragment 0
  after step 4), overlap 1 with alpha 0.5, e4m3 outer gradients, inner SGD with momentum 0.9
  (default), BatchNorm statistics per replica. Checkpoints every 2 steps: the one at 4 holds
  fragment 0's pending update (merged after step 5)."""
  c = small_digits(**{"max_steps": 6, "log_every": 1, "eval_every": 6, "checkpoint_every": 2,
                      "schedule": {"name": "constant"}, **fields})
  c.diloco.period = 4
  c.diloco.fragments = 2
  c.diloco.overlap = 1
  c.diloco.alpha = 0.5
  c.diloco.outer_format = "e4m3"
  return c


@pytest.fixture(scope="module")
def streaming_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("streaming"))
  loop.train_and_evaluate(streaming_config(), workdir, progress=False)
  return workdir


def test_a_resumed_diloco_run_equals_the_uninterrupted_run(streaming_run, tmp_path):
  workdir = str(tmp_path / "resumed")
  shutil.copytree(streaming_run, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4"]
  loop.train_and_evaluate(streaming_config(), workdir, progress=False)
  assert stable(read_metrics(workdir)) == stable(read_metrics(streaming_run))
  _, want = final_checkpoint(streaming_run)
  _, got = final_checkpoint(workdir)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # The replicas differ between syncs (own data, own momentum): the state is per replica.
  params = _params(want, "['params']")
  assert any(not np.array_equal(v[0], v[1]) for v in params.values())


def test_wire_bytes_only_on_the_steps_that_sync(streaming_run):
  rows = read_metrics(streaming_run)
  wire = [r["wire_bytes"] for r in rows]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert wire[0] == wire[2] == wire[4] == 0
  assert wire[1] == wire[5] > 0 and wire[3] > 0
  # Both fragments together: every parameter once, one e4m3 byte to each of the W - 1 peers.
  _, flat = final_checkpoint(streaming_run)
  n = sum(v[0].size for v in _params(flat, "['params']").values())
  assert wire[1] + wire[3] == (W - 1) * n
  assert all(r["payload_bytes"] == r["wire_bytes"] for r in rows)


def _refused(c, field):
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  message = str(e.value)
  assert f"config.{field}=" in message and "\n" not in message, message
  return message


@pytest.mark.parametrize("diloco, other, field", [
    ({"fragments": 2}, {}, "diloco.fragments"),
    ({"outer_format": "e4m3"}, {}, "diloco.outer_format"),
    ({"period": -1}, {}, "diloco.period"),
    ({"period": 4, "fragments": 5}, {}, "diloco.fragments"),
    ({"period": 4, "overlap": 4}, {}, "diloco.overlap"),
    ({"period": 4, "alpha": 1.5}, {}, "diloco.alpha"),
    ({"period": 4, "outer_format": "e5m10"}, {}, "diloco.outer_format"),
    ({"period": 4, "outer_format": "nonsense"}, {}, "diloco.outer_format"),
    ({"period": 4, "outer_optimizer.momentum": 0.0}, {}, "diloco.outer_optimizer.nesterov"),
    ({"period": 4, "outer_optimizer.name": "adam"}, {}, "diloco.outer_optimizer.name"),
    ({"period": 4}, {"compression.name": "onebit"}, "compression.name"),
    ({"period": 4}, {"emulate_nodes": 2}, "emulate_nodes"),
    ({"period": 4}, {"pipeline.schedule": "gpipe"}, "pipeline.schedule"),
    ({"period": 4, "outer_format": "e2m1"}, {"grad_format": "e4m3"}, "grad_format"),
])
def test_fields_that_do_not_apply_are_refused(diloco, other, field):
  c = small_digits()
  for key, value in [("diloco." + k, v) for k, v in diloco.items()] + list(other.items()):
    parent, name = key.rsplit(".", 1) if "." in key else ("", key)
    node = c
    for part in filter(None, parent.split(".")):
      node = node[part]
    node[name] = value
  _refused(c, field)


def test_digits_wide_takes_diloco_from_the_command_line():
  from configs import digits_wide  # pylint: disable=g-import-not-at-top
  c = digits_wide.get_config()
  c.diloco.period = 10  # --config.diloco.period=10
  config_lib.validate(c)
  d = recipe.diloco(c, recipe.optimizer(c, 0.1))
  assert (d.period, d.fragments, d.overlap, d.alpha, d.outer_format, d.outer_sync) == (
      10, 1, 0, 0.0, None, None)
  # The outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9 (torch's: trace, then the sum).
  state = d.outer.init(np.zeros(2, np.float32))
  g = np.array([1.0, -2.0], np.float32)
  upd, state = d.outer.update(g, state)
  np.testing.assert_allclose(upd, -0.7 * (g + 0.9 * g), rtol=1e-6)
  # The gradient-sync fields set the outer sync.
  c.grad_format, c.use_aps = "e5m2", True
  config_lib.validate(c)
  sync = recipe.diloco(c, d.inner).outer_sync
  assert sync is not None and sync.aps and (sync.fmt.exp, sync.fmt.man) == (5, 2)
  c.diloco.fragments = 7  # the MLP has 8 parameter leaves (4 layers)
  recipe.diloco(c, d.inner, {"a": [np.zeros(1)] * 8})
  c.diloco.fragments = 9
  with pytest.raises(ValueError, match=r"config.diloco.fragments=9 .*8 parameter leaves"):
    recipe.diloco(c, d.inner, {"a": [np.zeros(1)] * 8})


def _meta(c):
  return {"config": json.loads(config_lib.resolved(c).to_json_best_effort()),
          "devices": workdir_record.device_layout()}


def test_a_resume_with_changed_diloco_fields(tmp_path):
  workdir = str(tmp_path)
  c = streaming_config()
  meta = _meta(c)
  assert workdir_record.check_resume(c, workdir, meta, allow_change=False) == {}
  changed = streaming_config()
  changed.diloco.outer_optimizer.lr = 0.5
  with pytest.raises(workdir_record.ConfigChangedError,
                     match=r"diloco.outer_optimizer.lr 0.7 -> 0.5") as e:
    workdir_record.check_resume(changed, workdir, meta, allow_change=False)
  assert "\n" not in str(e.value)
  assert workdir_record.check_resume(changed, workdir, meta, allow_change=True) == {
      "diloco.outer_optimizer.lr": (0.7, 0.5)}
  # The state's layout cannot change, even when allowed.
  for field, value in (("fragments", 1), ("period", 0)):
    other = streaming_config()
    if field == "period":
      other.diloco = config_lib.diloco_defaults()
    else:
      other.diloco[field] = value
    with pytest.raises(workdir_record.ConfigChangedError, match=f"diloco.{field}"):
      workdir_record.check_resume(other, workdir, meta, allow_change=True)
  # A checkpoint written before the diloco fields existed resumes without DiLoCo only.
  plain = small_digits()
  old = _meta(plain)
  del old["config"]["diloco"]
  assert workdir_record.check_resume(plain, workdir, old, allow_change=False) == {}
  with pytest.raises(workdir_record.ConfigChangedError, match="diloco.period"):
    workdir_record.check_resume(streaming_config(), workdir, old, allow_change=True)
  # Another device count cannot take the per-replica state.
  moved = dict(meta, devices={"devices": 2, "processes": 1})
  with pytest.raises(workdir_record.ConfigChangedError, match="per-replica"):
    workdir_record.check_resume(c, workdir, moved, allow_change=True)
