"""SD-PIPE's group scheduler alone (jlp.pipeline.preduce.Scheduler), driven by hand without the
event engine: every expected group, time and wait is worked out in the comments from the rules of
the module docstring (sdpipe.md §2.1-2.2), with group costs cost_s[m] given literally."""

import pytest

from jlp.pipeline.costs import PReduce
from jlp.pipeline.preduce import (FORCED, ORDINARY, Deadline, Departure, Group, Outcome,
                                  Scheduler)

# cost_s[m]: seconds a group of m members takes to average (alpha 1 ms + beta 0.5 ms (m - 1)).
COST_S = [0.0, 0.001, 0.0015, 0.002, 0.0025]


def test_arrivals_in_one_window_form_one_group_that_leaves_at_close_plus_cost():
  # N=4, S=1, wait_ms_init 1 ms. Pipeline 2 (update 3) opens window 1 at t=1.0: deadline
  # 1.0 + 1000 us = 1.001. Pipelines 0 (update 4) and 1 (update 3) join before it; nobody closes
  # early (max_group = N = 4). The deadline closes the window: one group (0, 1, 2), sorted, round
  # max(4, 3, 3) = 4; each member leaves at 1.001 + cost_s[3] = 1.003, its wait x 0.9 = 0.9 ms.
  scheduler = Scheduler(PReduce(), 4, 1, 10, COST_S)
  opened = scheduler.arrive(2, 0, 3, 1.0)
  assert opened.departures == [] and opened.windows == []
  [deadline] = opened.deadlines
  assert (deadline.stage, deadline.window_id) == (0, 1)
  assert deadline.time == pytest.approx(1.001, abs=1e-12)
  assert scheduler.arrive(0, 0, 4, 1.0002) == Outcome()
  assert scheduler.arrive(1, 0, 3, 1.0005) == Outcome()
  closed = scheduler.deadline(0, 1, 1.001)
  assert closed.deadlines == []
  assert closed.windows == [(Group((0, 1, 2), 0, 4, 1.0, 1.001, ORDINARY),)]
  assert [(i, s, b) for i, s, b, _ in closed.departures] == [(0, 0, 4), (1, 0, 3), (2, 0, 3)]
  assert [d.time for d in closed.departures] == pytest.approx([1.003] * 3, abs=1e-12)
  assert [row[0] for row in scheduler.wait_ms] == pytest.approx([0.9, 0.9, 0.9, 1.0])
  assert scheduler.deadline(0, 1, 1.001) == Outcome()  # that window has closed already

  # max_group=2 (N=3): the second arrival closes the window at once, at its own time 0.0004;
  # both leave at 0.0004 + cost_s[2] = 0.0019.
  scheduler = Scheduler(PReduce(max_group=2), 3, 1, 10, COST_S)
  assert scheduler.arrive(0, 0, 0, 0.0).deadlines == [Deadline(0.001, 0, 1)]
  closed = scheduler.arrive(1, 0, 0, 0.0004)
  assert closed.windows == [(Group((0, 1), 0, 0, 0.0, 0.0004, ORDINARY),)]
  assert closed.departures == [Departure(0, 0, 0, pytest.approx(0.0019, abs=1e-12)),
                               Departure(1, 0, 0, pytest.approx(0.0019, abs=1e-12))]


def test_a_lone_arrival_grows_its_wait_up_to_the_cap_and_a_group_shrinks_it():
  # N=2, S=1. Pipeline 0 arrives alone at t = 0, 1, ..., 5 s; each window times out with the
  # one member (< alone_below = 2), so its wait goes x2 up to 10 ms: the windows last 1, 2, 4, 8,
  # 10, 10 ms, and it leaves at the deadline + cost_s[1] = 1 ms.
  scheduler = Scheduler(PReduce(), 2, 1, 100, COST_S)
  for k, wait_ms in enumerate([1, 2, 4, 8, 10, 10]):
    t = float(k)
    [deadline] = scheduler.arrive(0, 0, k, t).deadlines
    assert deadline.window_id == k + 1
    assert deadline.time == pytest.approx(t + wait_ms / 1000, abs=1e-12)
    closed = scheduler.deadline(0, deadline.window_id, deadline.time)
    assert closed.windows == [(Group((0,), 0, k, t, deadline.time, ORDINARY),)]
    assert closed.departures == [Departure(0, 0, k, pytest.approx(deadline.time + 0.001))]
  assert scheduler.wait_ms == [[10.0], [1.0]]
  # Both arrive within pipeline 0's 10 ms window: a group of 2 (= max_group = N) closes at the
  # second arrival; both waits x 0.9: 9 ms and 0.9 ms.
  scheduler.arrive(0, 0, 6, 10.0)
  closed = scheduler.arrive(1, 0, 0, 10.0005)
  assert closed.windows == [(Group((0, 1), 0, 6, 10.0, 10.0005, ORDINARY),)]
  assert scheduler.wait_ms == [[pytest.approx(9.0)], [pytest.approx(0.9)]]


def test_a_disconnected_union_graph_after_a_period_forces_a_window_until_connected():
  # N=3, S=1, connect_every=1: a period is 3 members. Window 1: {0, 1} (2 members), window 2: {2}
  # alone (3 members: the period is crossed, every pipeline has arrived, union graph {0, 1}, {2}).
  # Window 3, opened by pipeline 0 at 0.02, is forced: no deadline; pipeline 1 joining at 0.5
  # (long past any 1-10 ms window) leaves the graph disconnected; pipeline 2 at 0.9 connects it
  # and closes the window: group (0, 1, 2), round 1, leaving at 0.9 + cost_s[3] = 0.902.
  scheduler = Scheduler(PReduce(connect_every=1), 3, 1, 100, COST_S)
  scheduler.arrive(0, 0, 0, 0.0)
  scheduler.arrive(1, 0, 0, 0.0002)
  assert scheduler.deadline(0, 1, 0.001).windows == [(Group((0, 1), 0, 0, 0.0, 0.001, ORDINARY),)]
  [deadline] = scheduler.arrive(2, 0, 0, 0.01).deadlines
  assert deadline.window_id == 2 and deadline.time == pytest.approx(0.011, abs=1e-12)
  assert scheduler.deadline(0, 2, deadline.time).windows == [
      (Group((2,), 0, 0, 0.01, deadline.time, ORDINARY),)]
  assert scheduler.arrive(0, 0, 1, 0.02) == Outcome()  # forced: no deadline asked
  assert scheduler.owner == 0  # the stage holding the forced window
  assert scheduler.arrive(1, 0, 1, 0.5) == Outcome()
  closed = scheduler.arrive(2, 0, 1, 0.9)
  assert closed.windows == [(Group((0, 1, 2), 0, 1, 0.02, 0.9, FORCED),)]
  assert closed.departures == [Departure(i, 0, 1, pytest.approx(0.902, abs=1e-12))
                               for i in range(3)]
  assert scheduler.owner == -1
