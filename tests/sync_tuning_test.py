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
             topologies=("ps", "ring"), psum=(6e-5, 1.5)):
  out = []
  for size in sizes:
    out.append(("float32", size, float32[0] * size + float32[1]))
    if psum is not None:
      out.append(("psum", size, psum[0] * size + psum[1]))
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
  assert fit.predict("psum", 1 << 20) == pytest.approx(6e-5 * (1 << 20) + 1.5, rel=1e-6)


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


#: onebit's whole syncs on the namespaced cluster (4 hosts x 2 devices, 100 Mbit/s; the study's
#: sync_fits of 2026-11-30): ms not in SeCoPa's shape (ps K=4 slower than K=1 and K=8 at 1M).
CLUSTER_SAMPLES = [
    ("float32", 65536, 43.96), ("psum", 65536, 43.67), ("ps, K=1", 65536, 10.22),
    ("ps, K=4", 65536, 15.49), ("ps, K=8", 65536, 16.47), ("ring, K=1", 65536, 37.62),
    ("ring, K=4", 65536, 29.13), ("ring, K=8", 65536, 34.51),
    ("float32", 1048576, 669.60), ("psum", 1048576, 656.14), ("ps, K=1", 1048576, 91.56),
    ("ps, K=4", 1048576, 142.19), ("ps, K=8", 1048576, 57.57), ("ring, K=1", 1048576, 439.33),
    ("ring, K=4", 1048576, 166.98), ("ring, K=8", 1048576, 87.70),
    ("float32", 4194304, 2628.25), ("psum", 4194304, 2544.84), ("ps, K=1", 4194304, 333.58),
    ("ps, K=4", 4194304, 607.46), ("ps, K=8", 4194304, 190.33), ("ring, K=1", 4194304, 1725.63),
    ("ring, K=4", 4194304, 651.12), ("ring, K=8", 4194304, 260.68)]


def test_timed_syncs_are_predicted_from_their_timings_and_plans_pick_a_timed_k():
  """SeCoPa's formula, fitted by NNLS to these timings, priced ps K=3 at 1M below the timed
  K=8 (98 ms against 57.6), and the plan ran K=3 (99.7 ms measured). A timed label is now
  predicted from its own timings (linear between sizes, beyond them the nearest segment with
  its slope clamped at >= 0), a plan picks among the timed K, and SeCoPa's formula prices only
  the K that were not timed."""
  fit = st.fit_from_samples(CLUSTER_SAMPLES, compressor="onebit", num_nodes=N, cluster="test")
  assert fit.predict("ps, K=8", 1 << 20) == pytest.approx(57.57)
  assert fit.predict("ps, K=8", 5 << 19) == pytest.approx((57.57 + 190.33) / 2)  # midway
  assert fit.predict("psum", 1 << 22) == pytest.approx(2544.84)
  assert fit.predict("ring, K=8", 1 << 23) == pytest.approx(260.68 + (260.68 - 87.70) / 3 * 4)
  assert fit.partitions("ps") == fit.partitions("ring") == (1, 4, 8)
  codec = st.base.get("onebit")
  formula = st._compressed_cost(fit.model("ps"), "ps", 1 << 20, 3, N, codec)  # pylint: disable=protected-access
  assert fit.predict("ps, K=3", 1 << 20) == pytest.approx(formula)
  plan = st.plan_sync({"g": jax.ShapeDtypeStruct((1 << 20,), jnp.float32)}, "onebit", fit)
  assert (plan.label, dict(plan.leaf_plan)) == ("ps", {"['g']": (True, 8)})
  assert plan.predicted_ms == pytest.approx(57.57)
  # A noisy pair must not predict a bigger sync as the cheaper: the slope beyond is clamped.
  noisy = st.fit_from_samples(CLUSTER_SAMPLES + [("float32", 8 << 20, 100.0)],
                              compressor="onebit", num_nodes=N, cluster="test")
  assert noisy.predict("float32", 16 << 20) == pytest.approx(100.0)


