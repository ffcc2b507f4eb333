"""SeCoPa planner (jlp.compression.secopa), its CLI (experiments/secopa.py) and the cost-model
profiler (jlp.compression.profile).

References: `ref_costs` below, a plain-Python evaluation of hipress.md §2.5's four formulas with
the coefficient table typed from the spec (the compressed payload rS/K with HiPress's r = 1/16,
or a codec's wire bytes of one partition / 4, computed here from hipress.md §1's wire formats:
onebit ceil(c/8) + 8 bytes, DGC 4 + 8*ceil(c*density), b-bit TernGrad 10 + ceil(c*b/8)); the
VGG19 input (the 38 ImageNet VGG19 tensors of
HiPress's input.txt, sizes computed here from the architecture) and the plan lines HiPress's
SeCoPaPlan.txt holds for it at N=4 PS (its last line corrected to the input's size, §2.5); the
spec's break-even sizes and chosen K values (§2.5).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jlp.compression as jc
from jlp.compression import leaf_routes, profile, secopa
from jlp.compression.secopa import CostModel, LinearCost

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# hipress.md §2.5: (w ms/element, b ms, o ms); gather G and broadcast B per node count N.
SPEC = {
    "E": (1.4133e-8, 5.8938e-2, 0.05408),
    "D": (6.2041e-9, 1.3956e-1, 0.07287),
    "A": (0.0, 0.0, 0.0),
    "R": (8.5005e-7, 2.0337e-1, 0.09766),
    "G": {4: (2.7156e-6, 0.4193, 0.15573), 8: (6.1167e-6, 0.80768, 0.28778),
          16: (1.2937e-5, 1.4406, 0.59503)},
    "B": {4: (2.7157e-6, 0.22156, 0.1482), 8: (6.1172e-6, 0.27285, 0.29666),
          16: (1.2915e-5, 0.45538, 0.58353)},
}


def ref_costs(size: int, n: int, topology: str, wire=None) -> tuple[list[float], list[float]]:
  """(orig, comp) for K = 1..N from §2.5's formulas, c(x) = max(o, w x + b); the compressed
  partition: r = 1/16 of S/K, or with `wire` (bytes of one payload of c elements) wire(c) / 4
  float32 elements, c = ceil(S/K)."""
  def c(name, x):
    w, b, o = SPEC[name][n] if name in ("G", "B") else SPEC[name]
    return max(o, w * x + b)
  r = 1 / 16
  orig, comp = [], []
  for k in range(1, n + 1):
    part, small = size / k, size * r / k
    if wire is not None:
      small = wire(math.ceil(size / k)) / 4
    if topology == "ps":
      orig.append(c("G", part) + c("B", part) + (n - 1) * c("A", part))
      comp.append(c("G", small) + c("B", small) + min(k + 1, n) * c("E", part)
                  + min(n - 1 + k, 2 * (n - 1)) * c("D", small) + (n - 1) * c("A", part))
    else:
      orig.append(2 * (n - 1) * c("R", part) + (n - 1) * c("A", part))
      comp.append(2 * (n - 1) * c("R", small) + n * c("E", part) + n * c("D", small)
                  + (n - 1) * c("A", part))
  return orig, comp


def ref_decision(size: int, n: int, topology: str, wire=None) -> tuple[bool, int]:
  orig, comp = ref_costs(size, n, topology, wire)
  if min(comp) < min(orig):
    return True, 1 + comp.index(min(comp))
  return False, 1 + orig.index(min(orig))


def vgg19_imagenet() -> list[tuple[str, int]]:
  """HiPress's input.txt: MXNet Gluon ImageNet VGG19 (16 3x3 convs, 3 dense), forward order."""
  grads, cin = [], 3
  for i, cout in enumerate([64, 64, 128, 128] + [256] * 4 + [512] * 8):
    grads += [(f"vgg0_conv{i}_weight", 9 * cin * cout), (f"vgg0_conv{i}_bias", cout)]
    cin = cout
  for i, (fin, fout) in enumerate([(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]):
    grads += [(f"vgg0_dense{i}_weight", fin * fout), (f"vgg0_dense{i}_bias", fout)]
  return grads


# HiPress's SeCoPaPlan.txt (N=4, PS): compressed tensors and their K; every other line is "n,4".
SHIPPED_COMPRESSED = {"vgg0_conv8_weight": 2, **{f"vgg0_conv{i}_weight": 4 for i in range(9, 16)},
                      **{f"vgg0_dense{i}_weight": 4 for i in range(3)}}


def shipped_plan_text() -> str:
  return "".join(f"{name},{size},y,{SHIPPED_COMPRESSED[name]}\n" if name in SHIPPED_COMPRESSED
                 else f"{name},{size},n,4\n" for name, size in vgg19_imagenet())


def test_vgg19_input_is_hipress_sample():
  grads = vgg19_imagenet()
  assert len(grads) == 38 and sum(s for _, s in grads) == 143667240
  assert grads[32] == ("vgg0_dense0_weight", 102760448) and grads[-1] == ("vgg0_dense2_bias", 1000)


def test_sample_plan_n4_ps(tmp_path):
  (tmp_path / "input.txt").write_text("".join(f"{n},{s}\n" for n, s in vgg19_imagenet())[:-1])
  plan = secopa.secopa_plan(secopa.read_grads(tmp_path / "input.txt"), num_nodes=4,
                            topology="PS")
  secopa.write_plan(tmp_path / "plan.txt", plan)
  assert (tmp_path / "plan.txt").read_bytes() == shipped_plan_text().encode()
  assert secopa.read_plan(tmp_path / "plan.txt") == plan
  assert plan[16] == ("vgg0_conv8_weight", 1179648, True, 2)
  # HiPress's ratio given explicitly, and TBQ's own (exactly 1/16 at these partition sizes).
  for kwargs in (dict(ratio=1 / 16), dict(compressor="tbq")):
    assert secopa.secopa_plan(vgg19_imagenet(), num_nodes=4, topology="ps", **kwargs) == plan


def test_chosen_k_n16_ps():
  plan = {e.size: (e.compress, e.partitions)
          for e in secopa.secopa_plan(vgg19_imagenet(), num_nodes=16, topology="ps")}
  assert plan[4096000] == (True, 6)
  assert plan[16777216] == (True, 12)
  assert plan[102760448] == (True, 16)
  assert plan[2359296] == (False, 16)
  assert sum(c for c, _ in plan.values()) == 3


@pytest.mark.parametrize("topology", ["ps", "ring"])
@pytest.mark.parametrize("n", [4, 8, 16])
def test_matches_reference_formulas(n, topology):
  rng = np.random.default_rng(n)
  sizes = sorted({0, 1, 64, 1000, 262144, *[s for _, s in vgg19_imagenet()],
                  *rng.integers(1, 2 ** 28, 150).tolist(),
                  *np.round(10 ** rng.uniform(4, 7.5, 150)).astype(int).tolist()})
  plan = secopa.secopa_plan([(str(s), s) for s in sizes], num_nodes=n, topology=topology)
  for s, entry in zip(sizes, plan, strict=True):
    assert (entry.compress, entry.partitions) == ref_decision(s, n, topology), s
    got = secopa.sync_costs(s, num_nodes=n, topology=topology)
    want = ref_costs(s, n, topology)
    np.testing.assert_allclose(got.orig + got.comp, want[0] + want[1], rtol=1e-13)
  # §2.5: uncompressed partitions are free, so K = N; an empty gradient ties at every K (K = 1).
  assert all(e.partitions == (n if e.size else 1) for e in plan if not e.compress)


@pytest.mark.parametrize("topology,n,spec_millions", [
    ("ps", 4, 0.68), ("ps", 8, 1.27), ("ps", 16, 2.47),
    ("ring", 4, 0.67), ("ring", 8, 1.15), ("ring", 16, 2.15)])
def test_break_even_sizes(topology, n, spec_millions):
  lo, hi = 1, 10 ** 9  # the reference's smallest compressed size, by bisection
  assert not ref_decision(lo, n, topology)[0] and ref_decision(hi, n, topology)[0]
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if ref_decision(mid, n, topology)[0] else (mid, hi)
  assert abs(hi / 1e6 - spec_millions) < 0.005
  below, at = secopa.secopa_plan([("a", hi - 1), ("b", hi)], num_nodes=n, topology=topology)
  assert (below.compress, at.compress) == (False, True)


def test_seed_model():
  model = CostModel.seed()
  assert model is secopa.SEED_COEFFICIENTS and model.nodes == (4, 8, 16) and model.ratio == 1 / 16
  for n in (4, 8, 16):
    for name, line in (("G", model.gather_at(n)), ("B", model.broadcast_at(n))):
      assert (line.w, line.b, line.o) == SPEC[name][n]
  assert (model.ring_send.w, model.ring_send.b, model.ring_send.o) == SPEC["R"]
  assert LinearCost(2.0, 1.0, 5.0)(1.0) == 5.0 and LinearCost(2.0, 1.0, 5.0)(3.0) == 7.0
  scaled = model.scaled_communication(10.0)
  assert scaled.encode == model.encode and scaled.decode == model.decode
  assert scaled.ring_send.w == pytest.approx(8.5005e-6, rel=1e-15)
  assert (scaled.ring_send.b, scaled.ring_send.o) == SPEC["R"][1:]
  assert scaled.gather_at(16).w == pytest.approx(1.2937e-4) and scaled.broadcast_at(4).b == 0.22156


# hipress.md §1: wire bytes of one payload of c elements.
WIRE = {"onebit": lambda c: math.ceil(c / 8) + 8,  # sign bits + two float32 means
        "dgc": lambda c: 4 + 8 * math.ceil(c * 0.001),  # M, then (idx, val) pairs at capacity
        "dgc5": lambda c: 4 + 8 * math.ceil(c * 0.05),
        "terngrad8": lambda c: 10 + c}  # 10-byte header, 8 bits per element
CODECS = {"onebit": jc.get("onebit"), "dgc": jc.get("dgc"), "dgc5": jc.get("dgc", density=0.05),
          "terngrad8": jc.get("terngrad", bitwidth=8)}


def test_codec_ratios():
  c = 2 ** 20
  assert secopa.compression_ratio("onebit", c) == (c / 8 + 8) / (4 * c)
  assert secopa.compression_ratio("onebit", c) == pytest.approx(1 / 32, rel=1e-4)
  assert secopa.compression_ratio(CODECS["dgc"], c) == pytest.approx(2 * 0.001, rel=1e-3)
  assert secopa.compression_ratio(CODECS["dgc5"], c) == pytest.approx(2 * 0.05, rel=1e-4)
  assert secopa.compression_ratio("tbq", c) == 1 / 16
  assert secopa.compression_ratio(CODECS["terngrad8"], c) == pytest.approx(1 / 4, rel=1e-4)
  assert secopa.compression_ratio(CODECS["terngrad8"], 1) == 11 / 4  # the header dominates
  for name, wire in WIRE.items():
    for size in (1, 7, 1000, 123457):
      assert secopa.compression_ratio(CODECS[name], size) == wire(size) / (4 * size), (name, size)


@pytest.mark.parametrize("topology", ["ps", "ring"])
@pytest.mark.parametrize("name", sorted(WIRE))
def test_each_codec_is_planned_with_its_own_payload(name, topology):
  """sync_costs / secopa_plan with a compressor: the codec's payload at each partition size."""
  sizes = [1, 1000, 262144, 845190, 1088806, 1200000, 4000000, 16777216, 102760448]
  plan = secopa.secopa_plan([(str(s), s) for s in sizes], num_nodes=8, topology=topology,
                            compressor=CODECS[name])
  for size, entry in zip(sizes, plan, strict=True):
    got = secopa.sync_costs(size, num_nodes=8, topology=topology, compressor=CODECS[name])
    want = ref_costs(size, 8, topology, WIRE[name])
    np.testing.assert_allclose(got.orig + got.comp, want[0] + want[1], rtol=1e-13)
    assert (entry.compress, entry.partitions) == ref_decision(size, 8, topology, WIRE[name])


def test_codec_plans_differ_where_the_cost_model_says():
  """N=8, CaSync-PS, seed coefficients. Break-even sizes (the reference's smallest compressed
  size): DGC (density 0.001) 845190, onebit 1088806, HiPress's 1/16 1274800, 8-bit TernGrad
  2146197. In between, and in the K of large gradients, the plans differ."""
  def plan(size, **kwargs):
    return tuple(secopa.secopa_plan([("g", size)], num_nodes=8, topology="ps", **kwargs)[0][2:])
  for size, hipress, onebit, dgc, terngrad8 in [
      (1000000, (False, 8), (False, 8), (True, 1), (False, 8)),
      (1200000, (False, 8), (True, 2), (True, 1), (False, 8)),
      (2000000, (True, 3), (True, 2), (True, 1), (False, 8)),
      (4000000, (True, 4), (True, 3), (True, 1), (True, 8)),
      (102760448, (True, 8), (True, 8), (True, 8), (True, 8))]:
    assert plan(size) == plan(size, ratio=1 / 16) == hipress == ref_decision(size, 8, "ps")
    assert plan(size, compressor="onebit") == onebit == ref_decision(size, 8, "ps", WIRE["onebit"])
    assert plan(size, compressor="dgc") == dgc == ref_decision(size, 8, "ps", WIRE["dgc"])
    assert plan(size, compressor=CODECS["terngrad8"]) == terngrad8 == \
        ref_decision(size, 8, "ps", WIRE["terngrad8"])
  # An explicit ratio of 1/32 plans like onebit (whose payload is 1/32 plus 8 bytes) at these sizes.
  assert plan(1200000, ratio=1 / 32) == (True, 2) and plan(1000000, ratio=1 / 32) == (False, 8)


def test_plan_for_tree_with_the_sync_compressor():
  tree = {"w": jax.ShapeDtypeStruct((1200, 1000), np.float32),
          "b": jax.ShapeDtypeStruct((1000,), np.float32)}
  seed = secopa.plan_for_tree(tree, num_nodes=8, topology="ps")
  onebit = secopa.plan_for_tree(tree, num_nodes=8, topology="ps", compressor=jc.get("onebit"))
  terngrad8 = secopa.plan_for_tree(tree, num_nodes=8, compressor=CODECS["terngrad8"])
  assert seed == terngrad8 == {"['b']": (False, 8), "['w']": (False, 8)}
  assert onebit == {"['b']": (False, 8), "['w']": (True, 2)}
  routes = leaf_routes(tree, 8, plan=onebit)
  assert {r.path: (r.compress, r.K) for r in routes} == onebit
  static = secopa.plan_for_tree(tree, num_nodes=8, comp_threshold=0, compressor="onebit")
  assert static == {"['b']": (True, 8), "['w']": (True, 8)}


@pytest.mark.parametrize("kwargs, message", [
    (dict(compressor="zip"), "compressor='zip' is not allowed; expected None, a "
     "jlp.compression.Compressor or one of \\[.*'onebit'"),
    (dict(compressor=1 / 32), "compressor=0.03125 is not allowed"),
    (dict(compressor="onebit", ratio=1 / 32), "ratio=0.03125 is not allowed; expected None when "
     "a compressor is given"),
    (dict(ratio=0.0), "ratio=0.0 is not allowed; expected None or a float in \\(0, 1\\]"),
    (dict(ratio=2), "ratio=2 is not allowed"), (dict(ratio="1/16"), "ratio='1/16' is not allowed"),
])
def test_bad_compressor_or_ratio(kwargs, message):
  for fn in (lambda: secopa.secopa_plan([("a", 10)], num_nodes=4, topology="ps", **kwargs),
             lambda: secopa.sync_costs(10, num_nodes=4, topology="ps", **kwargs),
             lambda: secopa.plan_for_tree({"a": np.zeros(3, np.float32)}, num_nodes=4,
                                          comp_threshold=0, **kwargs)):
    with pytest.raises(ValueError, match=message):
      fn()
  with pytest.raises(ValueError, match="size=0 is not allowed"):
    secopa.compression_ratio("onebit", 0)


def test_ties_stay_uncompressed():
  """Free codecs and size-independent transfers: comp == orig at every K, so 'n' (HiPress
  compresses iff orig > comp) and the first K."""
  free, flat = LinearCost(0, 0, 0), LinearCost(0, 1.0, 0.5)
  model = CostModel(free, free, free, flat, gather={4: flat}, broadcast={4: flat})
  for topology in ("ps", "ring"):
    assert secopa.secopa_plan([("a", 10 ** 6)], num_nodes=4, topology=topology,
                              cost_model=model) == [("a", 10 ** 6, False, 1)]


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_nodes=5), "num_nodes=5"), (dict(num_nodes=32), "num_nodes=32"),
    (dict(num_nodes=True), "num_nodes=True"), (dict(num_nodes=4.0), "num_nodes=4.0"),
    (dict(topology="tree"), "topology='tree'"), (dict(topology=None), "topology=None"),
    (dict(cost_model="seed"), "cost_model='seed'")])
