"""SeCoPa fitted from whole syncs on the namespaced cluster (the multi-host tier: root, iproute2):
2 hosts x 2 devices at 100 Mbit/s, a 256K-element gradient. For each compressor the planned sync
is within 1.3x of the fastest fixed sync of that compressor (float32 psum and ring, its PS and
ring), and picks the faster topology wherever one is 1.5x faster; the fits are saved and a second
study on the same cluster and link reuses them instead of timing again."""

import json
import os
import subprocess
import sys

import pytest

from jlp.train import cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEEDS_ROOT = pytest.mark.skipif(not cluster.can_make_namespaces(),
                                reason="needs root (or CAP_NET_ADMIN), iproute2 and unshare")


def _study(workdir, fits):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-m", "experiments.cluster_study", "--sections=sync",
                        "--hosts=2", "--devices_per_host=2", "--bandwidths=100mbit",
                        "--size=256K", "--repeats=3", f"--sync_fits={fits}",
                        "--sync_fit_sizes=64K,256K,1M",
                        f"--workdir={workdir}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-2000:]
  return {r["case"]: r for r in json.load(open(os.path.join(workdir, "100mbit.json")))["rows"]}


@pytest.mark.slow
@NEEDS_ROOT
def test_the_plan_is_the_fastest_sync_on_the_cluster_and_its_fit_is_reused(tmp_path):
  fits = tmp_path / "fits"
  rows = _study(tmp_path / "a", fits)
  for codec in ("onebit", "tbq", "dgc"):
    fixed = {c: rows[c]["ms"] for c in ("float32 psum", "float32 ring", f"{codec} PS",
                                         f"{codec} ring")}
    plan = rows[f"{codec} plan (whole-sync fit)"]
    assert plan["ms"] <= 1.3 * min(fixed.values()), (codec, plan, fixed)
    ps, ring = fixed[f"{codec} PS"], fixed[f"{codec} ring"]
    if max(ps, ring) >= 1.5 * min(ps, ring) and min(ps, ring) < min(fixed["float32 psum"],
                                                                    fixed["float32 ring"]):
      assert plan["plan"].startswith("ps" if ps < ring else "ring"), (codec, plan, fixed)
  saved = sorted(os.listdir(fits))
  assert saved == ["100mbit_dgc.json", "100mbit_onebit.json", "100mbit_tbq.json"]
  stamps = {f: os.stat(fits / f).st_mtime_ns for f in saved}
  again = _study(tmp_path / "b", fits)
  assert {f: os.stat(fits / f).st_mtime_ns for f in saved} == stamps  # read, not re-timed
  for codec in ("onebit", "tbq", "dgc"):
    assert again[f"{codec} plan (whole-sync fit)"]["fit_ms"] == pytest.approx(
        rows[f"{codec} plan (whole-sync fit)"]["fit_ms"])
