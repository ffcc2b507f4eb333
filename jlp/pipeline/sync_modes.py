"""How the N pipelines synchronise, per stage, at every update
(docs/sdpipe.md#syncs-across-pipelines): one small strategy object per `Pipeline(sync=...)` mode,
called by the jitted program (`jlp.pipeline.program`) inside `jax.shard_map` on one device (pipeline
i, stage s) of the ("data", "stage") mesh.

Each mode has two hooks around the stage's optimizer step:
  `gradients`     the gradient the step applies (default: the pipeline's own);
  `after_update`  the weights the stage keeps after the step (default: the stepped ones).
`gradients` takes `do_update` (whether this tick updates the stage: a backward of 1F1B, the end of
a GPipe mini-batch); with "allreduce" the pipelines of one stage update at the same ticks, so its
collective runs inside `lax.cond(do_update, ...)`, met by every pipeline. `after_update` runs at
every tick with the tick's events; its collectives run inside a `lax.cond` on an event that is the
same on every pipeline of the stage.

Modes:
  "allreduce"  `AllReduce`: the step uses sum_i gradient_i / N, summed by
               `jlp.sync.reduce_gradients` with the pipeline's `GradSync` on the stage's own
               gradient (one flat leaf of its own length, never the padded buffer) and the
               stage's own compression state.
  "none"       `Local`: every pipeline trains alone.
  "preduce", "adpsgd"  `Mixing`: at the ticks a group averages (after the step), x_i <- sum_j
               mix[i, j] x_j with the tick's mixing matrix (a jitted input, one compile for every
               grouping); optimizer states and stashed weights are never mixed.
  "hetpipe"    `HetPipeServer`: a parameter-server copy per stage takes each pushed delta / N in
               arrival order; a pull replaces the local weights by the copy.
The ticks of the averages, pushes and pulls are the events of `after_update`, inputs of the
program (`jlp.pipeline.placement` places them from the virtual-time timeline).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.pipeline.packing import Packer
from jlp.sync import SYNC_REPORT, GradSync, reduce_gradients

__all__ = ["AllReduce", "HetPipeServer", "Local", "Mixing", "SyncMode", "sync_mode"]

DATA = "data"


def _no_report() -> dict[str, jax.Array]:
  return {name: jnp.zeros((), dtype) for name, dtype in SYNC_REPORT.items()}


class SyncMode:
  """The hooks of one sync mode (module docstring); the base class is "none"."""

  #: whether the jitted program takes the plan's mixing matrices as an input.
  uses_mix: bool = False
  #: whether the mode keeps a parameter-server copy (PipelineState.global_params).
  uses_server: bool = False
  #: whether the mode reports the gradient sync's bytes (jlp.sync.SYNC_REPORT) per mini-batch.
  reports: bool = False

  def gradients(self, carry: dict[str, Any], stage: jax.Array, grads: jax.Array,
                do_update: jax.Array, batch_index: jax.Array, global_batch: jax.Array
                ) -> tuple[jax.Array, dict[str, Any]]:
    """(the packed float32 gradient the stage's step applies, carry)."""
    del stage, do_update, batch_index, global_batch
    return grads, carry

  def after_update(self, carry: dict[str, Any], stage: jax.Array, params: jax.Array,
                   delta: jax.Array, events: dict[str, jax.Array]
                   ) -> tuple[jax.Array, dict[str, Any]]:
    """(the packed float32 weights the stage keeps, carry), given the stepped weights and the
    step's delta (zeros where the tick does not update), at every tick, updating or not.
    `events`: the tick's row of the mode's events (`Mixing`, `HetPipeServer`), the same on every
    device."""
    del stage, delta, events
    return params, carry


class Local(SyncMode):
  """sync="none": N independent pipelines."""


@dataclasses.dataclass(frozen=True, eq=False)
class AllReduce(SyncMode):
  """sync="allreduce": the mean gradient over the pipelines, by `grad_sync`, on each stage's own
  gradient: stage s's float32 parameters are the first `lengths[s]` elements of its packed buffer,
  and its compression state is `state_packer`'s stage s (None without compression)."""
  grad_sync: GradSync
  num_pipelines: int
  lengths: tuple[int, ...]
  state_packer: Packer | None
  reports = True

  def gradients(self, carry, stage, grads, do_update, batch_index, global_batch):
    branches = [self._stage(s, global_batch) for s in range(len(self.lengths))]

    def synced(packed, own):
      return lax.switch(stage, branches, packed, own)

    def skipped(packed, own):
      return packed, own, _no_report()

    carry = dict(carry)
    summed, carry["sync_state"], report = lax.cond(do_update, synced, skipped, grads,
                                                   carry["sync_state"])
    carry["sync_report"] = {
        name: v.at[batch_index].set(jnp.where(do_update, report[name], v[batch_index]))
        for name, v in carry["sync_report"].items()}
    return summed, carry

  def _stage(self, s: int, global_batch: jax.Array):
    """Stage s's sync as a `lax.switch` branch: (packed gradient [L], packed state) -> (summed
    packed gradient, new packed state, report)."""
    length, scale = self.lengths[s], np.float32(1.0 / self.num_pipelines)

    def branch(packed, state):
      own = None if state is None else self.state_packer.unpack(s, state)
      # The stage index is folded into the sync's random stream: every stage draws its own.
      summed, new_state, report = reduce_gradients({"stage": packed[:length] * scale},
                                                   self.grad_sync, own, global_batch, stream=s)
      # A pad, not an update of a zero buffer: jax 0.11's Shardy crashes compiling an update
      # that covers the whole buffer (the longest stage's).
      summed = jnp.pad(summed["stage"], (0, packed.shape[0] - length))
      new_state = None if state is None else self.state_packer.pack(s, new_state)
      return summed, new_state, {name: report[name].astype(dtype)
                                 for name, dtype in SYNC_REPORT.items()}
    return branch


@dataclasses.dataclass(frozen=True, eq=False)
class Mixing(SyncMode):
  """sync="preduce" / "adpsgd": model averaging. events: "has_mix" bool [S] (stage s averages at
  this tick) and "mix" float32 [S, N, N] (its matrix: the groups' rows, identity elsewhere)."""
  num_pipelines: int
  uses_mix = True

  def after_update(self, carry, stage, params, delta, events):
    del delta

    def mixed(params):
      everyone = lax.all_gather(params, DATA)  # [N, L]
      row = events["mix"][stage, lax.axis_index(DATA)]
      out = everyone[0] * row[0]
      for j in range(1, self.num_pipelines):
        out = out + everyone[j] * row[j]
      return out

    return lax.cond(events["has_mix"][stage], mixed, lambda params: params, params), carry


@dataclasses.dataclass(frozen=True, eq=False)
class HetPipeServer(SyncMode):
  """sync="hetpipe": the parameter-server copy. events: "push" int32 [S, N] (the pipelines whose
  update of this tick pushes its delta, in arrival order, then -1) and "pull" bool [N, S] (the
  local weights become the server's, after the pushes)."""
  num_pipelines: int
  uses_server = True

  def after_update(self, carry, stage, params, delta, events):
    N = self.num_pipelines
    order = events["push"][stage]

    def push(server, delta):
      deltas = lax.all_gather(delta, DATA)
      for k in range(N):
        j = order[k]
        server = jnp.where(j >= 0, server + deltas[jnp.maximum(j, 0)] * np.float32(1.0 / N),
                           server)
      return server

    server = lax.cond(order[0] >= 0, push, lambda server, delta: server,
                      carry["global_params"]["float32"], delta)
    carry = dict(carry, global_params={"float32": server})
    pull = events["pull"][lax.axis_index(DATA), stage]
    return jnp.where(pull, server, params), carry


def sync_mode(sync: str, *, num_pipelines: int, grad_sync: GradSync, lengths: tuple[int, ...],
              state_packer: Packer | None) -> SyncMode:
  """The strategy object of `sync` (one of jlp.pipeline.SYNC_MODES, checked by Pipeline)."""
  if sync == "allreduce":
    return AllReduce(grad_sync, num_pipelines, lengths, state_packer)
  if sync in ("preduce", "adpsgd"):
    return Mixing(num_pipelines)
  if sync == "hetpipe":
    return HetPipeServer(num_pipelines)
  return Local()