def test_bad_arguments(kwargs, field):
  args = dict(num_nodes=4, topology="ps") | kwargs
  with pytest.raises(ValueError, match=f"{field} is not allowed; expected"):
    secopa.secopa_plan([("a", 10)], **args)


@pytest.mark.parametrize("grads,field", [
    ([("a", -1)], "grads\\[0\\] size=-1"), ([("a", 1.5)], "grads\\[0\\] size=1.5"),
    ([("a", True)], "grads\\[0\\] size=True"), ([(1, 2)], "grads\\[0\\]="),
    ([("a", 1, 2)], "grads\\[0\\]="), ("a,1", "grads=")])
def test_bad_grads(grads, field):
  with pytest.raises(ValueError, match=f"{field}.* is not allowed"):
    secopa.secopa_plan(grads, num_nodes=4, topology="ps")


def test_cost_model_validation_and_json(tmp_path):
  with pytest.raises(ValueError, match="LinearCost.w=-1.0 is not allowed"):
    LinearCost(-1.0, 0.0, 0.0)
  with pytest.raises(ValueError, match="LinearCost.o=nan is not allowed"):
    LinearCost(1.0, 0.0, float("nan"))
  seed = CostModel.seed()
  with pytest.raises(ValueError, match="broadcast node counts"):
    CostModel(seed.encode, seed.decode, seed.aggregate, seed.ring_send,
              gather={4: seed.gather_at(4)}, broadcast={8: seed.broadcast_at(8)})
  with pytest.raises(ValueError, match="CostModel.ratio=0.0 is not allowed"):
    CostModel(seed.encode, seed.decode, seed.aggregate, seed.ring_send,
              gather=seed.gather, broadcast=seed.broadcast, ratio=0.0)
  seed.save(tmp_path / "seed.json")
  assert CostModel.load(tmp_path / "seed.json") == seed
  assert hash(CostModel.load(tmp_path / "seed.json")) == hash(seed)
  data = json.loads((tmp_path / "seed.json").read_text())
  assert data["gather"]["16"] == {"w": 1.2937e-5, "b": 1.4406, "o": 0.59503}
  data["extra"] = 1
  (tmp_path / "bad.json").write_text(json.dumps(data))
  with pytest.raises(ValueError, match="cost model key 'extra'"):
    CostModel.load(tmp_path / "bad.json")
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="not a JSON cost model"):
    CostModel.load(tmp_path / "bad.json")


