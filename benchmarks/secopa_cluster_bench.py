"""A simulated cluster: SeCoPa's predicted gradient-sync time against node count and bandwidth.

Run: python -m benchmarks.secopa_cluster_bench [--profile=coeffs.json] [--out=out/secopa.png]
     [--bandwidths=10,25,56,100] [--nodes=4,8,16]

Nothing is trained or sent: the per-iteration sync time of a model's gradients is what SeCoPa's
cost model (jlp.compression.secopa, docs/hipress.md#secopa) predicts, summed over the gradients (one
after another, as the model treats each gradient on its own):

  off     every gradient uncompressed, its best K (= N)         sum of min_K orig
  static  HiPress's --comp-threshold rule: compress iff > 262144 elements, K = N
  SeCoPa  the plan: per gradient the cheaper of min_K orig and min_K comp

for CaSync-PS and CaSync-Ring, N = --nodes, two cost models:

  seed    HiPress's coefficients (its local cluster: GTX 1080Ti, 56 Gbps; HiPress paper, Fig. 7-8)
  fitted  `fit_cost_model` on this machine's 8 emulated CPU devices (TBQ; G and B at N = 4 and
          8; N = 16 extrapolated linearly in N from them, each of w, b, o; or --profile)

Bandwidth: the communication coefficients w of R, G and B are scaled by base / bandwidth, base =
56 Gbps for the seed (its cluster's network) and, for the fitted model, the rate its ring send
measured (32 bits / w_R; emulated devices copy memory between threads). Encode, decode and
aggregate keep their measured costs: "fitted" is this CPU's TBQ codec on a network of the given
bandwidth.

Gradients: ImageNet VGG19 (the 38 tensors of HiPress's input.txt, 143.7M floats, sizes computed
from the architecture), jlp's VGG19-BN and ResNet50 with 1000 classes (`jlp.models`, leaf sizes
from `nnx.eval_shape`). Iteration time = compute + sync, compute = the paper's Fig. 11
"computation alone" (VGG19 273 ms on the local cluster; none is given for ResNet50). The paper's
own numbers (Figs. 7-8 and 11) are printed first for comparison. A figure of sync time against
bandwidth goes to --out.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jlp.compression import secopa  # noqa: E402
from jlp.compression.secopa import CostModel, LinearCost  # noqa: E402

_PROFILE = flags.DEFINE_string("profile", None, "A saved fitted cost model (JSON) instead of "
                               "fitting one now; needs G/B at two node counts.")
_SAVE_PROFILE = flags.DEFINE_string("save_profile", None, "Save the fitted cost model here.")
_OUT = flags.DEFINE_string("out", "out/secopa_cluster.png", "Where to write the figure.")
_BANDWIDTHS = flags.DEFINE_list("bandwidths", ["10", "25", "56", "100"], "Network, Gbps.")
_NODES = flags.DEFINE_list("nodes", ["4", "8", "16"], "Node counts N (4, 8, 16).")

SEED_BANDWIDTH = 56.0  # Gbps, HiPress's local cluster (HiPress paper, Fig. 7-8)
COMPUTE_MS = {"VGG19 (ImageNet)": 273.0}  # fig11 "computation alone" (HiPress paper)
PAPER = [  # HiPress paper, Fig. 7-8 and 11 (local cluster: 1080Ti, 56 Gbps, 32 GPUs)
    ("VGG19 fig11 sync, BytePS (no compression)", "590 ms"),
    ("VGG19 fig11 sync, CaSync-PS +On-GPU / +Pipeline / +Bulk Sync", "346 / 319 / 236 ms"),
    ("VGG19 fig11 sync, CaSync-PS +SeCoPa", "189 ms"),
    ("VGG19 fig11 computation alone", "273 ms"),
    ("VGG19 iteration (114 ms offset + sync)", "703 -> 303 ms (2.32x)"),
    ("VGG19 throughput, 32 GPUs: BytePS / Ring / HiPress", "1457 / 2118 / 3396 img/s (2.33x)"),
    ("ResNet50 throughput, 32 GPUs: BytePS / Ring / HiPress", "4732 / 4844 / 5645 img/s (1.19x)"),
    ("Bert-base fig11 sync, Ring -> CaSync-Ring +SeCoPa", "430 -> 299 ms"),
]


def vgg19_imagenet() -> list[tuple[str, int]]:
  """HiPress's input.txt: ImageNet VGG19, 16 3x3 convs and 3 dense layers with biases."""
  grads, cin = [], 3
  for i, cout in enumerate([64, 64, 128, 128] + [256] * 4 + [512] * 8):
    grads += [(f"vgg0_conv{i}_weight", 9 * cin * cout), (f"vgg0_conv{i}_bias", cout)]
    cin = cout
  for i, (fin, fout) in enumerate([(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]):
    grads += [(f"vgg0_dense{i}_weight", fin * fout), (f"vgg0_dense{i}_bias", fout)]
  return grads


def zoo_grads(name: str) -> list[tuple[str, int]]:
  """(keystr path, size) of the parameters of jlp.models.get_model(name, num_classes=1000)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jlp import models  # pylint: disable=g-import-not-at-top
  model = nnx.eval_shape(lambda: models.get_model(name, num_classes=1000))
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  return [(jax.tree_util.keystr(p), math.prod(x.shape)) for p, x in leaves]


def extrapolate(model: CostModel, n_new: int) -> CostModel:
  """G and B at n_new, linear in N through the model's two largest node counts (each of w, b,
  o; w and o kept >= 0)."""
  (n1, _), (n2, _) = model.gather[-2:]
  def line(c1: LinearCost, c2: LinearCost) -> LinearCost:
    t = (n_new - n2) / (n2 - n1)
    return LinearCost(max(0.0, c2.w + t * (c2.w - c1.w)), c2.b + t * (c2.b - c1.b),
                      max(0.0, c2.o + t * (c2.o - c1.o)))
  gather = dict(model.gather) | {n_new: line(model.gather_at(n1), model.gather_at(n2))}
  bcast = dict(model.broadcast) | {n_new: line(model.broadcast_at(n1), model.broadcast_at(n2))}
  return dataclasses.replace(model, gather=gather, broadcast=bcast)


def base_bandwidth(model: CostModel, is_seed: bool) -> float:
  """Gbps that the model's communication coefficients stand for (module docstring)."""
  return SEED_BANDWIDTH if is_seed else 32.0 / (model.ring_send.w * 1e-3) / 1e9


