r"""Gradient sync time per step on a real (emulated) network: hosts in network namespaces at several
bandwidths, every sync the framework has, wall-clock.

  python -m experiments.cluster_study --workdir=out/cluster_study            # 4 hosts x 2 devices
  python -m experiments.cluster_study --bandwidths=1gbit --hosts=2 --size=1M --workdir=W

For each bandwidth the cluster launcher (`jlp.train.cluster`) starts --hosts processes of
--devices_per_host devices, each in its own namespace with its link shaped (tbf; `none`:
unshaped), and every host runs `jlp.train.sync_timing.time_syncs`: one float32 gradient of --size
elements per device synced by float32 psum, the float32 ring, CPD's e4m3 ring on the packed and
the float32 wire, and HiPress's onebit, TBQ and DGC on PS and ring, then fits SeCoPa's cost model
on the same hosts (`jlp.compression.profile.fit_cost_model`, as `experiments.secopa --fit` does,
once per compressor) and predicts each sync with it, and times the sync SeCoPa plans with each
compressor's fitted model (`planned_sync`: PS or ring, compress or not, K partitions; a plan that
is the same program as a fixed row is that row, timed once, marked "(= row)"). Writes
WORKDIR/<bandwidth>.json (host 0's rows), WORKDIR/sync_time.md (the table: median ms per sync
and bandwidth, ratio to float32 psum, SeCoPa's prediction, the plan's choice in brackets, wire
bytes per device) and WORKDIR/sync_time.png. Needs root (see `experiments.cluster`); without it
the hosts share localhost and only `none` runs.

Then it trains `configs/digits_wide.py` (a 4.8M-parameter MLP on digits) on the same cluster
with `experiments.train`, and reads each run's metrics (`jlp.train.run_timing`):
  * pipelines (every bandwidth): wall seconds per mini-batch of data parallelism (the float32
    ring, which moves psum's bytes; the default sequential all-reduce gathers W - 1 copies), GPipe and 1F1B,
    and the flush schedules of issue 34 (1F1B-flush, ZB-H1 on the same model; interleaved 1F1B
    v = 2 and ZB-V, two chunks per device, on a deeper MLP of 2 * stages - 1 hidden layers of
    1536 so it splits into 2 * stages parts, beside GPipe on that model), 4 micro-batches each,
    with --stages stages spanning the hosts (stage s on host
    s // (stages / hosts), each stage's all-reduce across the pipelines inside one host), over
    --train_steps steps; writes WORKDIR/step_time.md;
  * time to accuracy (--accuracy_bandwidths, default 100mbit): the float32 ring, onebit (PS), CPD's
    e4m3 ring on the packed wire with APS, PowerSGD rank 2 and 4 (all-reduce), DiLoCo H = 10 and
    50 and Streaming DiLoCo (H = 10, 4 fragments, e2m1 outer gradients) (ACCURACY_RUNS), each stopped at the first evaluation (every 5 steps)
    reaching --target: steps, seconds per step (the mean of the steps up to the target, after the
    first interval: an outer sync every H steps counts at its share), training seconds to the
    target; writes WORKDIR/time_to_accuracy.md and time_to_accuracy.png.
--sections picks the parts (sync, pipelines, accuracy), --accuracy_run the time-to-accuracy runs
(repeated; default all); --train_override adds
--config.FIELD=VALUE arguments to every training run (the tests shrink the model with it).
"""

import json
import os
import sys
from typing import Any

from absl import app, flags

from jlp.train import cli

_WORKDIR = flags.DEFINE_string("workdir", "out/cluster_study", "Where results go.")
_HOSTS = flags.DEFINE_integer("hosts", 4, "Host processes.")
_DEVICES = flags.DEFINE_integer("devices_per_host", 2, "Emulated CPU devices per host.")
_BANDWIDTHS = flags.DEFINE_list("bandwidths", ["100mbit", "1gbit", "none"],
                                "Link bandwidths (tc rates) or none.")
