"""Flush schedules as data (jlp.pipeline.schedule_data): torch's compute-only CSV, its validator's
rules plus the cross-stage ones, the named generators, and the counted bubble and activations
against the closed forms (GPipe, Huang et al. 2019; PipeDream-Flush, Narayanan et al. 2021;
interleaved 1F1B, Megatron; ZB-H1 / ZB-V, Qi et al. ICLR 2024)."""

import pathlib

import pytest

import jlp.pipeline as pipeline
from jlp.pipeline.schedule_data import (FLUSH_SCHEDULES, Action, Overlap, Schedule, bubble,
                                        parse_action, peak_inflight)

DATA = pathlib.Path(__file__).parent / "data"

# Copied from pytorch/pytorch, test/distributed/pipelining/artifacts/dualpipev_4rank_10mb.csv
# (commit a2af973f46e7172e0494afebc88090d1a07eae66): torch's regression artifact of
# ScheduleDualPipeV with 4 ranks and 10 micro-batches (its test_csv_compare).
TORCH_DUALPIPEV_4RANK_10MB = DATA / "dualpipev_4rank_10mb.csv"

GRID = [(1, 1), (1, 3), (2, 2), (2, 5), (3, 4), (4, 1), (4, 3), (4, 8), (4, 10), (5, 16)]


def _named(name, d, m, **kw):
  return Schedule.named(name, d, m, **kw)


