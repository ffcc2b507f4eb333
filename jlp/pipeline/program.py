"""The jitted program of `jlp.pipeline.Pipeline`: what every device (pipeline i, stage s) of the
("data", "stage") mesh runs inside one `jax.shard_map` for one `Pipeline.run`
(docs/sdpipe.md#schedules).

A loop over the ticks of the schedule (GPipe: a `lax.scan` over its static one-mini-batch table,
inside a scan over the mini-batches; 1F1B: a `lax.fori_loop` over the run's table, an input
placed from the virtual-time timeline by `jlp.pipeline.placement` / `run_tables`, one row per
device, with what is in flight carried in the state from one run to the next): at each tick the
device runs its stage's op of that tick (a `lax.switch` over stage x {idle, forward,
backward}), then the activations go one stage down and the input gradients one stage up with
`lax.ppermute` over "stage" (the collectives sit after the switch, so every device issues the same
ones), and what arrives is stored in the ring slots of its (micro-)batch (`jlp.pipeline.buffers`).
A backward recomputes its stage's forward from the stashed input and weights (`jax.vjp`;
activation memory is one input per in-flight micro-batch), except 1F1B's last stage, whose
backward comes right after its forward with the same weights and state: there the forward tick
does nothing and the backward runs the stage once (loss, gradients, new state). An update is the
stage's optimizer step between the sync mode's hooks (`jlp.pipeline.sync_modes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jlp.pipeline import schedules as sched
from jlp.pipeline.buffers import Layout, write_slot
from jlp.pipeline.packing import Packer
from jlp.pipeline.sync_modes import SyncMode
from jlp.sync import SYNC_REPORT

__all__ = ["PipelineState", "Program"]

DATA, STAGE = "data", "stage"


class PipelineState(NamedTuple):
  """Every pipeline's training state, each buffer [N, S, ...] sharded over ("data", "stage")."""
  step: jax.Array  # int32: mini-batches trained
  params: dict[str, jax.Array]  # {"float32": [N, S, L]} latest weights (jlp.pipeline.packing)
  opt_state: dict[str, jax.Array]  # {dtype: [N, S, L_dtype]}, one optax state per (pipeline, stage)
  model_state: dict[str, jax.Array]  # {dtype: [N, S, L_dtype]} stateful stages' state ({} if none)
  global_params: dict[str, jax.Array]  # sync="hetpipe": the parameter server's copy; else {}
  # grad_sync's compression state, each stage's own packed as {dtype: [N, S, L]} (None without
  # compression).
  sync_state: Any
  # float32 [N, S, 2]: the virtual second at which each (pipeline, stage) finished its last
  # update, as (whole seconds, fraction); the next run's simulation starts from it.
  virtual_time: jax.Array
  # int32: the mini-batch at which the pipeline was last empty (1F1B: its fill began there).
  fill_start: jax.Array
  # 1F1B: what the mini-batches in flight need, kept from one run to the next ({} when the
  # pipeline is empty): "buffers" (received activations and gradients, stashed weights and
  # states, [N, S, K, ...]), "xs" / "ys" (the last S mini-batches' inputs, [S, N*b, ...]),
  # "metrics" / "sync_report" ([N, S, S] per name) of those S, and "fill_clock" ([N, S, 2],
  # kept by the host: the clocks at which the fill began, where its virtual time starts).
  inflight: dict[str, Any]


