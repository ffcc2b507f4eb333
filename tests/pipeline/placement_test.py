"""jlp.pipeline.placement: the ticks keep what the virtual-time timeline says happened before what,
checked event by event against the timeline's own record (not against the placement's edges)."""

import numpy as np
import pytest

from jlp.pipeline import schedules as sched
from jlp.pipeline.costs import HetPipe, Hetero, PReduce
from jlp.pipeline.placement import Placement
from jlp.pipeline.timeline import Timeline

N, S = 4, 3


def _placed(sync, hetero, runs=6, per_run=4):
  n = N
  timeline = Timeline("1f1b", sync, n, S, 1, seed=3, hetero=hetero, preduce=PReduce(),
                      hetpipe=HetPipe(pull_every=2), first_batch=0, start=np.zeros((n, S)),
                      log=True)
  placement = Placement(timeline, aligned=sync == "allreduce")
  ticks, offset = {}, 0
  for r in range(1, runs + 1):
    nodes = placement.take(placement.chunk_cut(r * per_run * n))
    local = placement.local_ticks(nodes)
    ticks.update({node: offset + t for node, t in local.items()})
    offset += max(local.values()) + 1
  return timeline, placement, ticks, n


@pytest.mark.parametrize("sync", ["none", "allreduce", "preduce", "adpsgd", "hetpipe"])
@pytest.mark.parametrize("hetero", [Hetero(delay_s=0.04, probability=0.3),
                                    Hetero(slowdown=((1.0,) * S, (2.0,) * S, (1.3,) * S,
                                                     (1.0,) * S))])
def test_ticks_keep_the_timelines_order(sync, hetero):
  timeline, placement, ticks, n = _placed(sync, hetero)
  ops = {node: placement.times[node] for node in ticks if node[0] == "op"}
  # A device runs its ops in its order, one per tick.
  for i in range(n):
    for s in range(S):
      mine = sorted((ops[node][0], ticks[node]) for node in ops if node[1:3] == (i, s))
      assert all(a[1] < b[1] for a, b in zip(mine, mine[1:]))
  # A forward after its input's forward, a backward after its gradient's backward.
  for node, t in ticks.items():
    if node[0] != "op":
      continue
    _, i, s, k, m = node
    other = ("op", i, s - 1, k, m) if k == sched.FWD else ("op", i, s + 1, k, m)
    if other in ticks:
      assert ticks[other] < t
  log = timeline.log
  if sync == "allreduce":
    for s in range(S):
      for m in range(5):
        assert len({ticks[("op", i, s, sched.BWD, m)] for i in range(n)}) == 1
  if sync in ("preduce", "adpsgd"):
    groups = [(e[1], e[2]) for e in log if e[0] == "group"]
    assert groups
    for (group, updates), (_, node) in zip(groups, placement.groups):
      if node not in ticks:
        continue
      for i in group.members:
        update = ("op", i, group.stage, sched.BWD, updates[i])
        assert ticks[update] <= ticks[node]
        later = [t for nd, t in ticks.items() if nd[0] == "op" and nd[1:3] == (i, group.stage)
                 and ops[nd][0] >= group.closed]
        assert all(t > ticks[node] for t in later)
  if sync == "hetpipe":
    pushes = [(e[4], e[1], e[2], e[3]) for e in log if e[0] == "arrive"]
    pulls = [(e[4], e[1], e[2], e[3]) for e in log if e[0] == "pull"]
    assert pulls
    for time, i, s, m in pulls:
      pull = ("pull", i, s, m)
      if pull not in ticks:
        continue
      for arrival, j, s2, m2 in pushes:
        push = ("op", j, s2, sched.BWD, m2)
        if s2 != s or push not in ticks:
          continue
        if arrival <= time:
          assert ticks[push] <= ticks[pull]
        else:
          assert ticks[push] > ticks[pull]


def test_a_slow_pipeline_takes_fewer_chunks():
  _, placement, _, _ = _placed("none", Hetero(slowdown=((1.0,) * S, (2.0,) * S, (1.0,) * S,
                                                       (1.0,) * S)))
  placement.chunk_cut(6 * 4 * N)
  taken = np.bincount([i for i, _ in placement.chunks_between(0, 6 * 4 * N)], minlength=N)
  assert taken[1] < 0.65 * taken[0] and max(taken[[0, 2, 3]]) - min(taken[[0, 2, 3]]) <= 1