def predict(grads: list[tuple[str, int]], model: CostModel, n: int, topology: str) -> dict:
  """Sync ms with compression off, the static rule, and SeCoPa's plan; compressed counts."""
  off = static = plan = 0.0
  compressed = 0
  for _, size in grads:
    costs = secopa.sync_costs(size, num_nodes=n, topology=topology, cost_model=model)
    off += min(costs.orig)
    static += costs.comp[n - 1] if size > secopa.COMP_THRESHOLD else costs.orig[n - 1]
    plan += min(min(costs.orig), min(costs.comp))
    compressed += min(costs.comp) < min(costs.orig)
  return {"off": off, "static": static, "plan": plan, "compressed": compressed}


def fitted_model() -> CostModel:
  if _PROFILE.value:
    model = CostModel.load(_PROFILE.value)
  else:
    from jlp.compression import profile  # pylint: disable=g-import-not-at-top
    if len(jax.devices()) < 8:
      raise app.UsageError(f"expected 8 devices, found {len(jax.devices())}")
    model = profile.fit_cost_model(node_counts=(4, 8))
    if _SAVE_PROFILE.value:
      model.save(_SAVE_PROFILE.value)
  if len(model.nodes) < 2:
    raise app.UsageError(f"the cost model has G/B at {model.nodes} only; need two node counts")
  return model


def wbo(c: LinearCost) -> str:
  return f"(w={c.w:.3g}, b={c.b:.3g}, o={c.o:.3g})"


