"""The buffer layout of one `Pipeline.run` input shape: the schedule's tick table and how many ring
slots each per-device buffer needs.

Every device holds, as rings indexed by (micro-)batch mod K:
  recv_x       activations received from the stage above, from their arrival to the backward
               that last reads them;
  recv_g       input gradients received from the stage below, until the backward that reads them;
  stash_w      1F1B's stashed weights (PipeDream's weight stashing), from a forward to its
               backward; stash_state likewise for stateful stages' state (both schedules).
K is the smallest ring size under which no two items that live at once on a stage share a slot,
taken over all stages (every device runs the same SPMD program, so one size for all).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jlp.pipeline import schedules as sched
from jlp.pipeline.packing import Packer

__all__ = ["Layout", "make_layout", "ring_slots", "write_slot"]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Everything static about one `run` input shape."""
  num_batches: int
  table: sched.Table
  act: Packer  # the S - 1 inter-stage values, as float32 structs
  act_dtypes: tuple  # per boundary: the original leaf dtypes
  x_slots: int
  w_slots: int
  g_slots: int
  metric_names: tuple[str, ...]  # "loss", then the names of loss_fn's aux

  def pack_act(self, boundary: int, tree: Any) -> jax.Array:
    """The value crossing `boundary` (after stage `boundary`) as one flat float32 buffer."""
    tree = jax.tree.map(lambda a: a.astype(jnp.float32), tree)
    return self.act.pack(boundary, tree)["float32"]

  def unpack_act(self, boundary: int, flat: jax.Array) -> Any:
    """The inverse of `pack_act`, each leaf back in its own dtype."""
    tree = self.act.unpack(boundary, {"float32": flat})
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x.astype(d) for x, d in zip(leaves, self.act_dtypes[boundary], strict=True)]
    return jax.tree.unflatten(treedef, leaves)


def ring_slots(table: sched.Table, starts: dict, ends: dict) -> int:
  """The smallest K such that no two items live at once on a stage share index mod K; an item
  (stage, index) lives from tick starts[key] to ends[key] (both inclusive)."""
  best = 1
  for s in range(table.num_stages):
    items = [(starts[k], ends[k], k[1]) for k in starts if k[0] == s]
    for k in range(1, len(items) + 2):
      ok = all(not (a[2] % k == b[2] % k and a[0] <= b[1] and b[0] <= a[1])
               for n, a in enumerate(items) for b in items[n + 1:])
      if ok:
        best = max(best, k)
        break
  return best


def make_layout(schedule: str, num_stages: int, num_batches: int, num_microbatches: int,
                act: Packer, act_dtypes: tuple, metric_names: tuple[str, ...]) -> Layout:
  """The layout of a run of `num_batches` mini-batches and the ring sizes its ops need: GPipe's
  one-mini-batch table (repeated per mini-batch); for 1F1B, whose runs are cuts of one table
  with no end (`schedules.continuous_1f1b`), the table of 4S mini-batches (warm-up, more than
  2S ticks of the steady state that then repeats, drain): ring sizes that hold for every run,
  so the in-flight buffers keep their shapes from one run to the next."""
  S = num_stages
  if schedule == "gpipe":
    table = sched.tick_table("gpipe", S, 1, num_microbatches)
  else:
    table = sched.tick_table("1f1b", S, 4 * S, 1)
  x_starts, x_ends, w_starts, w_ends, g_starts, g_ends = {}, {}, {}, {}, {}, {}
  for t in range(table.num_ticks):
    for s in range(S):
      kind = table.kind[t, s]
      index = table.micro[t, s] if schedule == "gpipe" else table.batch[t, s]
      if kind == sched.FWD:
        w_starts[(s, index)] = t
        if s + 1 < S:
          x_starts[(s + 1, index)] = t
      elif kind == sched.BWD:
        w_ends[(s, index)] = t
        x_ends[(s, index)] = t
        if s > 0:
          g_starts[(s - 1, index)] = t
        if s < S - 1:
          g_ends[(s, index)] = t
  x_slots, w_slots = ring_slots(table, x_starts, x_ends), ring_slots(table, w_starts, w_ends)
  g_slots = ring_slots(table, g_starts, g_ends)
  if schedule == "1f1b":
    # Pipelines that progress by their own clocks: a stage holds at most S - s + 1 received
    # activations, S - s stashed versions and S - s received gradients (1F1B's order bounds them,
    # whatever the timing), consecutive mini-batches each.
    x_slots, w_slots, g_slots = max(x_slots, S), max(w_slots, S), max(g_slots, S)
  return Layout(num_batches, table, act, act_dtypes, x_slots, w_slots, g_slots, metric_names)


def write_slot(buffers: Any, slot: jax.Array, values: Any, when: jax.Array) -> Any:
  """`buffers` (a pytree of [K, ...] ring buffers) with entry `slot` replaced by `values` where
  `when` holds, kept otherwise: one slot read and written, not the whole buffer."""
  return jax.tree.map(lambda b, v: b.at[slot].set(jnp.where(when, v, b[slot])), buffers, values)