_SIZE = flags.DEFINE_string("size", "4M", "Gradient elements per device (K/M suffixes).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 11, "Timed calls per sync (median; 11 as in the whole-sync fits: with 5, single "
    "calls of 20-40 ms moved a sync's median by up to 42 % between runs).")
_HOST_OUT = flags.DEFINE_string("host_out", None, "Internal: run as a host, write rows here.")
_LINK = flags.DEFINE_string("link", "none", "Internal: the hosts' link, named in their sync fits.")
_SYNC_FIT_SIZES = flags.DEFINE_list(
    "sync_fit_sizes", ["64K", "1M", "4M"], "Gradient elements per device (K/M suffixes) of the "
    "whole-sync fits' timings, up to the largest --size planned for: fitted up to 1M, the plans' "
    "predictions at 4M were within ±30 % in 42-52 % of the cells against 58-76 % at 1M.")
_SYNC_FITS = flags.DEFINE_string(
    "sync_fits", None, "Where the whole-sync fits are kept and reused (one JSON per link and "
    "compressor; default WORKDIR/sync_fits).")
_SECTIONS = flags.DEFINE_multi_enum("sections", ["sync", "pipelines", "accuracy"],
                                    ["sync", "pipelines", "accuracy"], "Parts of the study to run.")
_ACCURACY_BANDWIDTHS = flags.DEFINE_list("accuracy_bandwidths", ["100mbit"],
                                         "Bandwidths of the time-to-accuracy runs.")
_ACCURACY_RUNS = flags.DEFINE_multi_string(
    "accuracy_run", None, "Names of ACCURACY_RUNS to run (repeat the flag; default all; the "
    "ratios are against 'float32 ring' when it runs).")
_HEARTBEAT_TIMEOUT = flags.DEFINE_float(
    "heartbeat_timeout", 600.0, "The training runs' --heartbeat_timeout: longer than a compile of "
    "their largest program on loaded cores (a host's heartbeat waits for it).")
_TARGET = flags.DEFINE_float("target", 0.97, "Test accuracy of the time-to-accuracy runs.")
_STAGES = flags.DEFINE_integer("stages", 4, "Stages of the pipelined runs.")
_TRAIN_STEPS = flags.DEFINE_integer(
    "train_steps", 40, "Steps of the step-time runs (1F1B drains and compiles its flush in the "
    "last two intervals: the median is over the ones after the first).")
_TRAIN_OVERRIDES = flags.DEFINE_multi_string("train_override", [],
                                             "--config.FIELD=VALUE for every training run.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_CONFIG = os.path.join(REPO, "configs", "digits_wide.py")
#: The time-to-accuracy runs: name -> experiments.train config arguments.
ACCURACY_RUNS = {
    "float32 ring": ["--config.grad_algorithm=ring"],
    "onebit PS": ["--config.compression.name=onebit"],
    "e4m3 ring, packed wire + APS": ["--config.grad_exp=4", "--config.grad_man=3",
                                     "--config.grad_algorithm=ring", "--config.use_aps"],
    # issue 35's baselines; PowerSGD compresses from step 3 (start_iter=2: torch's default 1000
    # would never compress in these runs of at most 150 steps)
    "PowerSGD rank 2 (start_iter 2)": [
        "--config.compression.name=powersgd", "--config.compression.topology=allreduce",
        '--config.compression.kwargs={"rank": 2, "start_iter": 2}'],
    "PowerSGD rank 4 (start_iter 2)": [
        "--config.compression.name=powersgd", "--config.compression.topology=allreduce",
        '--config.compression.kwargs={"rank": 4, "start_iter": 2}'],
    "DiLoCo H=10": ["--config.diloco.period=10"],
    "DiLoCo H=50": ["--config.diloco.period=50"],
    "Streaming DiLoCo H=10, 4 fragments, e2m1": [
        "--config.diloco.period=10", "--config.diloco.fragments=4",
        "--config.diloco.outer_format=e2m1"],
}


#: The cost model's fit sizes, up to a quarter of the synced 4M elements (larger fits take minutes per
#: compressor at 100 Mbit/s).
FIT_SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)


def _fit_and_predict(size: int, num_devices: int) -> tuple[dict[str, float], dict[str, Any]]:
  """SeCoPa's predicted ms per case, from cost models fitted here (one per compressor: its
  encode and decode; the collectives the same), K = W partitions as the syncs use; the float32
  rows are its uncompressed ring formula; the e4m3 rows have no SeCoPa formula. Also returns the
  fitted models by compressor name."""
  from jlp.compression import profile, secopa  # pylint: disable=g-import-not-at-top
  out, models = {}, {}
  for codec in ("onebit", "tbq", "dgc"):
    model = models[codec] = profile.fit_cost_model(sizes=FIT_SIZES, compressor=codec, repeats=3)
    for topology, label in (("ps", "PS"), ("ring", "ring")):
      costs = secopa.sync_costs(size, num_nodes=num_devices, topology=topology, cost_model=model,
                                compressor=codec)
      out[f"{codec} {label}"] = costs.comp[num_devices - 1]
    ring = secopa.sync_costs(size, num_nodes=num_devices, topology="ring", cost_model=model)
    out.setdefault("float32 psum", ring.orig[num_devices - 1])
    out.setdefault("float32 ring", ring.orig[num_devices - 1])
  return out, models


def planned_sync(size: int, num_devices: int, codec: str, model: Any) -> tuple[Any, float, str]:
  """The sync SeCoPa plans for one gradient {"g": size floats} with `codec` and the fitted
  `model`: of its CaSync-PS and CaSync-Ring plans (each: compress or not, and the partition
  count K), the one it predicts faster, as process 0 planned it. (GradSync, predicted ms, e.g.
  "PS, K=3" or "ring, K=8, uncompressed")."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jlp.compression import secopa  # pylint: disable=g-import-not-at-top
  from jlp.sync import GradSync  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  grads = {"g": jax.ShapeDtypeStruct((size,), jnp.float32)}
  choices = []
  for topology in ("ps", "ring"):
    plan = secopa.plan_for_tree(grads, num_nodes=num_devices, topology=topology,
                                cost_model=model, compressor=codec)
    compress, k = plan["['g']"]
    costs = secopa.sync_costs(size, num_nodes=num_devices, topology=topology, cost_model=model,
                              compressor=codec)
    choices.append(((costs.comp if compress else costs.orig)[k - 1], topology, compress, k))
  predicted, topology, compress, k = min(choices)
  # Each host fits its own model from its own timings: all of them run process 0's plan.
  choice = np.array([predicted, topology == "ring", compress, k], np.float64)
  predicted, ring, compress, k = multihost_utils.broadcast_one_to_all(choice).tolist()
  topology, compress, k = ("ring" if ring else "ps"), bool(compress), int(k)
  sync = GradSync(compression=codec, topology=topology, min_size=0, plan={"['g']": (compress, k)})
  label = f"{'ring' if ring else 'PS'}, K={k}" + ("" if compress else ", uncompressed")
  return sync, predicted, label


def _sync_fits(num_devices: int) -> dict[str, Any]:
  """Per compressor, the fit from whole syncs (`jlp.sync_tuning.fit_sync_costs`; K in {1, W/2,
  W}), read back from --sync_fits (one JSON per compressor) when one was made on this cluster
  and link, else timed now and saved there by host 0."""
  import jax  # pylint: disable=g-import-not-at-top
  from jlp import sync_tuning  # pylint: disable=g-import-not-at-top
  fits = {}
  cluster = f"{sync_tuning.cluster_key()} at {_LINK.value}"
  for codec in ("onebit", "tbq", "dgc"):
    path = os.path.join(_SYNC_FITS.value, f"{_LINK.value}_{codec}.json")
    fit = sync_tuning.SyncFit.load(path, cluster=cluster, compressor=codec,
                                   num_nodes=num_devices)
    if fit is None:
      sizes = tuple(cli.elements(text, "sync_fit_sizes") for text in _SYNC_FIT_SIZES.value)
      fit = sync_tuning.fit_sync_costs(codec, sizes=sizes, cluster=cluster)
      if jax.process_index() == 0:
        os.makedirs(_SYNC_FITS.value, exist_ok=True)
        fit.save(path)
    fits[codec] = fit
  return fits


def _fit_prediction(fits: dict[str, Any], case: str, size: int, num_devices: int
                    ) -> float | None:
  """The whole-sync fit's ms for a fixed row of `sync_timing.CASES` (None: no formula)."""
  if case == "float32 psum" and fits["onebit"].psum is not None:
    return fits["onebit"].psum(size)
  if case in ("float32 psum", "float32 ring"):  # a fit saved before psum was timed: the ring's
    return fits["onebit"].float32(size)
  codec, _, topology = case.partition(" ")
  if codec in fits and topology in ("PS", "ring"):
    return fits[codec].predict(f"{topology.lower()}, K={num_devices}", size)
  return None


def _host(size: int) -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax import ShapeDtypeStruct  # pylint: disable=g-import-not-at-top
  from jlp import sync_tuning  # pylint: disable=g-import-not-at-top
  from jlp.compression import base  # pylint: disable=g-import-not-at-top
  from jlp.train import distributed, sync_timing  # pylint: disable=g-import-not-at-top
  info = distributed.initialize()
  devices = info["global_devices"]
  predicted, models = _fit_and_predict(size, devices)
  fits = _sync_fits(devices)
  # The fixed rows and both fits' plans, timed together in rounds (sync_timing.time_syncs); a plan
  # that lowers to a fixed row's program takes that row's times.
  cases, plans = list(sync_timing.CASES), {}
  for codec, model in models.items():
    sync, ms, plan = planned_sync(size, devices, codec, model)
    cases.append((f"{codec} SeCoPa plan", sync))
    plans[cases[-1][0]] = {"secopa_ms": ms, "plan": plan}
  for codec, fit in fits.items():
    chosen = sync_tuning.plan_sync({"g": ShapeDtypeStruct((size,), jnp.float32)}, codec, fit)
    label = chosen.label if chosen.topology in (None, "allreduce") else \
        f"{chosen.label}, K={dict(chosen.leaf_plan)["['g']"][1]}"
    cases.append((f"{codec} plan (whole-sync fit)", chosen.grad_sync(base.get(codec))))
    plans[cases[-1][0]] = {"fit_ms": chosen.predicted_ms, "plan": label}
  rows = sync_timing.time_syncs(size, _REPEATS.value, cases)
  for row in rows:
    if row["case"] in plans:
      row.update(plans[row["case"]])
    else:
      row["secopa_ms"] = predicted.get(row["case"])
      row["fit_ms"] = _fit_prediction(fits, row["case"], size, devices)
  if info["process_index"] == 0:
    with open(_HOST_OUT.value, "w") as f:
      json.dump({"devices": info["global_devices"], "size": size, "rows": rows}, f, indent=1)


def _same_program_mark(row: dict) -> str:
  """The suffix ' (= fixed row)' of a plan row that is a fixed row's program (timed once)."""
  return f" (= {row['same_program_as']})" if row.get("same_program_as") else ""


def _table(results: dict[str, dict]) -> str:
  bandwidths = list(results)
  cases = [r["case"] for r in next(iter(results.values()))["rows"]]
  head = "| sync | " + " | ".join(f"{b}: ms (vs psum) / SeCoPa / fit" for b in bandwidths) + \
      " | wire bytes / device |"
  lines = [head, "| --- " * (len(bandwidths) + 2) + "|"]
  within = total = 0
  fit_within = fit_total = 0
  for case in cases:
    cells = []
    for b in bandwidths:
      rows = {r["case"]: r for r in results[b]["rows"]}
      row = rows[case]
      ratio = row["ms"] / rows["float32 psum"]["ms"]
      predicted = row.get("secopa_ms")
      cell = f"{row['ms']:.1f} ({ratio:.2f}×)"
      if row.get("plan"):
        cell += f" [{row['plan']}]"
      cell += _same_program_mark(row)
      cell += " / " + ("–" if predicted is None else f"{predicted:.1f}")
      # A plan that is a fixed row's program is that row's measurement: counted once, there.
      counted = not row.get("same_program_as")
      if predicted is not None and counted:
        total += 1
        within += abs(predicted - row["ms"]) <= 0.3 * row["ms"]
      fitted = row.get("fit_ms")
      cell += " / " + ("–" if fitted is None else f"{fitted:.1f}")
      if fitted is not None and counted:
        fit_total += 1
        fit_within += abs(fitted - row["ms"]) <= 0.3 * row["ms"]
      cells.append(cell)
    wire = {r["case"]: r for r in results[bandwidths[0]]["rows"]}[case]["wire_bytes"]
    lines.append(f"| {case} | " + " | ".join(cells) + f" | {wire / 1e6:.2f} MB |")
  if total:
    lines.append(f"\nPredictions within ±30 % of the measured time (target: at least 80 %; a "
                 f"plan that is a fixed row's program is counted once, in that row): "
                 f"SeCoPa with the seed's per-operation fit {within} of {total} cells "
                 f"({100 * within / total:.0f} %); with the whole-sync fit {fit_within} of "
                 f"{fit_total} ({100 * fit_within / max(fit_total, 1):.0f} %).")
  lines += ["", _plan_table(results)]
  return "\n".join(lines)


def _plan_table(results: dict[str, dict]) -> str:
  """Per compressor and bandwidth: each plan's choice and time against the fastest fixed sync
  of that compressor (its PS and ring rows, the float32 psum and ring)."""
  lines = ["| compressor | bandwidth | plan, whole-sync fit: ms | SeCoPa plan, per-operation fit: "
           "ms | fastest fixed sync: ms | plan / fastest |", "| --- | --- | --- | --- | --- | --- |"]
  for b, result in results.items():
    rows = {r["case"]: r for r in result["rows"]}
    for codec in ("onebit", "tbq", "dgc"):
      fixed = [rows[c] for c in ("float32 psum", "float32 ring", f"{codec} PS", f"{codec} ring")
               if c in rows]
      best = min(fixed, key=lambda r: r["ms"])
      plan = rows.get(f"{codec} plan (whole-sync fit)")
      seed = rows.get(f"{codec} SeCoPa plan")
      cell = lambda r: "–" if r is None else f"[{r['plan']}] {r['ms']:.1f}" + \
          _same_program_mark(r)
      ratio = "–" if plan is None else f"{plan['ms'] / best['ms']:.2f}×"
      lines.append(f"| {codec} | {b} | {cell(plan)} | {cell(seed)} | {best['case']}: "
                   f"{best['ms']:.1f} | {ratio} |")
  return "\n".join(lines)


def _plot(results: dict[str, dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  bandwidths = list(results)
  cases = [r["case"] for r in next(iter(results.values()))["rows"]]
  fig, ax = plt.subplots(figsize=(10, 4.5))
  width = 0.8 / len(bandwidths)
  for k, b in enumerate(bandwidths):
    rows = {r["case"]: r for r in results[b]["rows"]}
    ax.bar(np.arange(len(cases)) + (k - (len(bandwidths) - 1) / 2) * width,
           [rows[c]["ms"] for c in cases], width, label=b)
  ax.set_xticks(np.arange(len(cases)), cases, rotation=30, ha="right")
  ax.set_yscale("log")
  ax.set_ylabel("ms per sync (median)")
  ax.legend(title="link")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _train(bandwidth: str, name: str, args: list[str]) -> tuple[list[dict], dict]:
  """Runs experiments.train on the cluster in a fresh workdir; (metrics rows, config)."""
  import shutil  # pylint: disable=g-import-not-at-top
  from jlp.train import cluster, metrics  # pylint: disable=g-import-not-at-top
  slug = "".join(c if c.isalnum() else "_" for c in name)
  workdir = os.path.abspath(os.path.join(_WORKDIR.value, "train", f"{bandwidth}_{slug}"))
  shutil.rmtree(workdir, ignore_errors=True)
  code = cluster.launch("experiments.train",
                        [f"--config={TRAIN_CONFIG}", f"--workdir={workdir}", *args,
                         *_TRAIN_OVERRIDES.value],
                        hosts=_HOSTS.value, devices_per_host=_DEVICES.value,
                        bandwidth=bandwidth, workdir=os.path.join(workdir, "hosts"),
                        heartbeat_timeout=_HEARTBEAT_TIMEOUT.value)
  if code:  # interrupted (SIGINT / SIGTERM passed to the hosts)
    sys.exit(code)
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  return metrics.read_metrics(workdir), config


def _step_times(bandwidth: str) -> dict[str, dict]:
  """Seconds per mini-batch of data parallelism, GPipe and 1F1B on `bandwidth`."""
  from jlp.train import run_timing  # pylint: disable=g-import-not-at-top
  steps = _TRAIN_STEPS.value
  common = [f"--config.max_steps={steps}", "--config.eval_every=0", "--config.log_every=5",
            "--config.checkpoint_every=0", "--config.stop_at_accuracy=0"]
  pipelined = [f"--config.pipeline.stages={_STAGES.value}", "--config.pipeline.batches_per_call=5"]
  runs = {"data parallel, float32 ring": (["--config.grad_algorithm=ring"], 5),
          "GPipe (4 micro-batches)": (["--config.pipeline.schedule=gpipe",
                                       "--config.pipeline.microbatches=4", *pipelined], 5),
          "1F1B": (["--config.pipeline.schedule=1f1b", *pipelined], 5)}
  flush = ["--config.pipeline.microbatches=4", *pipelined]
  runs.update({
      "1F1B-flush (4 micro-batches)": (["--config.pipeline.schedule=1f1b_flush", *flush], 5),
      "ZB-H1 (4 micro-batches)": (["--config.pipeline.schedule=zb_h1", *flush], 5)})
  # v = 2 schedules need 2 * stages parts; digits_wide's MLP has 4 units (3 hidden + head), so
  # these rows train a deeper MLP (2 * stages - 1 hidden layers of 1536), GPipe on it the baseline;
  # a --train_override of the hidden layers (applied last) would replace it: then they are left out
  deep = 2 * _STAGES.value - 1
  deeper = [f"--config.model.kwargs.hidden=({'1536,' * deep})", *flush]
  if any("model.kwargs.hidden" in o for o in _TRAIN_OVERRIDES.value):
    print("the v = 2 rows (interleaved 1F1B, ZB-V) are left out: --train_override sets "
          "model.kwargs.hidden, which replaces their deeper MLP", flush=True)
  else:
    runs.update({
        f"GPipe (4 micro-batches; MLP {deep}x1536)": (["--config.pipeline.schedule=gpipe",
                                                        *deeper], 5),
        f"interleaved 1F1B v=2 (4 micro-batches; MLP {deep}x1536)": (
            ["--config.pipeline.schedule=interleaved_1f1b", "--config.pipeline.virtual_stages=2",
             *deeper], 5),
        f"ZB-V (4 micro-batches; MLP {deep}x1536)": (["--config.pipeline.schedule=zbv",
                                                      *deeper], 5)})
  out = {}
  for name, (args, warmup) in runs.items():
    rows, config = _train(bandwidth, name, common + args)
    out[name] = {"s_per_step": run_timing.seconds_per_step(rows, config["batch_size"], warmup)}
    print(f"{bandwidth}: {name} {out[name]['s_per_step']:.3f} s/step", flush=True)
  return out


def _accuracy_runs(bandwidth: str) -> dict[str, dict]:
  """Time to --target of each ACCURACY_RUNS entry on `bandwidth`."""
  from jlp.train import run_timing  # pylint: disable=g-import-not-at-top
  out = {}
  for name, args in ACCURACY_RUNS.items():
    if _ACCURACY_RUNS.value and name not in _ACCURACY_RUNS.value:
      continue
    rows, config = _train(bandwidth, name, [*args, f"--config.stop_at_accuracy={_TARGET.value}"])
    steps = run_timing.steps_to_accuracy(rows, _TARGET.value)
    # the mean up to the target: a cost only some steps carry (DiLoCo's outer syncs) counts
    per_step = run_timing.seconds_per_step_to(rows, steps, config["batch_size"],
                                              config["log_every"])
    out[name] = {"steps": steps, "s_per_step": per_step,
                 "seconds": None if steps is None else steps * per_step,
                 "curve": [(r["step"] * per_step, r["eval_accuracy"]) for r in rows
                           if r.get("eval_accuracy") is not None]}
    print(f"{bandwidth}: {name} reached {_TARGET.value} at step {steps} "
          f"({per_step:.3f} s/step)", flush=True)
  return out


def _step_table(results: dict[str, dict]) -> str:
  bandwidths = list(results)
  names = list(next(iter(results.values())))
  lines = ["| run | " + " | ".join(f"{b}: s / mini-batch (vs DP)" for b in bandwidths) + " |",
           "| --- " * (len(bandwidths) + 1) + "|"]
  for name in names:
    cells = []
    for b in bandwidths:
      base = next(iter(results[b].values()))["s_per_step"]
      t = results[b][name]["s_per_step"]
      cells.append(f"{t:.3f} ({t / base:.2f}×)")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _accuracy_table(results: dict[str, dict]) -> str:
  lines = [f"| bandwidth | run | steps to {_TARGET.value:g} | s / step | seconds to "
           f"{_TARGET.value:g} (vs float32) |", "| --- | --- | --- | --- | --- |"]
  for b, runs in results.items():
    base = runs.get("float32 ring", {}).get("seconds")
    for name, r in runs.items():
      if r["seconds"] is None:
        seconds = "not reached"
      else:
        seconds = f"{r['seconds']:.1f}" + (f" ({r['seconds'] / base:.2f}×)" if base else "")
      lines.append(f"| {b} | {name} | {r['steps']} | {r['s_per_step']:.3f} | {seconds} |")
  return "\n".join(lines)


def _plot_accuracy(results: dict[str, dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
  for ax, (b, runs) in zip(axes[0], results.items()):
    for name, r in runs.items():
      xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
      ax.plot(xs, ys, marker=".", label=name)
    ax.axhline(_TARGET.value, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training seconds (steps x mean s/step)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"digits_wide, {_HOSTS.value} hosts x {_DEVICES.value} devices, {b}")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _sync_section(size: int) -> None:
  from jlp.train import cluster  # pylint: disable=g-import-not-at-top
  results = {}
  for bandwidth in _BANDWIDTHS.value:
    out = os.path.abspath(os.path.join(_WORKDIR.value, f"{bandwidth}.json"))
    fits = os.path.abspath(_SYNC_FITS.value or os.path.join(_WORKDIR.value, "sync_fits"))
    cluster.launch("experiments.cluster_study",
                   [f"--host_out={out}", f"--size={_SIZE.value}", f"--repeats={_REPEATS.value}",
                    f"--link={bandwidth}", f"--sync_fits={fits}",
                    f"--sync_fit_sizes={','.join(_SYNC_FIT_SIZES.value)}"],
                   hosts=_HOSTS.value, devices_per_host=_DEVICES.value, bandwidth=bandwidth,
                   workdir=os.path.join(_WORKDIR.value, f"hosts_{bandwidth}"))
    with open(out) as f:
      results[bandwidth] = json.load(f)
    print(f"{bandwidth}: " + ", ".join(f"{r['case']} {r['ms']:.1f} ms"
                                         for r in results[bandwidth]["rows"]), flush=True)
  table = _table(results)
  devices = next(iter(results.values()))["devices"]
  header = (f"{_HOSTS.value} hosts x {_DEVICES.value} devices ({devices}), {size} float32 "
            f"per device, median of {_REPEATS.value}")
  with open(os.path.join(_WORKDIR.value, "sync_time.md"), "w") as f:
    f.write(header + "\n\n" + table + "\n")
  _plot(results, os.path.join(_WORKDIR.value, "sync_time.png"))
  print("\n" + header + "\n\n" + table, flush=True)


def _training_sections() -> None:
  header = f"configs/digits_wide.py on {_HOSTS.value} hosts x {_DEVICES.value} devices"
  if "pipelines" in _SECTIONS.value:
    steps = {b: _step_times(b) for b in _BANDWIDTHS.value}
    table = (f"{header}, {_TRAIN_STEPS.value} steps, {_STAGES.value} stages, median seconds per "
             "mini-batch after the first interval\n\n" + _step_table(steps))
    with open(os.path.join(_WORKDIR.value, "step_time.md"), "w") as f:
      f.write(table + "\n")
    print("\n" + table, flush=True)
  if "accuracy" in _SECTIONS.value:
    runs = {b: _accuracy_runs(b) for b in _ACCURACY_BANDWIDTHS.value}
    table = (f"{header}, evaluated every 5 steps, mean seconds per step up to the target after "
             "the first interval\n\n" + _accuracy_table(runs))
    with open(os.path.join(_WORKDIR.value, "time_to_accuracy.md"), "w") as f:
      f.write(table + "\n")
    _plot_accuracy(runs, os.path.join(_WORKDIR.value, "time_to_accuracy.png"))
    print("\n" + table, flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  size = cli.elements(_SIZE.value, "size")
  if len({cli.elements(text, "sync_fit_sizes") for text in _SYNC_FIT_SIZES.value}) < 2:
    raise app.UsageError(f"--sync_fit_sizes={','.join(_SYNC_FIT_SIZES.value)} is not allowed; "
                         "expected at least two distinct sizes.")
  for name in _ACCURACY_RUNS.value or ():
    if name not in ACCURACY_RUNS:
      raise app.UsageError(f"--accuracy_run={name!r} is not allowed; expected one of "
                           f"{list(ACCURACY_RUNS)}.")
  if _HOST_OUT.value:
    _host(size)
    return
  from jlp.train import cluster  # pylint: disable=g-import-not-at-top
  os.makedirs(_WORKDIR.value, exist_ok=True)
  try:
    if "sync" in _SECTIONS.value:
      _sync_section(size)
    _training_sections()
  except (ValueError, cluster.ClusterError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2 if isinstance(e, ValueError) else 1)

if __name__ == "__main__":
  cli.run(main)