def test_plan_files(tmp_path):
  path = tmp_path / "input.txt"
  path.write_bytes(b"conv_w,1179648\r\n\nb,64\n")
  assert secopa.read_grads(path) == [("conv_w", 1179648), ("b", 64)]
  plan = secopa.secopa_plan(secopa.read_grads(path), num_nodes=4, topology="ps")
  secopa.write_plan(tmp_path / "plan.txt", plan)
  assert (tmp_path / "plan.txt").read_text() == "conv_w,1179648,y,2\nb,64,n,4\n"
  for text in ("a\n", "a,1,2\n", "a,-3\n", "a,x\n", ",5\n"):
    path.write_text(text)
    with pytest.raises(ValueError, match="line 1=.* is not allowed; expected 'name,num_elements'"):
      secopa.read_grads(path)
  for text in ("a,1,y\n", "a,1,Y,2\n", "a,1,y,0\n", "a,-1,n,1\n"):
    (tmp_path / "plan.txt").write_text(text)
    with pytest.raises(ValueError, match="line 1=.* is not allowed; expected 'name,size,y|n,K'"):
      secopa.read_plan(tmp_path / "plan.txt")
  with pytest.raises(ValueError, match="plan\\[0\\] name='a,b' is not allowed"):
    secopa.write_plan(tmp_path / "x.txt", [("a,b", 1, False, 1)])
  with pytest.raises(ValueError, match="plan\\[0\\] K=0 is not allowed"):
    secopa.write_plan(tmp_path / "x.txt", [("a", 1, False, 0)])


