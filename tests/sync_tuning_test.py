"""jlp.sync_tuning: SeCoPa's coefficients fitted from whole-sync timings, the planner over every
topology and the uncompressed ring, autotuning. The planner's logic runs on fixed timings; the
reference timings come from SeCoPa's own formulas (`jlp.compression.secopa.sync_costs`, a separate
implementation) under a known cost model."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.compression import secopa
from jlp.compression.secopa import CostModel, LinearCost
from jlp.sync import GradSync, reduce_gradients
from jlp import sync_tuning as st

N = 8


def _truth(encode_w=2e-6, ring_w=4e-5, gather_w=6e-5, intercept=0.5):
  return CostModel(encode=LinearCost(encode_w, 0.05, 0), decode=LinearCost(1e-6, 0.04, 0),
                   aggregate=LinearCost(1e-7, 0, 0), ring_send=LinearCost(ring_w, intercept, 0),
                   gather={N: LinearCost(gather_w, 2 * intercept, 0)},
                   broadcast={N: LinearCost(gather_w, intercept, 0)})


def _samples(truth, codec, sizes=(1 << 14, 1 << 16, 1 << 18), ks=(1, 4, 8), float32=(4e-5, 1.0),
             topologies=("ps", "ring")):
  out = []
  for size in sizes:
    out.append(("float32", size, float32[0] * size + float32[1]))
    for topology in topologies:
      costs = secopa.sync_costs(size, num_nodes=N, topology=topology, cost_model=truth,
                                compressor=codec)
      out += [(f"{topology}, K={k}", size, costs.comp[k - 1]) for k in ks]
  return out


@pytest.mark.parametrize("codec", ["onebit", "tbq", "dgc"])
def test_the_fit_reproduces_secopas_formulas_at_unseen_sizes_and_partitions(codec):
  truth = _truth()
  fit = st.fit_from_samples(_samples(truth, codec), compressor=codec, num_nodes=N,
                            cluster="test")
  assert set(fit.topologies) == {"ps", "ring"}
  for topology in ("ps", "ring"):
    for size, k in ((3 << 17, 3), (1 << 20, 8), (5000, 2)):
      want = secopa.sync_costs(size, num_nodes=N, topology=topology, cost_model=truth,
                               compressor=codec).comp[k - 1]
      got = fit.predict(f"{topology}, K={k}", size)
      assert got == pytest.approx(want, rel=0.02), (topology, size, k)
  assert fit.predict("float32", 1 << 20) == pytest.approx(4e-5 * (1 << 20) + 1.0, rel=1e-6)


def test_the_seed_per_operation_model_misprices_what_the_whole_sync_fit_gets():
  """Timings where a ring hop costs 5x what an isolated send suggests (dependent hops on shared
  cores): SeCoPa's per-operation model (the truth's sends) is far off; the fit is not."""
  isolated = _truth(ring_w=4e-6)
  real = _truth(ring_w=2e-5, intercept=2.5)
  fit = st.fit_from_samples(_samples(real, "onebit"), compressor="onebit", num_nodes=N,
                            cluster="test")
  size = 1 << 19
  measured = secopa.sync_costs(size, num_nodes=N, topology="ring", cost_model=real,
                               compressor="onebit").comp[N - 1]
  per_op = secopa.sync_costs(size, num_nodes=N, topology="ring", cost_model=isolated,
                             compressor="onebit").comp[N - 1]
  assert abs(per_op - measured) > 0.3 * measured
  assert fit.predict(f"ring, K={N}", size) == pytest.approx(measured, rel=0.05)


def _fit(ps_scale=1.0, ring_scale=1.0, float32=(4e-5, 1.0)):
  samples = []
  for label, size, ms in _samples(_truth(), "onebit", float32=float32):
    scale = ps_scale if label.startswith("ps") else ring_scale if label.startswith("ring") else 1
    samples.append((label, size, ms * scale))
  return st.fit_from_samples(samples, compressor="onebit", num_nodes=N, cluster="test")


GRADS = {"big": jax.ShapeDtypeStruct((1 << 20,), jnp.float32),
         "mid": jax.ShapeDtypeStruct((1 << 16,), jnp.float32),
         "tiny": jax.ShapeDtypeStruct((10,), jnp.float32)}


def test_the_plan_picks_the_topology_that_is_much_faster():
  for ps_scale, ring_scale, want in ((1.0, 3.0, "ps"), (3.0, 1.0, "ring")):
    plans = st.rank_plans(GRADS, "onebit", _fit(ps_scale, ring_scale))
    assert plans[0].label == want, [(p.label, p.predicted_ms) for p in plans]
    assert [p.predicted_ms for p in plans] == sorted(p.predicted_ms for p in plans)
    assert {p.label for p in plans} == {"float32", "ps", "ring"}
    leaf = dict(plans[0].leaf_plan)
    assert leaf["['big']"][0] and not leaf["['tiny']"][0]  # a 10-element leaf stays dense
    expected = plans[0].predicted_ms
    fit = _fit(ps_scale, ring_scale)
    by_hand = sum(fit.predict(f"{want}, K={k}", {"['big']": 1 << 20, "['mid']": 1 << 16}[name])
                  for name, (compress, k) in leaf.items() if compress)
    dense = sum({"['big']": 1 << 20, "['mid']": 1 << 16, "['tiny']": 10}[name]
                for name, (compress, _) in leaf.items() if not compress)
    assert expected == pytest.approx(by_hand + fit.float32(dense))


def test_dont_compress_is_a_plan_and_wins_when_the_network_is_fast():
  plans = st.rank_plans(GRADS, "onebit", _fit(float32=(1e-8, 0.01)))
  assert plans[0].label == "float32" and plans[0].topology is None
  assert plans[0].grad_sync(st.base.get("onebit")) == GradSync(algorithm="ring")


def test_without_a_fit_every_plan_is_a_candidate_and_unpriced():
  plans = st.rank_plans(GRADS, "onebit", num_nodes=N)
  assert {p.label for p in plans} == {"float32", "ps", "ring"}
  assert all(math.isnan(p.predicted_ms) for p in plans)
  # The sync's own rule on each topology: leaves above min_size compressed, in K = min(N, size).
  ps = next(p for p in st.rank_plans(GRADS, "onebit", num_nodes=N, min_size=1000)
            if p.label == "ps")
  assert dict(ps.leaf_plan) == {"['big']": (True, N), "['mid']": (True, N),
                                "['tiny']": (False, 1)}
  powersgd = st.rank_plans({"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}, "powersgd",
                           num_nodes=N)
  assert {p.label for p in powersgd} == {"float32", "allreduce"}


def test_autotune_times_at_most_limit_plans_and_keeps_the_fastest():
  timed = []
  ms = {"float32": 30.0, "ps": 10.0, "ring": 20.0}

  def timer(sync, tree):
    label = "float32" if sync.compression is None else sync.topology
    timed.append(label)
    return ms[label]
  got = st.autotune(GRADS, "onebit", timer=timer, mesh=_mesh())
  assert got.plan.label == "ps" and sorted(timed) == ["float32", "ps", "ring"]
  assert got.measured_ms == ms
  timed.clear()
  # With a fit, only the `limit` best ranked are timed: here ring (predicted fastest) alone.
  got = st.autotune(GRADS, "onebit", fit=_fit(3.0, 1.0), limit=1, timer=timer, mesh=_mesh())
  assert timed == ["ring"] and got.plan.label == "ring"
  assert st.Autotuned.from_dict(got.to_dict()) == got


def _mesh():
  from jax.sharding import Mesh
  return Mesh(np.array(jax.devices()), ("data",))


def test_a_fit_is_saved_and_reused_only_on_its_own_cluster(tmp_path):
  fit = _fit()
  path = tmp_path / "fit.json"
  fit.save(path)
  assert st.SyncFit.load(path, cluster="test", compressor="onebit", num_nodes=N) == fit
  assert st.SyncFit.load(path, cluster="another") is None
  assert st.SyncFit.load(path, num_nodes=4) is None
  assert st.SyncFit.load(tmp_path / "missing.json") is None
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="is not a JSON sync fit"):
    st.SyncFit.load(tmp_path / "bad.json")


def test_a_live_fit_and_autotune_on_the_test_devices():
  """On the 8 test devices: whole syncs timed (two small sizes, K = 8), a fit with every topology,
  and autotune's choice a GradSync that sums like the float32 reference."""
  fit = st.fit_sync_costs("onebit", sizes=(1 << 10, 1 << 12), partitions=(N,), repeats=1)
  assert fit.num_nodes == len(jax.devices()) == N and set(fit.topologies) == {"ps", "ring"}
  assert {label for label, _, _ in fit.samples} == {"float32", f"ps, K={N}", f"ring, K={N}"}
  assert all(ms > 0 for _, _, ms in fit.samples)
  tree = {"a": jax.ShapeDtypeStruct((1 << 12,), jnp.float32)}
  chosen = st.autotune(tree, "onebit", fit=fit, limit=2, repeats=1)
  assert len(chosen.measured_ms) == 2 and chosen.plan.label in chosen.measured_ms
  sync = chosen.plan.grad_sync(st.base.get("onebit"))
  x = np.ones((N * 16,), np.float32)

  def body(g):
    grads = {"a": g}
    state = sync.init_state(grads, N) if sync.compression is not None else None
    return reduce_gradients(grads, sync, state, jnp.int32(0))[0]["a"]
  from jax.sharding import PartitionSpec as P
  out = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))(x)
  np.testing.assert_allclose(np.asarray(out), np.full((N * 16,), float(N)), rtol=0.2)
