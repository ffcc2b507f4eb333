"""How the N pipelines synchronise, per stage, at every update (sdpipe.md §1.3, §2, §3): one
small strategy object per `Pipeline(sync=...)` mode, called by the jitted program
(`jlp.pipeline.program`) inside `jax.shard_map` on one device (pipeline i, stage s) of the
("data", "stage") mesh.

Each mode has two hooks around the stage's optimizer step:
  `gradients`     the gradient the step applies (default: the pipeline's own);
  `after_update`  the weights the stage keeps after the step (default: the stepped ones).
Both take `do_update` (whether this tick updates the stage: a backward of 1F1B, the end of a GPipe
mini-batch). The pipelines of one stage update at the same ticks, so every collective over "data"
runs inside `lax.cond(do_update, ...)`: on the ticks that update only, and met by every pipeline.

Modes:
  "allreduce"  `AllReduce`: the step uses sum_i gradient_i / N, summed by
               `jlp.sync.reduce_gradients` with the pipeline's `GradSync` on the stage's own
               gradient (one flat leaf of its own length, never the padded buffer) and the
               stage's own compression state.
  "none"       `Local`: every pipeline trains alone.
  "preduce", "adpsgd"  `Mixing`: after the local step, x_i <- sum_j mix[b, s, i, j] x_j with the
               mixing matrix of update b of stage s (a jitted input, one compile for every
               grouping); optimizer states and stashed weights are never mixed (§2.1).
  "hetpipe"    `HetPipeServer`: a parameter-server copy per stage takes every pipeline's delta / N
               in pipeline order; every `pull_every`-th mini-batch (counted over the whole
               training) the local weights are replaced by the copy (§3.2).
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
                   delta: jax.Array, do_update: jax.Array, batch_index: jax.Array,
                   global_batch: jax.Array, mix: jax.Array | None
                   ) -> tuple[jax.Array, dict[str, Any]]:
    """(the packed float32 weights the stage keeps, carry), given the stepped weights and the
    step's delta (zeros where the tick does not update)."""
    del stage, delta, do_update, batch_index, global_batch, mix
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
  """sync="preduce" / "adpsgd": model averaging with the plan's mixing matrices."""
  num_pipelines: int
  uses_mix = True

  def after_update(self, carry, stage, params, delta, do_update, batch_index, global_batch, mix):
    del delta, global_batch

    def mixed(params):
      everyone = lax.all_gather(params, DATA)  # [N, L]
      row = mix[batch_index, stage, lax.axis_index(DATA)]
      out = everyone[0] * row[0]
      for j in range(1, self.num_pipelines):
        out = out + everyone[j] * row[j]
      return out

    return lax.cond(do_update, mixed, lambda params: params, params), carry


@dataclasses.dataclass(frozen=True, eq=False)
class HetPipeServer(SyncMode):
  """sync="hetpipe": the parameter-server copy and the periodic pull."""
  num_pipelines: int
  pull_every: int
  uses_server = True

  def after_update(self, carry, stage, params, delta, do_update, batch_index, global_batch, mix):
    del stage, batch_index, mix
    N = self.num_pipelines

    def push(server, delta):
      deltas = lax.all_gather(delta, DATA)
      for j in range(N):
        server = server + deltas[j] * np.float32(1.0 / N)
      return server

    server = lax.cond(do_update, push, lambda server, delta: server,
                      carry["global_params"]["float32"], delta)
    carry = dict(carry, global_params={"float32": server})
    pull = jnp.logical_and(do_update, (global_batch + 1) % self.pull_every == 0)
    return jnp.where(pull, server, params), carry


def sync_mode(sync: str, *, num_pipelines: int, grad_sync: GradSync, lengths: tuple[int, ...],
              state_packer: Packer | None, pull_every: int) -> SyncMode:
  """The strategy object of `sync` (one of jlp.pipeline.SYNC_MODES, checked by Pipeline)."""
  if sync == "allreduce":
    return AllReduce(grad_sync, num_pipelines, lengths, state_packer)
  if sync in ("preduce", "adpsgd"):
    return Mixing(num_pipelines)
  if sync == "hetpipe":
    return HetPipeServer(num_pipelines, pull_every)
  return Local()