def test_plan_for_tree_feeds_sync():
  tree = {"dense": {"kernel": jax.ShapeDtypeStruct((4096, 1000), np.float32),
                    "bias": jax.ShapeDtypeStruct((1000,), np.float32)},
          "conv": [np.zeros((3, 3, 256, 512), np.float32), np.zeros((0,), np.float32)]}
  plan = secopa.plan_for_tree(tree, num_nodes=8, topology="RING")
  assert plan == {"['conv'][0]": (True, 8), "['conv'][1]": (False, 1),
                  "['dense']['bias']": (False, 8), "['dense']['kernel']": (True, 8)}
  for path, size in (("['conv'][0]", 1179648), ("['dense']['kernel']", 4096000)):
    assert plan[path] == ref_decision(size, 8, "ring")
  routes = leaf_routes(tree, 8, plan=plan)  # jlp.compression.sync takes the plan as is
  assert {r.path: (r.compress, r.K) for r in routes} == plan
  static = secopa.plan_for_tree(tree, num_nodes=4, comp_threshold=secopa.COMP_THRESHOLD)
  assert static == {"['conv'][0]": (True, 4), "['conv'][1]": (False, 4),
                    "['dense']['bias']": (False, 4), "['dense']['kernel']": (True, 4)}


def test_fit_line_least_squares():
  xs, ms = [1.0, 2.0, 4.0, 8.0], [1.5, 2.4, 4.7, 8.2]
  mx, my = sum(xs) / 4, sum(ms) / 4  # closed-form least squares
  w = sum((x - mx) * (y - my) for x, y in zip(xs, ms)) / sum((x - mx) ** 2 for x in xs)
  line = profile.fit_line(xs, ms)
  assert line.w == pytest.approx(w, rel=1e-12) and line.b == pytest.approx(my - w * mx, rel=1e-12)
  assert line.o == 1.5
  assert profile.fit_line([1, 2, 3], [3.0, 2.0, 1.0]) == LinearCost(0.0, 2.0, 1.0)
  with pytest.raises(ValueError, match="sizes=.* is not allowed"):
    profile.fit_line([1, 1], [1.0, 2.0])


