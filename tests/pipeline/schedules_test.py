"""Schedule tables (jlp.pipeline.schedules) against the orders written out from sdpipe.md §1.1
(Hetu's `pipedream_scheduler`) and GPipe's fill-drain (Huang et al. 2019)."""

import numpy as np
import pytest

import jlp.pipeline.schedules as sched

# 1F1B, S = 4 stages, 7 mini-batches, written by hand from the Hetu order with unit-time ops:
# stage s runs F1..F(S-s), then B1, F(S-s+1), B2, ..., then the remaining B's. 1-based here.
EXPECTED_1F1B_S4_B7 = """
F1 F2 F3 F4 .  .  .  B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
.  F1 F2 F3 .  .  B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
.  .  F1 F2 .  B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
.  .  .  F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
"""


def _cells(table: sched.Table, one_based: bool) -> list[list[str]]:
  out = []
  for s in range(table.num_stages):
    row = []
    for t in range(table.num_ticks):
      kind = table.kind[t, s]
      index = table.micro[t, s] if table.schedule == "gpipe" else table.batch[t, s]
      row.append("." if kind == sched.IDLE else
                 ("F" if kind == sched.FWD else "B") + str(index + one_based))
    out.append(row)
  return out


def test_1f1b_table_s4_b7_matches_the_hand_written_table():
  table = sched.tick_table("1f1b", 4, 7)
  assert table.num_ticks == 2 * 7 + 2 * (4 - 1) == 20
  expected = [line.split() for line in EXPECTED_1F1B_S4_B7.strip().splitlines()]
  assert _cells(table, one_based=True) == expected


@pytest.mark.parametrize("stages,batches", [(1, 3), (2, 5), (3, 1), (4, 2), (4, 7), (8, 20)])
def test_1f1b_tick_count_warmup_and_orders(stages, batches):
  table = sched.tick_table("1f1b", stages, batches)
  assert table.num_ticks == 2 * batches + 2 * (stages - 1)
  for s in range(stages):
    ops = [(int(k), int(b)) for k, b in zip(table.kind[:, s], table.batch[:, s]) if k]
    # Hetu's order, built here independently of stage_order.
    warm = min(stages - s, batches)
    expected = [(sched.FWD, b) for b in range(warm)]
    for b in range(batches):
      expected.append((sched.BWD, b))
      if warm + b < batches:
        expected.append((sched.FWD, warm + b))
    assert ops == expected


@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 4), (4, 7), (4, 8), (8, 3)])
def test_gpipe_fill_drain_ticks_and_bubble(stages, micro):
  table = sched.tick_table("gpipe", stages, 1, micro)
  assert table.num_ticks == 2 * (micro + stages - 1)
  assert sched.bubble_fraction(table) == pytest.approx((stages - 1) / (micro + stages - 1))
  for s in range(stages):
    fwd = [int(m) for k, m in zip(table.kind[:, s], table.micro[:, s]) if k == sched.FWD]
    bwd = [int(m) for k, m in zip(table.kind[:, s], table.micro[:, s]) if k == sched.BWD]
    assert fwd == list(range(micro)) and bwd == list(reversed(range(micro)))
    # forward of micro-batch m at stage s at tick m + s (fill).
    assert [int(t) for t in np.nonzero(table.kind[:, s] == sched.FWD)[0]] == \
        [m + s for m in range(micro)]


def test_dependencies_hold_in_every_table():
  for table in (sched.tick_table("1f1b", 4, 9), sched.tick_table("gpipe", 4, 1, 6),
                sched.tick_table("1f1b", 3, 2)):
    when = {}
    for t in range(table.num_ticks):
      for s in range(table.num_stages):
        if table.kind[t, s]:
          index = table.micro[t, s] if table.schedule == "gpipe" else table.batch[t, s]
          when[(int(table.kind[t, s]), int(index), s)] = t
    last = table.num_stages - 1
    for (kind, index, s), t in when.items():
      if kind == sched.FWD and s > 0:
        assert when[(sched.FWD, index, s - 1)] < t
      if kind == sched.BWD:
        before = (sched.FWD, index, s) if s == last else (sched.BWD, index, s + 1)
        assert when[before] < t


def test_render_shows_the_table():
  text = sched.tick_table("gpipe", 2, 1, 2).render()
  assert text.splitlines()[0].split()[2:] == ["F0", "F1", ".", ".", "B1", "B0"]


@pytest.mark.parametrize("args,field", [
    (("zb", 4, 1, 1), "schedule"), (("1f1b", 0, 1, 1), "num_stages"),
    (("1f1b", 4, 0, 1), "num_batches"), (("gpipe", 4, 1, 0), "num_microbatches"),
    (("1f1b", 4, 2, 3), "num_microbatches"), (("gpipe", 4, 2, 3), "num_batches"),
    (("1f1b", True, 2, 1), "num_stages")])
def test_bad_arguments_are_rejected(args, field):
  with pytest.raises(ValueError, match=field):
    sched.tick_table(*args)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_runs_of_any_lengths_lay_out_one_table(num_stages):
  """Runs of 1F1B with no end, cut at the forwards of stage 0 (continuous_1f1b) and completed by
  drain_1f1b, concatenate to the table of all the mini-batches, tick for tick, for every split
  of 0..23 mini-batches tried (one run, runs of 1, a run of 5 then the rest, uneven runs)."""
  for total in (1, 5, 9, 23):
    whole = sched.tick_table("1f1b", num_stages, total)
    for lengths in ([total], [1] * total, [min(5, total), total - min(5, total)], [2, 7, 14]):
      lengths = [n for n in lengths if n] if sum(lengths) == total else [total]
      parts, first = [], 0
      for n in lengths:
        parts.append(sched.continuous_1f1b(num_stages, first, n))
        first += n
      parts.append(sched.drain_1f1b(num_stages, total))
      kind = np.concatenate([p.kind for p in parts])
      batch = np.concatenate([p.batch for p in parts])
      np.testing.assert_array_equal(kind, whole.kind, err_msg=f"{num_stages} {lengths}")
      np.testing.assert_array_equal(batch, whole.batch, err_msg=f"{num_stages} {lengths}")
