"""jlp.pipeline.timeline: one fill of a pipeline in virtual time, decided as the runs need it.
The engine's rules with an end are tested through `jlp.pipeline.simulate` (simulator_test.py,
expectations worked out from sdpipe.md §7.4); here the references are the timeline itself
decided all at once (for decisions asked for piece by piece) and the timeline with an end (what
it shares with the never-ending one)."""

import numpy as np
import pytest

from jlp.pipeline import HetPipe, Hetero, PReduce
from jlp.pipeline.preduce import FORCED
from jlp.pipeline.schedules import FWD
from jlp.pipeline.simulator import SYNC_MODES, simulate
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


SLOW = Hetero(slowdown=((1.0,) * 4, (2.0,) * 4))  # N = 2, S = 4: pipeline 1 twice as slow
SLOW_ODD = Hetero(slowdown=((1.0,) * 4, (2.0,) * 4) * 2)  # N = 4: pipelines 1 and 3


@pytest.mark.parametrize("sync", ["none", "preduce", "adpsgd", "hetpipe", "allreduce"])
def test_gpipe_pipelines_run_in_lockstep(sync):
  """GPipe (N = 4, S = 4, M = 2; N = 4 so that AD-PSGD's pairs change from round to round) with
  pipelines 1 and 3 twice as slow, 20 mini-batches: the executor runs mini-batch b's table on
  every pipeline between the updates of b - 1 and b, so no (pipeline, stage) starts an op of
  mini-batch b before every (pipeline, stage) has left the sync of update b - 1, the fast
  pipelines' clocks at every update are past everyone's previous update (they wait for the slow
  ones instead of running ahead), and every group (preduce, adpsgd) holds its members at one
  update, its round, where the executor applies it. PReduce's forced windows (periods of 10 N
  members) close within their round. allreduce is the control: it ran in lockstep already."""
  timeline = Timeline("gpipe", sync, 4, 4, 2, seed=3, hetero=SLOW_ODD, preduce=PReduce(),
                      hetpipe=HetPipe(pull_every=3), first_batch=0, start=np.zeros((4, 4)),
                      log=True)
  timeline.decide([(b, s) for b in range(20) for s in range(4)])
  ops = np.zeros(20, int)
  for event in timeline.log:
    if event[0] == "op":
      _, _, _, (_, b, _), start, _ = event
      if b >= 1:
        assert start >= timeline.time(b - 1), (event, timeline.time(b - 1))
      if b < 20:
        ops[b] += 1
  assert list(ops) == [4 * 4 * 2 * 2] * 20  # every op of the 20 mini-batches ran
  for b in range(1, 20):
    assert np.all(timeline.finish[b] > timeline.time(b - 1)), b
  # The fast pipelines wait for the slow ones: their updates come as often.
  assert timeline.finish[19][[0, 2]].min() > timeline.time(18)
  groups = [event[1:] for event in timeline.log if event[0] == "group"]
  for group, updates in groups:
    assert set(updates.values()) == {group.round}, (group, updates)
  if sync in ("preduce", "adpsgd"):
    assert any(len(group.members) >= 2 for group, _ in groups)
  if sync == "preduce":
    assert any(group.kind == FORCED for group, _ in groups)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_a_gpipe_stall_costs_its_minibatch_stage_and_direction_one_delay_whatever_m(m):
  """Stalls of 0.05 s with probability 0.3, sync none, N = 2, S = 3, 12 mini-batches: the M
  micro-batch forwards (backwards) of mini-batch b at a stage take together their base cost plus
  0 or exactly delay_s, and the stalled (pipeline, stage, mini-batch, direction)s are those of
  1F1B under the same seed (one draw each, op id 2b or 2b + 1), so GPipe against 1F1B under
  stalls does not depend on M."""
  hetero = Hetero(delay_s=0.05, probability=0.3)

  def extra_time(schedule, num_microbatches):
    timeline = Timeline(schedule, "none", 2, 3, num_microbatches, seed=5, hetero=hetero,
                        preduce=PReduce(), hetpipe=HetPipe(), first_batch=0,
                        start=np.zeros((2, 3)), log=True)
    timeline.decide([(b, s) for b in range(12) for s in range(3)])
    extra = {}
    for event in timeline.log:
      if event[0] == "op" and event[3][1] < 12:
        _, i, s, (kind, b, _), start, end = event
        base = (hetero.fwd_s if kind == FWD else hetero.bwd_s) / num_microbatches
        extra[(i, s, b, kind)] = extra.get((i, s, b, kind), 0.0) + (end - start - base)
    assert len(extra) == 2 * 3 * 12 * 2
    return extra

  extra = extra_time("gpipe", m)
  for key, seconds in extra.items():
    assert np.isclose(seconds, 0.0, atol=1e-9) or np.isclose(seconds, 0.05, atol=1e-9), key
  stalled = {key for key, seconds in extra.items() if seconds > 0.025}
  assert stalled == {key for key, seconds in extra_time("1f1b", 1).items() if seconds > 0.025}
  assert 0.15 < len(stalled) / len(extra) < 0.45


@pytest.mark.parametrize("sync", ["none", "hetpipe"])
def test_a_gpipe_fill_from_the_clocks_another_left_continues_its_lockstep(sync):
  """No stalls, pipeline 1 twice as slow: GPipe's 10 mini-batches simulated at once, or 6 and
  then 4 from the clocks the first 6 left (`start` = finish[-1], which differ per pipeline), give
  the same times: a fill's first mini-batch starts everywhere at the latest clock, where the
  barrier after the previous update puts it."""
  hetpipe = HetPipe(pull_every=3)
  whole = simulate("gpipe", sync, 2, 4, 10, 2, hetero=SLOW, hetpipe=hetpipe)
  first = simulate("gpipe", sync, 2, 4, 6, 2, hetero=SLOW, hetpipe=hetpipe)
  assert len(np.unique(first.finish[-1])) > 1
  rest = simulate("gpipe", sync, 2, 4, 4, 2, hetero=SLOW, hetpipe=hetpipe, first_batch=6,
                  start=first.finish[-1])
  np.testing.assert_array_equal(np.concatenate([first.finish, rest.finish]), whole.finish)


def test_gpipe_pipelines_share_their_counts():
  """GPipe's pipelines run in lockstep, so a timeline with per-pipeline counts is refused."""
  with pytest.raises(ValueError, match=r"first_batch=\[1, 0\].*schedule='gpipe'"):
    Timeline("gpipe", "none", 2, 2, 2, seed=0, hetero=Hetero(), preduce=PReduce(),
             hetpipe=HetPipe(), first_batch=[1, 0], start=np.zeros((2, 2)))