def _with_ps_k4(ms_at_4m):
  """The 4 hosts x 2 devices cluster's TBQ fit unshaped (the study's sync_fits of 2026-11-30),
  with ps K=4 at 4M elements set to `ms_at_4m` (timed there: 71.10 against K=8's 71.23)."""
  samples = [("float32", 1048576, 37.58), ("psum", 1048576, 24.48), ("ps, K=1", 1048576, 29.01),
             ("ps, K=4", 1048576, 23.21), ("ps, K=8", 1048576, 25.33),
             ("ring, K=1", 1048576, 251.97), ("ring, K=4", 1048576, 64.06),
             ("ring, K=8", 1048576, 66.17), ("float32", 4194304, 101.64),
             ("psum", 4194304, 83.58), ("ps, K=1", 4194304, 115.61), ("ps, K=4", 4194304, ms_at_4m),
             ("ps, K=8", 4194304, 71.23), ("ring, K=1", 4194304, 1141.20),
             ("ring, K=4", 4194304, 254.02), ("ring, K=8", 4194304, 279.91)]
  return st.fit_from_samples(samples, compressor="tbq", num_nodes=N, cluster="test")


def test_a_smaller_k_is_planned_only_when_predicted_clearly_faster_than_k_equal_n():
  """K = 4 was predicted 0.1 % (4M) and 8 % (1M) faster than K = 8 and planned; it ran 2.5x
  and 1.46x slower than K = 8 (BENCHMARKS.md, the cluster study with fresh fits). Within
  `SMALLER_K_AT_MOST` of K = N, K = N is planned; beyond it the smaller K is."""
  grads = {"g": jax.ShapeDtypeStruct((1 << 22,), jnp.float32)}
  assert st.SMALLER_K_AT_MOST == 0.8
  for k4_ms, planned in ((71.10, 8), (0.81 * 71.23, 8), (0.79 * 71.23, 4)):
    plan = st.plan_sync(grads, "tbq", _with_ps_k4(k4_ms))
    assert (plan.label, dict(plan.leaf_plan)) == ("ps", {"['g']": (True, planned)}), k4_ms
    assert plan.predicted_ms == pytest.approx(71.23 if planned == 8 else k4_ms)
  ranked = st.rank_plans({"g": jax.ShapeDtypeStruct((1 << 20,), jnp.float32)}, "tbq",
                         _with_ps_k4(71.10))
  ps = next(p for p in ranked if p.label == "ps")
  assert dict(ps.leaf_plan) == {"['g']": (True, 8)} and ps.predicted_ms == pytest.approx(25.33)
  assert ranked[0].label == "psum"  # 24.48 ms: cheaper than K = 8, not than K = 4 (23.21)


def _fit(ps_scale=1.0, ring_scale=1.0, float32=(4e-5, 1.0), psum=(6e-5, 1.5)):
  samples = []
  for label, size, ms in _samples(_truth(), "onebit", float32=float32, psum=psum):
    scale = ps_scale if label.startswith("ps,") else ring_scale if label.startswith("ring") else 1
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
    assert {p.label for p in plans} == {"float32", "psum", "ps", "ring"}
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
  # XLA's all-reduce is a plan of its own, priced by its own line.
  plans = st.rank_plans(GRADS, "onebit", _fit(float32=(1e-8, 0.01), psum=(1e-9, 0.001)))
  assert plans[0].label == "psum" and plans[0].topology is None
  assert plans[0].grad_sync(st.base.get("onebit")) == GradSync(algorithm="psum")
  assert plans[0].predicted_ms == pytest.approx(1e-9 * ((1 << 20) + (1 << 16) + 10) + 0.001)


def test_compressing_every_leaf_saves_the_float32_all_reduce_whole():
  """The float32 all-reduce costs 100 ms whatever its size (a fixed latency): compressing a
  leaf never beats the slope of adding it to that all-reduce, yet compressing every leaf saves
  the 100 ms. Unshaped on the namespaced cluster, the per-leaf rule alone planned the float32
  ring for onebit's one 1M gradient at 38.8 ms predicted, against 30.0 for PS (K = 8)."""
  fit = _fit(float32=(1e-9, 100.0), psum=None)
  tree = {"big": GRADS["big"], "mid": GRADS["mid"]}
  plan = next(p for p in st.rank_plans(tree, "onebit", fit) if p.label == "ps")
  assert all(compress for compress, _ in dict(plan.leaf_plan).values())
  by_hand = sum(fit.predict(f"ps, K={k}", size) for (_, (_, k)), size in
                zip(plan.leaf_plan, (1 << 20, 1 << 16)))  # leaf_plan is in leaf order: big, mid
  assert plan.predicted_ms == pytest.approx(by_hand) and plan.predicted_ms < 100.0
  assert st.plan_sync(tree, "onebit", fit).label in ("ps", "ring")