def test_fit_cost_model_tiny(tmp_path):
  """Runs the profiler on the 8 emulated devices with tiny sizes: a usable model, no timings
  asserted."""
  model = profile.fit_cost_model(sizes=(64, 256, 1024), node_counts=(4, 8), repeats=1)
  assert model.nodes == (4, 8) and model.ratio == 1 / 16 and "TBQ" in model.source
  lines = [model.encode, model.decode, model.aggregate, model.ring_send,
           *[c for _, c in model.gather + model.broadcast]]
  for line in lines:
    assert all(math.isfinite(v) for v in (line.w, line.b, line.o))
    assert line.w >= 0 and line.o > 0
  model.save(tmp_path / "fit.json")
  assert CostModel.load(tmp_path / "fit.json") == model
  plan = secopa.secopa_plan(vgg19_imagenet(), num_nodes=8, topology="ps", cost_model=model)
  assert all(1 <= e.partitions <= 8 for e in plan)
  with pytest.raises(ValueError, match="num_nodes=16 is not allowed; expected one of \\(4, 8\\)"):
    secopa.secopa_plan([("a", 1)], num_nodes=16, topology="ps", cost_model=model)
  with pytest.raises(ValueError, match="node_counts entry=16 is not allowed"):
    profile.fit_cost_model(sizes=(64, 256), node_counts=(16,))
  with pytest.raises(ValueError, match="sizes=\\(64,\\) is not allowed"):
    profile.fit_cost_model(sizes=(64,))