def _cases():
  for name in FLUSH_SCHEDULES:
    for d, m in GRID:
      if name == "dualpipev" and (m % 2 or m < 2 * d):
        continue
      if name == "interleaved_1f1b" and m % max(1, m // d):
        continue
      yield name, d, m


# ---- actions and CSV ----------------------------------------------------------------------------


def test_cells_parse_and_print_as_torch_writes_them():
  assert parse_action("0F3") == Action("F", 0, 3)
  assert parse_action("7I0") == Action("I", 7, 0)
  assert parse_action("7W0") == Action("W", 7, 0)
  assert parse_action("12B5") == Action("B", 12, 5)
  assert parse_action("") is None and parse_action(" ") is None
  pair = parse_action("(0F7;7B3)OVERLAP_F_B")
  assert pair == Overlap(Action("F", 0, 7), Action("B", 7, 3))
  assert str(pair) == "(0F7;7B3)OVERLAP_F_B" and str(Action("I", 7, 0)) == "7I0"
  for bad in ("0X3", "0F", "3SEND_F1", "1UNSHARD", "(0F7)OVERLAP_F_B", "(0B7;7F3)OVERLAP_F_B"):
    with pytest.raises(ValueError):
      parse_action(bad)


def test_torch_dualpipev_artifact_round_trips_and_is_what_the_generator_orders():
  text = TORCH_DUALPIPEV_4RANK_10MB.read_text()
  s = Schedule.from_torch_csv(text)
  assert s.to_torch_csv() == text
  assert (s.num_devices, s.num_stages, s.num_microbatches) == (4, 8, 10)
  assert s.placement == (0, 1, 2, 3, 3, 2, 1, 0)  # the V
  s.validate(ticks=False)  # torch's rules, and its per-device orders run without deadlock
  with pytest.raises(ValueError, match=r"^device 1, tick 0, action 1F0: needs 0F0"):
    s.validate()  # torch packs its orders without idle ticks: not a tick table
  generated = _named("dualpipev", 4, 10)
  assert generated.orders() == s.orders()
  assert Schedule.from_orders(s.orders()) == generated
  assert bubble(s) == pytest.approx(bubble(generated))


def test_ragged_rows_and_idle_cells_round_trip():
  text = ",0F0,,0B0\n\n1F0,1B0\n"
  s = Schedule.from_torch_csv(text)
  assert s.ticks[0] == (None, Action("F", 0, 0), None, Action("B", 0, 0)) and s.ticks[1] == ()
  assert s.to_torch_csv() == text


@pytest.mark.parametrize("name,d,m", list(_cases()))
def test_every_named_schedule_validates_and_round_trips_through_csv(name, d, m):
  s = _named(name, d, m)
  s.validate()
  s.validate(ticks=False)
  v = 2 if name in ("interleaved_1f1b", "zbv", "dualpipev") else 1
  assert (s.num_devices, s.num_stages, s.num_microbatches) == (d, v * d, m)
  back = Schedule.from_torch_csv(s.to_torch_csv())
  assert back == s and back.to_torch_csv() == s.to_torch_csv()
  assert Schedule.from_orders(s.orders()) == s  # already at the earliest ticks


def test_placements():
  assert _named("1f1b_flush", 4, 8).placement == (0, 1, 2, 3)
  assert _named("interleaved_1f1b", 4, 8).placement == (0, 1, 2, 3, 0, 1, 2, 3)
  assert _named("interleaved_1f1b", 2, 4, virtual_stages=3).placement == (0, 1, 0, 1, 0, 1)
  assert _named("zbv", 4, 8).placement == (0, 1, 2, 3, 3, 2, 1, 0)


def test_1f1b_flush_orders_are_pipedream_flush():
  # device r: D-1-r warm-up F, then F and B alternate, then the remaining B
  s = _named("1f1b_flush", 4, 6)
  assert [str(a) for a in s.orders()[1]] == [
      "1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1B4", "1B5"]
  assert [str(a) for a in s.orders()[3]] == [
      "3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4", "3F5", "3B5"]


def test_interleaved_warmup_is_torchs():
  # device r warms up with (v-1)·(M / rounds) + 2(D-1-r) forwards, depth first by rounds
  s = _named("interleaved_1f1b", 4, 8)
  first_b = [next(i for i, a in enumerate(o) if a.kind == "B") for o in s.orders()]
  assert first_b == [4 + 6 + 1, 4 + 4 + 1, 4 + 2 + 1, 4 + 0 + 1]
  assert [str(a) for a in s.orders()[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1"]


def test_named_constraints_are_one_line_errors():
  with pytest.raises(ValueError, match=r"^num_microbatches=7 .*dualpipev.*even"):
    _named("dualpipev", 2, 7)
  with pytest.raises(ValueError, match=r">= 2D = 8"):
    _named("dualpipev", 4, 6)
  with pytest.raises(ValueError, match=r"multiple of the number of rounds max\(1, M // D\) = 2"):
    _named("interleaved_1f1b", 4, 9)
  _named("interleaved_1f1b", 4, 10)  # torch's own example: rounds = 2
  _named("interleaved_1f1b", 4, 3)  # rounds = 1
  with pytest.raises(ValueError, match="schedule='pipedream'"):
    _named("pipedream", 4, 8)
  with pytest.raises(ValueError, match="virtual_stages=3"):
    _named("zbv", 4, 8, virtual_stages=3)
  with pytest.raises(ValueError, match="num_devices=0"):
    _named("gpipe", 0, 8)
  with pytest.raises(ValueError) as info:
    _named("dualpipev", 3, 5)
  assert "\n" not in str(info.value)


# ---- the rules, one broken schedule each --------------------------------------------------------

GOOD_2X2 = "0F0,0F1,,,0B0,,0B1\n,1F0,1F1,1B0,1B1,,\n"  # GPipe-like, D = 2, M = 2 (B in order)


def _broken(text):
  with pytest.raises(ValueError) as info:
    Schedule.from_torch_csv(text).validate()
  message = str(info.value)
  assert "\n" not in message
  return message


def test_a_good_table_validates():
  Schedule.from_torch_csv(GOOD_2X2).validate()


def test_rule_every_stage_exactly_m_forwards():
  assert "runs twice" in _broken("0F0,0F0,0F1,,0B0,,0B1\n,1F0,1F1,1B0,1B1,,\n")
  message = _broken("0F0,0F1,,,0B0,,0B1\n,1F0,,1B0,,,\n")
  assert message.startswith("device 1, stage 1: no action 1F1")


def test_rule_i_and_w_counts_equal():
  message = _broken("0F0,0F1,,,0B0,,0B1\n,1F0,1F1,1I0,1B1,,\n")
  assert message.startswith("device 1, tick 3, action 1I0: 1I0 has no 1W0")


def test_rule_b_plus_half_i_w_is_m():
  message = _broken("0F0,0F1,,,0B0\n,1F0,1F1,1B0,1B1\n")
  assert message.startswith("device 0, stage 0: micro-batch 1 has no backward")
  assert "both a B and an I" in _broken("0F0,0F1,,,0B0,,0B1\n,1F0,1F1,1B0,1B1,1I1,1W1\n")


def test_rule_b_and_i_after_their_f():
  assert _broken("0B0,0F0,0F1,,,,0B1\n,1F0,1F1,1B0,1B1,,\n").startswith(
      "device 0, tick 0, action 0B0: 0B0 before 0F0")
  assert "1I0 before 1F0" in _broken("0F0,0F1,,,0B0,,0B1\n,1I0,1F0,1F1,1W0,1B1,\n")


def test_rule_w_after_its_i():
  assert "1W0 before 1I0" in _broken("0F0,0F1,,,0B0,,0B1\n,1F0,1F1,1W0,1I0,1B1,\n")


def test_rule_f_of_next_stage_in_a_later_tick():
  message = _broken("0F0,0F1,,,0B0,,0B1\n1F0,,1F1,1B0,1B1,,\n")
  assert message.startswith("device 1, tick 0, action 1F0: needs 0F0 (device 0, tick 0)")
  assert "F of the previous stage" in message


def test_rule_backward_after_the_next_stages():
  message = _broken("0F0,0F1,,0B0,,,0B1\n,1F0,1F1,1B0,1B1,,\n")
  assert message.startswith("device 0, tick 3, action 0B0: needs 1I0 or 1B0 (device 1, tick 3)")
  assert "I or B of the next stage" in message


def test_rule_last_stage_backward_after_its_own_f_in_an_earlier_tick():
  # one stage: a pair whose B is of the micro-batch its F starts (torch's per-rank check passes it)
  with pytest.raises(ValueError, match=r"^device 0, tick 1, action \(0F1;0B1\)OVERLAP_F_B: needs "
                     r"0F1 \(device 0, tick 1\) in an earlier tick \(a B or I runs after its own F"):
    Schedule.from_torch_csv("0F0,(0F1;0B1)OVERLAP_F_B,0B0\n").validate()
  Schedule.from_torch_csv("0F0,(0F1;0B0)OVERLAP_F_B,0B1\n").validate()


def test_a_stage_lives_on_one_device():
  with pytest.raises(ValueError, match=r"^device 1, tick 1, action 0B0: stage 0 is also on device 0"):
    Schedule.from_torch_csv("0F0\n,0B0\n")


def test_deadlocked_orders_are_named():
  orders = [[Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 0)],
            [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)]]
  Schedule.from_orders(orders).validate()
  crossed = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
             [Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)]]
  with pytest.raises(ValueError, match=r"^the orders deadlock at tick 1: device 0 waits at 0B0 "
                     r"for 1I0 or 1B0; device 1 waits at 1F1 for 0F1\.$"):
    Schedule.from_orders(crossed)
  with pytest.raises(ValueError, match="which no device runs"):
    Schedule.from_orders([[Action("F", 1, 0)], [Action("F", 0, 1)]])
  table = Schedule(tuple(tuple(o) for o in crossed))
  with pytest.raises(ValueError, match="the orders deadlock"):
    table.validate(ticks=False)