def test_a_fit_saved_before_psum_was_timed_loads_and_leaves_psum_unpriced(tmp_path):
  fit = _fit(psum=None)
  assert fit.psum is None
  data = fit.to_dict()
  del data["psum"]  # as written before psum was fitted
  old = st.SyncFit.from_dict(data)
  assert old == fit
  plans = st.rank_plans(GRADS, "onebit", old)
  assert plans[-1].label == "psum" and math.isnan(plans[-1].predicted_ms)


def test_without_a_fit_every_plan_is_a_candidate_and_unpriced():
  plans = st.rank_plans(GRADS, "onebit", num_nodes=N)
  assert {p.label for p in plans} == {"float32", "psum", "ps", "ring"}
  assert all(math.isnan(p.predicted_ms) for p in plans)
  # The sync's own rule on each topology: leaves above min_size compressed, in K = min(N, size).
  ps = next(p for p in st.rank_plans(GRADS, "onebit", num_nodes=N, min_size=1000)
            if p.label == "ps")
  assert dict(ps.leaf_plan) == {"['big']": (True, N), "['mid']": (True, N),
                                "['tiny']": (False, 1)}
  powersgd = st.rank_plans({"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}, "powersgd",
                           num_nodes=N)
  assert {p.label for p in powersgd} == {"float32", "psum", "allreduce"}


def test_autotune_times_at_most_limit_plans_and_keeps_the_fastest():
  timed = []
  ms = {"float32": 30.0, "psum": 25.0, "ps": 10.0, "ring": 20.0}

  def timer(syncs, tree):
    labels = [sync.topology if sync.compression else "psum" if sync.algorithm == "psum"
              else "float32" for sync in syncs]
    timed.extend(labels)
    return [ms[label] for label in labels]
  got = st.autotune(GRADS, "onebit", timer=timer, mesh=_mesh())
  # "Don't compress" is timed as psum only (the float32 ring sums the same mean).
  assert got.plan.label == "ps" and sorted(timed) == ["ps", "psum", "ring"]
  assert got.measured_ms == {k: v for k, v in ms.items() if k != "float32"}
  timed.clear()
  ms["psum"] = 5.0
  assert st.autotune(GRADS, "onebit", timer=timer, mesh=_mesh()).plan.label == "psum"
  timed.clear()
  # With a fit, only the `limit` best ranked are candidates: here ring (predicted fastest)
  # alone, chosen without timing.
  got = st.autotune(GRADS, "onebit", fit=_fit(3.0, 1.0), limit=1, timer=timer, mesh=_mesh())
  assert timed == [] and got.plan.label == "ring" and got.measured_ms == {}
  assert st.Autotuned.from_dict(got.to_dict()) == got


def test_with_a_fit_a_plan_predicted_over_twice_as_slow_as_the_best_is_not_timed():
  """Each candidate costs the runner a train-step compile (about 2 s for digits_wide here), so a
  plan the fit predicts more than DROP_ABOVE = 2x slower than the best is not timed, and a plan
  left alone is chosen without timing anything."""
  timed = []

  def timer(syncs, tree):
    timed.extend(sync.topology if sync.compression else sync.algorithm for sync in syncs)
    return [1.0] * len(syncs)
  predicted = {p.label: p.predicted_ms for p in st.rank_plans(GRADS, "onebit", _fit())}
  assert predicted["ring"] < 2 * predicted["ps"] < predicted["psum"]
  got = st.autotune(GRADS, "onebit", fit=_fit(), timer=timer, mesh=_mesh())
  assert timed == ["ps", "ring"] and set(got.measured_ms) == {"ps", "ring"}
  timed.clear()
  slow_ring = _fit(ring_scale=3.0)
  predicted = {p.label: p.predicted_ms for p in st.rank_plans(GRADS, "onebit", slow_ring)}
  assert 2 * predicted["ps"] < min(predicted["ring"], predicted["psum"])
  got = st.autotune(GRADS, "onebit", fit=slow_ring, timer=timer, mesh=_mesh())
  assert timed == [] and got.plan.label == "ps" and got.measured_ms == {}


def _mesh():
  from jax.sharding import Mesh
  return Mesh(np.array(jax.devices()), ("data",))


class _LoadedClock:
  """A fake clock for `time_in_rounds`: each call advances it by its cost, times 3 while the
  clock is below `busy_until` (another process holding the cores)."""

  def __init__(self, busy_until: float):
    self.now, self.busy_until = 0.0, busy_until

  def __call__(self) -> float:
    return self.now

  def run(self, cost: float):
    return lambda: setattr(self, "now", self.now + cost * (3 if self.now < self.busy_until else 1))


def test_rounds_spread_a_change_of_load_over_every_call():
  """Call a costs 10, b 12; the cores are busy (3x) until t = 60. Timed one after the other, a's
  three calls all fall in the busy time and b looks the faster; in rounds each sees the busy
  time once and a is the faster. Times are in clock units x 1000 (ms of seconds)."""
  clock = _LoadedClock(busy_until=60)
  sequential = [st.time_in_rounds([call], 3, clock=clock)[0]
                for call in (clock.run(10), clock.run(12))]
  assert [float(np.median(t)) for t in sequential] == [30000, 12000]
  clock = _LoadedClock(busy_until=60)
  a, b = st.time_in_rounds([clock.run(10), clock.run(12)], 3, clock=clock)
  assert (a, b) == ([30000, 10000, 10000], [36000, 12000, 12000])
  assert np.median(a) < np.median(b)


def test_rounds_drop_a_call_far_slower_than_the_fastest_after_the_first_round():
  clock = _LoadedClock(busy_until=0)
  calls = [clock.run(10), clock.run(25), clock.run(19)]
  times = st.time_in_rounds(calls, 3, drop_above=2.0, clock=clock)
  assert [len(t) for t in times] == [3, 1, 3] and times[1] == [25000]
  with pytest.raises(ValueError, match="repeats"):
    st.time_in_rounds(calls, 0)


def test_the_timing_data_differs_per_device_and_is_drawn_once():
  """`_device_tree` gives every device the leaf's one draw, rotated by the device's index."""
  tree = {"a": jax.ShapeDtypeStruct((5,), jnp.float32), "b": jax.ShapeDtypeStruct((), jnp.float32)}
  data = st._device_tree(tree, _mesh(), "data", seed=3)  # pylint: disable=protected-access
  one = np.random.default_rng(3).standard_normal((5,)).astype(np.float32)
  got = np.asarray(data["a"]).reshape(N, 5)
  for d in range(N):
    np.testing.assert_array_equal(got[d], np.roll(one, d))
  assert data["a"].sharding.spec == jax.sharding.PartitionSpec("data")
  assert np.asarray(data["b"]).shape == (N,)


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


def test_a_fit_takes_the_median_of_fit_repeats_rounds(monkeypatch):
  """By default each sync of a fit is the median of `FIT_REPEATS` (11) rounds: with 3, one psum
  came out 29.6 and 24.5 ms in two fits on the cluster, and plans that close followed it."""
  calls = []

  def rounds(syncs, tree, *, mesh, axis, repeats):
    calls.append(repeats)
    return [1.0 + i for i in range(len(syncs))]
  monkeypatch.setattr(st, "time_syncs_ms", rounds)
  st.fit_sync_costs("onebit", sizes=(1 << 10, 1 << 12), partitions=(N,))
  assert st.FIT_REPEATS == 11 and calls == [11, 11]
  st.fit_sync_costs("onebit", sizes=(1 << 10, 1 << 12), partitions=(N,), repeats=2)
  assert calls[2:] == [2, 2]


def test_a_live_fit_and_autotune_on_the_test_devices():
  """On the 8 test devices: whole syncs timed (two small sizes, K = 8), a fit with every topology,
  and autotune's choice a GradSync that sums like the float32 reference."""
  fit = st.fit_sync_costs("onebit", sizes=(1 << 10, 1 << 12), partitions=(N,), repeats=1)
  assert fit.num_nodes == len(jax.devices()) == N and set(fit.topologies) == {"ps", "ring"}
  assert {label for label, _, _ in fit.samples} == {"float32", "psum", f"ps, K={N}",
                                                     f"ring, K={N}"}
  assert fit.psum is not None
  assert all(ms > 0 for _, _, ms in fit.samples)
  tree = {"a": jax.ShapeDtypeStruct((1 << 12,), jnp.float32)}
  chosen = st.autotune(tree, "onebit", fit=fit, limit=2, repeats=1)
  # Both candidates timed, or one left by the fit's predictions and chosen untimed.
  assert (len(chosen.measured_ms) == 2 and chosen.plan.label in chosen.measured_ms or
          chosen.measured_ms == {})
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
