"""Pipeline schedules as static tables: which op every stage runs at every tick.

A schedule is first an *order* per stage (a list of ops), then a *tick table* that places every op
at the earliest unit-time tick its dependencies allow (docs/sdpipe.md#schedules):

  * F(b, m) at stage s needs F(b, m) at stage s - 1 in an earlier tick (its input activation);
  * B(b, m) at stage s needs B(b, m) at stage s + 1 in an earlier tick (its output gradient), or,
    on the last stage, F(b, m) at the same stage in an earlier tick;
  * a stage runs at most one op per tick, in its order.

Schedules (S stages, ops named by 0-based mini-batch b and micro-batch m):

  "gpipe"  (GPipe, Huang et al. 2019; torchgpipe): one mini-batch of M micro-batches, fill-drain:
           every stage runs F(0, 0..M-1), then B(0, M-1..0). 2(M + S - 1) ticks; one optimizer
           update per mini-batch (the executor), after the table.
  "1f1b"   (PipeDream, Narayanan et al. SOSP'19, as SD-PIPE's Hetu executor runs it,
           docs/sdpipe.md#schedules): B mini-batches, no micro-batches; stage s runs F(0..S-s-1)
           (warm-up), then alternates B(k), F(k + S - s) while forwards remain, then the remaining
           B's (drain). 2B + 2(S - 1) ticks. Each B is its own optimizer update at its stage.

The bubble fraction of a table is the share of its (tick, stage) slots that are idle; for GPipe it
is (S - 1) / (M + S - 1) (Huang et al. 2019, §2.2).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["BWD", "FWD", "IDLE", "SCHEDULES", "Table", "bubble_fraction", "continuous_1f1b",
           "drain_1f1b", "stage_order", "tick_table"]

SCHEDULES = ("gpipe", "1f1b")
IDLE, FWD, BWD = 0, 1, 2

#: One op: (kind, mini-batch b, micro-batch m), kind FWD or BWD.
Op = tuple[int, int, int]


def _check(schedule: str, num_stages: int, num_batches: int, num_microbatches: int) -> None:
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r} is not allowed; expected one of {SCHEDULES}.")
  for name, value in (("num_stages", num_stages), ("num_batches", num_batches),
                      ("num_microbatches", num_microbatches)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}={value!r} is not allowed; expected an integer >= 1.")
  if schedule == "1f1b" and num_microbatches != 1:
    raise ValueError(f"num_microbatches={num_microbatches} is not allowed with schedule='1f1b'; "
                     "expected 1 (every mini-batch is its own update, docs/sdpipe.md#schedules).")
  if schedule == "gpipe" and num_batches != 1:
    raise ValueError(f"num_batches={num_batches} is not allowed with schedule='gpipe'; expected "
                     "1 (the table covers one mini-batch; the executor repeats it).")


def stage_order(schedule: str, num_stages: int, num_batches: int = 1,
                num_microbatches: int = 1) -> list[list[Op]]:
  """The ops of every stage in the order the stage runs them (module docstring)."""
  _check(schedule, num_stages, num_batches, num_microbatches)
  orders = []
  for s in range(num_stages):
    if schedule == "gpipe":
      m = num_microbatches
      order = [(FWD, 0, i) for i in range(m)] + [(BWD, 0, i) for i in reversed(range(m))]
    else:
      warm = min(num_stages - s, num_batches)
      order = [(FWD, b, 0) for b in range(warm)]
      next_fwd = warm
      for b in range(num_batches):
        order.append((BWD, b, 0))
        if next_fwd < num_batches:
          order.append((FWD, next_fwd, 0))
          next_fwd += 1
    orders.append(order)
  return orders


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
  """A tick table: kind[t, s] in {IDLE, FWD, BWD}, batch[t, s] and micro[t, s] (-1 when idle)."""
  schedule: str
  kind: np.ndarray
  batch: np.ndarray
  micro: np.ndarray

  @property
  def num_ticks(self) -> int:
    return self.kind.shape[0]

  @property
  def num_stages(self) -> int:
    return self.kind.shape[1]

  def render(self) -> str:
    """The table as text, one row per stage ("F3" = forward of op index 3, "." = idle)."""
    rows = []
    for s in range(self.num_stages):
      cells = []
      for t in range(self.num_ticks):
        k = self.kind[t, s]
        index = self.micro[t, s] if self.schedule == "gpipe" else self.batch[t, s]
        cells.append("." if k == IDLE else f"{'F' if k == FWD else 'B'}{index}")
      rows.append(f"stage {s}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(rows)


def tick_table(schedule: str, num_stages: int, num_batches: int = 1,
               num_microbatches: int = 1) -> Table:
  """Every op of `stage_order` at its earliest tick (module docstring)."""
  orders = stage_order(schedule, num_stages, num_batches, num_microbatches)
  done: dict[tuple[int, int, int, int], int] = {}  # (kind, b, m, stage) -> tick it ran
  position = [0] * num_stages
  columns: list[list[Op | None]] = [[] for _ in range(num_stages)]
  t = 0
  while any(position[s] < len(orders[s]) for s in range(num_stages)):
    ran = []
    for s in range(num_stages):
      if position[s] == len(orders[s]):
        columns[s].append(None)
        continue
      kind, b, m = orders[s][position[s]]
      if kind == FWD:
        need = None if s == 0 else (FWD, b, m, s - 1)
      else:
        need = (FWD, b, m, s) if s == num_stages - 1 else (BWD, b, m, s + 1)
      if need is None or done.get(need, t) < t:
        columns[s].append((kind, b, m))
        ran.append((kind, b, m, s))
        position[s] += 1
      else:
        columns[s].append(None)
    if not ran:
      raise AssertionError(f"schedule {schedule!r} deadlocks at tick {t}")  # a bug, not input
    for key in ran:
      done[key] = t
    t += 1
  kind = np.zeros((t, num_stages), np.int32)
  batch = np.full((t, num_stages), -1, np.int32)
  micro = np.full((t, num_stages), -1, np.int32)
  for s, column in enumerate(columns):
    for i, op in enumerate(column):
      if op is not None:
        kind[i, s], batch[i, s], micro[i, s] = op
  return Table(schedule, kind, batch, micro)


def _first_forward(table: Table, batch: int) -> int:
  """The tick of F(batch) at stage 0."""
  return int(np.nonzero((table.kind[:, 0] == FWD) & (table.batch[:, 0] == batch))[0][0])


def _shifted(table: Table, start: int, stop: int, shift: int) -> Table:
  kind = table.kind[start:stop].copy()
  batch = np.where(kind == IDLE, -1, table.batch[start:stop] + shift).astype(np.int32)
  micro = np.where(kind == IDLE, -1, 0).astype(np.int32)
  return Table("1f1b", kind, batch, micro)


def continuous_1f1b(num_stages: int, first: int, count: int) -> Table:
  """The ticks of 1F1B with no end (mini-batches 0, 1, ... forever) from the forward of
  mini-batch `first` at stage 0 (included) to that of `first + count` (excluded): the run that
  feeds `count` more mini-batches to a pipeline that has been fed `first`. The table of B
  mini-batches is this infinite table with the forwards of b >= B left out (its ops keep their
  ticks), so runs of any lengths followed by `drain_1f1b` run every op at the tick one table of
  all the mini-batches gives it. From the forward of mini-batch 2S on, the infinite table repeats
  every 2 ticks (one mini-batch later), so only the first 2S + count + 1 mini-batches are laid
  out."""
  _check("1f1b", num_stages, max(count, 1), 1)
  if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or first < 0:
    raise ValueError(f"first={first!r} is not allowed; expected an integer >= 0.")
  shift = max(0, first - 2 * num_stages)
  table = tick_table("1f1b", num_stages, first - shift + count + 1)
  return _shifted(table, _first_forward(table, first - shift),
                  _first_forward(table, first - shift + count), shift)


def drain_1f1b(num_stages: int, fed: int) -> Table:
  """The ticks that complete a 1F1B pipeline fed `fed` mini-batches (the end of the table of
  `fed` mini-batches, from where the next forward would have been at stage 0); no ticks when
  fed = 0."""
  _check("1f1b", num_stages, 1, 1)
  if isinstance(fed, bool) or not isinstance(fed, (int, np.integer)) or fed < 0:
    raise ValueError(f"fed={fed!r} is not allowed; expected an integer >= 0.")
  if fed == 0:
    return Table("1f1b", np.zeros((0, num_stages), np.int32),
                 np.zeros((0, num_stages), np.int32), np.zeros((0, num_stages), np.int32))
  shift = max(0, fed - 2 * num_stages)
  start = _first_forward(tick_table("1f1b", num_stages, fed - shift + 1), fed - shift)
  table = tick_table("1f1b", num_stages, fed - shift)
  return _shifted(table, start, table.num_ticks, shift)


def bubble_fraction(table: Table) -> float:
  """The share of idle (tick, stage) slots of `table`."""
  return float(np.mean(table.kind == IDLE))
