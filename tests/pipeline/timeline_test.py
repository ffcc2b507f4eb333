"""jlp.pipeline.timeline: one fill of a pipeline in virtual time, decided as the runs need it.
References: `jlp.pipeline.simulate` (the event model of a whole run of B mini-batches, written
from sdpipe.md §7.4 and tested on its own) for a fill with an end and no stalls (the two draw
their stalls differently: per op position there, per op here), and the timeline itself decided
all at once for decisions asked for piece by piece."""

import numpy as np
import pytest

from jlp.pipeline import HetPipe, Hetero, PReduce, simulate
from jlp.pipeline.simulator import SYNC_MODES
from jlp.pipeline.timeline import Timeline


def _timeline(schedule, sync, n, s, m, hetero, hetpipe=HetPipe(), total=None, seed=3):
  return Timeline(schedule, sync, n, s, m, seed=seed, hetero=hetero, preduce=PReduce(),
                  hetpipe=hetpipe, first_batch=0, start=np.zeros((n, s)), total=total)


@pytest.mark.parametrize("schedule, m", [("1f1b", 1), ("gpipe", 2)])
@pytest.mark.parametrize("sync", SYNC_MODES)
@pytest.mark.parametrize("n, s", [(2, 4), (4, 2)])
@pytest.mark.parametrize("slow", [False, True])
def test_a_fill_with_an_end_is_the_simulation_of_its_minibatches(schedule, m, sync, n, s, slow):
  """No stalls (a persistent slowdown or none): a timeline of B = 9 mini-batches with that end
  leaves every sync when `simulate` of 9 says, and forms the same groups (mixing matrices);
  HetPipe with the barrier at every third pull."""
  slowdown = tuple(tuple(1.0 + 0.7 * ((i + j) % 2) for j in range(s)) for i in range(n))
  hetero = Hetero(slowdown=slowdown if slow else None)
  hetpipe = HetPipe(barrier=True, pull_every=3)
  plan = simulate(schedule, sync, n, s, 9, m, seed=3, hetero=hetero, hetpipe=hetpipe)
  timeline = _timeline(schedule, sync, n, s, m, hetero, hetpipe, total=9)
  timeline.decide([(b, j) for b in range(9) for j in range(s)])
  np.testing.assert_array_equal(np.stack([timeline.finish[b] for b in range(9)]), plan.finish)
  np.testing.assert_array_equal(
      np.stack([[timeline.mix(b, j) for j in range(s)] for b in range(9)]), plan.mix)


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
