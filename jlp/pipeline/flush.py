"""Flush schedules run as one SPMD program: any valid `jlp.pipeline.Schedule` (1F1B-flush,
interleaved 1F1B, ZB-H1, ZB-V, DualPipeV, a torch CSV) on the devices of the "stage" mesh axis,
inside one `jax.shard_map` (docs/sdpipe.md, "Flush schedules").

`FlushTables` lowers a schedule to static integer tables, one row per tick and one column per
device: the action each device runs (kind, local chunk, micro-batch; a second column for the
backward of an overlapped F+B pair), where its output goes (a channel: a fixed shift along the
stage axis, or the device itself for the turn of a V), and the ring slot it lands in. Ring sizes
come from the schedule: the smallest K per buffer under which no two values that live at once on
a chunk share index m mod K (a value lives from the tick it arrives to the last action that reads
it). So 1F1B-flush holds about D inputs per device whatever M, GPipe M.

`FlushProgram` is what every device (pipeline i, device d) runs for B mini-batches: a `lax.scan`
over the mini-batches, each a `lax.scan` over the schedule's ticks, then one optimizer step per
chunk. At a tick the device runs its action with a `lax.switch` over (stage, kind):

  F  the stage's forward on its input (stage 0: micro-batch m of xs; else the received activation),
     with the chunk's state, which it then replaces (BatchNorm statistics, RNG counters) after
     stashing the state it ran with; the last stage also evaluates loss_fn on micro-batch m's
     targets (the mini-batch's metrics are the means over its micro-batches). It runs under
     `jax.vjp` and keeps the forward's residuals (`jlp.pipeline.residuals.Residuals`: those that
     depend on the input, in a ring per dtype sized like the stash; the others are the weights,
     input, state or targets, kept anyway, or functions of them that B recomputes);
  B  the full backward from those residuals (the vjp function rebuilt from them), no forward:
     returns the input gradient and the weight gradient, which is added to the chunk's sum;
  I  the input-gradient half of B (the weight gradient is not computed); it keeps what its W needs
     of its own work (`jlp.pipeline.residuals.Split`: the results of its dots that the weight
     gradient reads);
  W  the weight-gradient half, at a later tick, from what F and I kept and the received output
     gradient. I + W is B's arithmetic, each dot once, and gives B's bits.

With `remat=True`, F keeps only the input (less memory) and B, I and W recompute the forward from
it and the stashed state (`jax.vjp`), as GPipe's program does; the update is the same bit for bit.

The last stage's backward differentiates loss / M (the loss is scaled, never the gradients), so the
sum over micro-batches is the gradient of the mini-batch's mean loss. After the ticks, the two
chunks of a shared stage pair (`shared`) add their sums, every chunk's sum goes through the sync
mode (`jlp.pipeline.sync_modes`: "allreduce" with the pipeline's GradSync, or "none") and the
optimizer steps. Weights do not change within a mini-batch, so nothing is stashed but the state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jlp.pipeline.buffers import Layout, write_slot
from jlp.pipeline.packing import Packer
from jlp.pipeline.program import DATA, STAGE, PipelineState, stage_steps
from jlp.pipeline.residuals import KEEP, REDO, Residuals, depends, split_backward
from jlp.pipeline.schedule_data import Overlap, Schedule
from jlp.pipeline.sync_modes import SyncMode
from jlp.sync import SYNC_REPORT

__all__ = ["FlushProgram", "FlushTables", "flush_tables"]

IDLE, F, B, I, W = 0, 1, 2, 3, 4
_KIND = {"F": F, "B": B, "I": I, "W": W}


@dataclasses.dataclass(frozen=True, eq=False)
class FlushTables:
  """A schedule lowered for the program (module docstring). Arrays are int32 [T, D]:
  kind / chunk / micro of the tick's action (column 0) and of an overlapped pair's backward
  (column 1); act_channel / grad_channel: the index in `act_shifts` / `grad_shifts` of the channel
  the tick's activation / input gradient leaves on (-1: none); act_slot / grad_slot: the flat ring
  slot (chunk * K + m % K) it lands in at its receiver."""
  num_devices: int
  num_stages: int
  num_microbatches: int
  stages_per_device: int
  stage_of: np.ndarray  # [D, v]: the stage that chunk c of device d holds
  row_stage: tuple[int, ...]  # the stage held at state row d * v + c
  kind: np.ndarray  # [T, D, 2]
  chunk: np.ndarray
  micro: np.ndarray
  act_channel: np.ndarray  # [T, D]
  act_slot: np.ndarray
  grad_channel: np.ndarray
  grad_slot: np.ndarray
  act_shifts: tuple[int, ...]  # device d sends to (d + shift) mod D; 0: to itself
  grad_shifts: tuple[int, ...]
  # The distinct shifts other than 0 (one ppermute each); [T, len]: whether any device sends on
  # the shift at the tick; per shift, the (sender, receiver) pairs of the devices that ever send.
  send_shifts: tuple[int, ...]
  sends: np.ndarray
  send_pairs: tuple[tuple[tuple[int, int], ...], ...]
  x_slots: int
  g_slots: int
  w_slots: int
  overlaps: bool  # whether any tick runs an overlapped pair (the second column is used)
  partner: np.ndarray  # [D, v]: the chunk sharing chunk c's weights, -1: none

  @property
  def num_ticks(self) -> int:
    return self.kind.shape[0]


def _write_row_if(pred: jax.Array, ring: Any, row: Any, slot: jax.Array) -> Any:
  """`ring` (a pytree of [K, ...] buffers) with `row` written at `slot` where `pred`, else as it
  was. As a `lax.cond`, a tick that writes nothing moves no bytes (a ring's row is as large as a
  micro-batch's activations); the untaken branch returns the ring itself, which XLA:CPU updates
  in place without copying."""
  return lax.cond(pred, lambda ring, row, slot: jax.tree.map(
      lambda a, r: lax.dynamic_update_index_in_dim(a, r, slot, 0), ring, row),
                  lambda ring, row, slot: ring, ring, row, slot)


def _ring(items: list[tuple[int, int, int, int, int]]) -> int:
  """The smallest K such that no two items (device, chunk, m, first tick, last tick) alive at once
  on one (device, chunk) share m mod K."""
  by_key: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
  for d, c, m, start, end in items:
    by_key.setdefault((d, c), []).append((m, start, end))

  def fits(k: int) -> bool:
    return not any(a[0] % k == b[0] % k and a[1] <= b[2] and b[1] <= a[2]
                   for group in by_key.values() for n, a in enumerate(group) for b in group[n + 1:])

  k = 1
  while not fits(k):
    k += 1
  return k


def flush_tables(schedule: Schedule, shared: Sequence[tuple[int, int]] = ()) -> FlushTables:
  """The program's tables of a validated schedule (module docstring); ValueError unless every
  device holds the same number of stages."""
  D, S, M = schedule.num_devices, schedule.num_stages, schedule.num_microbatches
  if S % D:
    raise ValueError(f"a schedule of {S} stages on {D} devices is not allowed; expected the same "
                     "number of stages on every device.")
  v = S // D
  held = [[s for s in range(S) if schedule.placement[s] == d] for d in range(D)]
  for d, stages in enumerate(held):
    if len(stages) != v:
      raise ValueError(f"device {d} holds stages {stages}; expected {v} stages on every device "
                       f"({S} stages on {D} devices).")
  stage_of = np.array(held, np.int32)
  chunk_of = {s: c for row in held for c, s in enumerate(row)}
  place = schedule.placement
  T = schedule.num_ticks
  kind = np.zeros((T, D, 2), np.int32)
  chunk = np.zeros((T, D, 2), np.int32)
  micro = np.zeros((T, D, 2), np.int32)
  tick_of: dict[tuple[str, int, int], int] = {}
  for d, row in enumerate(schedule.ticks):
    for t, item in enumerate(row):
      if item is None:
        continue
      for col, a in enumerate(item.leaves):
        kind[t, d, col] = _KIND[a.kind]
        chunk[t, d, col] = chunk_of[a.stage]
        micro[t, d, col] = a.microbatch
        tick_of[(a.kind, a.stage, a.microbatch)] = t

  def last_read(s: int, m: int) -> int:
    return max(tick_of.get((k, s, m), -1) for k in "FBIW")

  def grad_tick(s: int, m: int) -> int:
    return tick_of[("B", s, m)] if ("B", s, m) in tick_of else tick_of[("I", s, m)]

  x_items, g_items, w_items = [], [], []
  for s in range(S):
    d, c = place[s], chunk_of[s]
    for m in range(M):
      end = last_read(s, m)
      w_items.append((d, c, m, tick_of[("F", s, m)], end))
      if s > 0:
        x_items.append((d, c, m, tick_of[("F", s - 1, m)], end))
      if s < S - 1:
        g_items.append((d, c, m, grad_tick(s + 1, m), end))
  x_slots, g_slots, w_slots = _ring(x_items), _ring(g_items), _ring(w_items)

  act_shifts = tuple(sorted({(place[s + 1] - place[s]) % D for s in range(S - 1)}))
  grad_shifts = tuple(sorted({(place[s - 1] - place[s]) % D for s in range(1, S)}))
  act_channel = np.full((T, D), -1, np.int32)
  grad_channel = np.full((T, D), -1, np.int32)
  act_slot = np.zeros((T, D), np.int32)
  grad_slot = np.zeros((T, D), np.int32)
  for d, row in enumerate(schedule.ticks):
    for t, item in enumerate(row):
      for a in () if item is None else item.leaves:
        s, m = a.stage, a.microbatch
        if a.kind == "F" and s < S - 1:
          act_channel[t, d] = act_shifts.index((place[s + 1] - d) % D)
          act_slot[t, d] = chunk_of[s + 1] * x_slots + m % x_slots
        elif a.kind in "BI" and s > 0:
          grad_channel[t, d] = grad_shifts.index((place[s - 1] - d) % D)
          grad_slot[t, d] = chunk_of[s - 1] * g_slots + m % g_slots
  send_shifts = tuple(sorted({k for k in act_shifts + grad_shifts if k}))
  sends = np.zeros((T, len(send_shifts)), bool)
  send_pairs = []
  for n, k in enumerate(send_shifts):
    senders = np.zeros(D, bool)
    for channel, shifts in ((act_channel, act_shifts), (grad_channel, grad_shifts)):
      if k in shifts:
        on = channel == shifts.index(k)  # [T, D]
        sends[:, n] |= on.any(axis=1)
        senders |= on.any(axis=0)
    send_pairs.append(tuple((int(d), int(d + k) % D) for d in np.flatnonzero(senders)))
  partner = np.full((D, v), -1, np.int32)
  for i, j in shared:
    partner[place[i], chunk_of[i]] = chunk_of[j]
    partner[place[j], chunk_of[j]] = chunk_of[i]
  return FlushTables(
      num_devices=D, num_stages=S, num_microbatches=M, stages_per_device=v, stage_of=stage_of,
      row_stage=tuple(int(s) for s in stage_of.reshape(-1)), kind=kind, chunk=chunk, micro=micro,
      act_channel=act_channel, act_slot=act_slot, grad_channel=grad_channel, grad_slot=grad_slot,
      act_shifts=act_shifts, grad_shifts=grad_shifts, send_shifts=send_shifts, sends=sends,
      send_pairs=tuple(send_pairs), x_slots=x_slots, g_slots=g_slots,
      w_slots=w_slots, overlaps=any(isinstance(item, Overlap) for row in schedule.ticks
                                    for item in row), partner=partner)


@dataclasses.dataclass(frozen=True, eq=False)
class FlushProgram:
  """One run's per-device program for a flush schedule (module docstring).

  apply: apply(s, params_s, x, state_s) -> (y, new_state_s), stage s's call.
  loss_metrics: (y_last, target) -> {"loss", **aux}, float32 scalars.
  packers: the (params, optimizer states, stage states) Packers, one entry per stage.
  """
  apply: Callable[[int, Any, Any, Any], tuple[Any, Any]]
  loss_metrics: Callable[[Any, Any], dict[str, jax.Array]]
  optimizer: optax.GradientTransformation
  packers: tuple[Packer, Packer, Packer]
  mode: SyncMode
  tables: FlushTables
  num_pipelines: int
  layout: Layout  # the run's: num_batches, the inter-stage values, metric_names
  # True: B, I and W recompute the forward from the kept input (less memory: one input per
  # micro-batch in flight); False: F keeps the forward's residuals, and B, I and W only run the
  # backward (module docstring).
  remat: bool = False

  def __call__(self, state: PipelineState, xs: Any, ys: Any
               ) -> tuple[PipelineState, dict[str, jax.Array]]:
    """xs, ys: [B, rows, ...] (this pipeline's rows of each mini-batch). Returns the new state and
    per mini-batch the metrics (means over the pipelines; sync reports per device, averaged over
    the devices) and "computed_slots" (the (tick, device) slots that ran an action, summed)."""
    squeeze = lambda tree: jax.tree.map(lambda x: x[0], tree)
    device = lax.axis_index(STAGE)
    carry = dict(params=squeeze(state.params), opt=squeeze(state.opt_state),
                 model_state=squeeze(state.model_state), sync_state=squeeze(state.sync_state),
                 computed=jnp.int32(0),
                 metrics={name: jnp.zeros((self.layout.num_batches,), jnp.float32)
                          for name in self.layout.metric_names},
                 sync_report={name: jnp.zeros((self.layout.num_batches,), dtype)
                              for name, dtype in SYNC_REPORT.items()} if self.mode.reports else {})
    tab = self.tables
    rows = {name: jnp.asarray(getattr(tab, name))
            for name in ("kind", "chunk", "micro", "act_channel", "act_slot", "grad_channel",
                         "grad_slot", "sends")}

    def minibatch(carry, b):
      x_b = jax.tree.map(lambda a: a[b], xs)
      y_b = jax.tree.map(lambda a: a[b], ys)
      carry = self._minibatch(carry, device, rows, x_b, y_b, b, state.step + b)
      return carry, None

    carry, _ = lax.scan(minibatch, carry, jnp.arange(self.layout.num_batches))
    N, D = self.num_pipelines, tab.num_devices
    out = {name: lax.psum(lax.psum(v, STAGE), DATA) / N for name, v in carry["metrics"].items()}
    for name, v in carry["sync_report"].items():
      total = lax.psum(lax.psum(v, STAGE), DATA)
      out[name] = total // N if name == "nonfinite" else total / (N * D)
    out["computed_slots"] = lax.psum(lax.psum(carry["computed"], STAGE), DATA)
    expand = lambda tree: jax.tree.map(lambda x: x[None], tree)
    new_state = state._replace(
        step=state.step + self.layout.num_batches, params=expand(carry["params"]),
        opt_state=expand(carry["opt"]), model_state=expand(carry["model_state"]),
        sync_state=expand(carry["sync_state"]))
    return new_state, out

  # -- one mini-batch ----------------------------------------------------------------------------
  def _minibatch(self, carry, device, rows, x_b, y_b, b, global_batch):
    tab, state_packer = self.tables, self.packers[2]
    v, M = tab.stages_per_device, tab.num_microbatches
    micro_rows = jax.tree.leaves(x_b)[0].shape[0] // M
    act_len = self.layout.act.sizes.get("float32", 0)
    micro = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((micro_rows,) + a.shape[1:], a.dtype), tree)
    res = None if self.remat else _residual_specs(self, carry, micro(x_b), micro(y_b))
    bufs = dict(recv_x=jnp.zeros((v * tab.x_slots, act_len), jnp.float32),
                recv_g=jnp.zeros((v * tab.g_slots, act_len), jnp.float32),
                stash=state_packer.zeros((v * tab.w_slots,), xp=jnp),
                res={} if res is None else res.packer.zeros((v * tab.w_slots,), xp=jnp),
                iw={} if res is None or res.carried is None else res.carried.zeros(
                    (v * tab.w_slots,), xp=jnp),
                grads=jax.tree.map(jnp.zeros_like, carry["params"]),
                sums={name: jnp.float32(0) for name in self.layout.metric_names})
    stage_of = jnp.asarray(tab.stage_of)[device]

    def tick(state, row):
      carry, bufs = state
      own = {name: a[device] for name, a in row.items() if name != "sends"}
      sends = dict(zip(tab.send_shifts, row["sends"]))
      act_out = grad_out = jnp.zeros((act_len,), jnp.float32)
      for col in range(2 if tab.overlaps else 1):
        kind, c, m = own["kind"][col], own["chunk"][col], own["micro"][col]
        take = lambda tree, m=m: jax.tree.map(
            lambda a: lax.dynamic_slice_in_dim(a, m * micro_rows, micro_rows), tree)
        a_out, g_out, carry, bufs = self._action(carry, bufs, stage_of[c], kind, c, m,
                                                 lambda take=take: take(x_b),
                                                 lambda take=take: take(y_b), res)
        act_out = jnp.where(kind == F, a_out, act_out)
        grad_out = jnp.where((kind == B) | (kind == I), g_out, grad_out)
      busy = own["kind"][0] != IDLE
      carry = dict(carry, computed=carry["computed"] + busy.astype(jnp.int32))
      bufs = self._exchange(bufs, own, act_out, grad_out, sends)
      return (carry, bufs), None

    (carry, bufs), _ = lax.scan(tick, (carry, bufs), rows)
    carry = dict(carry, metrics={name: value.at[b].set(bufs["sums"][name])
                                 for name, value in carry["metrics"].items()})
    grads = bufs["grads"]["float32"]  # [v, L]
    partner = jnp.asarray(tab.partner)[device]
    if (tab.partner >= 0).any():  # a shared stage: both chunks step with the summed gradient
      grads = jnp.stack([jnp.where(partner[c] >= 0, grads[c] + grads[jnp.maximum(partner[c], 0)],
                                   grads[c]) for c in range(v)])
    for c in range(v):
      carry = self._update(carry, stage_of[c], c, grads[c], b, global_batch)
    return carry

  def _stage_vjp(self, s, w, x, st, y_in):
    """Stage s's forward under `jax.vjp`: (output, vjp function, (metrics, new state)). The output
    is the activation (the loss / M and the scaled metrics at the last stage); stage 0 is
    differentiated in its weights only, the others in (weights, input)."""
    scale = np.float32(1.0 / self.tables.num_microbatches)
    if s == self.tables.num_stages - 1:
      def f(w, x):
        y, new_state = self.apply(s, w, x, st)
        metrics = {name: value * scale for name, value in self.loss_metrics(y, y_in).items()}
        return metrics["loss"], (metrics, new_state)
    else:
      def f(w, x):
        y, new_state = self.apply(s, w, x, st)
        return y, (None, new_state)
    if s == 0:
      out, vjp_fn, aux = jax.vjp(lambda w: f(w, x), w, has_aux=True)
    else:
      out, vjp_fn, aux = jax.vjp(f, w, x, has_aux=True)
    return out, vjp_fn, aux

  def _backward_core(self, s, res, params, stashed, recv_x, x_in, y_in, kept, recv_g, *,
                     pack_weights: bool = True):
    """Stage s's backward from F's kept residuals (`Residuals`): (weight gradient, input gradient;
    None at stage 0), packed (with pack_weights=False the weight gradient is the stage's pytree:
    what ZB's W returns, packed into the gradient sum as B's is)."""
    param_packer, _, state_packer = self.packers
    w, st = param_packer.unpack(s, params), state_packer.unpack(s, stashed)
    x = x_in if s == 0 else self.layout.unpack_act(s - 1, recv_x)
    vjp_fn = res.restore(s, kept, (w, x, st, y_in),
                         lambda: self._stage_vjp(s, w, x, st, y_in)[1])
    last = s == self.tables.num_stages - 1
    got = vjp_fn(jnp.ones((), jnp.float32) if last else self.layout.unpack_act(s, recv_g))
    return (param_packer.pack(s, got[0]) if pack_weights else got[0],
            None if s == 0 else self.layout.pack_act(s - 1, got[1]))

  def _action(self, carry, bufs, stage, kind, c, m, x_in, y_in, res):
    """Runs (kind, chunk c, micro-batch m) of this device: (activation out, input gradient out,
    carry, bufs). x_in, y_in: () -> micro-batch m's input / targets. `res`: the stages' residual
    layouts (`_residual_specs`); None: recompute the forward in B, I and W (`remat`).

    A branch of the switch is one stage's action, and a stage sits at one chunk of its device, so
    the branch reads that chunk's weights and adds to its gradient sum at a static index. The
    gradient sums go through the switch (only B and W change them), so what is as large as the
    weights is never read at a traced index, zeroed or rewritten at a tick that does not need it.
    F's residuals ("res") and what an I keeps for its W ("iw") do not: XLA copies a ring that
    a branch of the switch returns unchanged, so the switch returns the row to write (zeros where
    the action writes none), and a two-way `lax.cond` after it writes the row to its slot only at
    the ticks of F (res) and I (iw) (`_write_row_if`)."""
    tab = self.tables
    param_packer, _, state_packer = self.packers
    S, M = tab.num_stages, tab.num_microbatches
    chunk_of = {int(s): k for row in tab.stage_of for k, s in enumerate(row)}
    act_len = self.layout.act.sizes.get("float32", 0)
    zeros_act = jnp.zeros((act_len,), jnp.float32)
    model_state = jax.tree.map(lambda a: a[c], carry["model_state"])
    w_slot = c * tab.w_slots + m % tab.w_slots
    stashed = lambda: jax.tree.map(lambda a: a[w_slot], bufs["stash"])
    slot_of = lambda name: {dtype: a[w_slot] for dtype, a in bufs[name].items()}
    rings = dict(res={dtype: jnp.zeros(a.shape[1:], a.dtype) for dtype, a in bufs["res"].items()},
                 iw={dtype: jnp.zeros(a.shape[1:], a.dtype) for dtype, a in bufs["iw"].items()},
                 grads=bufs["grads"])
    put = lambda name, row: dict(rings, **{name: row})
    recv_x = lambda: bufs["recv_x"][c * tab.x_slots + m % tab.x_slots]
    recv_g = lambda: bufs["recv_g"][c * tab.g_slots + m % tab.g_slots]
    no_metrics = {name: jnp.float32(0) for name in self.layout.metric_names}
    scale = np.float32(1.0 / M)

    def params(s):
      return jax.tree.map(lambda a: a[chunk_of[s]], carry["params"])

    def add_grad(s, gw):
      return dict(rings, grads=jax.tree.map(lambda acc, g: acc.at[chunk_of[s]].add(g),
                                            bufs["grads"], gw))

    def idle():
      return zeros_act, zeros_act, model_state, no_metrics, rings

    def stage_input(s):
      return x_in() if s == 0 else self.layout.unpack_act(s - 1, recv_x())

    def forward(s):
      def op():
        w = param_packer.unpack(s, params(s))
        x, st = stage_input(s), state_packer.unpack(s, model_state)
        out = rings
        if res is None:
          y, new_state = self.apply(s, w, x, st)
          metrics = None if s < S - 1 else {
              name: value * scale for name, value in self.loss_metrics(y, y_in()).items()}
        else:  # the forward under jax.vjp: its residuals are kept for B, I and W
          y, vjp_fn, (metrics, new_state) = self._stage_vjp(s, w, x, st, y_in())
          out = put("res", res.keep(s, vjp_fn))
        new_state = state_packer.pack(s, new_state)
        if s < S - 1:
          return self.layout.pack_act(s, y), zeros_act, new_state, no_metrics, out
        return zeros_act, zeros_act, new_state, metrics, out
      return op

    def backward(s, want_w: bool, want_x: bool):
      def op():
        argnums = tuple(k for k, want in ((0, want_w), (1, want_x and s > 0)) if want)
        if not argnums:  # the input-gradient half of stage 0: there is no input gradient
          return zeros_act, zeros_act, model_state, no_metrics, rings
        if res is not None:  # the backward of F's forward, from its kept residuals
          args = (params(s), stashed(), recv_x(), x_in(), y_in(), slot_of("res"), recv_g())
          split = res.splits[s] if res.splits else None
          if split is not None and argnums == (1,):  # I: keeps what its W needs
            gx, carried = split.input_half(jax.tree.leaves(args))
            return zeros_act, gx, model_state, no_metrics, put("iw", res.carried.pack(s, carried))
          if split is not None and argnums == (0,):  # W: from what its I kept
            gw = split.weight_half(jax.tree.leaves(args), res.carried.unpack(s, slot_of("iw")))
            gw = param_packer.pack(s, jax.tree.unflatten(param_packer.treedefs[s], gw))
            return zeros_act, zeros_act, model_state, no_metrics, add_grad(s, gw)
          gw, gx = self._backward_core(s, res, *args)
          out = add_grad(s, gw) if 0 in argnums else rings
          gx = gx if 1 in argnums else zeros_act
          return zeros_act, gx, model_state, no_metrics, out
        # remat: recompute the forward from the kept input and stashed state
        w = param_packer.unpack(s, params(s))
        st = state_packer.unpack(s, stashed())
        x = stage_input(s)
        if s == S - 1:
          def f(w, x):
            y, _ = self.apply(s, w, x, st)
            return self.loss_metrics(y, y_in())["loss"] * scale
          got = jax.grad(f, argnums=argnums)(w, x)
        else:
          ct = self.layout.unpack_act(s, recv_g())
          f = lambda w, x: self.apply(s, w, x, st)[0]
          if argnums == (0,):
            got = jax.vjp(lambda w: f(w, x), w)[1](ct)
          elif argnums == (1,):
            got = jax.vjp(lambda x: f(w, x), x)[1](ct)
          else:
            got = jax.vjp(f, w, x)[1](ct)
        got = dict(zip(argnums, got, strict=True))
        out = add_grad(s, param_packer.pack(s, got[0])) if 0 in got else rings
        gx = self.layout.pack_act(s - 1, got[1]) if 1 in got else zeros_act
        return zeros_act, gx, model_state, no_metrics, out
      return op

    branches = [idle]
    for s in range(S):
      branches += [forward(s), backward(s, True, True), backward(s, False, True),
                   backward(s, True, False)]
    index = jnp.where(kind == IDLE, 0, 1 + stage * 4 + kind - 1)
    act_out, grad_out, new_state, metrics, new_rings = lax.switch(index, branches)
    write = lambda tree, value: jax.tree.map(lambda a, u: a.at[c].set(u), tree, value)
    is_f = kind == F
    bufs = dict(bufs, grads=new_rings["grads"])
    for name, when in (("res", kind == F), ("iw", kind == I)):
      if bufs[name]:  # none with remat, and "iw" only for ZB's split backwards
        bufs[name] = _write_row_if(when, bufs[name], new_rings[name], w_slot)
    bufs["stash"] = write_slot(bufs["stash"], w_slot, model_state, is_f)
    carry = dict(carry, model_state=write(carry["model_state"], jax.tree.map(
        lambda new, old: jnp.where(is_f, new, old), new_state, model_state)))
    bufs["sums"] = {name: bufs["sums"][name] + metrics[name] for name in self.layout.metric_names}
    return act_out, grad_out, carry, bufs

  def _exchange(self, bufs, own, act_out, grad_out, sends):
    """Sends the tick's activation and input gradient on their channels and stores what arrives
    in its ring slot. One `lax.ppermute` over "stage" per distinct shift k (device d sends to
    d + k; shift 0, the turn of a V, stays on the device) carries the values of the routes that
    have a channel of that shift and the sender's channels (+ 1: a device that receives nothing
    gets zeros) and slots, which a float32 holds exactly. Only the devices that the schedule ever
    sends from on that shift take part (1F1B's last device sends no activation around to the
    first), so each value crosses to its neighbour once and no link carries a dead send: on a
    real network a tick costs the schedule's bytes. At a tick where no device sends on a shift
    (GPipe's forward ticks send no gradient, its backward ticks no activation) its collective is
    skipped (`lax.cond` on the static table, the same on every device): a collective is a
    rendezvous of the devices, the cost that dominates a tick on emulated devices. Every device
    issues the same collectives; the tables say which sends carry a value."""
    tab = self.tables
    L = act_out.shape[0]
    routes = (("recv_x", act_out, "act_channel", "act_slot", tab.act_shifts),
              ("recv_g", grad_out, "grad_channel", "grad_slot", tab.grad_shifts))
    meta = jnp.stack([own["act_channel"] + 1, own["act_slot"], own["grad_channel"] + 1,
                      own["grad_slot"]]).astype(jnp.float32)
    arrived = {}  # shift: ({route: value}, the sender's meta)
    for shift, pairs in zip(tab.send_shifts, tab.send_pairs, strict=True):
      users = [r for r, (*_, shifts) in enumerate(routes) if shift in shifts]
      got = lax.cond(sends[shift], lambda payload, pairs=pairs: lax.ppermute(payload, STAGE, pairs),
                     jnp.zeros_like, jnp.concatenate([routes[r][1] for r in users] + [meta]))
      arrived[shift] = ({r: got[i * L:(i + 1) * L] for i, r in enumerate(users)},
                        got[len(users) * L:])
    bufs = dict(bufs)
    for r, (name, value, channel_key, slot_key, shifts) in enumerate(routes):
      for k, shift in enumerate(shifts):
        if shift == 0:
          got, channel, slot = value, own[channel_key] + 1, own[slot_key]
        else:
          values, sender = arrived[shift]
          got = values[r]
          channel, slot = sender[2 * r].astype(jnp.int32), sender[2 * r + 1].astype(jnp.int32)
        bufs[name] = _write_row_if(channel == k + 1, bufs[name], got, slot)
    return bufs

  def _update(self, carry, stage, c, grads, b, global_batch):
    """Chunk c's (stage `stage`'s) sync and optimizer step with its summed gradient [L]."""
    param_packer, opt_packer, _ = self.packers
    # The chunk's own sync state, and a report of its own: the device reports its chunks' sum.
    view = dict(carry, sync_state=None if carry["sync_state"] is None else jax.tree.map(
        lambda a: a[c], carry["sync_state"]),
        sync_report=jax.tree.map(jnp.zeros_like, carry["sync_report"]))
    summed, view = self.mode.gradients(view, stage, grads, jnp.bool_(True), b, global_batch)
    carry = dict(carry, sync_report=jax.tree.map(jnp.add, carry["sync_report"],
                                                 view["sync_report"]))
    if carry["sync_state"] is not None:
      carry["sync_state"] = jax.tree.map(lambda a, u: a.at[c].set(u), carry["sync_state"],
                                         view["sync_state"])
    params = jax.tree.map(lambda a: a[c], carry["params"])
    opt = jax.tree.map(lambda a: a[c], carry["opt"])
    new_params, new_opt, _ = lax.switch(stage, stage_steps(
        param_packer, opt_packer, self.optimizer, self.tables.num_stages, params,
        {"float32": summed}, opt))
    write = lambda tree, value: jax.tree.map(lambda a, u: a.at[c].set(u), tree, value)
    return dict(carry, params=write(carry["params"], new_params),
                opt=write(carry["opt"], new_opt))


def _residual_specs(program: FlushProgram, carry: dict[str, Any], x_in: Any, y_in: Any
                    ) -> Residuals:
  """Every stage's `Residuals` layout, from the jaxpr of its forward under `jax.vjp` (x_in,
  y_in: one micro-batch's input and targets as jax.ShapeDtypeStructs), and where the schedule has
  I actions, each stage's backward cut into I and W (`Split`)."""
  param_packer, _, state_packer = program.packers
  row = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
  params, state = row(carry["params"]), row(carry["model_state"])
  recv_x = jax.ShapeDtypeStruct((program.layout.act.sizes.get("float32", 0),), jnp.float32)
  is_key = lambda a: jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
  treedefs, sources, keys, kept = [], [], [], []
  for s in range(program.tables.num_stages):
    found = {}

    def probe(params, state, recv_x, x_in, y_in, s=s, found=found):
      w, st = param_packer.unpack(s, params), state_packer.unpack(s, state)
      x = x_in if s == 0 else program.layout.unpack_act(s - 1, recv_x)
      _, vjp_fn, _ = program._stage_vjp(s, w, x, st, y_in)  # pylint: disable=protected-access
      leaves, found["treedef"] = jax.tree.flatten(vjp_fn)
      known = jax.tree.leaves((w, x, st, y_in))
      found["known"] = [next((i for i, k in enumerate(known) if k is leaf), None)
                        for leaf in leaves]
      out = [leaf for leaf, i in zip(leaves, found["known"], strict=True) if i is None]
      found["keys"] = [jax.random.key_impl(a) if is_key(a) else None for a in out]
      return [jax.random.key_data(a) if is_key(a) else a for a in out]

    args = (params, state, recv_x, x_in, y_in)
    closed = jax.make_jaxpr(probe)(*args)
    # The input's leaves among the jaxpr's inputs: recv_x (stage 0: x_in).
    marks = [jax.tree.map(lambda _, k=k: k == (3 if s == 0 else 2), a) for k, a in enumerate(args)]
    on_x = iter(depends(closed.jaxpr, jax.tree.leaves(marks)))
    avals = iter(closed.out_avals)
    src, stage_keys, stage_kept = [], [], []
    key_of = iter(found["keys"])
    for i in found["known"]:
      if i is not None:
        src.append(i)
        continue
      aval, impl = next(avals), next(key_of)
      if next(on_x):
        src.append(KEEP)
        stage_keys.append(impl)
        stage_kept.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
      else:
        src.append(REDO)
    treedefs.append(found["treedef"])
    sources.append(tuple(src))
    keys.append(tuple(stage_keys))
    kept.append(stage_kept)
  res = Residuals(tuple(treedefs), tuple(sources), tuple(keys), Packer(kept))
  if not (program.tables.kind == I).any():
    return res
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  splits, carried = [], []
  for s in range(program.tables.num_stages):
    split = None
    if s > 0:
      args = (params, state, recv_x, x_in, y_in, jax.tree.map(sds, res.packer.zeros((), xp=jnp)),
              recv_x)
      # The weight gradient as the stage's leaves: W packs them into the sum as B does (packed
      # inside the cut, XLA:CPU built a zeroed buffer the size of the weights per W).
      core = functools.partial(program._backward_core, s, res,  # pylint: disable=protected-access
                               pack_weights=False)
      closed, (gw, _) = jax.make_jaxpr(core, return_shape=True)(*args)
      split = split_backward(closed, len(jax.tree.leaves(gw)))
    splits.append(split)
    carried.append([] if split is None else [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                             for v in split.carried])
  return dataclasses.replace(res, splits=tuple(splits), carried=Packer(carried))
