"""Compressed gradient sync in the data-parallel step and the runner (HiPress, hipress.md §2).

* A compressed TrainStep's summed gradient and per-device state equal, bit for bit, those of
  `jlp.compression.sync` run directly (in a shard_map of its own) on the per-device gradients,
  two steps in a row (state carried); the per-device states differ. Reference: that direct call.
  The loss is linear in the parameters, so every device's gradient is known exactly (its
  coefficient row / W) without running the model. On 4 devices (the equality does not depend on
  their number; fewer PS partitions and ring hops to compile).
* metrics["wire_bytes"]: hand-computed from the convention of jlp.train.step for the float32
  CPD all-reduce (sequential, ring, ring + Kahan, emulated nodes) and from HiPress's wire sizes
  for compressed syncs (onebit PS, TBQ ring).
* A compressed run resumed from its middle checkpoint logs the same rows and ends with the same
  checkpoint (parameters, optimizer state and the per-device compression state) as the
  uninterrupted run. Reference: the uninterrupted run.
* Bad compression settings fail on construction (GradSync) or in config validation, before the
  model is built, naming the field and what is allowed.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jlp.compression as jc
import jlp.train as jt
from configs import digits
from jlp.compression import secopa
from jlp.compression.casync import sync as compressed_sync
from jlp.train import data_parallel_loop, loop, recipe
from jlp.train.metrics import read_metrics
from runs import assert_trees_equal, final_checkpoint, stable
from tiny_models import build

pytestmark = pytest.mark.usefixtures("fast_compile")

W = 8
#: Devices of test_compressed_step_equals_a_direct_sync.
DIRECT_W = 4
# Leaves of the width-4 small CNN in flattening order (bn1 bias, scale, bn2 bias, scale, conv1,
# conv2, linear bias, kernel).
SIZES = (4, 4, 8, 8, 36, 288, 10, 80)


def _model():
  model = build("small_cnn", dict(width=4))
  model.train()
  return model


def linear_loss(model, batch):
  """sum over the parameter leaves i of <leaf_i, c[0, slice_i]>: the gradient of a device's loss
  is its own coefficient row, exactly (the step scales it by 1/W, a power of two)."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  coeffs, start, loss = batch["coeffs"][0], 0, jnp.float32(0)
  for leaf in leaves:
    loss = loss + jnp.sum(leaf.reshape(-1) * coeffs[start:start + leaf.size])
    start += leaf.size
  return loss, {}


def _coeffs(seed, w=W):
  """float32[w, n]: device d's coefficient row (one row per device)."""
  return np.random.default_rng(seed).standard_normal((w, sum(SIZES))).astype(np.float32)


def _gradient_recorder() -> optax.GradientTransformation:
  """Keeps the last gradient it was given as its state; never updates."""
  return optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _device_grads(params, coeffs):
  """The per-device gradient trees stacked on [w]: row d of coeffs ([w, n]) / w, shaped like
  params."""
  leaves, treedef = jax.tree.flatten(params)
  out, start, w = [], 0, coeffs.shape[0]
  for leaf in leaves:
    out.append((coeffs[:, start:start + leaf.size] / np.float32(w)).reshape((w,) + leaf.shape))
    start += leaf.size
  return jax.tree.unflatten(treedef, out)


def _direct_sync(mesh, sync):
  """f(stacked_grads, stacked_state, step): jlp.compression.sync on each device's gradient (rows
  of the stacked trees), as a reference; one program for every step (the key is an argument)."""

  def body(grads, state, key):
    grads, state = jax.tree.map(lambda x: x[0], (grads, state))
    out, state = compressed_sync(grads, "data", sync.compression, state, topology=sync.topology,
                                 min_size=sync.min_size, key=key)
    return out, jax.tree.map(lambda x: x[None], state)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                            out_specs=(P(), P("data")), check_vma=False))

  def run(stacked_grads, stacked_state, step):
    key = (jax.random.fold_in(jax.random.key(sync.seed), step) if sync.compression.needs_key
           else None)
    return f(stacked_grads, stacked_state, key)
  return run


