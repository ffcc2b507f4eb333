"""Flush pipeline schedules as data: per device, a tuple of ticks, each an action or idle.

`jlp.pipeline.Pipeline` runs any valid one (`jlp.pipeline.flush`); docs/sdpipe.md, "Flush
schedules as data".

Actions (written as torch.distributed.pipelining writes them in its compute-only CSV):

  * `Action("F", s, m)` = "sFm": the forward of micro-batch m on stage s;
  * `Action("B", s, m)` = "sBm": the full backward;
  * `Action("I", s, m)` = "sIm" and `Action("W", s, m)` = "sWm": the backward split into the
    input-gradient part (on the critical path) and the weight-gradient part (B = I + W);
  * `Overlap(Action("F", s, m), Action("B", s2, m2))` = "(sFm;s2Bm2)OVERLAP_F_B": a forward and a
    backward run together in one tick (DualPipe's overlapped F&B);
  * `None` = an empty cell: the device idles that tick.

Rules (`Schedule.validate`). Per stage, as torch's `_validate_schedule`: every stage runs exactly
M forwards (one per micro-batch); I and W counts are equal; B + (I + W) / 2 = M (every micro-batch
has one backward); a B or I of a micro-batch only after its F on that stage; a W only after its I.
Across stages, on the tick table: F(s + 1, m) in a later tick than F(s, m); I or B of (s, m) in a
later tick than the I or B of (s + 1, m), or, on the last stage, than its own F(m). Each device
runs one action per tick in tick order, so a table meeting these is free of deadlock. A schedule
given as per-device orders without ticks (torch runs its CSVs that way, skipping the empty cells)
gets its ticks from `Schedule.from_orders`, which places every action at the earliest tick its
dependencies allow and names the deadlock when there is none.

Costs (`bubble`, `peak_inflight`): F, I and W of a stage cost one unit each, B = I + W two, an
overlapped pair the sum of its two actions; a stage of a schedule with v stages per device
("chunks") costs 1/v of that. `bubble` places every action at its earliest start given these costs
and the per-device orders (an event simulation, no communication cost) and returns the idle share of
devices x makespan. `peak_inflight` counts, per device, the micro-batch activations held at once in
stage units (a chunk's = 1/v): a forward holds its activations from its start until the backward
that frees them ends: the B, or the W when the backward is split (the I keeps what the W needs).
In an overlapped pair the forward's activations are counted before the backward frees its own.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import re
from collections.abc import Iterable, Sequence

__all__ = ["Action", "FLUSH_SCHEDULES", "Overlap", "Schedule", "bubble", "makespan",
           "peak_inflight"]

FLUSH_SCHEDULES = ("gpipe", "1f1b_flush", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
KINDS = ("F", "I", "W", "B")
_COST = {"F": 1, "I": 1, "W": 1, "B": 2}
_ACTION = re.compile(r"(\d+)([FIWB])(\d+)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


def _index(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{name}={value!r} is not allowed; expected an integer >= 0.")
  return value


@dataclasses.dataclass(frozen=True)
class Action:
  """One compute action: kind "F", "I", "W" or "B" of micro-batch `microbatch` on stage `stage`."""
  kind: str
  stage: int
  microbatch: int

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind={self.kind!r} is not allowed; expected one of {KINDS}.")
    _index("stage", self.stage)
    _index("microbatch", self.microbatch)

  def __str__(self) -> str:
    return f"{self.stage}{self.kind}{self.microbatch}"

  @property
  def leaves(self) -> tuple[Action, ...]:
    return (self,)


@dataclasses.dataclass(frozen=True)
class Overlap:
  """A forward and a full backward in one tick (torch's OVERLAP_F_B, DualPipe's F&B)."""
  forward: Action
  backward: Action

  def __post_init__(self):
    if not (isinstance(self.forward, Action) and self.forward.kind == "F"):
      raise ValueError(f"Overlap forward={self.forward!r} is not allowed; expected an F Action.")
    if not (isinstance(self.backward, Action) and self.backward.kind == "B"):
      raise ValueError(f"Overlap backward={self.backward!r} is not allowed; expected a B Action.")

  def __str__(self) -> str:
    return f"({self.forward};{self.backward})OVERLAP_F_B"

  @property
  def leaves(self) -> tuple[Action, ...]:
    return (self.forward, self.backward)


Tick = Action | Overlap | None


def parse_action(cell: str) -> Tick:
  """One CSV cell: "" (idle), "sFm" / "sIm" / "sWm" / "sBm", or "(sFm;sBm)OVERLAP_F_B"."""
  text = cell.strip()
  if not text:
    return None
  if match := _OVERLAP.fullmatch(text):
    parts = [parse_action(p) for p in match.group(1).split(";")]
    if len(parts) != 2 or not all(isinstance(p, Action) for p in parts):
      raise ValueError(f"action {cell!r} is not allowed; expected (sFm;sBm)OVERLAP_F_B.")
    return Overlap(*parts)
  if match := _ACTION.fullmatch(text):
    return Action(match.group(2), int(match.group(1)), int(match.group(3)))
  raise ValueError(f"action {cell!r} is not allowed; expected a compute action such as 0F3, 7I0, "
                   "7W0, 2B5 or (0F7;7B3)OVERLAP_F_B, or an empty cell.")


def _done_keys(a: Action) -> tuple[tuple[str, int, int], ...]:
  """What `a` completes: ("F", s, m) its forward, ("G", s, m) the gradient to its input (I or B),
  ("W", s, m) its weight gradient (W or B)."""
  if a.kind == "F":
    return (("F", a.stage, a.microbatch),)
  if a.kind == "I":
    return (("G", a.stage, a.microbatch),)
  if a.kind == "W":
    return (("W", a.stage, a.microbatch),)
  return (("G", a.stage, a.microbatch), ("W", a.stage, a.microbatch))


def _needs(a: Action, num_stages: int) -> tuple[tuple[str, int, int], ...]:
  """The keys (`_done_keys`) that must be done before `a` starts."""
  s, m = a.stage, a.microbatch
  if a.kind == "F":
    return (("F", s - 1, m),) if s > 0 else ()
  if a.kind == "W":
    return (("G", s, m),)
  if s == num_stages - 1:
    return (("F", s, m),)
  return (("F", s, m), ("G", s + 1, m))


def _describe(key: tuple[str, int, int]) -> str:
  kind, s, m = key
  return {"F": f"{s}F{m}", "G": f"{s}I{m} or {s}B{m}", "W": f"{s}W{m} or {s}B{m}"}[kind]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per device, a tuple of ticks, each an `Action`, an `Overlap` or None (idle).

  Stages are numbered 0..S-1 and micro-batches 0..M-1 as used by the actions; the placement of
  stages on devices is read from the actions (a stage on exactly one device). Build one with
  `Schedule(ticks)`, `from_torch_csv`, `from_orders` or `named`; check it with `validate`.
  """
  ticks: tuple[tuple[Tick, ...], ...]

  def __post_init__(self):
    rows = tuple(tuple(row) for row in self.ticks)
    object.__setattr__(self, "ticks", rows)
    if not rows:
      raise ValueError("a Schedule needs at least one device.")
    placement: dict[int, int] = {}
    for d, row in enumerate(rows):
      for t, item in enumerate(row):
        if item is not None and not isinstance(item, (Action, Overlap)):
          raise ValueError(f"device {d}, tick {t}: {item!r} is not allowed; expected an Action, "
                           "an Overlap or None.")
        for a in () if item is None else item.leaves:
          if placement.setdefault(a.stage, d) != d:
            raise ValueError(f"device {d}, tick {t}, action {item}: stage {a.stage} is also on "
                             f"device {placement[a.stage]} (a stage lives on one device).")
    if not placement:
      raise ValueError("a Schedule needs at least one action.")
    missing = sorted(set(range(max(placement) + 1)) - set(placement))
    if missing:
      raise ValueError(f"stage {missing[0]} has no action on any device (stages are numbered "
                       f"0..{max(placement)}).")
    object.__setattr__(self, "_placement", tuple(placement[s] for s in range(len(placement))))

  # ---- shape -------------------------------------------------------------------------------------

  @property
  def num_devices(self) -> int:
    return len(self.ticks)

  @property
  def num_stages(self) -> int:
    return len(self._placement)

  @property
  def num_microbatches(self) -> int:
    return 1 + max(a.microbatch for a in self._leaves())

  @property
  def num_ticks(self) -> int:
    return max(len(row) for row in self.ticks)

  @property
  def placement(self) -> tuple[int, ...]:
    """placement[s] = the device that runs stage s."""
    return self._placement

  @property
  def stages_per_device(self) -> float:
    """v: stages over devices (1 for GPipe and 1F1B, 2 for ZB-V and DualPipeV)."""
    return self.num_stages / self.num_devices

  def orders(self) -> tuple[tuple[Action | Overlap, ...], ...]:
    """Per device, its actions in tick order, idle ticks left out."""
    return tuple(tuple(item for item in row if item is not None) for row in self.ticks)

  def _leaves(self) -> Iterable[Action]:
    for row in self.ticks:
      for item in row:
        if item is not None:
          yield from item.leaves

  def render(self) -> str:
    """The table as aligned text, one line per device ("." = idle)."""
    cells = [[("." if item is None else str(item)) for item in row] for row in self.ticks]
    width = max(len(c) for row in cells for c in row) if any(cells) else 1
    return "\n".join(f"device {d}: " + " ".join(f"{c:>{width}}" for c in row)
                     for d, row in enumerate(cells))

  # ---- torch's compute-only CSV ------------------------------------------------------------------

  @classmethod
  def from_torch_csv(cls, text: str) -> Schedule:
    """Reads torch.distributed.pipelining's compute-only CSV (`_dump_csv` / `_load_csv`): one row
    per rank, one cell per tick, "" for an idle tick. Rows keep their own lengths. Does not
    validate (call `validate`; torch runs such a table as per-device orders, see `from_orders`)."""
    rows = [[parse_action(cell) for cell in row] for row in csv.reader(io.StringIO(text))]
    return cls(tuple(tuple(row) for row in rows))

  def to_torch_csv(self) -> str:
    """The compute-only CSV torch's `_load_csv` reads: one line per device, "\\n"-terminated."""
    return "".join(",".join("" if item is None else str(item) for item in row) + "\n"
                   for row in self.ticks)

  # ---- ticks from orders -------------------------------------------------------------------------

  @classmethod
  def from_orders(cls, orders: Sequence[Sequence[Tick]]) -> Schedule:
    """Per-device orders (None entries are skipped) placed at ticks: each device runs its next
    action at the earliest tick at which what it needs (module docstring) ran in an earlier tick.
    Raises ValueError naming the waiting devices when the orders deadlock."""
    queues = [[item for item in row if item is not None] for row in orders]
    leaves = [a for q in queues for item in q for a in item.leaves]
    if not leaves:
      raise ValueError("from_orders needs at least one action.")
    num_stages = 1 + max(a.stage for a in leaves)
    exists = {k for a in leaves for k in _done_keys(a)}
    done: dict[tuple[str, int, int], int] = {}
    position = [0] * len(queues)
    rows: list[list[Tick]] = [[] for _ in queues]
    t = 0
    while any(position[d] < len(q) for d, q in enumerate(queues)):
      ran = []
      for d, q in enumerate(queues):
        if position[d] == len(q):
          continue
        item = q[position[d]]
        if all(done.get(k, t) < t for a in item.leaves for k in _needs(a, num_stages)):
          rows[d].append(item)
          ran.append(item)
          position[d] += 1
        else:
          rows[d].append(None)
      if not ran:
        waits = []
        for d, q in enumerate(queues):
          if position[d] < len(q):
            item = q[position[d]]
            need = next(k for a in item.leaves for k in _needs(a, num_stages) if k not in done)
            where = "" if need in exists else ", which no device runs"
            waits.append(f"device {d} waits at {item} for {_describe(need)}{where}")
        raise ValueError(f"the orders deadlock at tick {t}: " + "; ".join(waits) + ".")
      for item in ran:
        for a in item.leaves:
          for k in _done_keys(a):
            done[k] = t
      t += 1
    for row in rows:  # trailing idle ticks of devices that finished early are left out
      while row and row[-1] is None:
        row.pop()
    return cls(tuple(tuple(row) for row in rows))

  # ---- rules -------------------------------------------------------------------------------------

  def validate(self, num_microbatches: int | None = None, *, ticks: bool = True) -> Schedule:
    """Raises ValueError (one line: device, tick, action, rule) unless the schedule follows the
    rules of the module docstring; returns self. `num_microbatches` (default: 1 + the largest
    micro-batch index) is M. With ticks=False the cross-stage dependencies are checked on the
    per-device orders only (as torch runs a CSV: the ticks may be placed again by `from_orders`),
    and a deadlock of those orders is the error."""
    m_total = self.num_microbatches if num_microbatches is None else num_microbatches
    _index("num_microbatches", m_total)
    seen: dict[tuple[str, int, int], tuple[int, int, Tick]] = {}  # (kind, s, m) -> d, t, item
    for d, row in enumerate(self.ticks):
      for t, item in enumerate(row):
        for a in () if item is None else item.leaves:
          s, m = a.stage, a.microbatch
          where = f"device {d}, tick {t}, action {item}"
          if m >= m_total:
            raise ValueError(f"{where}: micro-batch {m} is out of range (M = {m_total}).")
          if (a.kind, s, m) in seen:
            raise ValueError(f"{where}: {a} runs twice (every stage runs one {a.kind} per "
                             "micro-batch).")
          if a.kind in "BI" and ("F", s, m) not in seen:
            raise ValueError(f"{where}: {a} before {s}F{m} (a B or I runs after that "
                             "micro-batch's F on its stage).")
          if a.kind in "BI" and (("I" if a.kind == "B" else "B"), s, m) in seen:
            raise ValueError(f"{where}: micro-batch {m} of stage {s} has both a B and an I (every "
                             "micro-batch has one backward: B, or I and W).")
          if a.kind == "W" and ("I", s, m) not in seen:
            raise ValueError(f"{where}: {a} before {s}I{m} (a W runs after its I).")
          seen[(a.kind, s, m)] = (d, t, item)
    for s in range(self.num_stages):
      d = self.placement[s]
      for m in range(m_total):
        if ("F", s, m) not in seen:
          raise ValueError(f"device {d}, stage {s}: no action {s}F{m} (every stage runs exactly "
                           f"M = {m_total} forwards).")
        if ("I", s, m) in seen and ("W", s, m) not in seen:
          _, t, item = seen[("I", s, m)]
          raise ValueError(f"device {d}, tick {t}, action {item}: {s}I{m} has no {s}W{m} (I and W "
                           "counts are equal).")
        if ("B", s, m) not in seen and ("I", s, m) not in seen:
          raise ValueError(f"device {d}, stage {s}: micro-batch {m} has no backward, neither "
                           f"{s}B{m} nor {s}I{m} and {s}W{m} (B + (I + W) / 2 = M = {m_total}).")
    if not ticks:
      Schedule.from_orders(self.orders())
      return self
    tick_of: dict[tuple[str, int, int], int] = {}
    for row in self.ticks:
      for t, item in enumerate(row):
        for a in () if item is None else item.leaves:
          for k in _done_keys(a):
            tick_of[k] = t
    for d, row in enumerate(self.ticks):
      for t, item in enumerate(row):
        for a in () if item is None else item.leaves:
          for k in _needs(a, self.num_stages):
            if tick_of[k] >= t:
              rule = ("an F runs after the F of the previous stage" if a.kind == "F" else
                      "a W runs after its I" if a.kind == "W" else
                      "a B or I runs after the I or B of the next stage" if k[0] == "G" else
                      "a B or I runs after its own F")
              raise ValueError(f"device {d}, tick {t}, action {item}: needs {_describe(k)} "
                               f"(device {self.placement[k[1]]}, tick {tick_of[k]}) in an "
                               f"earlier tick ({rule}; torch's CSVs are per-device orders: "
                               "validate(ticks=False) or Schedule.from_orders(s.orders())).")
    return self

  # ---- named schedules ---------------------------------------------------------------------------

  @classmethod
  def named(cls, name: str, num_devices: int, num_microbatches: int, *,
            virtual_stages: int | None = None) -> Schedule:
    """The named schedule on D = num_devices devices for M = num_microbatches, its actions at
    their earliest ticks (`from_orders`), validated. Names (FLUSH_SCHEDULES):

      "gpipe"             all F, then all B (torch ScheduleGPipe's order, B by micro-batch).
      "1f1b_flush"        PipeDream-Flush (torch Schedule1F1B): device r runs min(D-1-r, M)
                          warm-up F, then alternates F and B while forwards remain, then the
                          remaining B.
      "interleaved_1f1b"  v = virtual_stages (default 2) chunks per device, stage i on device
                          i mod D (torch ScheduleInterleaved1F1B): rounds = max(1, M // D) and M a
                          multiple of it; groups of M / rounds micro-batches go depth-first
                          through the chunks; device r warms up with
                          min((v-1)·M/rounds + 2(D-1-r), v·M) forwards.
      "zb_h1"             ZB-H1 (Qi et al., ICLR 2024), 1F1B with B split into I and W: the
                          F / I order of 1F1B; device r holds back the W of its first r steady
                          steps into the end, where 1F1B idles (torch's ZB1P with one chunk).
      "zbv"               ZB-V (Qi et al., §6; torch ScheduleZBVZeroBubble): two chunks per
                          device in a V, device r holds stages r and 2D-1-r.
      "dualpipev"         DualPipeV (DeepSeek-V3; deepseek-ai/DualPipe; torch ScheduleDualPipeV):
                          V placement, steady state of overlapped F+B pairs; M even and >= 2D.
    """
    if name not in FLUSH_SCHEDULES:
      raise ValueError(f"schedule={name!r} is not allowed; expected one of {FLUSH_SCHEDULES}.")
    for arg, value in (("num_devices", num_devices), ("num_microbatches", num_microbatches)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arg}={value!r} is not allowed; expected an integer >= 1.")
    if virtual_stages is not None and name != "interleaved_1f1b":
      if virtual_stages != (2 if name in ("zbv", "dualpipev") else 1):
        raise ValueError(f"virtual_stages={virtual_stages!r} is not allowed with schedule={name!r};"
                         f" it has {2 if name in ('zbv', 'dualpipev') else 1} stage(s) per device.")
    d_count, m_count = num_devices, num_microbatches
    if name == "gpipe":
      orders = [[Action("F", r, m) for m in range(m_count)] +
                [Action("B", r, m) for m in range(m_count)] for r in range(d_count)]
    elif name == "1f1b_flush":
      orders = [_one_f_one_b(r, d_count, m_count, split=False) for r in range(d_count)]
    elif name == "zb_h1":
      orders = [_one_f_one_b(r, d_count, m_count, split=True) for r in range(d_count)]
    elif name == "interleaved_1f1b":
      v = 2 if virtual_stages is None else virtual_stages
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages={v!r} is not allowed; expected an integer >= 1.")
      rounds = max(1, m_count // d_count)
      if m_count % rounds:
        raise ValueError(f"num_microbatches={m_count} is not allowed with "
                         f"schedule='interleaved_1f1b' and {d_count} devices; expected a multiple"
                         f" of the number of rounds max(1, M // D) = {rounds} (torch's rule).")
      orders = [_interleaved(r, d_count, m_count, v, m_count // rounds) for r in range(d_count)]
    elif name == "zbv":
      orders = [_zbv(r, d_count, m_count) for r in range(d_count)]
    else:
      if m_count % 2 or m_count < 2 * d_count:
        raise ValueError(f"num_microbatches={m_count} is not allowed with schedule='dualpipev' "
                         f"and {d_count} devices; expected an even number >= 2D = {2 * d_count}.")
      orders = [_dualpipev(r, d_count, m_count) for r in range(d_count)]
    return cls.from_orders(orders).validate(m_count)


# ---- generators: the per-device orders ------------------------------------------------------------


def _one_f_one_b(r: int, d_count: int, m_count: int, split: bool) -> list[Action | Overlap]:
  """1F1B-flush (split=False) or ZB-H1 (split=True) on device r (= stage r)."""
  warm = min(d_count - 1 - r, m_count)
  order: list[Action | Overlap] = [Action("F", r, m) for m in range(warm)]
  pending_w: list[int] = []
  steady = 0  # backwards run so far

  def backward(m: int):
    nonlocal steady
    if not split:
      order.append(Action("B", r, m))
      return
    order.append(Action("I", r, m))
    pending_w.append(m)
    if steady >= r:  # device r holds back the W of its first r backwards
      order.append(Action("W", r, pending_w.pop(0)))
    steady += 1

  for m in range(warm, m_count):
    order.append(Action("F", r, m))
    backward(m - warm)
  for m in range(m_count - warm, m_count):
    backward(m)
  order.extend(Action("W", r, m) for m in pending_w)
  return order


def _interleaved(r: int, d_count: int, m_count: int, v: int, per_round: int) -> list[Action]:
  """Interleaved 1F1B on device r: chunk c is stage c·D + r."""
  total = v * m_count
  warm = min((v - 1) * per_round + 2 * (d_count - 1 - r), total)
  next_f = [0] * v
  next_b = [0] * v
  order: list[Action] = []

  def forward(step: int):
    c = (step // per_round) % v
    order.append(Action("F", c * d_count + r, next_f[c]))
    next_f[c] += 1

  def backward(step: int):
    c = v - 1 - ((step - warm) // per_round) % v
    order.append(Action("B", c * d_count + r, next_b[c]))
    next_b[c] += 1

  for step in range(total):
    if step >= warm:
      forward(step)
      backward(step)
    else:
      forward(step)
  for step in range(total, total + warm):
    backward(step)
  return order


def _zbv(r: int, d_count: int, m_count: int) -> list[Action]:
  """ZB-V on device r (stages r and 2D-1-r), as torch's ScheduleZBVZeroBubble orders it; it lays
  out max(M, 2D-1) micro-batches and leaves out those >= M."""
  n = max(2 * d_count - 1, m_count)
  down, up = r, 2 * d_count - 1 - r
  order: list[Action] = []
  count = {(k, s): 0 for k in "FIW" for s in (down, up)}

  def add(kind: str, stage: int):
    order.append(Action(kind, stage, count[(kind, stage)]))
    count[(kind, stage)] += 1

  for _ in range(2 * (d_count - r) - 1):
    add("F", down)
  for _ in range(r):
    add("F", up)
    add("F", down)
  for _ in range(d_count - r):
    add("F", up)
    add("I", up)
    add("W", up)
  while count[("F", up)] < count[("F", down)] or count[("F", down)] < n:
    if count[("F", down)] < n:
      add("F", down)
    add("I", down)
    add("W", down)
    add("F", up)
    add("I", up)
    add("W", up)
  for _ in range(r):
    add("I", down)
    add("I", up)
  for _ in range(d_count - r):
    add("I", down)
    add("W", down)
  while count[("W", up)] < count[("I", up)]:
    add("W", up)
  while count[("W", down)] < count[("I", down)]:
    add("W", down)
  return [a for a in order if a.microbatch < m_count]


def _dualpipev(r: int, d_count: int, m_count: int) -> list[Action | Overlap]:
  """DualPipeV on device r (stages r and 2D-1-r), in the order torch's ScheduleDualPipeV gives
  (DeepSeek's dualpipev.py's eight steps)."""
  down, up = r, 2 * d_count - 1 - r
  order: list[Action | Overlap] = []
  next_f = {down: 0, up: 0}
  next_b = {down: 0, up: 0}  # the next micro-batch to get a backward (B, or I)
  waiting_w: list[Action] = []

  def forward(stage: int) -> Action:
    a = Action("F", stage, next_f[stage])
    next_f[stage] += 1
    return a

  def backward(stage: int, kind: str) -> Action:
    a = Action(kind, stage, next_b[stage])
    next_b[stage] += 1
    if kind == "I":
      waiting_w.append(Action("W", stage, a.microbatch))
    return a

  def weight():
    if waiting_w:
      order.append(waiting_w.pop(0))

  for _ in range(2 * (d_count - 1 - r)):  # 1: F0
    order.append(forward(down))
  for _ in range(r + 1):  # 2: F0 F1
    order.append(forward(down))
    order.append(forward(up))
  for _ in range(d_count - 1 - r):  # 3: I1 W F1
    order.append(backward(up, "I"))
    weight()
    order.append(forward(up))
  for i in range(m_count - 2 * d_count + r + 1):  # 4: (F0;B1) (F1;B0)
    if i == 0 and r == d_count - 1:
      order.append(forward(down))
      order.append(backward(up, "B"))
    else:
      order.append(Overlap(forward(down), backward(up, "B")))
    order.append(Overlap(forward(up), backward(down, "B")))
  for _ in range(d_count - 1 - r):  # 5: B1 (F1;B0)
    order.append(backward(up, "B"))
    order.append(Overlap(forward(up), backward(down, "B")))
  split = False
  for i in range(r + 1):  # 6: B1 B0, the second half split into I (W later)
    if i == (r + 1) // 2 and r % 2 == 1:
      split = True
    order.append(backward(up, "I" if split else "B"))
    if i == (r + 1) // 2 and r % 2 == 0:
      split = True
    order.append(backward(down, "I" if split else "B"))
  for _ in range(d_count - 1 - r):  # 7: W B0
    weight()
    order.append(backward(down, "I" if split else "B"))
  for _ in range(r + 1):  # 8: W
    weight()
  return order


# ---- costs ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _simulate(schedule: Schedule, costs: tuple[tuple[str, float], ...] = tuple(_COST.items())
              ) -> tuple[tuple[tuple[float, float], ...], ...]:
  """Per device, (start, end) of each action of its order, each at its earliest start given the
  costs of a stage's action (default: the unit costs of the module docstring; a chunk of a
  v-stages-per-device schedule costs 1/v), the device's order and what it needs."""
  orders = schedule.orders()
  scale = 1 / schedule.stages_per_device
  cost = dict(costs)
  num_stages = schedule.num_stages
  finish: dict[tuple[str, int, int], float] = {}
  times: list[list[tuple[float, float]]] = [[] for _ in orders]
  free = [0.0] * len(orders)
  while True:
    progress = False
    for d, order in enumerate(orders):
      while len(times[d]) < len(order):
        item = order[len(times[d])]
        needs = [k for a in item.leaves for k in _needs(a, num_stages)]
        if not all(k in finish for k in needs):
          break
        start = max([free[d]] + [finish[k] for k in needs])
        end = start + scale * sum(cost[a.kind] for a in item.leaves)
        times[d].append((start, end))
        free[d] = end
        for a in item.leaves:
          for k in _done_keys(a):
            finish[k] = end
        progress = True
    if all(len(times[d]) == len(o) for d, o in enumerate(orders)):
      return tuple(tuple(t) for t in times)
    if not progress:
      Schedule.from_orders(orders)  # raises, naming the deadlock
      raise AssertionError("the event simulation stalled on orders that do not deadlock")


def bubble(schedule: Schedule) -> float:
  """The idle share of devices x makespan with F = I = W = 1 unit, B = 2, an overlapped pair the
  sum, a stage of a v-stages-per-device schedule 1/v of that; every action at its earliest start
  given its device's order and its dependencies (module docstring)."""
  times = _simulate(schedule)
  makespan = max((t[-1][1] for t in times if t), default=0.0)
  busy = sum(end - start for t in times for start, end in t)
  return 1.0 - busy / (schedule.num_devices * makespan)


def makespan(schedule: Schedule, forward: float, backward: float) -> tuple[float, float]:
  """(makespan, busy device-time) of one mini-batch when a stage's forward costs `forward`, its
  full backward `backward` and each half of a split one backward / 2 (a chunk of a v-stages-per-
  device schedule 1/v of these), every action at its earliest start (as `bubble`)."""
  times = _simulate(schedule, (("F", forward), ("I", backward / 2), ("W", backward / 2),
                               ("B", backward)))
  span = max((t[-1][1] for t in times if t), default=0.0)
  return span, sum(end - start for t in times for start, end in t)


def peak_inflight(schedule: Schedule) -> tuple[float, ...]:
  """Per device, the most micro-batch activations held at once, in stage units (a stage's
  activations of one micro-batch = 1; a chunk of a v-stages-per-device schedule = 1/v): held from
  the F until the B, or the W when the backward is split, that frees them."""
  scale = 1 / schedule.stages_per_device
  peaks = []
  for order in schedule.orders():
    held = peak = 0
    for item in order:
      for a in item.leaves:  # an Overlap counts its forward before its backward frees
        if a.kind == "F":
          held += 1
          peak = max(peak, held)
        elif a.kind in "BW":
          held -= 1
    peaks.append(peak * scale)
  return tuple(peaks)
