"""jlp.pipeline.timeline: one fill of a pipeline in virtual time, decided as the runs need it.
The engine's rules with an end are tested through `jlp.pipeline.simulate` (simulator_test.py,
expectations worked out from sdpipe.md §7.4); here the references are the timeline itself
decided all at once (for decisions asked for piece by piece) and the timeline with an end (what
it shares with the never-ending one)."""

import numpy as np
import pytest

from jlp.pipeline import HetPipe, Hetero, PReduce
from jlp.pipeline.simulator import SYNC_MODES
from jlp.pipeline.timeline import Timeline


def _timeline(schedule, sync, n, s, m, hetero, hetpipe=HetPipe(), total=None, seed=3):
  return Timeline(schedule, sync, n, s, m, seed=seed, hetero=hetero, preduce=PReduce(),
                  hetpipe=hetpipe, first_batch=0, start=np.zeros((n, s)), total=total)


@pytest.mark.parametrize("schedule, m", [("1f1b", 1), ("gpipe", 2)])
@pytest.mark.parametrize("sync", SYNC_MODES)
def test_decisions_do_not_depend_on_how_they_are_asked_for(schedule, m, sync):
  """With stalls (0.05 s at probability 0.3) and no end: asking for the updates of mini-batches
  0..29 in pieces of 1, 3 or 7 mini-batches, or all at once, gives the same leave times and
  groups, every one of them."""
  hetero = Hetero(delay_s=0.05, probability=0.3)
  whole = _timeline(schedule, sync, 4, 2, m, hetero)
  whole.decide([(b, j) for b in range(30) for j in range(2)])
  for piece in (1, 3, 7):
    parts = _timeline(schedule, sync, 4, 2, m, hetero)
    for first in range(0, 30, piece):
      parts.decide([(b, j) for b in range(first, min(first + piece, 30)) for j in range(2)])
    for b in range(30):
      np.testing.assert_array_equal(parts.finish[b], whole.finish[b])
      for j in range(2):
        np.testing.assert_array_equal(parts.mix(b, j), whole.mix(b, j))
  if sync in ("preduce", "adpsgd"):
    decided = [g for g in whole.groups if g.round < 20]
    assert decided and any(len(g.members) > 1 for g in decided)


def test_an_end_changes_only_what_comes_after_the_last_forward():
  """1F1B under stalls: the fill that ends at 12 mini-batches agrees with the endless one on
  every update that precedes, at its stage, the first forward left out (mini-batch 12's), and
  its drain finishes no later."""
  hetero = Hetero(delay_s=0.05, probability=0.3)
  endless = _timeline("1f1b", "allreduce", 2, 4, 1, hetero)
  ended = _timeline("1f1b", "allreduce", 2, 4, 1, hetero, total=12)
  endless.decide([(b, j) for b in range(12) for j in range(4)])
  ended.decide([(b, j) for b in range(12) for j in range(4)])
  for j in range(4):
    for b in range(12 - (4 - j)):  # B(b) at stage j comes before F(12) iff b < 12 - (S - j)
      np.testing.assert_array_equal(ended.finish[b][:, j], endless.finish[b][:, j])
  assert ended.time(11) <= endless.time(11)


def test_hetpipe_barrier_meets_at_the_same_pull_whatever_each_pipelines_count():
  """After a flush the pipelines may have trained different numbers of mini-batches (7 and 6):
  with pull_every = 3 pipeline 0 pulls after its updates 1, 4, ... of the fill and pipeline 1
  after 2, 5, ...; the barrier of every pull gathers both at their own update of that pull, and
  every (pipeline, stage) leaves it at one time."""
  timeline = Timeline("1f1b", "hetpipe", 2, 2, 1, seed=0, hetero=Hetero(), preduce=PReduce(),
                      hetpipe=HetPipe(pull_every=3, barrier=True), first_batch=[7, 6],
                      start=np.zeros((2, 2)), log=True)
  timeline.decide([(b, s) for b in range(9) for s in range(2)])
  pulls = {}
  for event in timeline.log:
    if event[0] == "pull":
      _, i, s, b, t = event
      pulls.setdefault(((7, 6)[i] + b + 1) // 3, []).append((i, s, b, t))
  assert sorted((i, b) for i, s, b, _ in pulls[3] if s == 0) == [(0, 1), (1, 2)]
  for members in pulls.values():
    if len(members) == 4:
      assert len({t for *_, t in members}) == 1
  assert sum(len(m) == 4 for m in pulls.values()) >= 2