@pytest.mark.parametrize("sync", [
    jt.GradSync(compression=jc.get("onebit"), min_size=0),
    jt.GradSync(compression=jc.get("terngrad", stochastic=True), topology="ring", min_size=20,
                seed=3),
], ids=["onebit-ps", "terngrad-stochastic-ring"])
def test_compressed_step_equals_a_direct_sync(sync):
  mesh = jt.data_mesh(jax.devices()[:DIRECT_W])
  optimizer = _gradient_recorder()
  graphdef, state = jt.init_train_state(_model(), optimizer, mesh, sync)
  assert [x.size for x in jax.tree.leaves(state.params)] == list(SIZES)
  step = jt.TrainStep(graphdef, optimizer, mesh, sync, loss_fn=linear_loss)
  want_state, direct_sync = state.sync_state, _direct_sync(mesh, sync)
  for number, seed in enumerate((10, 11)):
    coeffs = _coeffs(seed, DIRECT_W)
    state, _ = step(state, {"coeffs": coeffs})
    want_grads, want_state = direct_sync(_device_grads(state.params, coeffs), want_state, number)
    assert_trees_equal(state.opt_state, want_grads)  # the recorder holds the summed gradient
    assert_trees_equal(state.sync_state, want_state)
    # The compressed sum is not the exact one (the test could not pass by summing in float32).
    exact = jax.tree.map(lambda g: np.sum(np.asarray(g, np.float64), 0),
                         _device_grads(state.params, coeffs))
    assert any(np.any(np.asarray(g) != e.astype(np.float32))
               for g, e in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(exact),
                               strict=True))
  assert int(state.step) == 2
  residuals = jax.tree.leaves(state.sync_state)  # onebit: per leaf its last v and scales
  assert len(residuals) == (16 if sync.compression.name == "onebit" else 0)
  if residuals:  # every device's error-feedback residuals are its own
    assert all(r.sharding.spec == P("data") and r.shape[0] == DIRECT_W for r in residuals)
    rows = np.concatenate([np.asarray(r).reshape(DIRECT_W, -1) for r in residuals], axis=1)
    assert len({row.tobytes() for row in rows}) == DIRECT_W


# -- wire bytes ---------------------------------------------------------------------------------


def _wire_bytes(sync, devices=W):
  mesh = jt.data_mesh(jax.devices()[:devices])
  optimizer = _gradient_recorder()
  graphdef, state = jt.init_train_state(_model(), optimizer, mesh, sync)
  step = jt.TrainStep(graphdef, optimizer, mesh, sync, loss_fn=linear_loss)
  return float(step(state, {"coeffs": _coeffs(0)})[1]["wire_bytes"])


# n = sum(SIZES) = 438 floats; ring chunks ceil(size / 8) = 1, 1, 1, 1, 5, 36, 2, 10 (sum 57).
# Slow tier: the plain ring and the float32 wire (the step reports the sync's
# allreduce_wire_bytes, whose ring, Kahan and wire branches tests/collectives/wire_test.py's
# test_wire_bytes_count_the_codes checks; ring-kahan runs the ring through the step here).
@pytest.mark.parametrize("sync, devices, want", [
    (jt.GradSync(), 8, 7 * 4 * 438),  # all_gather: (W-1) * 4 * n
    pytest.param(jt.GradSync(algorithm="ring"), 8, 7 * 4 * 57 * 2,  # W-1 hops + all_gather
                 marks=pytest.mark.slow),
    # + the compensation; e5m2's values travel as their 1-byte codes (the packed wire)
    (jt.GradSync(algorithm="ring", kahan=True, fmt="e5m2"), 8, 7 * 1 * 57 * 3),
    pytest.param(jt.GradSync(algorithm="ring", kahan=True, fmt="e5m2", wire="float32"), 8,
                 7 * 4 * 57 * 3, marks=pytest.mark.slow),
    (jt.GradSync(emulate_nodes=2), 4, 3 * 4 * 2 * 438),  # all_gather of 2 stacked nodes
    (jt.GradSync(emulate_nodes=2, form="cpd", fmt="e4m3"), 4, 3 * 4 * 438),  # local fold first
    (jt.GradSync(), 1, 0),
    # onebit (ceil(c/8) bytes of signs + 2 float32 means), PS, K = 8 partitions of c elements:
    # per device 7 worker partitions out and its own aggregated partition to 7 peers; conv2
    # c = 36 -> 5 + 8 bytes, linear kernel c = 10 -> 2 + 8 bytes; the other 70 floats by the
    # float32 ring: 7 hops and an all_gather of ceil(70/8) = 9 floats, 2 * 7 * 4 * 9 = 504.
    # Plus the sync's bookkeeping psum of 2 + 2 int32: 2 * 7/8 * 16 = 28.
    (jt.GradSync(compression=jc.get("onebit"), min_size=50), 8, 2 * 7 * (13 + 10) + 504 + 28),
    # TBQ (ceil(c/4) bytes), ring: per chunk 7 reduce hops and 7 forwards, 8 chunks over 8
    # devices: 2 * 7 per device; conv2 c = 36 -> 9 bytes, linear kernel c = 10 -> 3 bytes.
    (jt.GradSync(compression=jc.get("tbq"), topology="ring", min_size=50), 8,
     2 * 7 * (9 + 3) + 504 + 28),
], ids=["sequential", "ring", "ring-kahan", "ring-kahan-float32-wire", "nodes-flat", "nodes-cpd", "one-device", "onebit-ps",
        "tbq-ring"])