# ---- counted bubble and activations -------------------------------------------------------------


@pytest.mark.parametrize("d,m", [(2, 2), (4, 4), (4, 8), (4, 16), (3, 7), (8, 8)])
def test_bubbles_against_the_closed_forms(d, m):
  gpipe = bubble(_named("gpipe", d, m))
  flush = bubble(_named("1f1b_flush", d, m))
  zb_h1 = bubble(_named("zb_h1", d, m))
  assert gpipe == pytest.approx((d - 1) / (m + d - 1))
  assert flush == pytest.approx((d - 1) / (m + d - 1))
  assert zb_h1 <= (d - 1) / (3 * m + d - 1) + 1e-12
  if m % max(1, m // d) == 0:
    assert bubble(_named("interleaved_1f1b", d, m)) <= (d - 1) / (2 * m + d - 1) + 1e-12
  assert bubble(_named("zbv", d, m)) <= zb_h1 + 1e-12


def test_the_issues_targets_at_d4_m8():
  assert bubble(_named("zb_h1", 4, 8)) <= 0.12
  assert bubble(_named("1f1b_flush", 4, 8)) == pytest.approx(0.27, abs=0.005)
  assert bubble(_named("interleaved_1f1b", 4, 8)) <= 0.16


def _idle_slot_share(s):
  idle = sum(1 for row in s.ticks for item in row if item is None)
  return (idle + sum(s.num_ticks - len(row) for row in s.ticks)) / (s.num_devices * s.num_ticks)


def test_bubble_is_timed_by_costs_not_ticks():
  # With one tick per action the overlapped F+B pair (3 units) looks as cheap as an F (1 unit);
  # the event simulation times it, so DualPipeV's counted bubble is not its idle-slot share.
  s = _named("dualpipev", 4, 10)
  assert bubble(s) == pytest.approx(1 / 11)
  assert _idle_slot_share(s) != pytest.approx(bubble(s))
  one = Schedule.from_torch_csv("0F0,0B0\n")  # one device, no idle time whatever the costs
  assert bubble(one) == 0.0
  two = Schedule.from_torch_csv("0F0,,,0B0\n,1F0,1B0,\n")  # F 1, B 2 units: makespan 6, busy 6
  assert bubble(two) == pytest.approx(1 - 6 / (2 * 6))


@pytest.mark.parametrize("d,m", [(2, 2), (4, 3), (4, 8), (4, 16), (8, 5)])
def test_peak_inflight_against_the_closed_forms(d, m):
  assert peak_inflight(_named("gpipe", d, m)) == (float(m),) * d
  assert max(peak_inflight(_named("1f1b_flush", d, m))) == min(d, m)
  assert max(peak_inflight(_named("zb_h1", d, m))) == min(d, m)
  assert peak_inflight(_named("1f1b_flush", d, m))[0] == min(d, m)


def test_peak_inflight_targets_and_units():
  assert peak_inflight(_named("1f1b_flush", 4, 16))[0] * 4 == peak_inflight(
      _named("gpipe", 4, 16))[0]
  # interleaved, device 0: about D + (D-1)/v stage units
  assert peak_inflight(_named("interleaved_1f1b", 4, 8))[0] == 4 + 3 / 2


def test_public_names():
  for name in ("Schedule", "bubble", "peak_inflight", "FLUSH_SCHEDULES", "Action", "Overlap"):
    assert name in pipeline.__all__ and hasattr(pipeline, name)
  for name in ("SCHEDULES", "tick_table", "bubble_fraction", "Pipeline"):
    assert name in pipeline.__all__
