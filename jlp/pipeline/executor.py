"""Pipelined data-parallel training: N pipelines of S stages on a ("data", "stage") mesh, GPipe,
PipeDream-1F1B with weight stashing or a flush schedule inside one `jax.shard_map`, synchronised
across pipelines by all-reduce, SD-PIPE's partial reduce, AD-PSGD or HetPipe (docs/sdpipe.md).

    mesh = jlp.pipeline.pipeline_mesh(num_pipelines=2, num_stages=4)
    pipe = jlp.pipeline.Pipeline(stages, loss_fn, optax.sgd(0.1), mesh, schedule="1f1b")
    state = pipe.init(stage_params)               # list of S pytrees; every pipeline starts there
    state, metrics = pipe.run(state, xs, ys)      # xs, ys: [B, N*b, ...]; completed ones' metrics
    state, metrics = pipe.flush(state)            # 1F1B: complete the mini-batches in flight
    params = pipe.stage_params(state)             # list of S pytrees, leading [N] pipeline axis

Device (i, s) of the mesh is stage s of pipeline i. Pipeline i trains on rows [i*b, (i+1)*b) of
each mini-batch. Every device runs the same program (`jlp.pipeline.program`), a `lax.scan` over
the ticks of the schedule's static table (`jlp.pipeline.schedules`) with ring buffers sized by
`jlp.pipeline.buffers`. Stages may differ in their parameters and activation shapes: each is held
as flat per-dtype buffers of a common length (`jlp.pipeline.packing`). This module holds the
public object: checks, state, runs and flush, the syncs' decisions from the virtual time, and the
compiled programs by input shape.

Schedules:
  "gpipe"  every mini-batch is split into M = num_microbatches micro-batches of b/M rows, filled
           and drained (2(M + S - 1) ticks); the gradients of the micro-batches (each of the loss
           times 1/M) are summed in the order the backwards run (M-1, ..., 0), then synchronised
           and applied once per mini-batch. With sync="allreduce" this is the unpipelined model
           on the whole mini-batch up to float32 rounding.
  "1f1b"   PipeDream's asynchronous 1F1B as SD-PIPE's Hetu executor runs it
           (docs/sdpipe.md#schedules): mini-batches flow through the pipeline (warm-up, then one
           forward, one backward), each its own update at each stage. A `run` feeds B more and ends
           where the next would enter stage 0 (`schedules.continuous_1f1b`), with the pipeline still
           full; `flush` drains it (the table of all the mini-batches fed, tick for tick, whatever
           the runs). Weight stashing: the forward of mini-batch b (1-based) at stage s (0-based)
           uses the weights after b - (S - s) updates of that stage (v = max(0, b - (S - s))); its
           backward uses the same stashed version, and its update is applied to the latest weights.

  flush    "1f1b_flush", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev" or any
           `jlp.pipeline.Schedule` (`jlp.pipeline.flush`, docs/sdpipe.md "Running a flush
           schedule"): every mini-batch of M micro-batches flushed, the update GPipe's; v stages per
           device take v * S stage functions; syncs "allreduce" and "none".

Synchronisation across the N pipelines, per stage, at every update (`jlp.pipeline.sync_modes`):
  "allreduce"  the update uses the sum over pipelines of gradient / N, summed by
               `jlp.sync.reduce_gradients` with `grad_sync` (default: float32, sequential in
               pipeline order; a custom format, Kahan, APS or a HiPress compressor work too, on the
               stage's own gradient as one flat leaf of its own length, never the padded buffer,
               with a compression state per stage). It runs on the ticks that update only.
               SD-PIPE's AllReduce baseline.
  "none"       every pipeline trains alone.
  "preduce"    SD-PIPE's partial reduce (docs/sdpipe.md#preduce-scheduler): the local update, then
               model averaging x_i <- sum_j mix[b, s, i, j] x_j with the mixing matrix the group
               scheduler (`jlp.pipeline.preduce`, in the virtual time) chose for update b of stage
               s, passed to the jitted program as an input (one compile for every grouping).
               Optimizer states and the stashed weights are never averaged.
  "adpsgd"     the same averaging with seeded random perfect matchings.
  "hetpipe"    a parameter-server copy per stage updated by every pipeline's delta / N (in
               pipeline order); every `hetpipe.pull_every`-th mini-batch (counted over the whole
               training) the local step is skipped and the local weights are replaced by the
               copy, otherwise the local weights take the local delta. The seed's extra
               pull at the last batch of an epoch is not made.

Speed and stragglers live in virtual time (docs/sdpipe.md#virtual-time): the pipeline advances one
timeline of its fill (`jlp.pipeline.timeline`: the `hetero` cost model, seeded by (seed, the fill's
first mini-batch), with no last mini-batch until `flush`) and reports metrics["virtual_time"].
GPipe's pipelines run in lockstep (all do mini-batch b at the same tick; the timeline gives the
syncs' decisions and clocks). 1F1B's pipelines progress by their own clocks
(`jlp.pipeline.placement`): every op, group average, push and pull of the timeline is placed on
the devices' ticks in the order the timeline gives them, so a pipeline that is slower in virtual
time idles in the ticks it has no op and makes fewer updates; groups average the models their
members have at the group's close; HetPipe's server takes each delta when it arrives and a pull
reads it as it stands then. The N pipelines draw their mini-batches from the one stream of
xs, ys in the order their first stages start them: chunk c (pipeline c mod N's rows of
mini-batch c // N, as a lockstep run would) goes to the c-th forward of stage 0 in virtual time;
a run fed B mini-batches executes everything before the forward that takes chunk B*N. `run`
reports "updates" [N] (each pipeline's completed mini-batches) and, as "batch", every N
completions in completion order as one mini-batch (with equal speeds: the N pipelines' rows of
one mini-batch, and every number as the lockstep executor's). The scheduler's state (adaptive
windows, union-find, counts) lives from one run to the next like the pipeline's, pruned to
what later runs need and kept in the state as a snapshot (`jlp.pipeline.fill`): a restore or a
retry from an earlier state continues from it without replaying the fill.

Stages: `stage(params, x) -> y`, or with `stateful=True` `stage(params, x, state) -> (y,
new_state)` (BatchNorm statistics, RNG counters: `jlp.pipeline.split_model` builds such stages
from a zoo model). A forward op replaces the stage's state by new_state (its pipeline's own copy,
never synchronised) and stashes the state it ran with, which the backward's recomputation uses.
Intermediate values (between stages) must be floating point (pytrees allowed); the inputs of
stage 0 (xs) and the targets (ys) may be any arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jlp._checks import is_int
from jlp.pipeline import schedules as sched
from jlp.pipeline.buffers import Layout, make_layout
from jlp.pipeline.costs import check_sizes
from jlp.pipeline.flush import FlushProgram, FlushTables, flush_tables
from jlp.pipeline.fill import (Fill, FillCache, FillModel, encode_snapshot, model_capacity,
                               snapshot_capacity)
from jlp.pipeline.packing import Packer
from jlp.pipeline.program import DATA, STAGE, PipelineState, Program
from jlp.pipeline.run_tables import bucket, make_run_tables
from jlp.pipeline.schedule_data import FLUSH_SCHEDULES, Schedule, bubble, makespan, peak_inflight
from jlp.pipeline.simulator import SYNC_MODES, HetPipe, Hetero, PReduce
from jlp.pipeline.sync_modes import sync_mode
from jlp.sync import SYNC_REPORT, GradSync

__all__ = ["Pipeline", "PipelineState", "pipeline_mesh"]


def _shape_key(tree: Any) -> tuple[Any, tuple[Any, ...]]:
  """The structure, shapes and dtypes of a pytree of arrays (or ShapeDtypeStructs): what a
  layout or a compiled program of the batches depends on."""
  return jax.tree.structure(tree), tuple(
      (np.shape(a), np.dtype(a.dtype)) for a in jax.tree.leaves(tree))


def _put(value: Any, sharding: NamedSharding) -> jax.Array:
  """`value` (host data that every process computes alike) laid out as `sharding`; each process
  writes only its own devices' shards. `jax.device_put` of host data onto devices of several
  processes first checks that every process passed the same value by gathering the whole value
  from all of them over the network (the 1F1B in-flight buffers are 100s of MB): not here."""
  if sharding.is_fully_addressable or (isinstance(value, jax.Array)
                                       and not value.is_fully_addressable):
    return jax.device_put(value, sharding)
  host = np.asarray(value)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _host(array: jax.Array) -> np.ndarray:
  """A whole array on the host, also when its shards live in several processes."""
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
  return np.asarray(array)


def _idle_share(busy: float, span: float, num_pipelines: int, num_stages: int) -> float:
  """The share of num_pipelines * num_stages device-seconds over `span` virtual seconds in which
  the devices were not busy (`busy` device-seconds of ops); nan for an empty span."""
  if not span > 0:
    return float("nan")
  return 1.0 - busy / (num_pipelines * num_stages * span)


def _oldest_waiting(items: list[tuple[int, int]], num_pipelines: int) -> list[float]:
  """Per pipeline, the earliest update m of its completions waiting to be reported (inf: none):
  their leave times must stay."""
  oldest = [math.inf] * num_pipelines
  for i, m in items:
    oldest[i] = min(oldest[i], m)
  return oldest


def _stages_across_hosts(devices: list[jax.Device], num_pipelines: int,
                         num_stages: int) -> list[jax.Device]:
  """With P processes (hosts) that divide S and hold N * S / P devices each: stage s of every
  pipeline on host s // (S / P), so that each pipeline spans the hosts (its activations cross
  them) and each stage's all-reduce across the pipelines stays on one host (SD-PIPE's pipe_4_4
  layout). Device (i, s) is host h's local device i * (S / P) + s % (S / P)."""
  by_host: dict[int, list[jax.Device]] = {}
  for d in devices:
    by_host.setdefault(d.process_index, []).append(d)
  hosts = sorted(by_host)
  P = len(hosts)
  per_host = num_pipelines * num_stages // P if P else 0
  if P <= 1 or num_stages % P or any(len(by_host[h]) < per_host for h in hosts):
    return devices
  span = num_stages // P
  return [by_host[hosts[s // span]][i * span + s % span]
          for i in range(num_pipelines) for s in range(num_stages)]


def pipeline_mesh(num_pipelines: int, num_stages: int,
                  devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (num_pipelines, num_stages) mesh with axes ("data", "stage"), Auto axis types. One
  process: device (i, s) is devices[i * num_stages + s] (default: jax.devices()). Several
  processes whose number divides S, each with N * S / P of the devices: stage s on process
  s // (S / P), so every pipeline spans the processes (hosts) and each stage's sync across the
  pipelines stays on one host (SD-PIPE's pipe_4_4); otherwise the devices in order."""
  devices = jax.devices() if devices is None else list(devices)
  for name, value in (("num_pipelines", num_pipelines), ("num_stages", num_stages)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}={value!r} is not allowed; expected an integer >= 1.")
  if num_pipelines * num_stages > len(devices):
    raise ValueError(f"num_pipelines * num_stages={num_pipelines * num_stages} is not allowed; "
                     f"expected at most the {len(devices)} devices.")
  devices = _stages_across_hosts(devices, num_pipelines, num_stages)
  grid = np.asarray(devices[:num_pipelines * num_stages], dtype=object)
  return Mesh(grid.reshape(num_pipelines, num_stages), (DATA, STAGE),
              axis_types=(AxisType.Auto, AxisType.Auto))


def _flush_schedule(schedule: str | Schedule, num_devices: int, num_microbatches: int,
                    virtual_stages: int | None, shared: Any, num_functions: int, sync: str,
                    hetero: Hetero) -> tuple[Schedule, FlushTables]:
  """The checked flush schedule of a `Pipeline` (its name or a Schedule) and its tables; one-line
  ValueErrors for what does not fit (the peers' constraints come from `Schedule.named`)."""
  if isinstance(schedule, Schedule):
    if virtual_stages is not None:
      raise ValueError(f"virtual_stages={virtual_stages!r} is not allowed with a Schedule; "
                       "expected None (the schedule places its stages).")
    if schedule.num_devices != num_devices:
      raise ValueError(f"a Schedule of {schedule.num_devices} devices is not allowed; expected "
                       f"the mesh's {num_devices} {STAGE!r} devices.")
    if schedule.num_microbatches != num_microbatches:
      raise ValueError(f"num_microbatches={num_microbatches} is not allowed with a Schedule of "
                       f"{schedule.num_microbatches} micro-batches; expected "
                       f"{schedule.num_microbatches}.")
    table = schedule.validate(num_microbatches)
    name = "the Schedule"
  else:
    table = Schedule.named(schedule, num_devices, num_microbatches,
                           virtual_stages=virtual_stages)
    name = f"schedule={schedule!r}"
  if num_functions != table.num_stages:
    raise ValueError(f"len(stages)={num_functions} is not allowed with {name} on {num_devices} "
                     f"devices; expected {table.num_stages} ({table.num_stages // num_devices} "
                     "stage function(s) per device).")
  if sync not in ("allreduce", "none"):
    raise ValueError(f"sync={sync!r} is not allowed with {name}; expected 'allreduce' or 'none' "
                     "(the virtual-time syncs run with 'gpipe' and '1f1b').")
  pairs = []
  for pair in shared:
    ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(is_int(k) for k in pair)
          and all(0 <= k < table.num_stages for k in pair) and pair[0] != pair[1])
    if not ok or table.placement[pair[0]] != table.placement[pair[1]]:
      raise ValueError(f"shared_stages entry {pair!r} is not allowed; expected two different "
                       f"stages in [0, {table.num_stages}) on one device (placement "
                       f"{table.placement}).")
    pairs.append((int(pair[0]), int(pair[1])))
  stages_in_pairs = [k for pair in pairs for k in pair]
  if len(set(stages_in_pairs)) != len(stages_in_pairs):
    raise ValueError(f"shared_stages={shared!r} is not allowed; expected each stage in at most "
                     "one pair.")
  _check_flush_hetero(name, hetero)
  return table, flush_tables(table, pairs)


def _check_flush_hetero(name: str, hetero: Hetero) -> None:
  if isinstance(hetero, Hetero) and (hetero.slowdown is not None or hetero.delay_s):
    raise ValueError(f"hetero={hetero!r} is not allowed with {name}; expected no slowdown and "
                     "delay_s=0 (a flush schedule's virtual time counts fwd_s, bwd_s and the "
                     "all-reduce only).")


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
    schedule: "1f1b" or "gpipe" (module docstring); a flush schedule's name ("1f1b_flush",
      "interleaved_1f1b", "zb_h1", "zbv", "dualpipev": `jlp.pipeline.Schedule.named` on the
      mesh's D stage devices) or any valid `jlp.pipeline.Schedule` of D devices (a torch CSV:
      `Schedule.from_torch_csv`), run by `jlp.pipeline.flush`. A flush schedule with v stages per
      device takes v * D stage functions (`stages[i]` is stage i wherever the schedule places it)
      and syncs "allreduce" or "none".
    num_microbatches: M, the micro-batches per mini-batch of GPipe and the flush schedules; 1 for
      "1f1b".
    virtual_stages: v of "interleaved_1f1b" (default 2); the other names have their own (ZB-V and
      DualPipeV 2, the rest 1).
    shared_stages: pairs (i, j) of stages on one device that are one stage used twice (tied
      weights): both start from the same weights, their gradients are summed and both take the
      same step (flush schedules only).
    remat: whether a backward recomputes its stage's forward from the kept input. None: the
      schedule's own way ("gpipe" and "1f1b" recompute; the flush schedules keep each forward's
      residuals from F to its B, or its I and W, and run only the backward: less work, more
      memory); True with a flush schedule: recompute as GPipe does (the same update bit for bit).
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
               schedule: str | Schedule = "1f1b",
               num_microbatches: int = 1,
               virtual_stages: int | None = None,
               shared_stages: Sequence[tuple[int, int]] = (),
               remat: bool | None = None,
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
    names = sched.SCHEDULES + tuple(n for n in FLUSH_SCHEDULES if n not in sched.SCHEDULES)
    if not (isinstance(schedule, Schedule) or (isinstance(schedule, str) and schedule in names)):
      raise ValueError(f"schedule={schedule!r} is not allowed; expected one of {names} or a "
                       "jlp.pipeline.Schedule.")
    if not is_int(num_microbatches) or num_microbatches < 1:
      raise ValueError(f"num_microbatches={num_microbatches!r} is not allowed; expected an "
                       "integer >= 1.")
    #: the flush schedule run by jlp.pipeline.flush (None: "gpipe" or "1f1b" by the program).
    self.schedule_data: Schedule | None = None
    self._tables: FlushTables | None = None
    if isinstance(schedule, Schedule) or schedule not in sched.SCHEDULES:
      self.schedule_data, self._tables = _flush_schedule(
          schedule, mesh.shape[STAGE], int(num_microbatches), virtual_stages, shared_stages,
          len(stages), sync, hetero)
      schedule = schedule if isinstance(schedule, str) else "custom"
    else:
      if virtual_stages not in (None, 1):
        raise ValueError(f"virtual_stages={virtual_stages!r} is not allowed with schedule="
                         f"{schedule!r}; expected None (one stage per device).")
      if tuple(shared_stages):
        raise ValueError(f"shared_stages={shared_stages!r} is not allowed with schedule="
                         f"{schedule!r}; expected () (shared stages run in the flush schedules).")
      if len(stages) != mesh.shape[STAGE]:
        raise ValueError(f"len(stages)={len(stages)} is not allowed; expected the mesh's "
                         f"{STAGE!r} axis size {mesh.shape[STAGE]}.")
    if remat not in (None, True, False) or (remat is False and self.schedule_data is None):
      expected = "None or True" if self.schedule_data is None else "None, True or False"
      raise ValueError(f"remat={remat!r} is not allowed with schedule={schedule!r}; expected "
                       f"{expected} (GPipe's and 1F1B's programs always recompute).")
    if schedule == "1f1b" and num_microbatches != 1:
      raise ValueError(f"num_microbatches={num_microbatches} is not allowed with schedule='1f1b'; "
                       "expected 1 (every mini-batch is its own update, docs/sdpipe.md#schedules).")
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
    check_sizes(sync, hetero, preduce, mesh.shape[DATA], len(stages))
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
    self.shared_stages = tuple(tuple(pair) for pair in shared_stages)
    self.remat = bool(remat)
    # The state's rows: device d's chunks, d * v + c, hold stage _row_stage[d * v + c].
    self._row_stage = (self._tables.row_stage if self._tables is not None
                       else tuple(range(self.num_stages)))
    self._row_of = {s: r for r, s in enumerate(self._row_stage)}
    self._packers: tuple[Packer, Packer, Packer] | None = None
    self._sync_packer: Packer | None = None
    self._metric_names: tuple[str, ...] | None = None
    self._fill = FillCache()
    self._compiled: dict[Any, Any] = {}
    self._layouts: dict[Any, Layout] = {}

  # -- state -------------------------------------------------------------------------------------
  @property
  def sharding(self) -> NamedSharding:
    """The sharding of every [N, S, ...] state buffer."""
    return NamedSharding(self.mesh, P(DATA, STAGE))

  def _apply(self, s: int, params: Any, x: Any, state: Any) -> tuple[Any, Any]:
    if self.stateful:
      return self.stages[s](params, x, state)
    return self.stages[s](params, x), state

  def init(self, stage_params: Sequence[Any], stage_state: Sequence[Any] | None = None, *,
           batch: tuple[Any, Any] | None = None) -> PipelineState:
    """The state every pipeline starts from: `stage_params[s]` (float32 leaves) at stage s, the
    optimizer's fresh state, and `stage_state[s]` (stateful stages only). `batch`: (x, y) of one
    mini-batch ([N*b, ...] arrays or jax.ShapeDtypeStructs); with 1F1B it lays out the in-flight
    buffers now (otherwise the first `run` does), so the state has every buffer a checkpoint of
    a running pipeline holds (an abstract target for restoring one)."""
    S, N = self.num_stages, self.num_pipelines
    if not isinstance(stage_params, (list, tuple)) or len(stage_params) != S:
      given = (len(stage_params) if isinstance(stage_params, (list, tuple))
               else type(stage_params).__name__)
      raise ValueError(f"stage_params of length {given} is not allowed; expected a list of {S} "
                       "pytrees (one per stage).")
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
      rows = [packer.pack(s, jax.device_get(trees[s]), xp=np) for s in self._row_stage]
      out = {}
      for d in packer.sizes:
        full = np.broadcast_to(np.stack([r[d] for r in rows]), (N, S, packer.sizes[d]))
        out[d] = jax.make_array_from_callback(full.shape, self.sharding, lambda i, f=full: f[i])
      return out

    for i, j in self.shared_stages:
      same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                          stage_params[i], stage_params[j])
      if not all(jax.tree.leaves(same)):
        raise ValueError(f"stage_params[{i}] and stage_params[{j}] differ; expected the same "
                         f"weights for the shared stages ({i}, {j}).")
    params = stacked(param_packer, stage_params)
    sync_state = None
    if self.grad_sync.compression is not None:
      # Each stage's own state, for its own gradient's length (no padding in any residual).
      stage_states = [self.grad_sync.init_state(self._stage_grads(s), N) for s in range(S)]
      self._sync_packer = Packer(stage_states)
      sync_state = stacked(self._sync_packer, stage_states)
    replicated = NamedSharding(self.mesh, P())
    state = PipelineState(
        step=_put(np.zeros((), np.int32), replicated),
        params=params,
        opt_state=stacked(opt_packer, opt_states),
        model_state=stacked(state_packer, states),
        global_params=stacked(param_packer, stage_params) if self.sync == "hetpipe" else {},
        sync_state=sync_state,
        virtual_time=_put(np.zeros((N, S, 2), np.float32), replicated),
        fill_start=_put(np.zeros((), np.int32), replicated),
        inflight={} if self.schedule == "1f1b" or self._tables else self._fill_record(
            np.zeros((N, S, 2), np.float32), None))
    if batch is not None and self.schedule == "1f1b":
      if not (isinstance(batch, tuple) and len(batch) == 2):
        raise ValueError(f"batch of type {type(batch).__name__} is not allowed; expected (x, y) "
                         "of one mini-batch.")
      xs, ys = (jax.tree.map(lambda a: jax.ShapeDtypeStruct((1,) + tuple(np.shape(a)),
                                                            np.dtype(a.dtype)), t) for t in batch)
      state = state._replace(inflight=self._inflight_zeros(self._layout(xs, ys), xs, ys,
                                                           state.virtual_time))
    return state

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
    host = {d: _host(v) for d, v in state.params.items()}
    return [packer.unpack(s, {d: v[:, self._row_of[s]] for d, v in host.items()})
            for s in range(self.num_stages)]

  def stage_state(self, state: PipelineState) -> list[Any]:
    """The stateful stages' state: S pytrees (host numpy) with a leading [N] pipeline axis."""
    packer = self._require_init()[2]
    host = {d: _host(v) for d, v in state.model_state.items()}
    return [packer.unpack(s, {d: v[:, self._row_of[s]] for d, v in host.items()})
            for s in range(self.num_stages)]

  def stage_sync_state(self, state: PipelineState) -> list[Any] | None:
    """The gradient sync's compression state of each stage (for its own gradient length): S
    pytrees (host numpy) with a leading [N] pipeline axis; None without compression."""
    if state.sync_state is None:
      return None
    self._require_init()
    host = {d: _host(v) for d, v in state.sync_state.items()}
    return [self._sync_packer.unpack(s, {d: v[:, self._row_of[s]] for d, v in host.items()})
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

  def _layout(self, xs: Any, ys: Any, num_batches: int | None = None) -> Layout:
    """The static layout of a run on xs, ys; `num_batches=0` for a flush, whose xs, ys are
    [0, N*b, ...] (no new mini-batch)."""
    if num_batches is None:
      B, rows = self.check_batches(xs, ys)
    else:
      B, rows = num_batches, int(np.shape(jax.tree.leaves(xs)[0])[1]) // self.num_pipelines
    self._require_init()
    # Tracing the stages' shapes costs a run of a small model as much as its compute; the
    # structures are fixed from the first init on, so a layout depends on the batches' shapes only.
    per_row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[2:], a.dtype), (xs, ys))
    key = (rows, _shape_key(per_row))
    if key not in self._layouts:
      self._layouts[key] = self._new_layout(xs, ys, B, rows)
    return dataclasses.replace(self._layouts[key], num_batches=B)

  def _new_layout(self, xs: Any, ys: Any, B: int, rows: int) -> Layout:
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
        self._metric_names = metric_names
      x = y
    act = Packer([jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), b)
                  for b in boundaries] or [{}])
    act_dtypes = tuple(tuple(a.dtype for a in jax.tree.leaves(b)) for b in boundaries)
    if self._tables is not None:
      t = self._tables
      return Layout(B, None, act, act_dtypes, t.x_slots, t.w_slots, t.g_slots, metric_names)
    return make_layout(self.schedule, S, B, M, act, act_dtypes, metric_names)

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
  # -- virtual time ------------------------------------------------------------------------------
  def _model(self, hetero: Hetero, plan: Any) -> FillModel:
    """The model a run with this cost model and plan (or none) runs its fill under."""
    return FillModel(self.sync, hetero, self.preduce, self.hetpipe, self.seed, plan is not None)

  def _fill_record(self, clock: Any, model: FillModel | None) -> dict[str, jax.Array]:
    """The state's record of a fill: its starting clocks ([N, S, 2] as `virtual_time`) and its
    model (zeros: none yet, the first run sets it)."""
    replicated = NamedSharding(self.mesh, P())
    capacity = model_capacity(self.num_pipelines, self.num_stages)
    encoded = np.zeros((capacity,), np.uint8) if model is None else model.encode(capacity)
    return {"fill_clock": _put(np.asarray(clock), replicated),
            "fill_model": _put(encoded, replicated)}

  @staticmethod
  def fill_model(state: PipelineState) -> FillModel | None:
    """The model the state's fill runs under (None: no run yet)."""
    if "fill_model" not in state.inflight:
      return None
    return FillModel.decode(np.asarray(state.inflight["fill_model"]))

  def _fill_clock(self, state: PipelineState) -> np.ndarray:
    """float64 [N, S]: the clocks at which the state's fill began."""
    if "fill_clock" in state.inflight:
      clock = np.asarray(state.inflight["fill_clock"], np.float64)
      return clock[..., 0] + clock[..., 1]
    return self.virtual_clocks(state)

  # -- the run -----------------------------------------------------------------------------------
  def run(self, state: PipelineState, xs: Any, ys: Any, *, plan: Any = None,
          hetero: Hetero | None = None) -> tuple[PipelineState, dict[str, Any]]:
    """Feeds the B mini-batches of xs, ys ([B, N*b, ...]; pipeline i takes rows [i*b, (i+1)*b)
    of each) to the pipelines. GPipe trains each of them to its update. 1F1B keeps flowing: the
    run ends where the next mini-batch would enter stage 0, with the last mini-batches still in
    flight (their inputs, activations, stashed weights and partial metrics in state.inflight),
    so runs of any lengths do what one run does; `flush` completes them. 1F1B compiles one
    program per power-of-two bucket of a run's ticks and new mini-batches, whatever B; GPipe
    and the flush schedules compile one per B.

    The syncs' decisions (groups, mixing matrices) and the virtual clocks come from the
    pipeline's virtual-time model of its fill (`jlp.pipeline.timeline`: the `hetero` cost model,
    default the pipeline's, seeded by (seed, the fill's first mini-batch)), decided as far as
    this run's updates need, so they too do not depend on where runs end. `plan` replaces them:
    any object with `mix` [T, S, N, N], `times` [T] and `finish` [T, N, S] indexed by mini-batch
    over the whole training (T >= the mini-batches fed by the end of this run), e.g. a
    `jlp.pipeline.simulate` result; with 1F1B the pipelines then run in lockstep (equal speeds)
    and every update averages with the plan's matrix.

    Returns the new state and the metrics of the mini-batches that completed in this run (their
    last update, at stage 0, ran; with 1F1B every N completions, in completion order, count as
    one, module docstring): "batch" [C] (their indices, counted over the whole training),
    "loss" [C] (mean over pipelines of each one's loss; likewise every entry of loss_fn's aux),
    "updates" [N] (1F1B: the mini-batches each pipeline completed in this run),
    with sync="allreduce" the gradient sync's report ("wire_bytes" and "payload_bytes" [C]: per
    device, averaged over all devices; "nonfinite" [C]: summed over the stages;
    `jlp.sync.reduce_gradients`), "virtual_time" [C] (float64: virtual seconds at which each
    one's update finished, counted from the first run), "group_sizes" (the sizes of the groups
    of the updates this run made: preduce's groups, adpsgd's pairs), "bubble_fraction" (the idle
    share of the run's tick table: a check of the schedule), "idle_fraction" (the share of the
    N * S device-seconds of virtual time the run spans, "virtual_span" seconds from the latest
    clock before it to the latest after it, in which the devices ran no op: waits for inputs,
    for syncs and for slower pipelines; a stall counts as busy), "idle_slot_fraction" (the
    share of the N * S * ticks device slots in which the program ran no stage, counted by the
    devices: 1F1B's last stage computes only in its backward ticks) and "ticks" (how many)."""
    self.check_state(state)
    layout = self._layout(xs, ys)
    if self.schedule == "1f1b" and state.inflight:
      ring = [tuple(np.shape(a)[1:]) + (np.dtype(a.dtype),)
              for a in jax.tree.leaves((state.inflight["xs"], state.inflight["ys"]))]
      given = [tuple(np.shape(a)[1:]) + (np.dtype(a.dtype),) for a in jax.tree.leaves((xs, ys))]
      if ring != given:
        if int(np.asarray(state.step)) != int(np.asarray(state.fill_start)):
          raise ValueError(f"mini-batches of shapes {given} are not allowed while the pipeline "
                           f"holds mini-batches of shapes {ring} in flight; expected the same "
                           "shapes (or `flush` first).")
        # Empty: the new fill lays out its own buffers, and keeps the counts.
        inflight = self._inflight_zeros(layout, xs, ys, state.virtual_time)
        inflight.update(fed_start=state.inflight["fed_start"], pending=state.inflight["pending"])
        state = state._replace(inflight=inflight)
    hetero = self._check_hetero(hetero)
    batch_sharding = NamedSharding(self.mesh, P(None, DATA))
    if self._tables is not None:
      if plan is not None:
        raise ValueError(f"plan={plan!r} is not allowed with schedule={self.schedule!r}; expected "
                         "None (a flush schedule's pipelines run in lockstep).")
      xs, ys = (jax.tree.map(lambda a: _put(a, batch_sharding), t) for t in (xs, ys))
      return self._execute_flush(state, layout, xs, ys, hetero)
    self._check_model(state, self._model(hetero, plan), "run")
    if self.schedule == "1f1b":
      return self._execute_1f1b(state, layout, xs, ys, plan, hetero)
    xs = jax.tree.map(lambda a: _put(a, batch_sharding), xs)
    ys = jax.tree.map(lambda a: _put(a, batch_sharding), ys)
    return self._execute(state, layout, xs, ys, plan, hetero)

  def flush(self, state: PipelineState, *, plan: Any = None, hetero: Hetero | None = None
            ) -> tuple[PipelineState, dict[str, Any]]:
    """Completes the mini-batches in flight (1F1B's drain; nothing to do for GPipe or an empty
    pipeline): the state then holds every fed mini-batch's updates, and the next `run` fills
    the pipeline anew. The drain's decisions are those of the fill's timeline with its end
    (`Timeline(total=fed)`: no later mini-batch's forward delays the drain), continued from a
    point where it still agrees with the never-ending one (`jlp.pipeline.fill.Fill`), under the
    fill's own model. Returns the state and the metrics of the mini-batches completed, as `run`
    does."""
    self.check_state(state)
    if (self.schedule != "1f1b" or not state.inflight
        or int(np.asarray(state.step)) == int(np.asarray(state.fill_start))):
      return state, self._no_metrics()
    model = self.fill_model(state)
    if model is None:
      raise AssertionError("a fill with mini-batches in flight and no model")  # a bug
    if model.planned and plan is None:
      raise ValueError("plan=None is not allowed for this flush: the fill runs under a plan; "
                       "expected the plan its runs were given.")
    if hetero is not None or plan is not None:
      self._check_model(state, self._model(self._check_hetero(hetero), plan), "flush")
    return self._execute_1f1b(state, None, None, None, plan, model.hetero)

  def _check_hetero(self, hetero: Hetero | None) -> Hetero:
    """The cost model of a call (`hetero`, checked; None: the pipeline's)."""
    if hetero is None:
      return self.hetero
    if not isinstance(hetero, Hetero):
      raise ValueError(f"hetero={hetero!r} is not allowed; expected a jlp.pipeline.Hetero.")
    check_sizes(self.sync, hetero, self.preduce, self.num_pipelines, self.num_stages)
    if self._tables is not None:
      _check_flush_hetero(f"schedule={self.schedule!r}", hetero)
    return hetero

  def model_changed(self, state: PipelineState, *, hetero: Hetero | None = None,
                    plan: Any = None) -> list[str]:
    """The fields in which a 1F1B run with these settings would change the model of the fill the
    state holds in flight ([]: none in flight, GPipe, or the same model); `flush(state)` first
    when it is not empty (a resume under a changed config)."""
    held = self.fill_model(state)
    if (self.schedule != "1f1b" or held is None
        or int(np.asarray(state.step)) == int(np.asarray(state.fill_start))):
      return []
    return held.differences(self._model(self._check_hetero(hetero), plan))

  def _check_model(self, state: PipelineState, model: FillModel, call: str) -> None:
    """ValueError when a 1F1B call would change the model in the middle of the state's fill
    (`jlp.pipeline.fill`); GPipe starts a new fill instead (`_execute`)."""
    held = self.fill_model(state)
    if (self.schedule != "1f1b" or held is None or held == model
        or int(np.asarray(state.step)) == int(np.asarray(state.fill_start))):
      return
    changed = ", ".join(held.differences(model))
    raise ValueError(
        f"{call} with another {changed} is not allowed in the middle of a fill: the pipeline "
        f"holds mini-batches fed under {held.describe()}; expected the same, or "
        f"`flush(state)` first (it drains under the fill's own model).")

  def _plan_arrays(self, plan: Any, needed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mix, times, finish) of a `run(plan=...)` as float32 / float64 arrays, checked to cover
    the first `needed` mini-batches."""
    S, N = self.num_stages, self.num_pipelines
    mix_all, times_all, finish_all = (np.asarray(plan.mix, np.float32),
                                      np.asarray(plan.times, np.float64),
                                      np.asarray(plan.finish, np.float64))
    if mix_all.shape[1:] != (S, N, N) or len(mix_all) < needed or len(times_all) < needed or \
        finish_all.shape[1:] != (N, S) or len(finish_all) < needed:
      raise ValueError(f"plan with mix {mix_all.shape}, times {times_all.shape}, finish "
                       f"{finish_all.shape} is not allowed; expected [T, {S}, {N}, {N}], [T] "
                       f"and [T, {N}, {S}] by mini-batch with T >= {needed}.")
    return mix_all, times_all, finish_all

  def _scalar(self, value: Any) -> jax.Array:
    """A replicated int32 scalar of its own (a copy: a donated state must not hold one buffer
    twice)."""
    return _put(np.int32(np.asarray(value)), NamedSharding(self.mesh, P()))

  def _no_metrics(self) -> dict[str, Any]:
    names = self._metric_names or ("loss",)
    out = {name: np.zeros((0,), np.float32) for name in names}
    if self.sync == "allreduce":
      out.update({name: np.zeros((0,), dtype) for name, dtype in SYNC_REPORT.items()})
    return dict(out, batch=np.zeros((0,), np.int64), virtual_time=np.zeros((0,)),
                updates=np.zeros((self.num_pipelines,), np.int64),
                group_sizes=np.zeros((0,), np.int32), bubble_fraction=float("nan"),
                bubble=float("nan"),
                idle_fraction=float("nan"), virtual_span=0.0, idle_slot_fraction=float("nan"),
                ticks=0)

  def _execute(self, state: PipelineState, layout: Layout, xs: Any, ys: Any, plan: Any,
               hetero: Hetero) -> tuple[PipelineState, dict[str, Any]]:
    """GPipe: runs the compiled program on the B new mini-batches in lockstep, with the
    decisions of the updates it makes, and picks the metrics of the mini-batches (1F1B:
    `_execute_1f1b`)."""
    B, S, N = layout.num_batches, self.num_stages, self.num_pipelines
    step = int(np.asarray(state.step))
    ticks: dict[str, Any] = {}
    table = layout.table
    done, first, slots = np.arange(B), step, B
    updates = [(b, s) for b in range(B) for s in range(S)]
    # The decisions of this run's updates, by slot; the clocks after them. The first run and a
    # run under another model begin a fill (nothing is in flight between GPipe's runs).
    model = self._model(hetero, plan)
    if self.fill_model(state) != model:
      state = state._replace(fill_start=self._scalar(step),
                             inflight=self._fill_record(state.virtual_time, model))
    fill_start = int(np.asarray(state.fill_start))
    if plan is None:
      timeline = self._fill.timeline(model, self.schedule, N, S, self.num_microbatches,
                                     fill_start=fill_start, clock=self._fill_clock(state))
      timeline.decide([(first + p - fill_start, s) for p, s in updates])
      mix_of = lambda g, s: timeline.mix(g - fill_start, s)
      finish_of = lambda g: timeline.finish[g - fill_start]
      time_of = lambda g: timeline.time(g - fill_start)
      made = sorted({(first + p - fill_start, s) for p, s in updates})
      group_sizes = np.array([len(g.members) for key in made
                              for g in timeline.groups_at.get(key, ())], np.int32)
    else:
      mix_all, times_all, finish_all = self._plan_arrays(plan, step + B)
      mix_of, finish_of, time_of = (lambda g, s: mix_all[g, s], lambda g: finish_all[g],
                                    lambda g: times_all[g])
      group_sizes = np.zeros((0,), np.int32)
    mix = np.broadcast_to(np.eye(N, dtype=np.float32), (slots, S, N, N)).copy()
    clocks = self.virtual_clocks(state)
    for p, s in updates:
      if first + p >= 0:
        mix[p, s] = mix_of(first + p, s)
        clocks[:, s] = np.maximum(clocks[:, s], finish_of(first + p)[:, s])
    times = np.array([time_of(first + p) for p in done], np.float64)

    key = ("gpipe", _shape_key((xs, ys)), B)
    if key not in self._compiled:
      self._compiled[key] = self._build(layout, state)
    # The host keeps the clocks: the program neither reads nor changes them.
    program_state = state._replace(virtual_time=None, inflight={})
    uses_mix = self.sync in ("preduce", "adpsgd")
    new_state, means = self._compiled[key](program_state, xs, ys, ticks,
                                           jnp.asarray(mix) if uses_mix else None)
    whole = np.floor(clocks)
    new_state = new_state._replace(virtual_time=_put(
        np.stack([whole, clocks - whole], -1).astype(np.float32), NamedSharding(self.mesh, P())),
        inflight=state.inflight)
    ticks = len(table.kind) * B
    computed = int(np.asarray(means.pop("computed_slots")))
    metrics = {name: np.asarray(v)[done] for name, v in means.items()}
    span = float(clocks.max() - self.virtual_clocks(state).max())
    if plan is None:  # the ops' virtual durations (a plan gives times, not op costs)
      order = sched.stage_order("gpipe", S, 1, self.num_microbatches)
      duration = timeline._duration  # pylint: disable=protected-access
      busy = sum(duration(i, s, (kind, first + p - fill_start, m))
                 for p in range(B) for i in range(N) for s in range(S)
                 for kind, _, m in order[s])
    else:
      busy = float("nan")
    metrics.update(batch=first + done, virtual_time=times, group_sizes=group_sizes,
                   updates=np.full((N,), B, np.int64),
                   bubble_fraction=sched.bubble_fraction(table),
                   idle_fraction=_idle_share(busy, span, N, S), virtual_span=span,
                   idle_slot_fraction=1.0 - computed / (N * S * ticks) if ticks else float("nan"),
                   ticks=ticks)
    return new_state, metrics

  # -- flush schedules (jlp.pipeline.flush) -----------------------------------------------------
  @property
  def bubble(self) -> float:
    """The idle share of the schedule's timeline with F, I and W of a stage one unit each (B two,
    a chunk of a v-stages-per-device schedule 1/v): GPipe and the flush schedules
    (`jlp.pipeline.schedule_data.bubble`); nan for "1f1b", which never drains."""
    table = self.schedule_table
    return float("nan") if table is None else bubble(table)

  @property
  def peak_inflight(self) -> tuple[float, ...]:
    """Per device of a pipeline, the most micro-batch activations held at once, in stage units
    (`jlp.pipeline.schedule_data.peak_inflight`); "1f1b": stage s holds S - s mini-batches."""
    table = self.schedule_table
    if table is None:
      return tuple(float(self.num_stages - s) for s in range(self.num_stages))
    return peak_inflight(table)

  @functools.cached_property
  def schedule_table(self) -> Schedule | None:
    """The schedule as data (GPipe: `Schedule.named("gpipe", S, M)`); None for "1f1b"."""
    if self.schedule_data is not None:
      return self.schedule_data
    if self.schedule == "gpipe":
      return Schedule.named("gpipe", self.num_stages, self.num_microbatches)
    return None

  def _flush_program(self, layout: Layout) -> FlushProgram:
    mode = sync_mode(self.sync, num_pipelines=self.num_pipelines, grad_sync=self.grad_sync,
                     lengths=tuple(self._stage_grads(s)["stage"].shape[0]
                                   for s in range(self.num_stages)),
                     state_packer=self._sync_packer)
    return FlushProgram(self._apply, self._loss_metrics, self.optimizer, self._require_init(),
                        mode, self._tables, self.num_pipelines, layout, remat=self.remat)

  def _flush_compiled(self, layout: Layout, xs: Any, ys: Any):
    key = ("flush", _shape_key((xs, ys)), layout.num_batches)
    if key not in self._compiled:
      per = P(DATA, STAGE)
      state_spec = PipelineState(P(), per, per, per, per, per, P(), P(), {})
      mapped = jax.shard_map(self._flush_program(layout), mesh=self.mesh,
                             in_specs=(state_spec, P(None, DATA), P(None, DATA)),
                             out_specs=(state_spec, P()), check_vma=False)
      self._compiled[key] = jax.jit(mapped, donate_argnums=(0,) if self.donate else ())
    return self._compiled[key]

  def lower(self, state: PipelineState, xs: Any, ys: Any) -> jax.stages.Lowered:
    """The jitted program of `run(state, xs, ys)` lowered (flush schedules): `.compile()
    .memory_analysis()` gives its buffers' sizes."""
    if self._tables is None:
      raise ValueError(f"lower with schedule={self.schedule!r} is not allowed; expected a flush "
                       "schedule (GPipe's and 1F1B's programs take tables the run builds).")
    self.check_state(state)
    layout = self._layout(xs, ys)
    program_state = state._replace(virtual_time=None, inflight={})
    return self._flush_compiled(layout, xs, ys).lower(program_state, xs, ys)

  def _execute_flush(self, state: PipelineState, layout: Layout, xs: Any, ys: Any,
                     hetero: Hetero) -> tuple[PipelineState, dict[str, Any]]:
    """A flush schedule: the compiled program on the B mini-batches, all pipelines in lockstep,
    each mini-batch one update per stage. Virtual time: each mini-batch lasts the schedule's
    makespan under `hetero`'s fwd_s and bwd_s (a micro-batch's share, split halves equal), plus
    one all-reduce (allreduce_alpha_s + allreduce_beta_s (N - 1)) with sync="allreduce"."""
    B, N, D = layout.num_batches, self.num_pipelines, self._tables.num_devices
    step = int(np.asarray(state.step))
    program_state = state._replace(virtual_time=None, inflight={})
    new_state, means = self._flush_compiled(layout, xs, ys)(program_state, xs, ys)
    computed = int(np.asarray(means.pop("computed_slots")))
    metrics = {name: np.asarray(v) for name, v in means.items()}
    M = self.num_microbatches
    span, busy = makespan(self.schedule_data, hetero.fwd_s / M, hetero.bwd_s / M)
    if self.sync == "allreduce" and N > 1:
      span += hetero.allreduce_alpha_s + hetero.allreduce_beta_s * (N - 1)
    clocks = self.virtual_clocks(state)
    start = float(clocks.max())
    times = start + span * np.arange(1, B + 1, dtype=np.float64)
    clocks = np.full_like(clocks, times[-1])
    whole = np.floor(clocks)
    new_state = new_state._replace(
        virtual_time=_put(np.stack([whole, clocks - whole], -1).astype(np.float32),
                          NamedSharding(self.mesh, P())),
        inflight=state.inflight)
    ticks = self._tables.num_ticks * B
    idle = float(np.mean(self._tables.kind[:, :, 0] == 0))
    metrics.update(batch=np.arange(step, step + B, dtype=np.int64), virtual_time=times,
                   group_sizes=np.zeros((0,), np.int32), updates=np.full((N,), B, np.int64),
                   bubble_fraction=idle, bubble=self.bubble,
                   idle_fraction=1.0 - busy / (D * span) if span > 0 else float("nan"),
                   virtual_span=span * B,
                   idle_slot_fraction=1.0 - computed / (N * D * ticks), ticks=ticks)
    return new_state, metrics

  # -- 1F1B: every pipeline by its own clock -------------------------------------------------
  def _fill_at(self, state: PipelineState, model: FillModel, position: int) -> Fill:
    """The state's 1F1B fill (`jlp.pipeline.fill`) standing at `position` chunks taken: the one
    this pipeline keeps, the state's snapshot, or the fill replayed."""
    pending = state.inflight["pending"]
    count = int(np.asarray(pending["count"]))
    waiting = list(zip(np.asarray(pending["pipeline"])[:count].tolist(),
                       np.asarray(pending["m"])[:count].tolist()))
    return self._fill.fill(
        model, self.schedule, self.num_pipelines, self.num_stages,
        fill_start=int(np.asarray(state.fill_start)), clock=self._fill_clock(state),
        fed_start=[int(v) for v in np.asarray(state.inflight["fed_start"])], position=position,
        keep_updates_from=_oldest_waiting(waiting, self.num_pipelines),
        snapshot=state.inflight.get("snapshot"))

  def _execute_1f1b(self, state: PipelineState, layout: Layout | None, xs: Any, ys: Any,
                    plan: Any, hetero: Hetero) -> tuple[PipelineState, dict[str, Any]]:
    """A 1F1B run of the B mini-batches of xs, ys, or the flush (xs None)."""
    N, S = self.num_pipelines, self.num_stages
    flush = xs is None
    if not state.inflight:  # laid out by the first run (or init's batch)
      state = state._replace(inflight=self._inflight_zeros(layout, xs, ys, state.virtual_time),
                             fill_start=self._scalar(state.step))
    B = 0 if flush else layout.num_batches
    step, fill_start = int(np.asarray(state.step)), int(np.asarray(state.fill_start))
    fed_start = [int(v) for v in np.asarray(state.inflight["fed_start"])]
    model = self.fill_model(state) if step != fill_start else None
    if model is None:  # a new fill runs under this call's model
      model = self._model(hetero, plan)
      state = state._replace(inflight=dict(state.inflight, **self._fill_record(
          state.inflight["fill_clock"], model)))
    before = (step - fill_start) * N  # chunks (one pipeline's rows of a mini-batch) fed
    fill = self._fill_at(state, model, before)
    endless = fill.placement
    taken_before = list(endless.taken_counts)
    group_override: dict[Any, Any] = {}
    if flush:
      placement, nodes, group_override = fill.drain()
      chunks, taken_after = [], taken_before
      self._fill.clear()
    else:
      placement = endless
      cut = endless.chunk_cut(before + B * N)
      chunks = endless.chunks_between(before, before + B * N)
      nodes = endless.take(cut, before + B * N)
      taken_after = list(endless.taken_counts)
    plan_mix = None
    if plan is not None:
      mix_all, times_all, finish_all = self._plan_arrays(plan, step + B)
      if self.sync in ("preduce", "adpsgd"):
        plan_mix = lambda g, s: mix_all[g, s]
    tables = make_run_tables(placement, nodes, taken_before, taken_after, fed_start, self.sync,
                             plan_mix, group_override)
    timeline = placement.timeline

    def left_at(i: int, m: int) -> np.ndarray:  # [S] when pipeline i's update m left (nan: not yet)
      if plan is not None:
        return finish_all[fed_start[i] + m, i]
      return timeline.left_at(i, m)

    def time_of(i: int, m: int) -> float:
      if plan is not None:
        return float(times_all[fed_start[i] + m])
      return float(np.max(timeline.left_at(i, m)))

    # A clock is where its device's last update left its sync; one still in it, its arrival.
    clocks = self.virtual_clocks(state)
    for i, s, m in tables.updates:
      leave = left_at(i, m)[s]
      if np.isnan(leave):
        leave = placement.times[("op", i, s, sched.BWD, m)][1]
      clocks[i, s] = max(clocks[i, s], leave)

    # Each pipeline's new mini-batches: chunk q of the run is rows [q % N] of mini-batch q // N.
    K = bucket(max([len(n) for n in tables.new] + [1]))
    if not flush:
      rows = int(np.shape(jax.tree.leaves(xs)[0])[1]) // N
      order = {(i, m): q for q, (i, m) in enumerate(chunks)}

      def arrange(a):
        a = np.asarray(a)
        out = np.zeros((K,) + a.shape[1:], a.dtype)
        for i in range(N):
          for k, m in enumerate(tables.new[i]):
            q = order[(i, m)]
            out[k, i * rows:(i + 1) * rows] = a[q // N, (q % N) * rows:(q % N + 1) * rows]
        return out
      xs, ys = jax.tree.map(arrange, xs), jax.tree.map(arrange, ys)
    else:
      xs = jax.tree.map(lambda a: np.zeros((K,) + a.shape[1:], a.dtype), state.inflight["xs"])
      ys = jax.tree.map(lambda a: np.zeros((K,) + a.shape[1:], a.dtype), state.inflight["ys"])
    batch_sharding = NamedSharding(self.mesh, P(None, DATA))
    xs, ys = (jax.tree.map(lambda a: _put(a, batch_sharding), t) for t in (xs, ys))
    ticks = dict(kind=tables.kind, m=tables.m, slot=tables.slot, keep=tables.keep,
                 events=tables.events, count=np.int32(tables.ticks), batches=np.int32(B),
                 **{"global": tables.global_batch})

    if layout is None:
      shapes = lambda tree: jax.tree.map(
          lambda a: jax.ShapeDtypeStruct((1,) + a.shape[1:], a.dtype), tree)
      layout = self._layout(shapes(state.inflight["xs"]), shapes(state.inflight["ys"]),
                            num_batches=0)
    # B is data of the program (ticks["batches"]): one program serves runs of any length.
    layout = dataclasses.replace(layout, num_batches=0)
    key = ("1f1b", _shape_key((xs, ys)), len(tables.kind))
    if key not in self._compiled:
      self._compiled[key] = self._build(layout, state)
    program_state = state._replace(virtual_time=None, inflight={
        k: v for k, v in state.inflight.items() if k in ("buffers", "xs", "ys", "metrics",
                                                         "sync_report")})
    new_state, out = self._compiled[key](program_state, xs, ys, ticks, None)
    computed = int(np.asarray(out.pop("computed_slots")))
    per_slot = {name: np.asarray(v) for name, v in out.items()}  # [N, S + K]
    busy = sum(placement.times[node][1] - placement.times[node][0] for node in nodes
               if node[0] == "op")
    span = float(clocks.max() - self.virtual_clocks(state).max())

    # Report every N completions (in completion order) as one mini-batch: with equal speeds,
    # the N pipelines' rows of one mini-batch. A mini-batch is reported once its updates have
    # all left their syncs (its virtual time is known), and after the ones before it.
    pending = {k: np.asarray(v) for k, v in state.inflight["pending"].items()}
    count, done_units = int(pending["count"]), int(pending["done"])
    items = [(int(pending["pipeline"][k]), int(pending["m"][k]),
              {name: pending[name][k] for name in per_slot}) for k in range(count)]
    slot_of = lambda i, m: m % S if m < taken_before[i] else S + m - taken_before[i]
    items += [(i, m, {name: v[i, slot_of(i, m)] for name, v in per_slot.items()})
              for i, m in tables.completed]
    units = 0
    while len(items) >= (units + 1) * N and all(
        not np.isnan(left_at(i, m)).any() for i, m, _ in items[units * N:(units + 1) * N]):
      units += 1
    metrics: dict[str, Any] = {}
    for name, v in per_slot.items():
      values = np.array([[item[2][name] for item in items[u * N:(u + 1) * N]]
                         for u in range(units)], v.dtype).reshape(units, N)
      if name in SYNC_REPORT:
        total = values.sum(axis=1, dtype=v.dtype)
        metrics[name] = (total // N if name == "nonfinite" else
                         (total / (N * S)).astype(v.dtype))
      else:
        summed = values[:, 0].copy()
        for j in range(1, N):
          summed = summed + values[:, j]
        metrics[name] = (summed / np.float32(N)).astype(np.float32)
    metrics.update(
        batch=np.arange(done_units, done_units + units, dtype=np.int64),
        virtual_time=np.array([max(time_of(i, m) for i, m, _ in items[u * N:(u + 1) * N])
                               for u in range(units)], np.float64),
        group_sizes=np.array(tables.group_sizes, np.int32),
        updates=np.bincount([i for i, _ in tables.completed], minlength=N).astype(np.int64),
        bubble_fraction=float(np.mean(tables.kind[:tables.ticks] == sched.IDLE))
        if tables.ticks else float("nan"),
        idle_fraction=_idle_share(busy, span, N, S), virtual_span=span,
        idle_slot_fraction=(1.0 - computed / (N * S * tables.ticks) if tables.ticks
                            else float("nan")),
        ticks=tables.ticks)
    left = items[units * N:]
    capacity = self._pending_capacity
    if len(left) > capacity:
      raise AssertionError(f"{len(left)} completions wait to be reported, more than the "
                           f"{capacity} the state holds")  # a bug, not input
    replicated = NamedSharding(self.mesh, P())
    pad = [0] * (capacity - len(left))
    new_pending = {"count": np.int32(len(left)), "done": np.int32(done_units + units),
                   "pipeline": np.array([i for i, _, _ in left] + pad, np.int32),
                   "m": np.array([m for _, m, _ in left] + pad, np.int32)}
    for name, v in per_slot.items():
      new_pending[name] = np.array([item[2][name] for item in left] + pad, v.dtype)
    whole = np.floor(clocks)
    new_state = new_state._replace(virtual_time=_put(
        np.stack([whole, clocks - whole], -1).astype(np.float32), replicated))
    inflight = dict(new_state.inflight, fill_clock=state.inflight["fill_clock"],
                    fill_model=state.inflight["fill_model"], fed_start=state.inflight["fed_start"],
                    pending={k: _put(v, replicated) for k, v in new_pending.items()})
    if not flush:  # what the next run needs of the fill, so that a restore need not replay it
      oldest = _oldest_waiting([(i, m) for i, m, _ in left], N)
      fill.end_run(nodes, [min(oldest[i], taken_after[i] - S - 1) for i in range(N)])
      inflight["snapshot"] = _put(encode_snapshot(fill, snapshot_capacity(N, S)), replicated)
    new_state = new_state._replace(inflight=inflight)
    if flush:  # an empty pipeline: the next fill starts here
      zeros = self._inflight_zeros(layout, None, None, new_state.virtual_time,
                                   like=new_state.inflight)
      zeros["fed_start"] = _put(
          np.array(fed_start, np.int32) + np.array(taken_after, np.int32), replicated)
      zeros["pending"]["done"] = _put(np.int32(done_units + units), replicated)
      new_state = new_state._replace(inflight=zeros, fill_start=self._scalar(new_state.step))
    return new_state, metrics

  @property
  def _pending_capacity(self) -> int:
    """How many completed mini-batches the state holds until they are reported: fewer than N
    waiting for a whole group of N, and those waiting for a sync to decide (a device has at most
    one update in its sync), with room to spare."""
    return 4 * self.num_pipelines * (self.num_stages + 1)

  def _inflight_zeros(self, layout: Layout, xs: Any, ys: Any, clock: jax.Array, *,
                      like: dict[str, Any] | None = None) -> dict[str, Any]:
    """An empty 1F1B pipeline's in-flight state, on the devices (mini-batches like xs, ys, or
    like the rings of `like`); its fill begins at `clock`, every pipeline's count of mini-batches
    before it 0 and no completion pending."""
    N, S = self.num_pipelines, self.num_stages
    if like is not None:
      xs, ys = like["xs"], like["ys"]
    program = self._program(layout)
    host = program.inflight_zeros(xs, ys, (N, S))
    per = NamedSharding(self.mesh, P(DATA, STAGE))
    replicated = NamedSharding(self.mesh, P())
    out = {k: jax.tree.map(lambda a: _put(a, per), host[k])
           for k in ("buffers", "metrics", "sync_report")}
    for k in ("xs", "ys"):
      out[k] = jax.tree.map(lambda a: _put(a, NamedSharding(self.mesh, P(None, DATA))), host[k])
    out.update(self._fill_record(clock, None))
    out["snapshot"] = _put(np.zeros((snapshot_capacity(N, S),), np.uint8), replicated)
    out["fed_start"] = _put(np.zeros((N,), np.int32), replicated)
    capacity = self._pending_capacity
    pending = {"count": np.int32(0), "done": np.int32(0),
               "pipeline": np.zeros((capacity,), np.int32), "m": np.zeros((capacity,), np.int32)}
    pending.update({name: np.zeros((capacity,), np.float32) for name in layout.metric_names})
    if program.mode.reports:
      pending.update({name: np.zeros((capacity,), dtype) for name, dtype in SYNC_REPORT.items()})
    out["pending"] = {k: _put(v, replicated) for k, v in pending.items()}
    return out

  def _program(self, layout: Layout) -> Program:
    mode = sync_mode(self.sync, num_pipelines=self.num_pipelines, grad_sync=self.grad_sync,
                     lengths=tuple(self._stage_grads(s)["stage"].shape[0]
                                   for s in range(self.num_stages)),
                     state_packer=self._sync_packer)
    return Program(self._apply, self._loss_metrics, self.optimizer, self._require_init(), mode,
                   self.schedule, self.num_pipelines, self.num_stages, self.num_microbatches,
                   layout, self.hetpipe.pull_every)

  def _build(self, layout: Layout, state: PipelineState):
    per = P(DATA, STAGE)
    inflight_spec = {}
    out_spec: Any = P()
    if self.schedule == "1f1b":
      inflight_spec = {k: jax.tree.map(lambda _: per, state.inflight[k])
                       for k in ("buffers", "metrics", "sync_report")}
      inflight_spec.update(xs=jax.tree.map(lambda _: P(None, DATA), state.inflight["xs"]),
                           ys=jax.tree.map(lambda _: P(None, DATA), state.inflight["ys"]))
      names = list(state.inflight["metrics"]) + list(state.inflight["sync_report"])
      out_spec = dict({name: P() for name in names}, computed_slots=P())
    state_spec = PipelineState(P(), per, per, per, per, per, P(), P(), inflight_spec)
    mapped = jax.shard_map(
        self._program(layout), mesh=self.mesh,
        in_specs=(state_spec, P(None, DATA), P(None, DATA), P(), P()),
        out_specs=(state_spec, out_spec), check_vma=False)
    return jax.jit(mapped, donate_argnums=(0,) if self.donate else ())
