"""One 1F1B run's inputs from the placed timeline (`jlp.pipeline.placement`): the tick table of
every device, the mini-batches each pipeline takes, and the sync mode's events.

The run is the placement's events between two cuts (`Placement.take`) on ticks of their own
(`Placement.local_ticks`). Each pipeline numbers its mini-batches in the fill, m = 0, 1, ...; it
keeps its last S in a ring (slot m mod S) and receives this run's new ones as slots S + k.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jlp.pipeline import schedules as sched
from jlp.pipeline.placement import Placement

__all__ = ["RunTables", "bucket", "make_run_tables"]


def bucket(n: int, low: int = 1) -> int:
  """The power of two >= max(n, low): run shapes come from a few compiled programs."""
  size = low
  while size < n:
    size *= 2
  return size


@dataclasses.dataclass
class RunTables:
  """One run's inputs (module docstring). Tables [T, N, S] padded with idle ticks to `T`."""
  ticks: int  # ticks the run needs (before padding)
  kind: np.ndarray
  m: np.ndarray
  slot: np.ndarray
  global_batch: np.ndarray
  keep: np.ndarray  # [N, S]
  events: dict[str, np.ndarray]
  new: list[list[int]]  # per pipeline: its new mini-batches' m, in order
  completed: list[tuple[int, int]]  # (pipeline, m) of the mini-batches completed, in order
  updates: list[tuple[int, int, int]]  # (pipeline, stage, m) of the updates made
  group_sizes: list[int]


def make_run_tables(placement: Placement, nodes: list, taken_before: list[int],
                    taken_after: list[int], fed_start: list[int], sync: str,
                    plan_mix: Any = None, group_override: dict | None = None) -> RunTables:
  """The tables of the run made of `nodes` (cut order). taken_before / taken_after: each
  pipeline's mini-batches taken in the fill before / by the end of the run; fed_start: its
  mini-batches before the fill; plan_mix(global mini-batch, stage) -> [N, N]: a plan's matrix,
  averaged at every update (the placement then aligned); group_override: the group a mix node
  applies instead of the one it formed with (a flush's, `executor._drain_nodes`)."""
  N, S = placement.N, placement.S
  local = placement.local_ticks(nodes)
  ticks = max(local.values()) + 1 if local else 0
  T = bucket(ticks, 4)
  kind = np.zeros((T, N, S), np.int32)
  m_table = np.zeros((T, N, S), np.int32)
  slot = np.zeros((T, N, S), np.int32)
  global_batch = np.zeros((T, N, S), np.int32)

  def slot_of(i: int, m: int) -> int:
    return m % S if m < taken_before[i] else S + m - taken_before[i]

  events: dict[str, np.ndarray] = {}
  if sync in ("preduce", "adpsgd"):
    events = dict(mix=np.broadcast_to(np.eye(N, dtype=np.float32), (T, S, N, N)).copy(),
                  has_mix=np.zeros((T, S), bool))
  elif sync == "hetpipe":
    events = dict(push=np.full((T, S, N), -1, np.int32), pull=np.zeros((T, N, S), bool))
  pushes: dict[tuple[int, int], list[tuple[float, int]]] = {}
  completed, updates, group_sizes = [], [], []
  group_of = {node: group for group, node in placement.groups}
  group_of.update(group_override or {})
  for node in nodes:
    t = local[node]
    if node[0] == "op":
      _, i, s, op_kind, m = node
      if kind[t, i, s] != sched.IDLE:
        raise AssertionError(f"two ops of device ({i}, {s}) at tick {t}")  # a bug
      kind[t, i, s], m_table[t, i, s] = op_kind, m
      slot[t, i, s], global_batch[t, i, s] = slot_of(i, m), fed_start[i] + m
      if op_kind == sched.BWD:
        updates.append((i, s, m))
        if s == 0:
          completed.append((i, m))
        if sync == "hetpipe":
          pushes.setdefault((t, s), []).append((placement.push_index[node], i))
        if plan_mix is not None:
          events["has_mix"][t, s] = True
          events["mix"][t, s, i] = plan_mix(fed_start[i] + m, s)[i]
    elif node[0] == "mix":
      group = group_of[node]
      group_sizes.append(len(group.members))
      if len(group.members) > 1:
        rows = list(group.members)
        events["has_mix"][t, group.stage] = True
        events["mix"][t, group.stage, rows] = events["mix"][t, group.stage, rows].mean(axis=0)
    elif node[0] == "pull":
      _, i, s, _ = node
      events["pull"][t, i, s] = True
  for (t, s), arrivals in pushes.items():
    order = [i for _, i in sorted(arrivals)]
    events["push"][t, s, :len(order)] = order
  keep = np.zeros((N, S), np.int32)
  for i in range(N):
    for m in range(max(0, taken_after[i] - S), taken_after[i]):
      keep[i, m % S] = slot_of(i, m)
    for p in range(S):  # positions no mini-batch has reached keep what they hold
      if taken_after[i] - S + ((p - taken_after[i]) % S) < 0:
        keep[i, p] = p
  new = [list(range(taken_before[i], taken_after[i])) for i in range(N)]
  return RunTables(ticks, kind, m_table, slot, global_batch, keep, events, new, completed,
                   updates, group_sizes)