def stage_steps(param_packer: Packer, opt_packer: Packer, optimizer: optax.GradientTransformation,
                num_stages: int, params: Any, grads: Any, opt: Any) -> list[Callable[[], Any]]:
  """One `lax.switch` branch per stage s: the optimizer step of stage s's packed weights `params`
  with its packed gradient `grads` and optimizer state `opt` (each {dtype: [L]}): (new params, new
  optimizer state, the updates), packed."""
  def step(s):
    def op():
      p, g = param_packer.unpack(s, params), param_packer.unpack(s, grads)
      updates, o = optimizer.update(g, opt_packer.unpack(s, opt), p)
      return (param_packer.pack(s, optax.apply_updates(p, updates)), opt_packer.pack(s, o),
              param_packer.pack(s, updates))
    return op
  return [step(s) for s in range(num_stages)]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """One run's per-device program (module docstring); `Pipeline` builds one per input shape.

  apply: apply(s, params_s, x, state_s) -> (y, new_state_s), stage s's call.
  loss_metrics: (y_last, target) -> {"loss", **aux}, float32 scalars.
  packers: the (params, optimizer states, stage states) Packers.
  """
  apply: Callable[[int, Any, Any, Any], tuple[Any, Any]]
  loss_metrics: Callable[[Any, Any], dict[str, jax.Array]]
  optimizer: optax.GradientTransformation
  packers: tuple[Packer, Packer, Packer]
  mode: SyncMode
  schedule: str
  num_pipelines: int
  num_stages: int
  num_microbatches: int
  layout: Layout
  pull_every: int  # GPipe's HetPipe pulls (1F1B's come with the events)

  def __call__(self, state: PipelineState, xs: Any, ys: Any, ticks: dict[str, jax.Array],
               mix: jax.Array | None) -> tuple[PipelineState, dict[str, jax.Array]]:
    """The per-device program (inside `jax.shard_map`): the run's ticks, then the new state and
    the run's metrics (`Pipeline.run` picks the completed mini-batches').

    GPipe: xs, ys [B, rows, ...], `ticks` {}, `mix` [B, S, N, N] or None; metrics: means over the
    pipelines (sync reports: per device, averaged over the devices), one entry per mini-batch.

    1F1B: xs, ys [K, rows, ...]: each pipeline's new mini-batches of the run, in the order it
    takes them (padded); `ticks`: the run's table, [T, N, S] per device: "kind" (IDLE, FWD,
    BWD), "m" (the op's mini-batch, counted in its pipeline's fill: ring-buffer entries),
    "slot" (where its input and metrics are: [0, S) the pipeline's ring of its last S
    mini-batches, S + k its k-th new one), "global" (the mini-batch over its pipeline's whole
    training: the sync's random stream); "count" (the ticks run: the table is padded);
    "batches" (the run's B, by which the step advances: data, so that one compiled program
    serves runs of any length whose tables pad to the same T and K); "keep" [N, S] (the slots
    that make the new ring); and "events" (the sync mode's, [T, ...]:
    `jlp.pipeline.sync_modes`). Metrics: per pipeline and slot, [N, S + K] on every device (the
    last stage's values and the stages' summed reports, gathered over the pipelines)."""
    squeeze = lambda tree: jax.tree.map(lambda x: x[0, 0], tree)
    stage = lax.axis_index(STAGE)
    carry = dict(params=squeeze(state.params), opt=squeeze(state.opt_state),
                 model_state=squeeze(state.model_state),
                 global_params=squeeze(state.global_params),
                 sync_state=squeeze(state.sync_state),
                 computed=jnp.int32(0))  # ticks in which this device ran its stage
    inflight = dict(state.inflight)
    last = stage == self.num_stages - 1
    if self.schedule == "1f1b":
      carry, inflight = self._run_1f1b(carry, inflight, stage, xs, ys, ticks)
      # Gathered over the pipelines, so every process holds all of them.
      out = {name: lax.all_gather(lax.psum(jnp.where(last, v, 0.0), STAGE), DATA)
             for name, v in carry["metrics"].items()}
      out.update({name: lax.all_gather(lax.psum(v, STAGE), DATA)
                  for name, v in carry["sync_report"].items()})
    else:
      carry = self._run_gpipe(self._with_metrics(carry, self.layout.num_batches), stage,
                              state.step, xs, ys, mix)
      out = {name: lax.psum(lax.psum(jnp.where(last, v, 0.0), STAGE), DATA) / self.num_pipelines
             for name, v in carry["metrics"].items()}
      # The sync's bytes per device, averaged over all N*S devices (each stage's devices sync
      # their own stage's gradient); non-finite elements summed over the stages.
      for name, v in carry["sync_report"].items():
        total = lax.psum(lax.psum(v, STAGE), DATA)
        out[name] = total // self.num_pipelines if name == "nonfinite" else total / (
            self.num_pipelines * self.num_stages)
    out["computed_slots"] = lax.psum(lax.psum(carry["computed"], STAGE), DATA)
    expand = lambda tree: jax.tree.map(lambda x: x[None, None], tree)
    batches = ticks["batches"] if self.schedule == "1f1b" else self.layout.num_batches
    new_state = state._replace(
        step=state.step + batches, params=expand(carry["params"]),
        opt_state=expand(carry["opt"]), model_state=expand(carry["model_state"]),
        global_params=expand(carry["global_params"]), sync_state=expand(carry["sync_state"]),
        inflight=inflight)
    return new_state, out

  def _with_metrics(self, carry: dict[str, Any], slots: int) -> dict[str, Any]:
    """carry with zero per-mini-batch metrics and sync reports for `slots` mini-batches."""
    return dict(carry,
                metrics={name: jnp.zeros((slots,), jnp.float32)
                         for name in self.layout.metric_names},
                sync_report={name: jnp.zeros((slots,), dtype) for name, dtype in
                             SYNC_REPORT.items()} if self.mode.reports else {})

  def _tick_buffers(self, stash_weights: bool) -> dict[str, Any]:
    param_packer, _, state_packer = self.packers
    act = self.layout.act.sizes.get("float32", 0)
    out = dict(recv_x=jnp.zeros((self.layout.x_slots, act), jnp.float32),
               recv_g=jnp.zeros((self.layout.g_slots, act), jnp.float32),
               stash_state=state_packer.zeros((self.layout.w_slots,), xp=jnp))
    if stash_weights:
      out["stash_w"] = param_packer.zeros((self.layout.w_slots,), xp=jnp)
    return out

  def _tick(self, carry, bufs, stage, kind, index, x_in, y_in, loss_scale,
            grad_acc=None):
    """One op of this device's stage: (act_out, grad_out, param gradient, new model state,
    metrics: {"loss", aux...} of a last-stage backward, else zeros). With `grad_acc` (GPipe's
    sum over micro-batches) a backward returns grad_acc + its gradient and the other ops
    grad_acc, so that only backwards touch the sum."""
    param_packer, _, state_packer = self.packers
    S = self.num_stages
    act_len = self.layout.act.sizes.get("float32", 0)
    slot_x = index % self.layout.x_slots
    slot_w = index % self.layout.w_slots
    slot_g = index % self.layout.g_slots
    latest = carry["params"]
    stashed_w = (jax.tree.map(lambda b: b[slot_w], bufs["stash_w"]) if "stash_w" in bufs
                 else latest)
    stashed_state = jax.tree.map(lambda b: b[slot_w], bufs["stash_state"])
    recv_x = bufs["recv_x"][slot_x]
    recv_g = bufs["recv_g"][slot_g]
    zeros_act = jnp.zeros((act_len,), jnp.float32)
    zeros_grad = jax.tree.map(jnp.zeros_like, latest) if grad_acc is None else grad_acc
    no_metrics = {name: jnp.float32(0) for name in self.layout.metric_names}

    def idle(s):
      return lambda: (zeros_act, zeros_act, zeros_grad, carry["model_state"], no_metrics)

    # 1F1B runs the last stage's backward right after its forward, with the same weights and
    # state: the forward is left to the backward, which runs the stage once and keeps its state.
    fused_last = self.schedule == "1f1b"

    def forward(s):
      if s == S - 1 and fused_last:
        return idle(s)

      def op():
        x = x_in if s == 0 else self.layout.unpack_act(s - 1, recv_x)
        y, new_state = self.apply(s, param_packer.unpack(s, latest), x,
                                   state_packer.unpack(s, carry["model_state"]))
        out = self.layout.pack_act(s, y) if s < S - 1 else zeros_act
        return out, zeros_act, zeros_grad, state_packer.pack(s, new_state), no_metrics
      return op

    def backward(s):
      def op():
        w = param_packer.unpack(s, stashed_w)
        st = state_packer.unpack(s, stashed_state)
        x = x_in if s == 0 else self.layout.unpack_act(s - 1, recv_x)
        new_state = carry["model_state"]
        if s == S - 1:
          def f(w, x):
            y, stage_state = self.apply(s, w, x, st)
            metrics = self.loss_metrics(y, y_in)
            return metrics["loss"] * loss_scale, (metrics, stage_state)
          if s == 0:
            gw, (loss, stage_state) = jax.grad(lambda w: f(w, x), has_aux=True)(w)
            gx = None
          else:
            (gw, gx), (loss, stage_state) = jax.grad(f, argnums=(0, 1), has_aux=True)(w, x)
          if fused_last:
            new_state = state_packer.pack(s, stage_state)
        else:
          ct = self.layout.unpack_act(s, recv_g)
          loss = no_metrics
          if s == 0:
            _, vjp = jax.vjp(lambda w: self.apply(s, w, x, st)[0], w)
            (gw,), gx = vjp(ct), None
          else:
            _, vjp = jax.vjp(lambda w, x: self.apply(s, w, x, st)[0], w, x)
            gw, gx = vjp(ct)
        grad_out = self.layout.pack_act(s - 1, gx) if s > 0 else zeros_act
        gw = param_packer.pack(s, gw)
        if grad_acc is not None:
          gw = jax.tree.map(jnp.add, grad_acc, gw)
        return zeros_act, grad_out, gw, new_state, loss
      return op

    branches = []
    for s in range(S):
      branches += [idle(s), forward(s), backward(s)]
    return lax.switch(stage * 3 + kind, branches)

  def _exchange(self, bufs, stage, kind, index, act_out, grad_out):
    """Sends activations one stage down and input gradients one stage up (ppermute over
    "stage"), and stores what arrives in the receive slots of its micro-batch."""
    S = self.num_stages
    if S == 1:
      return bufs
    down = [(s, s + 1) for s in range(S - 1)]
    up = [(s + 1, s) for s in range(S - 1)]
    sent_x = jnp.where(kind == sched.FWD, index + 1, 0).astype(jnp.int32)
    sent_g = jnp.where(kind == sched.BWD, index + 1, 0).astype(jnp.int32)
    act, id_x = lax.ppermute((act_out, sent_x), STAGE, down)
    grad, id_g = lax.ppermute((grad_out, sent_g), STAGE, up)

    slot = lambda ident, slots: jnp.maximum(ident - 1, 0) % slots
    bufs = dict(bufs)
    bufs["recv_x"] = write_slot(bufs["recv_x"], slot(id_x, self.layout.x_slots), act, id_x > 0)
    bufs["recv_g"] = write_slot(bufs["recv_g"], slot(id_g, self.layout.g_slots), grad, id_g > 0)
    return bufs

  def _update(self, carry, stage, grads, do_update, batch_index, global_batch, events):
    """The optimizer step of this device's stage between the sync mode's hooks
    (`jlp.pipeline.sync_modes`)."""
    param_packer, opt_packer, _ = self.packers
    summed, carry = self.mode.gradients(carry, stage, grads["float32"], do_update, batch_index,
                                        global_batch)
    grads = {"float32": summed}

    def keep():
      return carry["params"], carry["opt"], jax.tree.map(jnp.zeros_like, carry["params"])

    steps = stage_steps(param_packer, opt_packer, self.optimizer, self.num_stages,
                        carry["params"], grads, carry["opt"])
    index = jnp.where(do_update, stage + 1, 0)
    params, opt, delta = lax.switch(index, [keep] + steps)
    params, carry = self.mode.after_update(carry, stage, params["float32"], delta["float32"],
                                           events)
    return dict(carry, params={"float32": params}, opt=opt)

  def _run_1f1b(self, carry, inflight, stage, xs, ys, ticks):
    """The run's ticks (`__call__`); returns (carry, the new in-flight state: ring buffers, each
    pipeline's last S mini-batches' inputs and partial metrics)."""
    S = self.num_stages
    squeeze = lambda tree: jax.tree.map(lambda x: x[0, 0], tree)
    pipeline = lax.axis_index(DATA)
    bufs = squeeze(inflight["buffers"])
    K = jax.tree.leaves(xs)[0].shape[0]
    # Each pipeline's own mini-batches: its ring of the last S, then this run's new ones.
    x_all = jax.tree.map(lambda r, x: jnp.concatenate([r, x]), inflight["xs"], xs)
    y_all = jax.tree.map(lambda r, y: jnp.concatenate([r, y]), inflight["ys"], ys)
    carry = dict(carry, **{
        group: {name: jnp.concatenate([ring[0, 0], jnp.zeros((K,), ring.dtype)])
                for name, ring in inflight[group].items()}
        for group in ("metrics", "sync_report")})
    events = ticks["events"]

    def tick(state, row):
      carry, bufs = state
      kind, index, slot, global_batch = (row[k][pipeline, stage]
                                         for k in ("kind", "m", "slot", "global"))
      x_in = jax.tree.map(lambda a: a[slot], x_all)
      y_in = jax.tree.map(lambda a: a[slot], y_all)
      slot_w = index % self.layout.w_slots
      is_fwd = kind == sched.FWD
      bufs = dict(bufs)
      # A forward stashes the weights and the state it runs with, for its backward.
      bufs["stash_w"] = write_slot(bufs["stash_w"], slot_w, carry["params"], is_fwd)
      bufs["stash_state"] = write_slot(bufs["stash_state"], slot_w, carry["model_state"], is_fwd)
      act_out, grad_out, grads, new_model_state, loss = self._tick(
          carry, bufs, stage, kind, index, x_in, y_in, jnp.float32(1))
      # The last stage's forward tick computes nothing (its backward runs the stage).
      computed = (kind == sched.BWD) | ((kind == sched.FWD) & (stage != S - 1))
      carry = dict(carry, model_state=new_model_state,
                   computed=carry["computed"] + computed.astype(jnp.int32))
      carry["metrics"] = {name: v.at[slot].set(jnp.where(kind == sched.BWD, loss[name], v[slot]))
                          for name, v in carry["metrics"].items()}
      bufs = self._exchange(bufs, stage, kind, index, act_out, grad_out)
      carry = self._update(carry, stage, grads, kind == sched.BWD, slot, global_batch,
                           row["events"])
      return (carry, bufs), None

    rows = dict(kind=ticks["kind"], m=ticks["m"], slot=ticks["slot"], events=events,
                **{"global": ticks["global"]})

    # The table is padded to a few lengths (one compile each); the loop stops at its last tick.
    def body(t, state):
      return tick(state, jax.tree.map(lambda a: a[t], rows))[0]

    carry, bufs = lax.fori_loop(0, ticks["count"], body, (carry, bufs))
    expand = lambda tree: jax.tree.map(lambda x: x[None, None], tree)
    keep_index = ticks["keep"][pipeline]  # [S]: where each ring position's mini-batch is
    keep = lambda a: a[keep_index]
    inflight = dict(
        buffers=expand(bufs), xs=jax.tree.map(keep, x_all), ys=jax.tree.map(keep, y_all),
        metrics={name: expand(keep(v)) for name, v in carry["metrics"].items()},
        sync_report={name: expand(keep(v)) for name, v in carry["sync_report"].items()})
    return carry, inflight

  def inflight_zeros(self, xs: Any, ys: Any, shards: tuple[int, int]) -> dict[str, Any]:
    """An empty pipeline's in-flight state for 1F1B (host numpy): ring buffers [N, S, K, ...]
    (shards = (N, S)), S mini-batches of inputs like one of xs / ys, and their metrics."""
    S = self.num_stages
    param_packer, _, state_packer = self.packers
    lead = shards
    act = self.layout.act.sizes.get("float32", 0)
    buffers = dict(recv_x=np.zeros(lead + (self.layout.x_slots, act), np.float32),
                   recv_g=np.zeros(lead + (self.layout.g_slots, act), np.float32),
                   stash_state=state_packer.zeros(lead + (self.layout.w_slots,)),
                   stash_w=param_packer.zeros(lead + (self.layout.w_slots,)))
    ring = lambda a: np.zeros((S,) + tuple(np.shape(a)[1:]), np.dtype(a.dtype))
    return dict(buffers=buffers, xs=jax.tree.map(ring, xs), ys=jax.tree.map(ring, ys),
                metrics={name: np.zeros(lead + (S,), np.float32)
                         for name in self.layout.metric_names},
                sync_report={name: np.zeros(lead + (S,), dtype) for name, dtype in
                             SYNC_REPORT.items()} if self.mode.reports else {})

  def _lockstep_events(self, mix, b, global_batch):
    """GPipe's events at the update of its mini-batch b: every pipeline averages with mix[b],
    pushes (in pipeline order) and, every pull_every-th mini-batch, pulls."""
    N, S = self.num_pipelines, self.num_stages
    events = {}
    if mix is not None:
      events.update(mix=mix[b], has_mix=jnp.ones((S,), bool))
    if self.mode.uses_server:
      pull = (global_batch + 1) % self.pull_every == 0
      events.update(push=jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (S, N)),
                    pull=jnp.broadcast_to(pull, (N, S)))
    return events

  def _run_gpipe(self, carry, stage, step, xs, ys, mix):
    table = self.layout.table
    M = self.num_microbatches
    rows = (jnp.asarray(table.kind), jnp.asarray(table.micro))

    def minibatch(carry, b):
      x_b = jax.tree.map(lambda a: a[b], xs)
      y_b = jax.tree.map(lambda a: a[b], ys)
      micro_rows = jax.tree.leaves(x_b)[0].shape[0] // M
      bufs = self._tick_buffers(stash_weights=False)
      grads = jax.tree.map(jnp.zeros_like, carry["params"])

      def tick(state, row):
        carry, bufs, grads, loss_sum = state
        kinds, micros = row
        kind, index = kinds[stage], jnp.maximum(micros[stage], 0)
        take = lambda a: lax.dynamic_slice_in_dim(a, index * micro_rows, micro_rows)
        x_in = jax.tree.map(take, x_b)
        y_in = jax.tree.map(take, y_b)
        slot = index % self.layout.w_slots
        bufs = dict(bufs)
        bufs["stash_state"] = write_slot(bufs["stash_state"], slot, carry["model_state"],
                                          kind == sched.FWD)
        act_out, grad_out, grads, new_model_state, loss = self._tick(
            carry, bufs, stage, kind, index, x_in, y_in, np.float32(1.0 / M), grads)
        carry = dict(carry, model_state=new_model_state,
                     computed=carry["computed"] + (kind != sched.IDLE).astype(jnp.int32))
        bufs = self._exchange(bufs, stage, kind, index, act_out, grad_out)
        return (carry, bufs, grads, jax.tree.map(jnp.add, loss_sum, loss)), None

      zero = {name: jnp.float32(0) for name in self.layout.metric_names}
      (carry, _, grads, loss_sum), _ = lax.scan(tick, (carry, bufs, grads, zero), rows)
      carry = self._update(carry, stage, grads, jnp.bool_(True), b, step + b,
                           self._lockstep_events(mix, b, step + b))
      carry["metrics"] = {name: v.at[b].set(loss_sum[name] / M)
                          for name, v in carry["metrics"].items()}
      return carry, None

    carry, _ = lax.scan(minibatch, carry, jnp.arange(self.layout.num_batches))
    return carry
