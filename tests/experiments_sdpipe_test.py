"""experiments.sdpipe_digits in quick mode, and jlp.studies.pipeline_study's input checks.

References: the study's structure (every sync x h in order, one evaluation per `run` call, the
untrained model first) and properties of the virtual-time model that the spec states
(sdpipe.md §1.3, §2.2, §3.1, §4): without stalls all pipelines arrive together, so every sync
takes the same virtual time and every PReduce group holds all N pipelines; with N = 2, AD-PSGD's
only matching pairs the two pipelines and both block, as AllReduce does, so the two take the same
virtual time at every h; stalls only add time.
"""

import os
import re

import pytest

from jlp import studies


@pytest.mark.slow  # 20-60 s; tests/pipeline covers the executor it drives
def test_sdpipe_digits_quick(tmp_path, capsys):
  from experiments import sdpipe_digits  # pylint: disable=g-import-not-at-top
  rows_by_layout = sdpipe_digits.run(str(tmp_path), quick=True)
  out = capsys.readouterr().out
  assert list(rows_by_layout) == [sdpipe_digits.LAYOUTS[0]]
  n, s = sdpipe_digits.LAYOUTS[0]
  rows = rows_by_layout[(n, s)]
  heteros = sdpipe_digits.QUICK_HETEROS
  assert [(r["sync"], r["hetero"]) for r in rows] == [
      (sync, h) for sync in studies.SDPIPE_SYNCS for h in heteros]
  evaluations = sdpipe_digits.QUICK_BATCHES // sdpipe_digits.QUICK_BATCHES_PER_RUN
  untrained = rows[0]["curve"][0]
  for r in rows:
    assert (r["num_pipelines"], r["num_stages"]) == (n, s)
    assert [c[0] for c in r["curve"]] == [
        k * sdpipe_digits.QUICK_BATCHES_PER_RUN for k in range(evaluations + 1)]
    assert r["curve"][0][:3] == untrained[:3]  # the same initial model for every run
    times = [c[1] for c in r["curve"]]
    assert times[0] == 0.0 and all(a < b for a, b in zip(times, times[1:]))
    assert all(0 <= c[2] <= 1 for c in r["curve"])
    assert r["losses"].shape == (sdpipe_digits.QUICK_BATCHES,) and (r["losses"] > 0).all()
    assert r["final_accuracy"] == r["curve"][-1][2] and r["virtual_s"] == times[-1]
    assert (r["mean_group_size"] is None) == (r["sync"] != "preduce")
  by = {(r["sync"], r["hetero"]): r for r in rows}
  # No stalls: the averages of allreduce, preduce (whole groups) and adpsgd (the one pair) cost
  # alike; HetPipe's push costs alpha only (beta > 0 charges every member beyond the first).
  assert len({by[sync, 0.0]["virtual_s"] for sync in ("allreduce", "preduce", "adpsgd")}) == 1
  assert by["hetpipe", 0.0]["virtual_s"] < by["allreduce", 0.0]["virtual_s"]
  assert by["preduce", 0.0]["mean_group_size"] == n
  stalled = max(heteros)
  assert 1 <= by["preduce", stalled]["mean_group_size"] < n
  for sync in studies.SDPIPE_SYNCS:
    assert by[sync, stalled]["virtual_s"] > by[sync, 0.0]["virtual_s"]
  for h in heteros:
    assert by["adpsgd", h]["virtual_s"] == by["allreduce", h]["virtual_s"]
  for sync in studies.SDPIPE_SYNCS:
    for h in heteros:
      assert re.search(rf"^\| {sync} \| {h:g} \|", out, re.M), (sync, h)
  assert "could not be retrieved" in out and "PReduce" in out
  for name in ("time_to_target.png", "accuracy_vs_virtual_time.png"):
    assert os.path.getsize(os.path.join(tmp_path, name)) > 0


def test_pipeline_study_rejects_bad_input():
  with pytest.raises(ValueError, match="syncs entry='ring' is not allowed"):
    studies.pipeline_study(syncs=["ring"])
  with pytest.raises(ValueError, match="heteros entry=-0.1 is not allowed"):
    studies.pipeline_study(heteros=[-0.1])
  with pytest.raises(ValueError, match="num_batches=25 is not allowed"):
    studies.PipelineStudy(num_batches=25, batches_per_run=12)
  with pytest.raises(ValueError, match="schedule='pipedream' is not allowed"):
    studies.PipelineStudy(schedule="pipedream")
  with pytest.raises(ValueError, match="study=3 is not allowed"):
    studies.pipeline_study(3)
