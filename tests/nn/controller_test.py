"""BFPsim's Simple dynamic precision controller and the epoch-keyed schedule (bfp.md §3.4, §5.3, §7.3 item 7)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlp.formats import BFPFormat
from jlp.gemm.config import GemmQuant
from jlp.nn.controller import (KEY_ROLES, PrecisionSchedule, SimpleController, WindowRecord,
                               bits_from_configs)
from jlp.numerics.bfp import bfp_quantize

ALL8 = {"w": 8, "x": 8, "dgrad_w": 8, "dgrad_dy": 8, "wgrad_dy": 8, "wgrad_x": 8}


def _ctl(s="Simple/0.1/0.2/0/0", window=1, **bits):
  return SimpleController.from_string(s, window=window, bits=bits or {"l": dict(ALL8)})


def _z(fw=0.15, biw=0.15, bwo=0.15, layer="l"):
  return {layer: {"fw": fw, "biw": biw, "bwo": bwo}}


def test_parse_fields_and_tag_ignored():
  c = SimpleController.from_string("Simple/0.1/0.2/50/1/5")
  assert (c.lo, c.hi, c.init, c.hold, c.tag) == (0.1, 0.2, 50, 1, "5")
  c2 = SimpleController.from_string("Simple/0.6/0.8/0/1")
  assert (c2.lo, c2.hi, c2.init, c2.hold, c2.tag) == (0.6, 0.8, 0, 1, None)
  c3 = SimpleController.from_string("Simple/0.1/0.2/150/1/L8/extra")
  assert (c3.init, c3.hold) == (150, 1)


@pytest.mark.parametrize("s,field", [("Fancy/0.1/0.2/0/1", "name"), ("Simple/x/0.2/0/1", "lo"),
                                     ("Simple/0.1/nan/0/1", "hi"), ("Simple/0.1/0.2/-1/1", "init"),
                                     ("Simple/0.1/0.2/1.5/1", "init"), ("Simple/0.1/0.2/0", "hold"),
                                     ("Simple/0.1/0.2/0/h", "hold"), ("Simple/0.3/0.2/0/1", "lo")])
def test_bad_strings_name_the_field(s, field):
  with pytest.raises(ValueError, match=field):
    SimpleController.from_string(s)


def test_ladder_and_paired_roles():
  c = _ctl(l={"w": 16, "x": 16, "dgrad_w": 4, "dgrad_dy": 4, "wgrad_dy": 8, "wgrad_x": 8})
  recs = c.update(_z(fw=0.05, biw=0.5, bwo=0.05))
  assert [(r.key, r.old_bits, r.new_bits) for r in recs] == [("fw", 16, 8), ("biw", 4, 8), ("bwo", 8, 4)]
  assert c.bits["l"] == {"w": 8, "x": 8, "dgrad_w": 8, "dgrad_dy": 8, "wgrad_dy": 4, "wgrad_x": 4}
  c.update(_z(fw=0.05, biw=0.5, bwo=0.05))
  assert c.bits["l"] == {"w": 4, "x": 4, "dgrad_w": 16, "dgrad_dy": 16, "wgrad_dy": 4, "wgrad_x": 4}
  c.update(_z(fw=0.05, biw=0.5, bwo=0.05))  # ends of the ladder stay
  assert c.bits["l"] == {"w": 4, "x": 4, "dgrad_w": 16, "dgrad_dy": 16, "wgrad_dy": 4, "wgrad_x": 4}
  c.update(_z(fw=0.9, biw=0.0, bwo=0.15))   # back up / down; inside [lo, hi] nothing
  assert c.bits["l"] == {"w": 8, "x": 8, "dgrad_w": 8, "dgrad_dy": 8, "wgrad_dy": 4, "wgrad_x": 4}
  assert [r.window for r in c.log] == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
  assert len(c.changes) == 3 + 2 + 0 + 2


def test_thresholds_are_strict_and_off_ladder_bits_never_change():
  c = _ctl()
  c.update(_z(fw=0.1, biw=0.2, bwo=0.1))
  assert c.bits["l"] == ALL8
  c = _ctl(l={"w": 12, "x": 12, "dgrad_w": 2, "dgrad_dy": 2, "wgrad_dy": 23, "wgrad_x": 8})
  c.update(_z(fw=0.0, biw=1.0, bwo=0.0))
  c.update(_z(fw=1.0, biw=0.0, bwo=1.0))
  assert c.bits["l"] == {"w": 12, "x": 12, "dgrad_w": 2, "dgrad_dy": 2, "wgrad_dy": 23, "wgrad_x": 8}


def test_window_average_and_init():
  # window of 3 updates; init=2: the ends of windows 1 and 2 take no decision, window 3 does.
  c = _ctl("Simple/0.1/0.2/2/0/tag", window=3)
  seq = [0.05, 0.05, 0.05] * 2 + [0.0, 0.0, 0.35]  # window 3 average 0.1167: inside -> no change
  out = [c.update(_z(fw=z, biw=0.15, bwo=0.15)) for z in seq]
  assert [bool(o) for o in out] == [False, False, True] * 3
  assert c.optimize_count == 3 and c.bits["l"]["w"] == 8
  assert [r.zse_avg for r in c.log if r.key == "fw"] == pytest.approx([0.05, 0.05, 0.35 / 3])
  for z in (0.05, 0.1, 0.1):  # average 0.0833 < 0.1 -> 8 -> 4 at window 4
    c.update(_z(fw=z))
  assert c.bits["l"]["w"] == 4 and c.bits["l"]["x"] == 4
  assert c.changes == [WindowRecord(4, "l", "fw", pytest.approx(0.25 / 3), 8, 4)]


def test_init_zero_changes_at_first_window():
  c = _ctl("Simple/0.1/0.2/0/1")
  c.update(_z(fw=0.0))
  assert c.bits["l"]["w"] == 4
  c = _ctl("Simple/0.1/0.2/1/1")
  c.update(_z(fw=0.0))
  assert c.bits["l"]["w"] == 8
  c.update(_z(fw=0.0))
  assert c.bits["l"]["w"] == 4


@pytest.mark.parametrize("hold,expected", [(0, [8, 4, 4, 8, 16, 16, 16]), (1, [8, 4, 4, 8, 16, 16, 16]),
                                           (2, [8, 8, 4, 4, 8, 8, 16]), (3, [8, 8, 8, 16, 16, 16, 16])])
def test_hold_keeps_a_new_precision_for_hold_windows(hold, expected):
  # A width set at the end of window w is used in windows w+1 .. w+max(hold, 1): the ends of
  # windows w+1 .. w+hold-1 take no decision. hold 0 and 1 are BFPsim's behaviour (no hold).
  c = _ctl(f"Simple/0.1/0.2/0/{hold}", l={"w": 16, "x": 16})
  widths = []
  for z in (0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5):
    c.update({"l": {"fw": z}})
    assert c.bits["l"]["w"] == c.bits["l"]["x"]
    widths.append(c.bits["l"]["w"])
  assert widths == expected


def test_hold_is_per_layer_and_key():
  c = _ctl("Simple/0.1/0.2/0/3", a=dict(ALL8), b=dict(ALL8))
  c.update({"a": {"fw": 0.0, "biw": 0.15}, "b": {"fw": 0.15}})
  assert c.bits["a"]["w"] == 4
  c.update({"a": {"fw": 0.9, "biw": 0.0}, "b": {"fw": 0.0}})  # a.fw held; a.biw and b.fw free
  assert (c.bits["a"]["w"], c.bits["a"]["dgrad_w"], c.bits["b"]["w"]) == (4, 4, 4)


def test_missing_keys_layers_and_roles():
  c = _ctl(window=2, l=dict(ALL8), m={"w": 16})  # m has no paired role and no biw/bwo roles
  c.update({"l": {"fw": 0.0}})
  recs = c.update({"l": {"fw": 0.0}, "m": {"fw": 0.0, "biw": 0.0}})  # l only fw; m.biw uncontrolled
  assert {(r.layer, r.key) for r in recs} == {("l", "fw"), ("m", "fw")}
  assert c.bits["m"] == {"w": 8} and c.bits["l"]["w"] == 4 and c.bits["l"]["dgrad_w"] == 8
  with pytest.raises(ValueError, match="unknown layer 'zz'"):
    c.update({"zz": {"fw": 0.1}})
  with pytest.raises(ValueError, match="unknown key 'fo'"):
    c.update({"l": {"fo": 0.1}})
  with pytest.raises(ValueError, match="role 'y'"):
    c.add_layer("n", {"y": 8})
  with pytest.raises(ValueError, match="window"):
    SimpleController(0.1, 0.2, window=0)


def test_arrays_feed_jit_without_recompiling():
  fmt = BFPFormat(16, (1, 4))
  cfg = GemmQuant(w=BFPFormat(16, (4, 1)), x=fmt, dgrad_w=BFPFormat(8, (4, 1)), dgrad_dy=fmt)
  bits = bits_from_configs({"dense": cfg})
  assert bits == {"dense": {"w": 16, "x": 16, "dgrad_w": 8, "dgrad_dy": 16}}
  c = SimpleController.from_string("Simple/0.1/0.2/0/0", bits=bits)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
  step = jax.jit(lambda x, b: bfp_quantize(x, fmt, man=b["dense"]["x"]))
  outs = []
  for z in (0.0, 0.0, 0.5):
    outs.append(np.asarray(step(x, c.as_arrays())))
    c.update({"dense": {"fw": z}})
  assert [r.new_bits for r in c.log if r.key == "fw"] == [8, 4, 8]
  assert step._cache_size() == 1
  np.testing.assert_array_equal(outs[1], np.asarray(bfp_quantize(x, BFPFormat(8, (1, 4)))))
  np.testing.assert_array_equal(outs[2], np.asarray(bfp_quantize(x, BFPFormat(4, (1, 4)))))
  arrays = c.as_arrays()
  assert arrays["dense"]["w"].dtype == jnp.int32 and int(arrays["dense"]["w"]) == 8


def test_state_dict_round_trip():
  c = _ctl("Simple/0.1/0.2/0/3", window=2)
  for z in (0.0, 0.0, 0.5):
    c.update(_z(fw=z))
  d = _ctl("Simple/0.1/0.2/0/3", window=2)
  d.load_state_dict(c.state_dict())
  for ctl in (c, d):
    for z in (0.5, 0.5, 0.5, 0.5, 0.5):
      ctl.update(_z(fw=z))
  assert c.log == d.log and c.bits == d.bits


def test_key_roles_match_bfpsim_pairs():
  from jlp.gemm.config import BFPSIM_ROLES
  pairs = {"fw": "fi", "biw": "bio", "bwo": "bwi"}
  for key, paired in pairs.items():
    assert KEY_ROLES[key] == (BFPSIM_ROLES[key][0], BFPSIM_ROLES[paired][0])


def test_precision_schedule():
  s = PrecisionSchedule({"0": "FB16", "20": "FB12LG16", 180: "FB16"})
  assert s.epochs == (0, 20, 180)
  assert [s.at(e) for e in (0, 19, 20, 21, 179, 180, 500)] == ["FB16", "FB16", "FB12LG16", "FB12LG16",
                                                               "FB12LG16", "FB16", "FB16"]
  assert s.changes_at(20) and not s.changes_at(0) and not s.changes_at(21)
  assert PrecisionSchedule({0: 8}).at(1000) == 8


@pytest.mark.parametrize("entries,match", [({1: "a"}, "include 0"), ({0: "a", -1: "b"}, "negative"),
                                           ({0: "a", "x": "b"}, "'x'"), ({0: "a", 1.5: "b"}, "1.5"),
                                           ({0: "a", True: "b"}, "True"), ({0: "a", "0": "b"}, "repeats"),
                                           ({}, "non-empty")])
def test_precision_schedule_bad_keys(entries, match):
  with pytest.raises(ValueError, match=match):
    PrecisionSchedule(entries)


def test_precision_schedule_bad_epoch():
  with pytest.raises(ValueError, match="epoch"):
    PrecisionSchedule({0: "a"}).at(-1)