def run_cli(*args, cwd):
  """experiments.secopa as a real process (its exit status and streams), in cwd."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "experiments.secopa", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=120, check=False)


def run_cli_here(*args):
  """experiments.secopa's main in this process (tests/entry_points.run_main: its flags
  parsed afresh, SystemExit caught): (exit status, stdout, stderr). Paths must be absolute."""
  from entry_points import run_main  # pylint: disable=g-import-not-at-top
  return run_main("experiments.secopa", *args)


def test_cli(tmp_path):
  """A real process with HiPress's coefficients (PS, N=4), then the same entry point in this
  process with a saved cost model (ring, N=16)."""
  grads = vgg19_imagenet()[16:20] + vgg19_imagenet()[32:34]
  (tmp_path / "input.txt").write_text("".join(f"{n},{s}\n" for n, s in grads))
  r = run_cli("--input=input.txt", "--output=plan.txt", "--topology=PS", "--nnodes=4",
              cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "plan.txt").read_bytes() == (
      b"vgg0_conv8_weight,1179648,y,2\nvgg0_conv8_bias,512,n,4\n"
      b"vgg0_conv9_weight,2359296,y,4\nvgg0_conv9_bias,512,n,4\n"
      b"vgg0_dense0_weight,102760448,y,4\nvgg0_dense0_bias,4096,n,4\n")
  CostModel.seed().save(tmp_path / "seed.json")
  status, out, err = run_cli_here(f"--input={tmp_path / 'input.txt'}",
                                  f"--output={tmp_path / 'ring.txt'}", "--topology=ring",
                                  "--nnodes=16", f"--profile={tmp_path / 'seed.json'}")
  assert status == 0 and "wrote" in out, err
  assert (tmp_path / "ring.txt").read_text() == "".join(
      f"{n},{s},{'y' if c else 'n'},{k}\n" for (n, s), (c, k) in
      zip(grads, (ref_decision(s, 16, "ring") for _, s in grads)))


@pytest.mark.parametrize("args,message", [
    (("--nnodes=5",), "num_nodes=5 is not allowed"),
    # Slow tier: the library's ValueError reaches the same `except` of the CLI as nnodes=5's.
    pytest.param(("--topology=tree",), "topology='tree' is not allowed",
                 marks=pytest.mark.slow),
    (("--input=missing.txt",), "No such file"),
    (("--nnodes=x",), "--nnodes"),
])
def test_cli_errors(tmp_path, args, message):
  """Each error: exit status 2, one `error: ` line, no plan written (in this process; test_cli
  runs the entry point as a process)."""
  (tmp_path / "input.txt").write_text("a,1\n")
  args = [a.replace("=missing.txt", f"={tmp_path / 'missing.txt'}") for a in args]
  if not any(a.startswith("--input=") for a in args):
    args.insert(0, f"--input={tmp_path / 'input.txt'}")
  status, _, err = run_cli_here(f"--output={tmp_path / 'plan.txt'}", *args)
  assert status == 2 and message in err and err.startswith("error: "), err
  assert not (tmp_path / "plan.txt").exists()
