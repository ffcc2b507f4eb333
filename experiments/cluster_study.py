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
once per compressor) and predicts each sync with it. Writes WORKDIR/<bandwidth>.json
(host 0's rows), WORKDIR/sync_time.md (the table: median ms per sync and bandwidth, ratio to
float32 psum, SeCoPa's prediction, wire bytes per device) and WORKDIR/sync_time.png. Needs root (see
`experiments.cluster`); without it the hosts share localhost and only `none` runs.
"""

import json
import os
import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", "out/cluster_study", "Where results go.")
_HOSTS = flags.DEFINE_integer("hosts", 4, "Host processes.")
_DEVICES = flags.DEFINE_integer("devices_per_host", 2, "Emulated CPU devices per host.")
_BANDWIDTHS = flags.DEFINE_list("bandwidths", ["100mbit", "1gbit", "none"],
                                "Link bandwidths (tc rates) or none.")
_SIZE = flags.DEFINE_string("size", "4M", "Gradient elements per device (K/M suffixes).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per sync (median).")
_HOST_OUT = flags.DEFINE_string("host_out", None, "Internal: run as a host, write rows here.")


def _elements(text: str) -> int:
  scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
  number = text[:-1] if scale > 1 else text
  if not number.isdigit() or int(number) < 1:
    raise app.UsageError(f"--size={text!r} is not allowed; expected a positive integer with an "
                         "optional K or M suffix.")
  return int(number) * scale


FIT_SIZES = (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18)


def _predictions(size: int, num_devices: int) -> dict[str, float]:
  """SeCoPa's predicted ms per case, from cost models fitted here (one per compressor: its
  encode and decode; the collectives the same), K = W partitions as the syncs use; the float32
  rows are its uncompressed ring formula; the e4m3 rows have no SeCoPa formula."""
  from jlp.compression import profile, secopa  # pylint: disable=g-import-not-at-top
  out = {}
  for codec in ("onebit", "tbq", "dgc"):
    model = profile.fit_cost_model(sizes=FIT_SIZES, compressor=codec, repeats=3)
    for topology, label in (("ps", "PS"), ("ring", "ring")):
      costs = secopa.sync_costs(size, num_nodes=num_devices, topology=topology, cost_model=model,
                                compressor=codec)
      out[f"{codec} {label}"] = costs.comp[num_devices - 1]
    ring = secopa.sync_costs(size, num_nodes=num_devices, topology="ring", cost_model=model)
    out.setdefault("float32 psum", ring.orig[num_devices - 1])
    out.setdefault("float32 ring", ring.orig[num_devices - 1])
  return out


def _host(size: int) -> None:
  from jlp.train import distributed, sync_timing  # pylint: disable=g-import-not-at-top
  info = distributed.initialize()
  rows = sync_timing.time_syncs(size, _REPEATS.value)
  predicted = _predictions(size, info["global_devices"])
  for row in rows:
    row["secopa_ms"] = predicted.get(row["case"])
  if info["process_index"] == 0:
    with open(_HOST_OUT.value, "w") as f:
      json.dump({"devices": info["global_devices"], "size": size, "rows": rows}, f, indent=1)


def _table(results: dict[str, dict]) -> str:
  bandwidths = list(results)
  cases = [r["case"] for r in next(iter(results.values()))["rows"]]
  head = "| sync | " + " | ".join(f"{b}: ms (vs psum) / SeCoPa" for b in bandwidths) + \
      " | wire bytes / device |"
  lines = [head, "| --- " * (len(bandwidths) + 2) + "|"]
  within = total = 0
  for case in cases:
    cells = []
    for b in bandwidths:
      rows = {r["case"]: r for r in results[b]["rows"]}
      row = rows[case]
      ratio = row["ms"] / rows["float32 psum"]["ms"]
      predicted = row.get("secopa_ms")
      cell = f"{row['ms']:.1f} ({ratio:.2f}×)"
      if predicted is not None:
        cell += f" / {predicted:.1f}"
        total += 1
        within += abs(predicted - row["ms"]) <= 0.3 * row["ms"]
      cells.append(cell)
    wire = {r["case"]: r for r in results[bandwidths[0]]["rows"]}[case]["wire_bytes"]
    lines.append(f"| {case} | " + " | ".join(cells) + f" | {wire / 1e6:.2f} MB |")
  if total:
    lines.append(f"\nSeCoPa's prediction within ±30 % of the measured time: {within} of {total} "
                 f"cells ({100 * within / total:.0f} %; target: at least 80 %).")
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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  size = _elements(_SIZE.value)
  if _HOST_OUT.value:
    _host(size)
    return
  from jlp.train import cluster  # pylint: disable=g-import-not-at-top
  os.makedirs(_WORKDIR.value, exist_ok=True)
  results = {}
  for bandwidth in _BANDWIDTHS.value:
    out = os.path.abspath(os.path.join(_WORKDIR.value, f"{bandwidth}.json"))
    try:
      cluster.launch("experiments.cluster_study",
                     [f"--host_out={out}", f"--size={_SIZE.value}",
                      f"--repeats={_REPEATS.value}"],
                     hosts=_HOSTS.value, devices_per_host=_DEVICES.value, bandwidth=bandwidth,
                     workdir=os.path.join(_WORKDIR.value, f"hosts_{bandwidth}"))
    except (ValueError, cluster.ClusterError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2 if isinstance(e, ValueError) else 1)
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
  print("\n" + header + "\n\n" + table)


if __name__ == "__main__":
  app.run(main)
