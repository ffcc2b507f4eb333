"""Pipelined data-parallel training: N pipelines of S stages on a ("data", "stage") mesh, GPipe or
PipeDream-1F1B with weight stashing inside one `jax.shard_map`, synchronised across pipelines by
all-reduce, SD-PIPE's partial reduce, AD-PSGD or HetPipe (sdpipe.md §1-§3, §7).

    mesh = jlp.pipeline.pipeline_mesh(num_pipelines=2, num_stages=4)
    pipe = jlp.pipeline.Pipeline(stages, loss_fn, optax.sgd(0.1), mesh, schedule="1f1b")
    state = pipe.init(stage_params)               # list of S pytrees; every pipeline starts there
    state, metrics = pipe.run(state, xs, ys)      # xs, ys: [B, N*b, ...]; metrics["loss"]: [B]
    params = pipe.stage_params(state)             # list of S pytrees, leading [N] pipeline axis

Device (i, s) of the mesh is stage s of pipeline i. Pipeline i trains on rows [i*b, (i+1)*b) of
each mini-batch. Every device runs the same program, a `lax.scan` over the ticks of the
schedule's static table (`jlp.pipeline.schedules`); at each tick it runs its stage's op of that
tick (a `lax.switch` over stage x {idle, forward, backward}), then the activations go one stage
down and the input gradients one stage up with `lax.ppermute` over "stage" (the collectives sit
after the switch, so every device issues the same ones, sdpipe.md §7.6). Stages may differ in
their parameters and activation shapes: each is held as flat per-dtype buffers of a common
length (`jlp.pipeline.packing`). A backward op recomputes its stage's forward from the stashed
input and weights (`jax.vjp`; activation memory is one input per in-flight micro-batch).

Schedules:
  "gpipe"  every mini-batch is split into M = num_microbatches micro-batches of b/M rows, filled
           and drained (2(M + S - 1) ticks); the gradients of the micro-batches (each of the loss
           times 1/M) are summed in the order the backwards run (M-1, ..., 0), then synchronised
           and applied once per mini-batch. With sync="allreduce" this is the unpipelined model
           on the whole mini-batch up to float32 rounding.
  "1f1b"   PipeDream's asynchronous 1F1B as SD-PIPE's Hetu executor runs it (sdpipe.md §1.1): the
           B mini-batches of a `run` flow through the pipeline (warm-up, one-forward-one-backward,
           drain at the end of `run`: 2B + 2(S - 1) ticks), each is its own update at each stage.
           Weight stashing: the forward of mini-batch b (1-based) at stage s (0-based) uses the
           weights after b - (S - s) updates of that stage (v = max(0, b - (S - s))); its backward
           uses the same stashed version, and its update is applied to the latest weights.

Synchronisation across the N pipelines, per stage, at every update:
  "allreduce"  the update uses the sum over pipelines of gradient / N, summed by
               `jlp.sync.reduce_gradients` with `grad_sync` (default: float32, sequential in
               pipeline order; a custom format, Kahan, APS or a HiPress compressor work too, on the
               stage's own gradient as one flat leaf of its own length, never the padded buffer,
               with a compression state per stage). It runs on the ticks that update only.
               SD-PIPE's AllReduce baseline (§1.3).
  "none"       every pipeline trains alone.
  "preduce"    SD-PIPE's partial reduce (§2): the local update, then model averaging
               x_i <- sum_j mix[b, s, i, j] x_j with the mixing matrix the host-side group scheduler
               (`jlp.pipeline.simulator`, virtual time) chose for update b of stage s, passed to the
               jitted program as an input (one compile for every grouping). Optimizer states and
               the stashed weights are never averaged (§2.1).
  "adpsgd"     the same averaging with seeded random perfect matchings (§3.1).
  "hetpipe"    a parameter-server copy per stage updated by every pipeline's delta / N (in
               pipeline order); every `hetpipe.pull_every`-th mini-batch (counted over the whole
               training) the local step is skipped and the local weights are replaced by the
               copy, otherwise the local weights take the local delta (§3.2). The seed's extra
               pull at the last batch of an epoch is not made.

Pipelines run in lockstep on the devices (all do mini-batch b at the same tick); speed and
stragglers live in virtual time (sdpipe.md §7.4): `run` simulates the same schedule with the
`hetero` cost model (`jlp.pipeline.simulator.simulate`, seeded by (seed, state.step)) from the
state's per-(pipeline, stage) clocks, so a pipeline keeps its lead from one run to the next, and
reports metrics["virtual_time"], the virtual seconds at which each mini-batch's update finished.
The simulated scheduler's own state (adaptive windows, union-find, counts) restarts at every run,
as the executor's pipeline fills and drains at every run.

A backward recomputes its stage's forward from the stashed input and weights, except 1F1B's last
stage, whose backward comes right after its forward with the same weights and state: there the
forward tick does nothing and the backward runs the stage once (loss, gradients, new state).

Stages: `stage(params, x) -> y`, or with `stateful=True` `stage(params, x, state) -> (y,
new_state)` (BatchNorm statistics, RNG counters: `jlp.pipeline.split_model` builds such stages
from a zoo model). A forward op replaces the stage's state by new_state (its pipeline's own copy,
never synchronised) and stashes the state it ran with, which the backward's recomputation uses.
Intermediate values (between stages) must be floating point (pytrees allowed); the inputs of
stage 0 (xs) and the targets (ys) may be any arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jlp._checks import is_int
from jlp.pipeline import schedules as sched
from jlp.pipeline.packing import Packer
from jlp.pipeline.simulator import SYNC_MODES, HetPipe, Hetero, PReduce, SyncPlan, simulate
from jlp.sync import SYNC_REPORT, GradSync, reduce_gradients

__all__ = ["Pipeline", "PipelineState", "pipeline_mesh"]

DATA, STAGE = "data", "stage"


def pipeline_mesh(num_pipelines: int, num_stages: int,
                  devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (num_pipelines, num_stages) mesh with axes ("data", "stage"), Auto axis types; device
  (i, s) is devices[i * num_stages + s] (default: jax.devices())."""
  devices = jax.devices() if devices is None else list(devices)
  for name, value in (("num_pipelines", num_pipelines), ("num_stages", num_stages)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}={value!r} is not allowed; expected an integer >= 1.")
  if num_pipelines * num_stages > len(devices):
    raise ValueError(f"num_pipelines * num_stages={num_pipelines * num_stages} is not allowed; "
                     f"expected at most the {len(devices)} devices.")
  grid = np.asarray(devices[:num_pipelines * num_stages], dtype=object)
  return Mesh(grid.reshape(num_pipelines, num_stages), (DATA, STAGE),
              axis_types=(AxisType.Auto, AxisType.Auto))


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


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Everything static about one `run` input shape."""
  num_batches: int
  table: sched.Table
  act: Packer  # the S - 1 inter-stage values, as float32 structs
  act_dtypes: tuple  # per boundary: the original leaf dtypes
  x_slots: int
  w_slots: int
  g_slots: int
  metric_names: tuple[str, ...]  # "loss", then the names of loss_fn's aux


def _slots(table: sched.Table, starts: dict, ends: dict) -> int:
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


def _write_slot(buffers: Any, slot: jax.Array, values: Any, when: jax.Array) -> Any:
  """`buffers` (a pytree of [K, ...] ring buffers) with entry `slot` replaced by `values` where
  `when` holds, kept otherwise: one slot read and written, not the whole buffer."""
  return jax.tree.map(lambda b, v: b.at[slot].set(jnp.where(when, v, b[slot])), buffers, values)


class Pipeline:
  """N pipelines x S stages trained with a pipeline schedule (module docstring).

  Args:
    stages: S callables, stage_s(params_s, x) -> y (with stateful=True: stage_s(params_s, x,
      state_s) -> (y, new_state_s)); pure and jittable; stages may differ.
    loss_fn: loss_fn(y_last, target) -> the mean loss over the (micro-)batch's rows, or
      (loss, {name: float32 scalar}) whose entries `run` reports beside the loss (e.g.
      accuracy), averaged the same way.
    optimizer: an optax GradientTransformation; one state per (pipeline, stage), never mixed.
    mesh: a mesh with axes "data" (N pipelines) and "stage" (S == len(stages)); see
      `pipeline_mesh`.
    schedule: "1f1b" or "gpipe".
    num_microbatches: GPipe's M (micro-batches per mini-batch); 1 for "1f1b".
    sync: "allreduce", "none", "preduce", "adpsgd" or "hetpipe".
    stateful: stages take and return a state (see above).
    grad_sync: how sync="allreduce" sums (a jlp.sync.GradSync over axis "data"; default float32
      sequential).
    hetero, preduce, hetpipe: the virtual-time cost model, the partial-reduce scheduler's knobs
      and HetPipe's (jlp.pipeline.simulator).
    seed: seeds the virtual-time simulation (and the AD-PSGD matchings).
    donate: donate the input state's buffers to the output state.
  """

  def __init__(self,
               stages: Sequence[Callable[..., Any]],
               loss_fn: Callable[[Any, Any], jax.Array],
               optimizer: optax.GradientTransformation,
               mesh: Mesh,
               *,
               schedule: str = "1f1b",
               num_microbatches: int = 1,
               sync: str = "allreduce",
               stateful: bool = False,
               grad_sync: GradSync | None = None,
               hetero: Hetero = Hetero(),
               preduce: PReduce = PReduce(),
               hetpipe: HetPipe = HetPipe(),
               seed: int = 0,
               donate: bool = False):
    if not isinstance(mesh, Mesh) or set(mesh.axis_names) != {DATA, STAGE}:
      raise ValueError(f"mesh={mesh!r} is not allowed; expected a jax.sharding.Mesh with axes "
                       f"({DATA!r}, {STAGE!r}) (jlp.pipeline.pipeline_mesh).")
    stages = list(stages) if isinstance(stages, (list, tuple)) else stages
    if not isinstance(stages, list) or not stages or not all(callable(f) for f in stages):
      raise ValueError(f"stages={stages!r} is not allowed; expected a non-empty list of callables.")
    if len(stages) != mesh.shape[STAGE]:
      raise ValueError(f"len(stages)={len(stages)} is not allowed; expected the mesh's "
                       f"{STAGE!r} axis size {mesh.shape[STAGE]}.")
    if schedule not in sched.SCHEDULES:
      raise ValueError(f"schedule={schedule!r} is not allowed; expected one of {sched.SCHEDULES}.")
    if not is_int(num_microbatches) or num_microbatches < 1:
      raise ValueError(f"num_microbatches={num_microbatches!r} is not allowed; expected an "
                       "integer >= 1.")
    if schedule == "1f1b" and num_microbatches != 1:
      raise ValueError(f"num_microbatches={num_microbatches} is not allowed with schedule='1f1b'; "
                       "expected 1 (every mini-batch is its own update, sdpipe.md §1.1).")
    if sync not in SYNC_MODES:
      raise ValueError(f"sync={sync!r} is not allowed; expected one of {SYNC_MODES}.")
    if not callable(loss_fn):
      raise ValueError(f"loss_fn={loss_fn!r} is not allowed; expected a callable.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
      raise ValueError(f"optimizer={optimizer!r} is not allowed; expected an optax "
                       "GradientTransformation.")
    if not isinstance(stateful, bool):
      raise ValueError(f"stateful={stateful!r} is not allowed; expected True or False.")
    grad_sync = GradSync() if grad_sync is None else grad_sync
    if not isinstance(grad_sync, GradSync) or grad_sync.axis_name != DATA or \
        grad_sync.uses_emulation:
      raise ValueError(f"grad_sync={grad_sync!r} is not allowed; expected a jlp.sync.GradSync "
                       f"over axis {DATA!r} without emulated nodes.")
    if grad_sync != GradSync() and sync != "allreduce":
      raise ValueError(f"grad_sync={grad_sync!r} is not allowed with sync={sync!r}; expected the "
                       "default (grad_sync sets how sync='allreduce' sums).")
    for name, value, kind in (("hetero", hetero, Hetero), ("preduce", preduce, PReduce),
                              ("hetpipe", hetpipe, HetPipe)):
      if not isinstance(value, kind):
        raise ValueError(f"{name}={value!r} is not allowed; expected a "
                         f"jlp.pipeline.{kind.__name__}.")
    if not is_int(seed):
      raise ValueError(f"seed={seed!r} is not allowed; expected an integer.")
    self.stages = stages
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.mesh = mesh
    self.schedule = schedule
    self.num_microbatches = int(num_microbatches)
    self.sync = sync
    self.stateful = stateful
    self.grad_sync = grad_sync
    self.hetero, self.preduce, self.hetpipe = hetero, preduce, hetpipe
    self.seed = int(seed)
    self.donate = donate
    self.num_pipelines = mesh.shape[DATA]
    self.num_stages = len(stages)
    self._packers: tuple[Packer, Packer, Packer] | None = None
    self._sync_packer: Packer | None = None
    self._compiled: dict[Any, Any] = {}

  # -- state -------------------------------------------------------------------------------------
  @property
  def sharding(self) -> NamedSharding:
    """The sharding of every [N, S, ...] state buffer."""
    return NamedSharding(self.mesh, P(DATA, STAGE))

  def _apply(self, s: int, params: Any, x: Any, state: Any) -> tuple[Any, Any]:
    if self.stateful:
      return self.stages[s](params, x, state)
    return self.stages[s](params, x), state

  def init(self, stage_params: Sequence[Any], stage_state: Sequence[Any] | None = None
           ) -> PipelineState:
    """The state every pipeline starts from: `stage_params[s]` (float32 leaves) at stage s, the
    optimizer's fresh state, and `stage_state[s]` (stateful stages only)."""
    S, N = self.num_stages, self.num_pipelines
    if not isinstance(stage_params, (list, tuple)) or len(stage_params) != S:
      raise ValueError(f"stage_params of length {len(stage_params) if isinstance(stage_params, (list, tuple)) else type(stage_params).__name__} "
                       f"is not allowed; expected a list of {S} pytrees (one per stage).")
    for s, tree in enumerate(stage_params):
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if np.dtype(jnp.result_type(leaf)) != np.float32:
          raise ValueError(f"stage_params[{s}]{jax.tree_util.keystr(path)}.dtype="
                           f"{jnp.result_type(leaf)} is not allowed; expected float32.")
    if self.stateful:
      if not isinstance(stage_state, (list, tuple)) or len(stage_state) != S:
        raise ValueError(f"stage_state={type(stage_state).__name__} is not allowed with "
                         f"stateful=True; expected a list of {S} pytrees.")
    elif stage_state is not None:
      raise ValueError("stage_state is not allowed with stateful=False; expected None.")
    states = list(stage_state) if self.stateful else [{} for _ in range(S)]
    opt_states = [self.optimizer.init(p) for p in stage_params]
    packers = (Packer(stage_params), Packer(opt_states), Packer(states))
    if self._packers is not None and any(
        (a.treedefs, a.layouts) != (b.treedefs, b.layouts)
        for a, b in zip(packers, self._packers, strict=True)):
      raise ValueError("stage_params / stage_state with other structures or shapes than this "
                       "pipeline's first init are not allowed; expected the same ones (build a "
                       "new Pipeline for another model).")
    self._packers = packers
    param_packer, opt_packer, state_packer = packers

    def stacked(packer: Packer, trees: Sequence[Any]) -> dict[str, jax.Array]:
      rows = [packer.pack(s, jax.device_get(t), xp=np) for s, t in enumerate(trees)]
      out = {}
      for d in packer.sizes:
        full = np.broadcast_to(np.stack([r[d] for r in rows]), (N, S, packer.sizes[d]))
        out[d] = jax.make_array_from_callback(full.shape, self.sharding, lambda i, f=full: f[i])
      return out

    params = stacked(param_packer, stage_params)
    sync_state = None
    if self.grad_sync.compression is not None:
      # Each stage's own state, for its own gradient's length (no padding in any residual).
      stage_states = [self.grad_sync.init_state(self._stage_grads(s), N) for s in range(S)]
      self._sync_packer = Packer(stage_states)
      sync_state = stacked(self._sync_packer, stage_states)
    replicated = NamedSharding(self.mesh, P())
    return PipelineState(
        step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
        params=params,
        opt_state=stacked(opt_packer, opt_states),
        model_state=stacked(state_packer, states),
        global_params=stacked(param_packer, stage_params) if self.sync == "hetpipe" else {},
        sync_state=sync_state,
        virtual_time=jax.device_put(jnp.zeros((N, S, 2), jnp.float32), replicated))

  def _stage_grads(self, s: int) -> dict[str, jax.ShapeDtypeStruct]:
    """What the gradient sync sees of stage s: its float32 parameters as one flat leaf of their
    own length (the packed buffer's padding never reaches a sync)."""
    length = sum(math.prod(shape) for dtype, _, shape in self._require_init()[0].layouts[s]
                 if dtype == "float32")
    return {"stage": jax.ShapeDtypeStruct((length,), jnp.float32)}

  def _require_init(self) -> tuple[Packer, Packer, Packer]:
    if self._packers is None:
      raise ValueError("this Pipeline has no state layout yet; expected pipe.init(stage_params) "
                       "before run / stage_params.")
    return self._packers

  def stage_params(self, state: PipelineState) -> list[Any]:
    """The latest weights: S pytrees (host numpy), each leaf with a leading [N] pipeline axis."""
    packer = self._require_init()[0]
    host = {d: np.asarray(v) for d, v in state.params.items()}
    return [packer.unpack(s, {d: v[:, s] for d, v in host.items()})
            for s in range(self.num_stages)]

  def stage_state(self, state: PipelineState) -> list[Any]:
    """The stateful stages' state: S pytrees (host numpy) with a leading [N] pipeline axis."""
    packer = self._require_init()[2]
    host = {d: np.asarray(v) for d, v in state.model_state.items()}
    return [packer.unpack(s, {d: v[:, s] for d, v in host.items()})
            for s in range(self.num_stages)]

  def stage_sync_state(self, state: PipelineState) -> list[Any] | None:
    """The gradient sync's compression state of each stage (for its own gradient length): S
    pytrees (host numpy) with a leading [N] pipeline axis; None without compression."""
    if state.sync_state is None:
      return None
    self._require_init()
    host = {d: np.asarray(v) for d, v in state.sync_state.items()}
    return [self._sync_packer.unpack(s, {d: v[:, s] for d, v in host.items()})
            for s in range(self.num_stages)]

  @staticmethod
  def virtual_clocks(state: PipelineState) -> np.ndarray:
    """float64 [N, S]: when each (pipeline, stage) finished its last update, in virtual seconds
    (stored as whole seconds + fraction in float32: microseconds for 100 virtual days)."""
    clock = np.asarray(state.virtual_time, np.float64)
    return clock[..., 0] + clock[..., 1]

  @classmethod
  def virtual_seconds(cls, state: PipelineState) -> float:
    """The virtual seconds `state` has trained: the latest of its clocks."""
    return float(cls.virtual_clocks(state).max())

  # -- input checks ------------------------------------------------------------------------------
  def check_state(self, state: PipelineState) -> None:
    """ValueError unless `state` has the buffers of this pipeline's latest `init`."""
    if not isinstance(state, PipelineState):
      raise ValueError(f"state of type {type(state).__name__} is not allowed; expected a "
                       "jlp.pipeline.PipelineState (pipe.init).")
    packers = self._require_init()
    lead = (self.num_pipelines, self.num_stages)
    for name, packer in zip(("params", "opt_state", "model_state"), packers, strict=True):
      buffers = getattr(state, name)
      expected = {d: lead + (n,) for d, n in packer.sizes.items()}
      shapes = {d: tuple(np.shape(v)) for d, v in buffers.items()}
      if shapes != expected:
        raise ValueError(f"state.{name} buffers {shapes} are not allowed; expected {expected} "
                         "(a state from this pipeline's latest init).")

  def check_batches(self, xs: Any, ys: Any) -> tuple[int, int]:
    """(B, rows per pipeline); ValueError unless xs and ys share [B, N*b] with N*M | N*b."""
    N, M = self.num_pipelines, self.num_microbatches
    leaves = jax.tree.leaves(xs) + jax.tree.leaves(ys)
    if not jax.tree.leaves(xs) or not jax.tree.leaves(ys):
      raise ValueError("xs and ys must each hold at least one array; expected [B, N*b, ...].")
    shapes = {tuple(np.shape(x)[:2]) for x in leaves}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
      raise ValueError(f"leading dimensions {sorted(shapes)} of xs and ys are not allowed; "
                       "expected one common [B, N*b] (B mini-batches of N*b rows).")
    B, rows = shapes.pop()
    if B < 1 or rows % (N * M) or rows == 0:
      raise ValueError(f"mini-batch rows={rows} is not allowed; expected a positive multiple of "
                       f"num_pipelines * num_microbatches = {N} * {M}.")
    return B, rows // N

  def _layout(self, xs: Any, ys: Any) -> _Layout:
    B, rows = self.check_batches(xs, ys)
    param_packer, _, state_packer = self._require_init()
    M, S = self.num_microbatches, self.num_stages
    micro = rows // M
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct((micro,) + np.shape(a)[2:], a.dtype), xs)
    y_target = jax.tree.map(lambda a: jax.ShapeDtypeStruct((micro,) + np.shape(a)[2:], a.dtype), ys)
    boundaries = []
    for s in range(S):
      p, st = param_packer.structs(s), state_packer.structs(s)
      try:
        y, _ = jax.eval_shape(lambda p, x, st, s=s: self._apply(s, p, x, st), p, x, st)
      except Exception as e:  # the stage's own error, said with which stage and input
        raise ValueError(f"stage {s} does not accept its input {x} (the output of stage {s - 1} "
                         f"or, for stage 0, one micro-batch of xs): {type(e).__name__}: {e}") from e
      if s < S - 1:
        for leaf in jax.tree.leaves(y):
          if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(f"stage {s} output dtype={leaf.dtype} is not allowed; expected "
                             "floating-point values between stages.")
        boundaries.append(y)
      else:
        try:
          out = jax.eval_shape(self._loss_metrics, y, y_target)
        except Exception as e:
          raise ValueError(f"loss_fn does not accept the last stage's output {y} and the "
                           f"targets {y_target}: {type(e).__name__}: {e}") from e
        metric_names = tuple(out)
      x = y
    act = Packer([jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), b)
                  for b in boundaries] or [{}])
    act_dtypes = tuple(tuple(a.dtype for a in jax.tree.leaves(b)) for b in boundaries)
    if self.schedule == "gpipe":
      table = sched.tick_table("gpipe", S, 1, M)
    else:
      table = sched.tick_table("1f1b", S, B, 1)
    x_starts, x_ends, w_starts, w_ends, g_starts, g_ends = {}, {}, {}, {}, {}, {}
    for t in range(table.num_ticks):
      for s in range(S):
        kind = table.kind[t, s]
        index = table.micro[t, s] if self.schedule == "gpipe" else table.batch[t, s]
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
    return _Layout(B, table, act, act_dtypes, _slots(table, x_starts, x_ends),
                   _slots(table, w_starts, w_ends), _slots(table, g_starts, g_ends),
                   metric_names)

  def _loss_metrics(self, y: Any, target: Any) -> dict[str, jax.Array]:
    """{"loss": loss_fn's loss, **its aux}, float32 scalars (ValueError otherwise)."""
    out = self.loss_fn(y, target)
    loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(aux, dict) or "loss" in aux:
      raise ValueError(f"loss_fn's aux of type {type(aux).__name__} is not allowed; expected a "
                       "dict of scalars (without the key 'loss').")
    metrics = {"loss": loss, **aux}
    for name, value in metrics.items():
      if jnp.shape(value) != ():
        raise ValueError(f"loss_fn's {name!r} of shape {jnp.shape(value)} is not allowed; "
                         "expected a scalar.")
    return {name: jnp.asarray(v, jnp.float32) for name, v in metrics.items()}

  # -- the run -----------------------------------------------------------------------------------
  def plan(self, state: PipelineState, num_batches: int, *, hetero: Hetero | None = None
           ) -> SyncPlan:
    """The virtual-time simulation of the next `num_batches` mini-batches (mixing matrices of
    preduce / adpsgd and the finish times), seeded by (seed, state.step), from the state's
    per-(pipeline, stage) clocks; `hetero` overrides the pipeline's cost model (e.g. a sweep
    over stalls with one compiled pipeline)."""
    step = int(np.asarray(state.step))
    return simulate(self.schedule, self.sync, self.num_pipelines, self.num_stages, num_batches,
                    self.num_microbatches, seed=int(np.random.SeedSequence(
                        [self.seed, step]).generate_state(1)[0]),
                    hetero=self.hetero if hetero is None else hetero, preduce=self.preduce,
                    hetpipe=self.hetpipe, first_batch=step, start=self.virtual_clocks(state))

  def run(self, state: PipelineState, xs: Any, ys: Any, plan: SyncPlan | None = None
          ) -> tuple[PipelineState, dict[str, Any]]:
    """Trains on the B mini-batches of xs, ys ([B, N*b, ...]; pipeline i takes rows [i*b, (i+1)*b)
    of each). Returns the new state and metrics: "loss" [B] (mean over pipelines of each
    mini-batch's loss; likewise every entry of loss_fn's aux), "bubble_fraction" (the schedule
    table's idle share), with sync="allreduce" the gradient sync's report per mini-batch
    ("wire_bytes" and "payload_bytes" [B]: per device, averaged over all devices; "nonfinite"
    [B]: summed over the stages; `jlp.sync.reduce_gradients`), "virtual_time" [B] (float64:
    virtual seconds at which each mini-batch's update finished, counted from the first run).
    `plan` (default: `self.plan(state, B)`) may be any object with the SyncPlan fields `mix`
    [B, S, N, N], `times` [B] and `finish` [B, N, S], on the clock of the state's
    `virtual_clocks`."""
    self.check_state(state)
    layout = self._layout(xs, ys)
    B = layout.num_batches
    if plan is None:
      plan = self.plan(state, B)
    mix = np.asarray(plan.mix, np.float32)
    expected = (B, self.num_stages, self.num_pipelines, self.num_pipelines)
    if mix.shape != expected:
      raise ValueError(f"plan.mix shape={mix.shape} is not allowed; expected {expected}.")
    key = (jax.tree.structure(xs), jax.tree.structure(ys),
           tuple((np.shape(a), np.dtype(a.dtype)) for a in jax.tree.leaves((xs, ys))))
    if key not in self._compiled:
      self._compiled[key] = self._build(layout)
    batch_sharding = NamedSharding(self.mesh, P(None, DATA))
    xs = jax.device_put(xs, batch_sharding)
    ys = jax.device_put(ys, batch_sharding)
    times = np.asarray(plan.times, np.float64)
    finish = np.asarray(plan.finish, np.float64)
    if times.shape != (B,) or finish.shape != (B, self.num_pipelines, self.num_stages):
      raise ValueError(f"plan.times shape={times.shape} / plan.finish shape={finish.shape} are "
                       f"not allowed; expected ({B},) and {(B, self.num_pipelines, self.num_stages)}.")
    new_state, means = self._compiled[key](state, xs, ys, jnp.asarray(mix))
    whole = np.floor(finish[-1])
    new_state = new_state._replace(virtual_time=jax.device_put(
        np.stack([whole, finish[-1] - whole], -1).astype(np.float32),
        NamedSharding(self.mesh, P())))
    metrics = {name: np.asarray(v) for name, v in means.items()}
    metrics.update(virtual_time=times, bubble_fraction=sched.bubble_fraction(layout.table))
    return new_state, metrics

  def _build(self, layout: _Layout):
    per = P(DATA, STAGE)
    state_spec = PipelineState(P(), per, per, per, per, per, P())
    program = jax.shard_map(
        lambda *a: self._device(layout, *a), mesh=self.mesh,
        in_specs=(state_spec, P(None, DATA), P(None, DATA), P()),
        out_specs=(state_spec, P()), check_vma=False)
    return jax.jit(program, donate_argnums=(0,) if self.donate else ())

  # -- the per-device program --------------------------------------------------------------------
  def _device(self, layout: _Layout, state: PipelineState, xs, ys, mix):
    squeeze = lambda tree: jax.tree.map(lambda x: x[0, 0], tree)
    params = squeeze(state.params)
    opt = squeeze(state.opt_state)
    model_state = squeeze(state.model_state)
    global_params = squeeze(state.global_params)
    sync_state = squeeze(state.sync_state)
    stage = lax.axis_index(STAGE)
    carry = dict(params=params, opt=opt, model_state=model_state, global_params=global_params,
                 sync_state=sync_state,
                 metrics={name: jnp.zeros((layout.num_batches,), jnp.float32)
                          for name in layout.metric_names},
                 sync_report={name: jnp.zeros((layout.num_batches,), dtype) for name, dtype in
                              SYNC_REPORT.items()} if self.sync == "allreduce" else {})
    if self.schedule == "1f1b":
      carry = self._run_1f1b(layout, carry, stage, state.step, xs, ys, mix)
    else:
      carry = self._run_gpipe(layout, carry, stage, state.step, xs, ys, mix)
    last = stage == self.num_stages - 1
    means = {name: lax.psum(lax.psum(jnp.where(last, v, 0.0), STAGE), DATA) / self.num_pipelines
             for name, v in carry["metrics"].items()}
    # The sync's bytes per device, averaged over all N*S devices (each stage's devices sync their
    # own stage's gradient); non-finite elements summed over the stages.
    for name, v in carry["sync_report"].items():
      total = lax.psum(lax.psum(v, STAGE), DATA)
      means[name] = total // self.num_pipelines if name == "nonfinite" else total / (
          self.num_pipelines * self.num_stages)
    expand = lambda tree: jax.tree.map(lambda x: x[None, None], tree)
    new_state = PipelineState(state.step + layout.num_batches, expand(carry["params"]),
                              expand(carry["opt"]), expand(carry["model_state"]),
                              expand(carry["global_params"]), expand(carry["sync_state"]),
                              state.virtual_time)
    return new_state, means

  def _tick_buffers(self, layout: _Layout, stash_weights: bool) -> dict[str, Any]:
    param_packer, _, state_packer = self._require_init()
    act = layout.act.sizes.get("float32", 0)
    out = dict(recv_x=jnp.zeros((layout.x_slots, act), jnp.float32),
               recv_g=jnp.zeros((layout.g_slots, act), jnp.float32),
               stash_state=state_packer.zeros((layout.w_slots,), xp=jnp))
    if stash_weights:
      out["stash_w"] = param_packer.zeros((layout.w_slots,), xp=jnp)
    return out

  def _pack_act(self, layout: _Layout, boundary: int, tree: Any) -> jax.Array:
    tree = jax.tree.map(lambda a: a.astype(jnp.float32), tree)
    return layout.act.pack(boundary, tree)["float32"]

  def _unpack_act(self, layout: _Layout, boundary: int, flat: jax.Array) -> Any:
    tree = layout.act.unpack(boundary, {"float32": flat})
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x.astype(d) for x, d in zip(leaves, layout.act_dtypes[boundary], strict=True)]
    return jax.tree.unflatten(treedef, leaves)

  def _tick(self, layout: _Layout, carry, bufs, stage, kind, index, x_in, y_in, loss_scale,
            grad_acc=None):
    """One op of this device's stage: (act_out, grad_out, param gradient, new model state,
    metrics: {"loss", aux...} of a last-stage backward, else zeros). With `grad_acc` (GPipe's
    sum over micro-batches) a backward returns grad_acc + its gradient and the other ops
    grad_acc, so that only backwards touch the sum."""
    param_packer, _, state_packer = self._require_init()
    S = self.num_stages
    act_len = layout.act.sizes.get("float32", 0)
    slot_x = index % layout.x_slots
    slot_w = index % layout.w_slots
    slot_g = index % layout.g_slots
    latest = carry["params"]
    stashed_w = (jax.tree.map(lambda b: b[slot_w], bufs["stash_w"]) if "stash_w" in bufs
                 else latest)
    stashed_state = jax.tree.map(lambda b: b[slot_w], bufs["stash_state"])
    recv_x = bufs["recv_x"][slot_x]
    recv_g = bufs["recv_g"][slot_g]
    zeros_act = jnp.zeros((act_len,), jnp.float32)
    zeros_grad = jax.tree.map(jnp.zeros_like, latest) if grad_acc is None else grad_acc
    no_metrics = {name: jnp.float32(0) for name in layout.metric_names}

    def idle(s):
      return lambda: (zeros_act, zeros_act, zeros_grad, carry["model_state"], no_metrics)

    # 1F1B runs the last stage's backward right after its forward, with the same weights and
    # state: the forward is left to the backward, which runs the stage once and keeps its state.
    fused_last = self.schedule == "1f1b"

    def forward(s):
      if s == S - 1 and fused_last:
        return idle(s)

      def op():
        x = x_in if s == 0 else self._unpack_act(layout, s - 1, recv_x)
        y, new_state = self._apply(s, param_packer.unpack(s, latest), x,
                                   state_packer.unpack(s, carry["model_state"]))
        out = self._pack_act(layout, s, y) if s < S - 1 else zeros_act
        return out, zeros_act, zeros_grad, state_packer.pack(s, new_state), no_metrics
      return op

    def backward(s):
      def op():
        w = param_packer.unpack(s, stashed_w)
        st = state_packer.unpack(s, stashed_state)
        x = x_in if s == 0 else self._unpack_act(layout, s - 1, recv_x)
        new_state = carry["model_state"]
        if s == S - 1:
          def f(w, x):
            y, stage_state = self._apply(s, w, x, st)
            metrics = self._loss_metrics(y, y_in)
            return metrics["loss"] * loss_scale, (metrics, stage_state)
          if s == 0:
            gw, (loss, stage_state) = jax.grad(lambda w: f(w, x), has_aux=True)(w)
            gx = None
          else:
            (gw, gx), (loss, stage_state) = jax.grad(f, argnums=(0, 1), has_aux=True)(w, x)
          if fused_last:
            new_state = state_packer.pack(s, stage_state)
        else:
          ct = self._unpack_act(layout, s, recv_g)
          loss = no_metrics
          if s == 0:
            _, vjp = jax.vjp(lambda w: self._apply(s, w, x, st)[0], w)
            (gw,), gx = vjp(ct), None
          else:
            _, vjp = jax.vjp(lambda w, x: self._apply(s, w, x, st)[0], w, x)
            gw, gx = vjp(ct)
        grad_out = self._pack_act(layout, s - 1, gx) if s > 0 else zeros_act
        gw = param_packer.pack(s, gw)
        if grad_acc is not None:
          gw = jax.tree.map(jnp.add, grad_acc, gw)
        return zeros_act, grad_out, gw, new_state, loss
      return op

    branches = []
    for s in range(S):
      branches += [idle(s), forward(s), backward(s)]
    return lax.switch(stage * 3 + kind, branches)

  def _exchange(self, layout: _Layout, bufs, stage, kind, index, act_out, grad_out):
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
    bufs["recv_x"] = _write_slot(bufs["recv_x"], slot(id_x, layout.x_slots), act, id_x > 0)
    bufs["recv_g"] = _write_slot(bufs["recv_g"], slot(id_g, layout.g_slots), grad, id_g > 0)
    return bufs

  def _update(self, carry, stage, grads, do_update, batch_index, global_batch, mix):
    """The optimizer step of this device's stage with the pipelines' sync (module docstring)."""
    param_packer, opt_packer, _ = self._require_init()
    N, S = self.num_pipelines, self.num_stages
    carry = dict(carry)
    if self.sync == "allreduce":
      own = carry["sync_state"]
      branches = [self._stage_sync(s, global_batch) for s in range(S)]

      def synced(packed, own):
        return lax.switch(stage, branches, packed, own)

      def skipped(packed, own):
        return packed, own, {name: jnp.zeros((), dtype) for name, dtype in SYNC_REPORT.items()}

      # The sync's collectives run on the ticks that update only (the pipelines of a stage
      # update at the same ticks, so its collectives over "data" meet).
      summed, carry["sync_state"], report = lax.cond(do_update, synced, skipped,
                                                     grads["float32"], own)
      grads = {"float32": summed}
      carry["sync_report"] = {
          name: v.at[batch_index].set(jnp.where(do_update, report[name], v[batch_index]))
          for name, v in carry["sync_report"].items()}

    def keep():
      return carry["params"], carry["opt"], jax.tree.map(jnp.zeros_like, carry["params"])

    def step(s):
      def op():
        p = param_packer.unpack(s, carry["params"])
        g = param_packer.unpack(s, grads)
        o = opt_packer.unpack(s, carry["opt"])
        updates, o = self.optimizer.update(g, o, p)
        p = optax.apply_updates(p, updates)
        return param_packer.pack(s, p), opt_packer.pack(s, o), param_packer.pack(s, updates)
      return op

    index = jnp.where(do_update, stage + 1, 0)
    params, opt, delta = lax.switch(index, [keep] + [step(s) for s in range(S)])
    carry["opt"] = opt
    if self.sync in ("preduce", "adpsgd"):
      everyone = lax.all_gather(params["float32"], DATA)  # [N, L]
      row = mix[batch_index, stage, lax.axis_index(DATA)]
      mixed = everyone[0] * row[0]
      for j in range(1, N):
        mixed = mixed + everyone[j] * row[j]
      params = {"float32": jnp.where(do_update, mixed, params["float32"])}
    elif self.sync == "hetpipe":
      deltas = lax.all_gather(delta["float32"], DATA)
      server = carry["global_params"]["float32"]
      for j in range(N):
        server = server + deltas[j] * np.float32(1.0 / N)
      server = jnp.where(do_update, server, carry["global_params"]["float32"])
      carry["global_params"] = {"float32": server}
      pull = jnp.logical_and(do_update, (global_batch + 1) % self.hetpipe.pull_every == 0)
      params = {"float32": jnp.where(pull, server, params["float32"])}
    carry["params"] = params
    return carry

  def _stage_sync(self, s: int, global_batch: jax.Array):
    """Stage s's gradient sync as a `lax.switch` branch: (packed gradient [L], packed state) ->
    (summed packed gradient, new packed state, report). The sync runs on the stage's own
    gradient length and state (`_stage_grads`), so no padding enters a mean, count, k or
    residual; the pipelines of one stage take the same branch, so its collectives over "data"
    meet."""
    N = self.num_pipelines

    def branch(packed, state):
      length = self._stage_grads(s)["stage"].shape[0]
      scaled = {"stage": packed[:length] * np.float32(1.0 / N)}
      own = None if state is None else self._sync_packer.unpack(s, state)
      # The stage index is folded into the sync's random stream: every stage draws its own.
      summed, new_state, report = reduce_gradients(scaled, self.grad_sync, own, global_batch,
                                                   stream=s)
      # A pad, not an update of a zero buffer: jax 0.11's Shardy crashes compiling an update
      # that covers the whole buffer (the longest stage's).
      summed = jnp.pad(summed["stage"], (0, packed.shape[0] - length))
      new_state = None if state is None else self._sync_packer.pack(s, new_state)
      return summed, new_state, {name: report[name].astype(dtype)
                                 for name, dtype in SYNC_REPORT.items()}
    return branch

  def _run_1f1b(self, layout: _Layout, carry, stage, step, xs, ys, mix):
    table = layout.table
    bufs = self._tick_buffers(layout, stash_weights=True)

    def tick(state, row):
      carry, bufs = state
      kinds, batches = row
      kind, index = kinds[stage], jnp.maximum(batches[stage], 0)
      x_in = jax.tree.map(lambda a: a[index], xs)
      y_in = jax.tree.map(lambda a: a[index], ys)
      slot_w = index % layout.w_slots
      is_fwd = kind == sched.FWD
      bufs = dict(bufs)
      # A forward stashes the weights and the state it runs with, for its backward.
      bufs["stash_w"] = _write_slot(bufs["stash_w"], slot_w, carry["params"], is_fwd)
      bufs["stash_state"] = _write_slot(bufs["stash_state"], slot_w, carry["model_state"], is_fwd)
      act_out, grad_out, grads, new_model_state, loss = self._tick(
          layout, carry, bufs, stage, kind, index, x_in, y_in, jnp.float32(1))
      carry = dict(carry, model_state=new_model_state)
      carry["metrics"] = {name: v.at[index].set(jnp.where(kind == sched.BWD, loss[name], v[index]))
                          for name, v in carry["metrics"].items()}
      bufs = self._exchange(layout, bufs, stage, kind, index, act_out, grad_out)
      carry = self._update(carry, stage, grads, kind == sched.BWD, index, step + index, mix)
      return (carry, bufs), None

    rows = (jnp.asarray(table.kind), jnp.asarray(table.batch))
    (carry, _), _ = lax.scan(tick, (carry, bufs), rows)
    return carry

  def _run_gpipe(self, layout: _Layout, carry, stage, step, xs, ys, mix):
    table = layout.table
    M = self.num_microbatches
    rows = (jnp.asarray(table.kind), jnp.asarray(table.micro))

    def minibatch(carry, b):
      x_b = jax.tree.map(lambda a: a[b], xs)
      y_b = jax.tree.map(lambda a: a[b], ys)
      micro_rows = jax.tree.leaves(x_b)[0].shape[0] // M
      bufs = self._tick_buffers(layout, stash_weights=False)
      grads = jax.tree.map(jnp.zeros_like, carry["params"])

      def tick(state, row):
        carry, bufs, grads, loss_sum = state
        kinds, micros = row
        kind, index = kinds[stage], jnp.maximum(micros[stage], 0)
        take = lambda a: lax.dynamic_slice_in_dim(a, index * micro_rows, micro_rows)
        x_in = jax.tree.map(take, x_b)
        y_in = jax.tree.map(take, y_b)
        slot = index % layout.w_slots
        bufs = dict(bufs)
        bufs["stash_state"] = _write_slot(bufs["stash_state"], slot, carry["model_state"],
                                          kind == sched.FWD)
        act_out, grad_out, grads, new_model_state, loss = self._tick(
            layout, carry, bufs, stage, kind, index, x_in, y_in, np.float32(1.0 / M), grads)
        carry = dict(carry, model_state=new_model_state)
        bufs = self._exchange(layout, bufs, stage, kind, index, act_out, grad_out)
        return (carry, bufs, grads, jax.tree.map(jnp.add, loss_sum, loss)), None

      zero = {name: jnp.float32(0) for name in layout.metric_names}
      (carry, _, grads, loss_sum), _ = lax.scan(tick, (carry, bufs, grads, zero), rows)
      carry = self._update(carry, stage, grads, jnp.bool_(True), b, step + b, mix)
      carry["metrics"] = {name: v.at[b].set(loss_sum[name] / M)
                          for name, v in carry["metrics"].items()}
      return carry, None

    carry, _ = lax.scan(minibatch, carry, jnp.arange(layout.num_batches))
    return carry