def test_wire_bytes(sync, devices, want):
  assert _wire_bytes(sync, devices) == want


# -- the runner: resume, config -----------------------------------------------------------------


def compressed_config(**overrides):
  """loop_test's small digits run, 8 steps, every gradient compressed with onebit (CaSync-PS)."""
  c = digits.get_config()
  c.model.kwargs.width = 8
  c.batch_size = 64
  c.max_steps, c.log_every, c.eval_every, c.checkpoint_every = 8, 2, 8, 4
  c.compression.name = "onebit"
  c.compression.min_size = 0
  for k, v in overrides.items():
    c[k] = v
  return c


def resume_config():
  """compressed_config with only the three kernels compressed (more than 50 floats each; the
  BatchNorm scales and biases go by the float32 ring): each compressed leaf is a sync of its own
  to compile, and the kernels carry the error-feedback state checked below."""
  c = compressed_config()
  c.compression.min_size = 50
  return c


def test_compressed_run_resumes_bit_exactly(tmp_path):
  """8 steps straight vs. the same run resumed at its step-4 checkpoint (step 8's removed)."""
  ref_dir, workdir = str(tmp_path / "straight"), str(tmp_path / "resumed")
  loop.train_and_evaluate(resume_config(), ref_dir, progress=False)
  shutil.copytree(ref_dir, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  result = loop.train_and_evaluate(resume_config(), workdir, progress=False)
  assert result["step"] == 8
  rows = read_metrics(ref_dir)
  assert stable(read_metrics(workdir)) == stable(rows)
  # (8 steps of the cosine warm-up barely move the loss: its window means need not fall.)
  assert all(r["wire_bytes"] > 0 and np.isfinite(r["train_loss"]) for r in rows)
  (_, ref_state), (_, state) = final_checkpoint(ref_dir), final_checkpoint(workdir)
  assert state.keys() == ref_state.keys()
  residuals = [k for k in ref_state if "sync_state" in k and "kernel" in k]  # onebit's v, scales
  assert len(residuals) == 6 and all(np.any(ref_state[k] != 0) for k in residuals)
  for k in ref_state:
    np.testing.assert_array_equal(state[k], ref_state[k], err_msg=k)


def autotune_config():
  c = resume_config()  # each candidate compiles a train step: the kernels compressed only
  c.compression.plan = "autotune"
  return c


@pytest.fixture(scope="module")
def autotune_run(tmp_path_factory):
  """The compression.plan="autotune" run of autotune_config, once for the two tests below, with
  sync_tuning.time_syncs_ms failing (the loop must time train steps, never a sync alone) and
  spies: (workdir, what it printed, the syncs it built a train step for, what its step timer
  returned)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  from jlp import sync_tuning  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp("autotune"))
  built, timed, out = [], [], io.StringIO()
  train_step = data_parallel_loop.Run.train_step
  step_timer = data_parallel_loop._StepTimer.__call__  # pylint: disable=protected-access

  def spy(self, syncs, tree):
    timed.append(step_timer(self, syncs, tree))
    return timed[-1]
  old = jax.config.read("jax_disable_most_optimizations")  # as fast_compile
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
      mp.setattr(sync_tuning, "time_syncs_ms", lambda *a, **k: pytest.fail("timed alone"))
      mp.setattr(data_parallel_loop.Run, "train_step",
                 lambda self, sync: built.append(sync) or train_step(self, sync))
      mp.setattr(data_parallel_loop._StepTimer, "__call__", spy)
      loop.train_and_evaluate(autotune_config(), workdir, progress=False)
  finally:
    jax.config.update("jax_disable_most_optimizations", old)
  return workdir, out.getvalue(), built, timed


def test_autotune_chooses_records_and_a_resume_reuses_the_choice(autotune_run, tmp_path, capsys,
                                                                  monkeypatch):
  """compression.plan="autotune": the plans are timed once, the fastest runs (its wire bytes are
  the chosen sync's), the choice and timings are printed and kept in WORKDIR/sync_plan.json; a
  resume reads it back without timing (autotune would fail) and ends bit for bit where the
  uninterrupted run ended."""
  import json
  from jlp import sync_tuning
  c = autotune_config()
  ref_dir, out = autotune_run[:2]
  workdir = str(tmp_path / "resumed")
  saved = json.load(open(os.path.join(ref_dir, "sync_plan.json")))
  label = saved["choice"]["label"]
  assert set(saved["choice"]["measured_ms"]) == {"psum", "ps", "ring"}
  assert f"autotune: {label} (" in out and "timed now" in out
  chosen = sync_tuning.Autotuned.from_dict(saved["choice"]).plan.grad_sync(jc.get("onebit"))
  run = data_parallel_loop.setup(c)
  params = jt.split_model(run.model)[1]
  sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]
  want = chosen.allreduce_wire_bytes(sizes, W) if chosen.compression is None else None
  rows = read_metrics(ref_dir)
  if want is not None:
    assert all(r["wire_bytes"] == pytest.approx(want) for r in rows)
  shutil.copytree(ref_dir, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  monkeypatch.setattr(sync_tuning, "autotune", lambda *a, **k: pytest.fail("timed again"))
  loop.train_and_evaluate(c, workdir, progress=False)
  assert "reused from" in capsys.readouterr().out
  assert stable(read_metrics(workdir)) == stable(rows)
  (_, ref_state), (_, state) = final_checkpoint(ref_dir), final_checkpoint(workdir)
  for k in ref_state:
    np.testing.assert_array_equal(state[k], ref_state[k], err_msg=k)


def test_autotune_times_the_candidates_as_train_steps_and_trains_as_the_chosen_plan(
    autotune_run, tmp_path, monkeypatch):
  """The loop's autotune times every candidate as the run's train step (never a sync alone:
  autotune_run's sync_tuning.time_syncs_ms fails), on copies of the initial state: the run ends
  bit for bit where a run whose timer ranks the same plan first without running a step ends.
  The chosen plan's step is built once (3 train steps built for 3 candidates, psum for "don't
  compress"; the run keeps the chosen one's)."""
  import json
  from jlp import sync_tuning
  c = autotune_config()
  timed_dir, _, built, timed = autotune_run
  told_dir = str(tmp_path / "told")
  label = json.load(open(os.path.join(timed_dir, "sync_plan.json")))["choice"]["label"]
  assert len(built) == 3 and len(timed) == 1 and all(ms > 0 for ms in timed[0])
  monkeypatch.setattr(sync_tuning, "time_syncs_ms", lambda *a, **k: pytest.fail("timed alone"))
  train_step = data_parallel_loop.Run.train_step
  built = []
  monkeypatch.setattr(data_parallel_loop.Run, "train_step",
                      lambda self, sync: built.append(sync) or train_step(self, sync))

  def label_of(sync):
    return sync.topology if sync.compression else "psum" if sync.algorithm == "psum" else \
        "float32"
  monkeypatch.setattr(data_parallel_loop._StepTimer, "__call__",
                      lambda self, syncs, tree: [1.0 if label_of(s) == label else 2.0
                                                 for s in syncs])
  loop.train_and_evaluate(c, told_dir, progress=False)
  assert json.load(open(os.path.join(told_dir, "sync_plan.json")))["choice"]["label"] == label
  assert len(built) == 1
  assert stable(read_metrics(timed_dir)) == stable(read_metrics(told_dir))
  (_, want), (_, got) = final_checkpoint(told_dir), final_checkpoint(timed_dir)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_autotune_with_a_fit_that_leaves_one_plan_times_nothing(tmp_path, capsys):
  """With compression.sync_fit predicting onebit's PS more than 2x faster than every other
  plan, the runner's autotune builds and times no train step (its timer fails here): it
  records and prints the predicted plan, which a resume reuses like a timed choice."""
  import json
  from jlp import sync_tuning
  samples = [(label, size, ms * size / 1024) for size in (1024, 1 << 16)
             for label, ms in (("float32", 10.0), ("psum", 10.0), ("ps, K=1", 2.0),
                               ("ps, K=8", 2.0), ("ring, K=1", 9.0), ("ring, K=8", 9.0))]
  fit = sync_tuning.fit_from_samples(samples, compressor="onebit", num_nodes=W, cluster="test")
  fit.save(tmp_path / "fit.json")
  c = compressed_config()
  c.compression.update(plan="autotune", sync_fit=str(tmp_path / "fit.json"))
  params = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  no_timing = lambda syncs, tree: pytest.fail("timed")  # noqa: E731
  sync = recipe.autotune_sync(c, recipe.grad_sync(c), params, mesh, str(tmp_path),
                              timer=no_timing)
  assert sync.compression == jc.get("onebit") and sync.topology == "ps"
  saved = json.load(open(tmp_path / "sync_plan.json"))["choice"]
  assert saved["label"] == "ps" and saved["measured_ms"] == {}
  assert saved["predicted_ms"] == pytest.approx(8.0)
  out = capsys.readouterr().out
  assert "autotune: ps (predicted 8.0 ms, no other candidate within 2x of it: none timed; " \
      f"from {tmp_path / 'fit.json'})" in out
  assert recipe.autotune_sync(c, recipe.grad_sync(c), params, mesh, str(tmp_path),
                              timer=no_timing) == sync
  assert "reused from" in capsys.readouterr().out


def test_compressed_config_builds_the_sync(tmp_path):
  sync = recipe.grad_sync(compressed_config(seed=5))
  assert sync.compression == jc.get("onebit") and sync.min_size == 0 and sync.seed == 5
  c = compressed_config()
  c.compression.update(name="tbq", topology="ring", kwargs={"threshold": 0.5})
  sync = recipe.grad_sync(c)
  assert sync.compression == jc.get("tbq", threshold=0.5) and sync.topology == "ring"
  assert recipe.grad_sync(digits.get_config()).compression is None
  # A SeCoPa plan file (names: keystr of the gradient paths).
  path = str(tmp_path / "plan.txt")
  secopa.write_plan(path, [("['conv1']['kernel'].value", 144, True, 2),
                           ("['linear']['bias'].value", 10, False, 8)])
  c.compression.plan = path
  assert recipe.grad_sync(c).plan == (("['conv1']['kernel'].value", True, 2),
                                      ("['linear']['bias'].value", False, 8))
  # "secopa": HiPress's seed cost model plans every gradient of the model; the digits CNN's are
  # all below its break-even size (~1.27M floats on 8 devices, PS), so none is compressed.
  c.compression.plan = "secopa"
  run = data_parallel_loop.setup(c)
  params = jax.tree_util.tree_flatten_with_path(jt.split_model(run.model)[1])[0]
  assert run.sync.plan == tuple(sorted((jax.tree_util.keystr(p), False, 8) for p, _ in params))
  with pytest.raises(ValueError, match=r"config.compression.plan='secopa' is not allowed; .*"
                     r"\(4, 8, 16\) devices .* this run has 2"):
    recipe.grad_sync(c, 2)


@pytest.mark.parametrize("compression, overrides, message", [
    ({"name": "zip"}, {}, r"config.compression.name='zip' is not allowed; expected one of "
     r"\('none', .*'onebit'.*'tbq'"),
    ({"topology": "tree"}, {}, r"config.compression.topology='tree' is not allowed; expected one "
     r"of \('ps', 'ring', 'allreduce'\)"),
    ({"min_size": -1}, {}, r"config.compression.min_size=-1 is not allowed; expected an int >= 0"),
    ({"kwargs": {"scale": 2.0}}, {}, r"config.compression.kwargs=\{'scale': 2.0\} is not allowed "
     r"for compressor 'onebit'.*one of the fields of OneBit: \['impl', 'scale_mode'\]"),
    ({"kwargs": {"scale_mode": "median"}}, {}, r"config.compression.kwargs=.*'median'.*"
     r"OneBit.scale_mode='median' is not allowed; expected one of"),
    ({"plan": "/no/such/plan.txt"}, {}, r"config.compression.plan='/no/such/plan.txt' is not "
     r"allowed"),
    ({"sync_fit": "/no/fit.json"}, {}, r"config.compression.sync_fit='/no/fit.json' is not "
     r"allowed; expected '' or, with compression.plan='autotune', the path"),
    ({}, {"grad_exp": 4, "grad_man": 3}, r"config.grad_format='e4m3' is not allowed; expected "
     r"float32 .* with config.compression.name='onebit'"),
    ({}, {"use_kahan": True}, r"config.use_kahan=True is not allowed"),
    ({}, {"grad_algorithm": "ring"}, r"config.grad_algorithm='ring' is not allowed; expected "
     r"'sequential' .*config.compression.topology"),
    ({}, {"emulate_nodes": 2}, r"config.emulate_nodes=2 is not allowed; expected 1"),
])
def test_bad_compression_config_fails_before_the_model_is_built(compression, overrides, message,
                                                                monkeypatch, tmp_path):
  monkeypatch.setattr(recipe, "model", lambda *a, **k: pytest.fail("model built"))
  c = compressed_config(**overrides)
  c.compression.update(compression)
  with pytest.raises(ValueError, match=message):
    loop.train_and_evaluate(c, str(tmp_path), progress=False)
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("kwargs, message", [
    (dict(compression="zip"), r"^compression='zip' is not allowed; expected None, a "
     r"jlp.compression.Compressor or one of \[.*'onebit'"),
    (dict(compression=3), r"^compression=3 is not allowed"),
    (dict(compression="tbq", topology="tree"), r"^topology='tree' is not allowed; expected one of "
     r"\('ps', 'ring', 'allreduce'\)"),
    (dict(compression="tbq", min_size=-1), r"^min_size=-1 is not allowed"),
    (dict(compression="tbq", plan={"['a']": (True, 0)}),
     r"^plan\[\"\['a'\]\"\] K=0 is not allowed; expected an int >= 1"),
    (dict(compression="tbq", fmt="e4m3"),
     r"^fmt=.* is not allowed; expected None with compression"),
    (dict(compression="tbq", kahan=True), r"^kahan=True is not allowed"),
    (dict(compression="tbq", algorithm="ring"), r"^algorithm='ring' is not allowed; expected "
     r"'sequential' with compression"),
    (dict(compression="tbq", emulate_nodes=2), r"^emulate_nodes=2 is not allowed; expected 1 with "
     r"compression"),
    (dict(topology="ring"), r"^topology='ring' is not allowed; expected 'ps' without compression"),
    (dict(plan={"['a']": (True, 2)}), r"^plan=.* is not allowed; expected None without"),
])
def test_bad_compressed_sync_settings(kwargs, message):
  with pytest.raises(ValueError, match=message):
    jt.GradSync(**kwargs)


def test_sync_plan_is_hashable_and_state_is_checked():
  a = jt.GradSync(compression="tbq", plan={"['b']": (False, 8), "['a']": (True, 2)})
  b = jt.GradSync(compression=jc.get("tbq"), plan=(("['a']", True, 2), ("['b']", False, 8)))
  assert a == b and hash(a) == hash(b) and a.plan_dict == {"['a']": (True, 2), "['b']": (False, 8)}
  mesh = jt.data_mesh()
  optimizer = _gradient_recorder()
  graphdef, state = jt.init_train_state(_model(), optimizer, mesh)  # no sync: no sync_state
  sync = jt.GradSync(compression="onebit", min_size=0)
  step = jt.TrainStep(graphdef, optimizer, mesh, sync, loss_fn=linear_loss)
  with pytest.raises(ValueError, match=r"state.sync_state=None is not allowed with a compressed "
                     r"sync; .*init_train_state\(model, optimizer, mesh, sync\)"):
    step(state, {"coeffs": _coeffs(0)})
  with pytest.raises(ValueError, match="mesh=None is not allowed with a compressed sync"):
    jt.init_train_state(_model(), optimizer, None, sync)