def plot(results: dict, bandwidths: list[float], nodes: list[int], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = list(dict.fromkeys(k[0] for k in results))
  rows = [(c, t) for c in ("seed", "fitted") for t in ("ps", "ring")]
  fig, axes = plt.subplots(len(rows), len(names), figsize=(4.2 * len(names), 3.2 * len(rows)),
                           squeeze=False)
  for i, (cost, topology) in enumerate(rows):
    for j, name in enumerate(names):
      ax = axes[i][j]
      for n, color in zip(nodes, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for mode, style in (("off", "--"), ("plan", "-")):
          ys = [results[(name, cost, topology, n, bw)][mode] for bw in bandwidths]
          ax.plot(bandwidths, ys, style, color=color, marker="o", ms=3,
                  label=f"N={n} {'SeCoPa' if mode == 'plan' else 'off'}")
      ax.set_xscale("log")
      ax.set_yscale("log")
      ax.set_xticks(bandwidths, [f"{b:g}" for b in bandwidths])
      ax.set_title(f"{name}\n{cost} coefficients, {topology.upper()}", fontsize=9)
      ax.set_xlabel("bandwidth (Gbps)")
      ax.set_ylabel("predicted sync (ms / iteration)")
      ax.grid(True, which="both", alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    bandwidths = [float(b) for b in _BANDWIDTHS.value]
    nodes = [int(n) for n in _NODES.value]
  except ValueError as e:
    raise app.UsageError(f"--bandwidths / --nodes: {e}") from None
  if any(b <= 0 for b in bandwidths) or any(n not in (4, 8, 16) for n in nodes):
    raise app.UsageError("--bandwidths must be positive and --nodes in 4, 8, 16.")
  fitted = fitted_model()
  measured_nodes = fitted.nodes
  for n in nodes:
    if n not in fitted.nodes:
      fitted = extrapolate(fitted, n)
  models = {"seed": CostModel.seed(), "fitted": fitted}
  base = {"seed": SEED_BANDWIDTH, "fitted": base_bandwidth(fitted, False)}
  grads = {"VGG19 (ImageNet)": vgg19_imagenet(), "VGG19-BN (jlp)": zoo_grads("vgg19"),
           "ResNet50 (jlp)": zoo_grads("resnet50")}

  print("The paper's numbers (Fig. 7-8 and 11; local cluster):")
  for what, value in PAPER:
    print(f"  {what:62s} {value}")
  print("\nCost models (ms; x = float32 elements):")
  for cost, model in models.items():
    print(f"  {cost} = {model.source}; network = {base[cost]:.3g} Gbps")
    print(f"    E {wbo(model.encode)}  D {wbo(model.decode)}  A {wbo(model.aggregate)}  "
          f"R {wbo(model.ring_send)}")
    for n in nodes:
      guess = cost == "fitted" and n not in measured_nodes
      print(f"    N={n:2d}  G {wbo(model.gather_at(n))}  B {wbo(model.broadcast_at(n))}"
            f"{'  (extrapolated)' if guess else ''}")
  print("\nGradients: " + ", ".join(f"{k} {len(v)} tensors {sum(s for _, s in v) / 1e6:.1f}M"
                                    for k, v in grads.items()))

  results = {}
  for name, gs in grads.items():
    for cost, model in models.items():
      for topology in ("ps", "ring"):
        for n in nodes:
          for bw in bandwidths:
            scaled = model.scaled_communication(base[cost] / bw)
            results[(name, cost, topology, n, bw)] = predict(gs, scaled, n, topology)

  def table(title, names, cell):
    """One markdown row per (model, cost model, topology, N), one cell(model, result) per
    bandwidth."""
    print(title)
    print("| model | cost | topo | N | " + " | ".join(f"{b:g} Gbps" for b in bandwidths) + " |")
    print("|" + " --- |" * (4 + len(bandwidths)))
    for name in names:
      for cost in models:
        for topology in ("ps", "ring"):
          for n in nodes:
            cells = [cell(name, results[(name, cost, topology, n, bw)]) for bw in bandwidths]
            print(f"| {name} | {cost} | {topology.upper()} | {n} | " + " | ".join(cells) + " |")

  def sync_cell(name, r):
    del name
    return f"{r['off']:.0f} / {r['static']:.0f} / {r['plan']:.0f} [{r['compressed']}]"

  def iteration_cell(name, r):
    off, on = COMPUTE_MS[name] + r["off"], COMPUTE_MS[name] + r["plan"]
    return f"{off:.0f} -> {on:.0f} ({off / on:.2f}x)"

  table("\nPredicted sync ms per iteration: off / static(262144) / SeCoPa "
        "[gradients compressed by SeCoPa]", grads, sync_cell)
  table("\nIteration ms = compute (fig11) + sync, off -> SeCoPa (speedup):", COMPUTE_MS,
        iteration_cell)

  plot(results, bandwidths, nodes, _OUT.value)
  print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
