"""BFP training controls on the host: BFPsim's "Simple" dynamic precision controller
and the epoch-keyed precision schedule (docs/bfp.md#simple-controller).

`SimpleController` is a pure-Python state machine. A train step computes, per
layer, the zero-setting errors (`jlp.nn.zse.zero_setting_error`) of three
tensors, keyed as in BFPsim (docs/bfp.md#zero-setting-error):

  key    tensor measured                   roles it controls (jlp.GemmQuant)
  fw     the weight                        w and x             (BFPsim fw, fi)
  biw    the local gradient dL/dx          dgrad_w, dgrad_dy   (BFPsim biw, bio)
  bwo    the weight gradient dL/dw         wgrad_dy, wgrad_x   (BFPsim bwo, bwi)

The host feeds them to `update` once per iteration. Every `window` updates a
window ends (BFPsim's `Optimize`): optimizeCount += 1 and, for every layer and
key, only when optimizeCount > init and the key is not held, the window average
z of that key's ZSE moves the key's precision one step along the ladder 4, 8, 16:

  z < lo:  16 -> 8, 8 -> 4   (4 stays)
  z > hi:  4 -> 8, 8 -> 16   (16 stays)

(strict comparisons; a width outside {4, 8, 16} never changes). The decision is
taken on the first role of the pair (w, dgrad_w, wgrad_dy: the bits of BFPsim's
fw, biw, bwo) and the new width is written to both roles. Group shapes never
change. The widths go into jitted code as int32 arrays (`as_arrays`), consumed
by `bfp_quantize(..., man=...)`, so a change does not recompile.

Hold. BFPsim parses `<hold>` but does not use it; its
README describes it as "fix precision for N steps if precision is changed", and
jlp honours it with steps = windows: a precision set at the end of window w is
kept for `hold` windows, i.e. it is used in windows w+1 .. w+hold and the key's
next change can happen at the end of window w + max(hold, 1) at the earliest
(the ends of windows w+1 .. w+hold-1 take no decision for that layer and key).
A new precision is always used for at least the one window after the change
(one step per window), so hold = 0 and hold = 1 both mean "no extra hold" and
give BFPsim's behaviour at HEAD; the README examples (`Simple/0.6/0.8/0/1`,
`Simple/0.1/0.2/50/1/5`) therefore match the code. hold = 3 (BFPsim's unused
`HOLDING` constant) keeps a new precision for three windows.

Other readings settled here:
  * `init`: BFPsim's optInitialBreak; the first `init` windows take no decision
    (optimizeCount > init after the increment, so init = 0 allows a change at
    the end of the first window).
  * A window average is sum / number of updates of that layer and key within the
    window; a layer or key absent from every update of a window (BFPsim skips
    layers without a weight gradient) takes no decision and is not logged.
  * A layer without the deciding role (w, dgrad_w or wgrad_dy) in its widths is
    not controlled for that key; a missing paired role is left missing.

`PrecisionSchedule` is BFPsim's `bfp-layer-conf-dict` with its intended
semantics (docs/bfp.md#precision-schedule): the entry of the largest listed epoch <= the current
epoch (the code at HEAD always rebuilt the net from the epoch-0 entry).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["KEYS", "KEY_ROLES", "LADDER", "WindowRecord", "SimpleController", "PrecisionSchedule",
           "bits_from_configs"]

KEYS = ("fw", "biw", "bwo")
# Measured key -> (deciding role, paired role): BFPsim fw->fi, biw->bio, bwo->bwi.
KEY_ROLES = {"fw": ("w", "x"), "biw": ("dgrad_w", "dgrad_dy"), "bwo": ("wgrad_dy", "wgrad_x")}
CONTROLLED_ROLES = tuple(r for k in KEYS for r in KEY_ROLES[k])
LADDER = (4, 8, 16)
_DOWN = {16: 8, 8: 4}
_UP = {4: 8, 8: 16}


class WindowRecord(NamedTuple):
  """One layer and key at the end of a window (BFPsim's dynamic.txt / data.txt row).

  window: optimizeCount after the increment (1 for the first window); zse_avg: the
  window's average ZSE; old_bits / new_bits: the key's width before / after the
  window's decision (equal when nothing changed).
  """
  window: int
  layer: str
  key: str
  zse_avg: float
  old_bits: int
  new_bits: int


def bits_from_configs(configs: Mapping[str, Any]) -> dict[str, dict[str, int]]:
  """Initial widths layer -> role -> man from per-layer GemmQuant-like configs.

  Every controlled role whose quantizer has an integer `man` (a BFPFormat) is
  taken; other roles (None, float formats) are left out.
  """
  out: dict[str, dict[str, int]] = {}
  for layer, cfg in configs.items():
    roles = {}
    for role in CONTROLLED_ROLES:
      fmt = getattr(cfg, role, None)
      man = getattr(fmt, "man", None)
      if isinstance(man, (int, np.integer)) and not isinstance(man, bool):
        roles[role] = int(man)
    out[str(layer)] = roles
  return out


def _check_bits(bits: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
  if not isinstance(bits, Mapping):
    raise ValueError(f"bits={bits!r} must be a mapping layer -> role -> int")
  out = {}
  for layer, roles in bits.items():
    if not isinstance(layer, str):
      raise ValueError(f"bits: layer name {layer!r} must be a str")
    if not isinstance(roles, Mapping):
      raise ValueError(f"bits[{layer!r}]={roles!r} must be a mapping role -> int")
    checked = {}
    for role, b in roles.items():
      if role not in CONTROLLED_ROLES:
        raise ValueError(f"bits[{layer!r}]: role {role!r} is not a controlled role; expected one of "
                         f"{CONTROLLED_ROLES}")
      if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b <= 24:
        raise ValueError(f"bits[{layer!r}][{role!r}]={b!r} must be an int in 1..24")
      checked[role] = int(b)
    out[layer] = checked
  return out


def _field(fields: list[str], i: int, name: str, conv, s: str):
  if len(fields) <= i:
    raise ValueError(f"controller string {s!r}: field {name} (#{i}) is missing; expected "
                     "'Simple/<lo>/<hi>/<init>/<hold>[/<tag>]'")
  raw = fields[i].strip()
  try:
    value = conv(raw)
  except ValueError:
    kind = "a number" if conv is float else "a non-negative integer"
    raise ValueError(f"controller string {s!r}: field {name}={raw!r} is not {kind}") from None
  return value


def _nonneg_int(raw: str) -> int:
  if not re.fullmatch(r"\+?[0-9]+", raw):
    raise ValueError(raw)
  return int(raw)


class SimpleController:
  """BFPsim's `--do Simple/<lo>/<hi>/<init>/<hold>[/<tag>]` precision controller.

  See the module docstring for the rule and the reading of `hold`.

  Args:
    lo, hi: thresholds on a window's average ZSE (lo <= hi, finite).
    init: number of initial windows without any change (optInitialBreak).
    hold: windows a new precision is kept (0 and 1: none beyond the next window).
    window: updates per window (BFPsim's `step`: len(trainloader) for CIFAR, 500 for ImageNet).
    bits: initial widths layer -> role -> int (see `bits_from_configs`); more
      layers can be added with `add_layer`.
    tag: the ignored label of the string form (kept for naming runs).
  """

  def __init__(self, lo: float, hi: float, init: int = 0, hold: int = 0, *, window: int = 1,
               bits: Mapping[str, Mapping[str, int]] | None = None, tag: str | None = None):
    for name, v in (("lo", lo), ("hi", hi)):
      if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        raise ValueError(f"{name}={v!r} must be a finite number")
    if lo > hi:
      raise ValueError(f"lo={lo!r} must be <= hi={hi!r}")
    for name, v, least in (("init", init, 0), ("hold", hold, 0), ("window", window, 1)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
        raise ValueError(f"{name}={v!r} must be an int >= {least}")
    self.lo, self.hi = float(lo), float(hi)
    self.init, self.hold, self.window = int(init), int(hold), int(window)
    self.tag = tag
    self._bits: dict[str, dict[str, int]] = _check_bits(bits or {})
    self.optimize_count = 0      # windows ended so far (BFPsim's optimizeCount)
    self.updates_in_window = 0   # updates since the last window end
    self._sums: dict[tuple[str, str], float] = {}
    self._counts: dict[tuple[str, str], int] = {}
    self._held_until: dict[tuple[str, str], int] = {}  # no decision while optimize_count <= value
    self.log: list[WindowRecord] = []

  # -- construction -------------------------------------------------------------------------
  @classmethod
  def from_string(cls, s: str, *, window: int = 1,
                  bits: Mapping[str, Mapping[str, int]] | None = None) -> "SimpleController":
    """Parses 'Simple/<lo>/<hi>/<init>/<hold>[/<tag>...]' (fields after <hold> ignored)."""
    if not isinstance(s, str):
      raise ValueError(f"controller string {s!r} must be a str")
    fields = s.split("/")
    if fields[0].strip() != "Simple":
      raise ValueError(f"controller string {s!r}: field name={fields[0]!r} is not 'Simple'; expected "
                       "'Simple/<lo>/<hi>/<init>/<hold>[/<tag>]'")
    lo = _field(fields, 1, "lo", float, s)
    hi = _field(fields, 2, "hi", float, s)
    init = _field(fields, 3, "init", _nonneg_int, s)
    hold = _field(fields, 4, "hold", _nonneg_int, s)
    for name, v in (("lo", lo), ("hi", hi)):
      if not math.isfinite(v):
        raise ValueError(f"controller string {s!r}: field {name}={v!r} is not finite")
    if lo > hi:
      raise ValueError(f"controller string {s!r}: field lo={lo!r} must be <= hi={hi!r}")
    tag = "/".join(fields[5:]) or None
    return cls(lo, hi, init, hold, window=window, bits=bits, tag=tag)

  def add_layer(self, layer: str, roles: Mapping[str, int]) -> None:
    """Registers (or replaces) the widths of one layer."""
    self._bits.update(_check_bits({layer: roles}))

  # -- state --------------------------------------------------------------------------------
  @property
  def bits(self) -> dict[str, dict[str, int]]:
    """Current widths, layer -> role -> int (a copy)."""
    return {layer: dict(roles) for layer, roles in self._bits.items()}

  def as_arrays(self) -> dict[str, dict[str, jnp.ndarray]]:
    """Current widths as int32 scalar arrays (a pytree of fixed structure: pass it
    to a jitted step and use it as `man=`; changes do not recompile)."""
    return {layer: {role: jnp.asarray(b, jnp.int32) for role, b in roles.items()}
            for layer, roles in self._bits.items()}

  @property
  def changes(self) -> list[WindowRecord]:
    """The log records where the precision changed."""
    return [r for r in self.log if r.old_bits != r.new_bits]

  def state_dict(self) -> dict[str, Any]:
    """Everything needed to resume (plain Python values)."""
    return {"bits": self.bits, "optimize_count": self.optimize_count,
            "updates_in_window": self.updates_in_window,
            "sums": [[l, k, v] for (l, k), v in self._sums.items()],
            "counts": [[l, k, v] for (l, k), v in self._counts.items()],
            "held_until": [[l, k, v] for (l, k), v in self._held_until.items()],
            "log": [list(r) for r in self.log]}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self._bits = _check_bits(state["bits"])
    self.optimize_count = int(state["optimize_count"])
    self.updates_in_window = int(state["updates_in_window"])
    self._sums = {(l, k): float(v) for l, k, v in state["sums"]}
    self._counts = {(l, k): int(v) for l, k, v in state["counts"]}
    self._held_until = {(l, k): int(v) for l, k, v in state["held_until"]}
    self.log = [WindowRecord(int(w), l, k, float(z), int(o), int(n)) for w, l, k, z, o, n in state["log"]]

  # -- stepping -----------------------------------------------------------------------------
  def update(self, zse: Mapping[str, Mapping[str, Any]]) -> list[WindowRecord]:
    """Adds one iteration's ZSEs, layer -> key ('fw', 'biw', 'bwo') -> value.

    Values may be Python/NumPy floats or JAX scalars (read to host). Ends a
    window after every `window` updates.

    Returns:
      the records of the window that ended with this update (empty otherwise).
    """
    staged = []
    for layer, keys in zse.items():
      if layer not in self._bits:
        raise ValueError(f"update: unknown layer {layer!r}; register it with bits= or add_layer")
      for key, value in keys.items():
        if key not in KEY_ROLES:
          raise ValueError(f"update: layer {layer!r}: unknown key {key!r}; expected one of {KEYS}")
        v = float(np.asarray(value))
        if not math.isfinite(v):
          raise ValueError(f"update: layer {layer!r} key {key!r}: ZSE {v!r} is not finite")
        staged.append(((layer, key), v))
    for lk, v in staged:
      self._sums[lk] = self._sums.get(lk, 0.0) + v
      self._counts[lk] = self._counts.get(lk, 0) + 1
    self.updates_in_window += 1
    if self.updates_in_window >= self.window:
      return self.end_window()
    return []

  def end_window(self) -> list[WindowRecord]:
    """Ends the current window now (BFPsim's `Optimize`); normally called by `update`."""
    self.optimize_count += 1
    w = self.optimize_count
    records = []
    for layer, roles in self._bits.items():
      for key in KEYS:
        lk = (layer, key)
        n = self._counts.get(lk, 0)
        first, second = KEY_ROLES[key]
        if n == 0 or first not in roles:
          continue
        avg = self._sums[lk] / n
        old = roles[first]
        new = old
        if w > self.init and w > self._held_until.get(lk, 0):
          if avg < self.lo:
            new = _DOWN.get(old, old)
          elif avg > self.hi:
            new = _UP.get(old, old)
        if new != old:
          roles[first] = new
          if second in roles:
            roles[second] = new
          self._held_until[lk] = w + max(self.hold, 1) - 1
        records.append(WindowRecord(w, layer, key, avg, old, new))
    self._sums.clear()
    self._counts.clear()
    self.updates_in_window = 0
    self.log.extend(records)
    return records

  def __repr__(self) -> str:
    tag = "" if self.tag is None else f", tag={self.tag!r}"
    return (f"SimpleController(lo={self.lo}, hi={self.hi}, init={self.init}, hold={self.hold}, "
            f"window={self.window}{tag})")


class PrecisionSchedule:
  """Epoch-keyed choice of precision (BFPsim's bfp-layer-conf-dict, intended semantics).

  Args:
    entries: {epoch: value}; epochs are non-negative ints (or their decimal strings,
      as JSON keys are) and must include 0; values are anything (a preset name,
      a GemmQuant, a dict of rules, ...).

  `at(epoch)` returns the value of the largest listed epoch <= epoch, so the
  precision switches at the listed epoch boundaries and nothing else (optimizer
  state and learning-rate schedule are the caller's and are not reset).
  """

  def __init__(self, entries: Mapping[Any, Any]):
    if not isinstance(entries, Mapping) or not entries:
      raise ValueError(f"PrecisionSchedule entries={entries!r} must be a non-empty mapping {{epoch: value}}")
    table: dict[int, Any] = {}
    for k, v in entries.items():
      epoch = self._epoch_key(k)
      if epoch in table:
        raise ValueError(f"PrecisionSchedule: epoch key {k!r} repeats epoch {epoch}")
      table[epoch] = v
    if 0 not in table:
      raise ValueError(f"PrecisionSchedule: epochs {sorted(table)} must include 0 (the starting precision)")
    self._epochs = sorted(table)
    self._values = [table[e] for e in self._epochs]

  @staticmethod
  def _epoch_key(k: Any) -> int:
    if isinstance(k, bool):
      raise ValueError(f"PrecisionSchedule: epoch key {k!r} is not a non-negative int")
    if isinstance(k, (int, np.integer)):
      e = int(k)
    elif isinstance(k, str) and re.fullmatch(r"\s*\+?[0-9]+\s*", k):
      e = int(k)
    else:
      raise ValueError(f"PrecisionSchedule: epoch key {k!r} is not a non-negative int")
    if e < 0:
      raise ValueError(f"PrecisionSchedule: epoch key {k!r} is negative")
    return e

  @property
  def epochs(self) -> tuple[int, ...]:
    """The listed epochs, ascending."""
    return tuple(self._epochs)

  def items(self) -> list[tuple[int, Any]]:
    return list(zip(self._epochs, self._values))

  def at(self, epoch: int) -> Any:
    """The value in force during `epoch` (0-based)."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
      raise ValueError(f"PrecisionSchedule.at: epoch={epoch!r} must be a non-negative int")
    i = int(np.searchsorted(self._epochs, int(epoch), side="right")) - 1
    return self._values[i]

  def changes_at(self, epoch: int) -> bool:
    """True when `epoch` > 0 starts a new entry (the precision may switch here)."""
    return epoch != 0 and int(epoch) in self._epochs

  def __len__(self) -> int:
    return len(self._epochs)

  def __repr__(self) -> str:
    return f"PrecisionSchedule({dict(self.items())!r})"
