"""Pipelined data parallelism (`jlp.pipeline`) on 8 emulated CPU devices: bubbles, step time,
compile time (issue 12 "Performance"; docs/sdpipe.md#schedules, #virtual-time).

Run: python -m benchmarks.pipeline_bench [--sections=bubble,step,compile,host,schedules]
       [--width=1024] [--host_batches=1200]
       [--batch=2048] [--microbatches=4,8,16] [--steps=5]
       [--schedule_microbatches=8,16] [--schedule_width=256] [--schedule_batch=2048]
       [--schedule_rounds=5]

bubble   The idle share of GPipe (S in {2, 4, 8} x M in {1, 4, 8, 16}) and of 1F1B over B
         mini-batches (the same grid with B for M), against (S - 1) / (M + S - 1): on the static
         tick table (`jlp.pipeline.bubble_fraction`) and in virtual time, by
         `jlp.pipeline.simulate` with no stalls, equal op times (fwd = bwd = 1 s), free transfers
         and no sync: 1 - busy / (S * makespan), busy = the S stages' op seconds; and the same
         with backwards twice as long as forwards. These check the schedule. Beside them, what
         the executor counts in its own run (`metrics["idle_slot_fraction"]`, one pipeline of a
         width-16 MLP, run and flush): the device slots in which the program ran no stage.
step     One training step of the same model (an MLP of 4 equal blocks, Linear(width, width) +
         ReLU each, the classifier Linear(width, 10) with the last) on the same global batch of
         --batch rows, plain SGD, state donated, cross-entropy:
           DP     `jlp.train.TrainStep` on the 8-device data mesh, float32 sequential all-reduce
                  (TrainStep's default, the baseline) and float32 ring;
           GPipe  `jlp.pipeline.Pipeline(schedule="gpipe", num_microbatches=M)` for each M of
                  --microbatches, N = 2 pipelines x S = 4 stages (one block per stage), one
                  mini-batch per `run` (the same update as DP: the gradient of the global batch);
           1F1B   N = 2 x S = 4, 8 mini-batches per `run` (each its own update), time per
                  mini-batch fed: runs keep the pipeline full (no drain between runs; the
                  gradient all-reduce runs on the ticks that update only).
         The cases run alternately, --steps rounds after a compile + warm-up step each; reported:
         the median seconds per update and, against each DP row, the median of the per-round
         ratios (target: GPipe <= 1.5x the unpipelined step).
compile  Seconds jax spends tracing, lowering and compiling (jax.monitoring's
         /jax/core/compile/* events) the first `run` of a Pipeline (a small MLP, width 128), against
         S in {2, 4, 8} (N = 8 / S), M in {4, 8, 16} and the mini-batches per run B in {1, 4, 16,
         64}: `lax.scan` over the schedule's ticks (and GPipe's mini-batches) keeps them flat.
host     A long 1F1B fill on the host: a linear probe (2 pipelines x 2 stages, x + p each) with
         preduce, pipeline 1 twice as slow and stalls, runs of 4 mini-batches, no flush. The
         growth of Python's traced heap (tracemalloc) from mini-batch 100 to 300 (target: <= 1.5
         MiB), the pickled fill's size, and at --host_batches mini-batches the first run after a
         restore (the pipeline's kept fill forgotten) against a normal run (target: <= 3x): from
         the state's snapshot, and the baseline of the same run replaying the fill from its start
         (the snapshot zeroed).
schedules
         The flush schedules (issue 34) on D = 4 devices x N = 2 pipelines (all 8 devices,
         sync="allreduce"), M of --schedule_microbatches, one model for all: an MLP of 8 equal
         blocks (Linear(w, w) + ReLU, w = --schedule_width, the classifier with the last), split
         into 4 stage functions of 2 blocks (one stage per device: gpipe, 1f1b_flush, zb_h1) or 8
         of 1 block (two chunks per device: interleaved_1f1b with v = 2, zbv, dualpipev), the
         same global batch of --schedule_batch rows at every M. Per schedule: the bubble it
         counts (`Pipeline.bubble`, F = I = W = 1 unit) against its closed form ((D-1)/(M+D-1)
         GPipe and 1F1B-flush, (D-1)/(3M+D-1) ZB-H1, (D-1)/(2M+D-1) interleaved v = 2; none
         given for ZB-V and DualPipeV), the max over devices of `Pipeline.peak_inflight`
         (micro-batch activations, stage units), XLA's temporary memory of the compiled run
         (`Pipeline.lower(...).compile().memory_analysis().temp_size_in_bytes`; flush executor
         only, so GPipe's is that of `Schedule.named("gpipe", D, M)` run by the flush executor; at
         M = 4 too, and at every M with the micro-batch fixed at the largest M's rows),
         and seconds per mini-batch: the cases alternated, --schedule_rounds rounds after a
         compile + warm-up run each, the median, and the median of the per-round ratios against
         `schedule="gpipe"` (GPipe's own program, the baseline). "gpipe (flush executor)" is the
         same GPipe order as a Schedule on the flush executor. 1F1B-flush's memory is also
         lowered at M = 4 (the target's reference). The flush executor keeps each forward's
         residuals for its B, I and W (no forward recomputed; ZB's I and W share no dot), while
         GPipe's program recomputes the forward in its backward by design, so the flush
         schedules do less arithmetic than GPipe; and the 8 emulated devices share the
         machine's cores, so idle ticks of one device are not free time for another.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import collections  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import pickle  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from flax import nnx  # noqa: E402

import jlp.pipeline as jp  # noqa: E402
import jlp.train as jt  # noqa: E402

SECTIONS = ("bubble", "step", "compile", "host", "schedules")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"which of {SECTIONS} to run.")
_WIDTH = flags.DEFINE_integer("width", 1024, "MLP width of the step section (4 blocks).")
_HOST_BATCHES = flags.DEFINE_integer("host_batches", 1200, "the host section's fill length.")
_BATCH = flags.DEFINE_integer("batch", 2048, "global batch of the step section.")
_MICRO = flags.DEFINE_list("microbatches", ["4", "8", "16"], "GPipe's M in the step section.")
_STEPS = flags.DEFINE_integer("steps", 5, "timed rounds of the step section.")
_SCHED_MICRO = flags.DEFINE_list("schedule_microbatches", ["8", "16"],
                                 "M of the schedules section.")
_SCHED_WIDTH = flags.DEFINE_integer("schedule_width", 256, "MLP width of the schedules section.")
_SCHED_BATCH = flags.DEFINE_integer("schedule_batch", 2048,
                                    "global batch (both pipelines) of the schedules section.")
_SCHED_ROUNDS = flags.DEFINE_integer("schedule_rounds", 5, "timed rounds of the schedules section.")

NUM_CLASSES = 10
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


# -- (a) bubbles ---------------------------------------------------------------------------------
def virtual_bubble(schedule: str, num_stages: int, count: int, bwd_s: float = 1.0) -> float:
  """1 - busy / (S * makespan) of one pipeline in virtual time: no stalls, a mini-batch's forward
  1 s and backward bwd_s per stage (a GPipe micro-batch op 1/M of it), free transfers, no sync
  (count = M for "gpipe", B for "1f1b")."""
  hetero = jp.Hetero(delay_s=0.0, fwd_s=1.0, bwd_s=bwd_s, p2p_s=0.0, allreduce_alpha_s=0.0)
  batches, micro = (1, count) if schedule == "gpipe" else (count, 1)
  plan = jp.simulate(schedule, "none", 1, num_stages, batches, micro, seed=0, hetero=hetero)
  busy = num_stages * batches * (1.0 + bwd_s)
  return 1.0 - busy / (num_stages * float(np.max(plan.finish)))


def executor_idle(schedule: str, num_stages: int, count: int) -> float:
  """The idle share the executor counts in its own run (`metrics["idle_slot_fraction"]`: device
  slots in which the program ran no stage) of one pipeline of a width-16 MLP: GPipe one
  mini-batch of M = count micro-batches, 1F1B a run of B = count mini-batches and the flush."""
  model = BlockMLP(num_stages, 16, NUM_CLASSES, rngs=nnx.Rngs(0))
  stages, params = stage_split(model)
  pipe = jp.Pipeline(stages, cross_entropy, optax.sgd(0.01), jp.pipeline_mesh(1, num_stages),
                     schedule=schedule, num_microbatches=count if schedule == "gpipe" else 1,
                     sync="none")
  batches, rows = (1, count) if schedule == "gpipe" else (count, 1)
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((batches, rows, 16)).astype(np.float32)
  ys = rng.integers(0, NUM_CLASSES, (batches, rows)).astype(np.int32)
  state, run = pipe.run(pipe.init(params), xs, ys)
  _, flush = pipe.flush(state)
  idle = run["idle_slot_fraction"] * run["ticks"] + (
      flush["idle_slot_fraction"] * flush["ticks"] if flush["ticks"] else 0.0)
  return idle / (run["ticks"] + flush["ticks"])


def bubble_section() -> None:
  for schedule, name in (("gpipe", "M"), ("1f1b", "B")):
    what = ("GPipe, one mini-batch of M micro-batches" if schedule == "gpipe" else
            "1F1B over B mini-batches (one run and the flush: warm-up, steady state, drain)")
    print(f"\nbubble fraction, {what}")
    head = (f"{'S':>2s} {name:>3s} {'(S-1)/(' + name + '+S-1)':>14s} {'table':>7s} "
            f"{'virtual':>8s} {'virtual, bwd = 2 fwd':>20s} {'executor':>9s}")
    print(head + "\n" + "-" * len(head))
    worst = 0.0
    for s in (2, 4, 8):
      for count in (1, 4, 8, 16):
        formula = (s - 1) / (count + s - 1)
        table = jp.bubble_fraction(jp.tick_table(schedule, s, *((1, count) if schedule == "gpipe"
                                                                 else (count, 1))))
        virtual = virtual_bubble(schedule, s, count)
        worst = max(worst, abs(table - formula), abs(virtual - formula))
        print(f"{s:2d} {count:3d} {formula:14.4f} {table:7.4f} {virtual:8.4f} "
              f"{virtual_bubble(schedule, s, count, bwd_s=2.0):20.4f} "
              f"{executor_idle(schedule, s, count):9.4f}")
    print(f"largest |table or virtual (equal op times) - formula|: {worst:.1e} (the table and "
          "the virtual time check the schedule; 'executor' counts the slots the program left "
          "idle, 1F1B's last stage computing in its backward ticks only)")


# -- (b) step time -------------------------------------------------------------------------------
class BlockMLP(nnx.Module):
  """`num_blocks` x (Linear(width, width) + ReLU), then Linear(width, classes)."""

  def __init__(self, num_blocks: int, width: int, num_classes: int, *, rngs: nnx.Rngs):
    self.blocks = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(num_blocks)])
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    for block in self.blocks:
      x = jax.nn.relu(block(x))
    return self.head(x)


def block_stage(params: dict[str, jax.Array], x: jax.Array, *, last: bool) -> jax.Array:
  """One block of `BlockMLP` as a pipeline stage (the last one with the classifier)."""
  y = jax.nn.relu(x @ params["kernel"] + params["bias"])
  return y @ params["head_kernel"] + params["head_bias"] if last else y


def stage_split(model: BlockMLP) -> tuple[list[Callable], list[dict[str, np.ndarray]]]:
  """(stage functions, stage params) of `model`, one block per stage: the same initial values."""
  n = len(model.blocks)
  params = []
  for s, block in enumerate(model.blocks):
    p = {"kernel": np.asarray(block.kernel[...]), "bias": np.asarray(block.bias[...])}
    if s == n - 1:
      p.update(head_kernel=np.asarray(model.head.kernel[...]),
               head_bias=np.asarray(model.head.bias[...]))
    params.append(p)
  return [functools.partial(block_stage, last=s == n - 1) for s in range(n)], params


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Case:
  """One timed update: `step()` runs it and blocks; `updates` = updates per call."""

  def __init__(self, name: str, step: Callable[[], None], updates: int = 1):
    self.name, self._step, self.updates = name, step, updates
    self.times: list[float] = []
    self.first = 0.0

  def warm_up(self) -> None:
    t0 = time.perf_counter()
    self._step()
    self.first = time.perf_counter() - t0
    self._step()

  def run(self) -> None:
    t0 = time.perf_counter()
    self._step()
    self.times.append((time.perf_counter() - t0) / self.updates)


def dp_case(name: str, model: BlockMLP, batch: dict[str, np.ndarray], sync: jt.GradSync) -> Case:
  mesh = jt.data_mesh()
  optimizer = optax.sgd(0.01)
  graphdef, state = jt.init_train_state(model, optimizer, mesh)
  step = jt.TrainStep(graphdef, optimizer, mesh, sync, donate=True)
  batch = jt.shard_batch(batch, mesh)
  holder = {"state": state}

  def run():
    holder["state"], metrics = step(holder["state"], batch)
    jax.block_until_ready(metrics)

  return Case(name, run)


def pipeline_case(name: str, model: BlockMLP, xs: np.ndarray, ys: np.ndarray, *, schedule: str,
                  num_microbatches: int = 1, num_pipelines: int = 2) -> Case:
  stages, params = stage_split(model)
  mesh = jp.pipeline_mesh(num_pipelines, len(stages))
  pipe = jp.Pipeline(stages, cross_entropy, optax.sgd(0.01), mesh, schedule=schedule,
                     num_microbatches=num_microbatches, donate=True)
  holder = {"state": pipe.init(params)}

  def run():
    holder["state"], metrics = pipe.run(holder["state"], xs, ys)
    jax.block_until_ready(holder["state"].params)
    assert np.all(np.isfinite(metrics["loss"]))

  return Case(name, run, updates=xs.shape[0])


def step_section(width: int, batch: int, microbatches: Sequence[int], steps: int) -> None:
  num_stages, num_pipelines, minibatches_1f1b = 4, 2, 8
  for m in microbatches:
    if m < 1 or batch % (num_pipelines * m) or batch % 8:
      raise app.UsageError(f"--batch={batch} with M={m} is not allowed; expected M >= 1 and a "
                           f"batch that is a multiple of 8 and of N * M = {num_pipelines * m}.")
  model = BlockMLP(num_stages, width, NUM_CLASSES, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((minibatches_1f1b, batch, width)).astype(np.float32)
  y = rng.integers(0, NUM_CLASSES, (minibatches_1f1b, batch)).astype(np.int32)
  params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"\nstep time: MLP of {num_stages} blocks of width {width} ({params / 1e6:.2f}M params), "
        f"global batch {batch}, SGD; {steps} rounds, cases alternated")
  cases = [
      dp_case("DP 8 devices, sequential (baseline)", model, {"image": x[0], "label": y[0]},
              jt.GradSync()),
      dp_case("DP 8 devices, ring", model, {"image": x[0], "label": y[0]},
              jt.GradSync(algorithm="ring")),
  ] + [
      pipeline_case(f"GPipe 2x4, M={m}, {batch // (num_pipelines * m)} rows/micro, 1 mb/run",
                    model, x[:1], y[:1], schedule="gpipe", num_microbatches=m)
      for m in microbatches
  ] + [
      pipeline_case(f"1F1B 2x4, {minibatches_1f1b} mb/run", model, x, y,
                    schedule="1f1b"),
  ]
  for case in cases:
    case.warm_up()
    print(f"  {case.name}: compile + first run {case.first:.1f} s", flush=True)
  for _ in range(steps):
    for case in cases:
      case.run()
  head = (f"{'case':48s} {'s/update':>9s} {'min':>7s} {'vs DP seq':>9s} {'vs DP ring':>10s}")
  print("\n" + head + "\n" + "-" * len(head))
  for case in cases:
    ratios = [statistics.median(a / b for a, b in zip(case.times, base.times))
              for base in cases[:2]]
    print(f"{case.name:48s} {statistics.median(case.times):9.3f} {min(case.times):7.3f} "
          f"{ratios[0]:8.2f}x {ratios[1]:9.2f}x")
  print("target: GPipe <= 1.5x the unpipelined data-parallel step")


# -- (c) compile time ----------------------------------------------------------------------------
@contextlib.contextmanager
def compile_seconds():
  """Yields a dict that collects jax's compile-event seconds by event while the block runs."""
  totals: dict[str, float] = collections.defaultdict(float)

  def listener(event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event in COMPILE_EVENTS:
      totals[event] += duration

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield totals
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def compile_case(schedule: str, num_stages: int, num_microbatches: int, num_batches: int
                 ) -> tuple[float, float, float]:
  """(trace + lower seconds, XLA compile seconds, first run seconds) of a fresh Pipeline."""
  width, rows = 128, 8
  num_pipelines = 8 // num_stages
  model = BlockMLP(num_stages, width, NUM_CLASSES, rngs=nnx.Rngs(0))
  stages, params = stage_split(model)
  pipe = jp.Pipeline(stages, cross_entropy, optax.sgd(0.01),
                     jp.pipeline_mesh(num_pipelines, num_stages), schedule=schedule,
                     num_microbatches=num_microbatches)
  state = pipe.init(params)
  rng = np.random.default_rng(0)
  batch = num_pipelines * num_microbatches * rows
  xs = rng.standard_normal((num_batches, batch, width)).astype(np.float32)
  ys = rng.integers(0, NUM_CLASSES, (num_batches, batch)).astype(np.int32)
  with compile_seconds() as totals:
    t0 = time.perf_counter()
    state, _ = pipe.run(state, xs, ys)
    jax.block_until_ready(state.params)
    first = time.perf_counter() - t0
  front = totals[COMPILE_EVENTS[0]] + totals[COMPILE_EVENTS[1]]
  return front, totals[COMPILE_EVENTS[2]], first


def compile_section() -> None:
  print("\ncompile time of the first run (MLP width 128, 8 rows per micro-batch per pipeline)")
  head = (f"{'schedule':8s} {'N x S':>5s} {'M':>3s} {'B':>3s} {'ticks/mb':>8s} "
          f"{'trace+lower s':>13s} {'XLA compile s':>13s} {'first run s':>11s}")
  print(head + "\n" + "-" * len(head))
  rows: list[tuple[str, int, int, int]] = []
  rows += [("gpipe", s, 8, 1) for s in (2, 4, 8)]
  rows += [("gpipe", 4, m, 1) for m in (4, 16)]
  rows += [("gpipe", 4, 8, b) for b in (4, 16, 64)]
  rows += [("1f1b", s, 1, 8) for s in (2, 4, 8)]
  rows += [("1f1b", 4, 1, b) for b in (1, 4, 16, 64)]
  for schedule, s, m, b in rows:
    front, backend, first = compile_case(schedule, s, m, b)
    if schedule == "gpipe":
      ticks = f"{2 * (m + s - 1)}"
    else:
      ticks = f"{(2 * b + 2 * (s - 1)) / b:.1f}"
    print(f"{schedule:8s} {8 // s:>2d}x{s:<2d} {m:3d} {b:3d} {ticks:>8s} {front:13.2f} "
          f"{backend:13.2f} {first:11.2f}", flush=True)


def host_section() -> None:
  """The host memory and restore time of a long fill (module docstring)."""
  n, s, rows, codes, per_run = 2, 2, 2, 16, 4
  pipe = jp.Pipeline([lambda p, x: x + p["p"]] * s,
                     lambda y, t: -jax.numpy.mean(jax.numpy.sum(y * t, -1)), optax.sgd(1.0),
                     jp.pipeline_mesh(n, s), schedule="1f1b", sync="preduce",
                     hetero=jp.Hetero(delay_s=0.03, probability=0.2,
                                      slowdown=((1.0,) * s, (2.0,) * s)))
  state = pipe.init([{"p": np.zeros((codes,), np.float32)}] * s)
  rng = np.random.default_rng(0)
  xs = np.zeros((per_run, n * rows, codes), np.float32)
  ys = rng.random((per_run, n * rows, codes)).astype(np.float32)
  marks, seconds = {}, []
  tracemalloc.start()
  for fed in range(per_run, 300 + 1, per_run):
    state, _ = pipe.run(state, xs, ys)
    if fed in (100, 300):
      gc.collect()
      marks[fed] = tracemalloc.get_traced_memory()[0]
  tracemalloc.stop()
  for _ in range(300, _HOST_BATCHES.value, per_run):  # timed without tracemalloc's overhead
    begin = time.perf_counter()
    state, _ = pipe.run(state, xs, ys)
    seconds.append(time.perf_counter() - begin)
  normal = statistics.median(seconds[-20:])
  size = len(pickle.dumps(pipe._fill._fill))  # pylint: disable=protected-access

  def first_run_after_restore(state) -> float:
    pipe._fill.clear()  # pylint: disable=protected-access
    begin = time.perf_counter()
    pipe.run(state, xs, ys)
    return time.perf_counter() - begin
  restored = statistics.median(first_run_after_restore(state) for _ in range(3))
  zeroed = state._replace(inflight=dict(state.inflight, snapshot=jax.numpy.zeros_like(
      state.inflight["snapshot"])))
  replayed = first_run_after_restore(zeroed)
  growth = (marks[300] - marks[100]) / 2 ** 20
  print("\nhost side of a long 1F1B fill (probe 2 x 2, preduce, pipeline 1 2x slow, stalls, "
        f"runs of {per_run})")
  print(f"traced heap growth, mini-batch 100 -> 300: {growth:+.3f} MiB "
        f"({(marks[300] - marks[100]) / 200 / 1024:+.2f} KiB per mini-batch; target <= 1.5 MiB)")
  print(f"pickled fill (the state's snapshot, before compression): {size / 1024:.1f} KiB")
  print(f"at mini-batch {_HOST_BATCHES.value}: a normal run {normal * 1e3:.1f} ms; the first run "
        f"after a restore, from the snapshot: {restored * 1e3:.1f} ms ({restored / normal:.2f}x; "
        f"target <= 3x); replaying the fill from its start (the baseline): "
        f"{replayed * 1e3:.1f} ms ({replayed / normal:.1f}x)")


# -- (d) flush schedules (issue 34) ---------------------------------------------------------------
SCHEDULE_BLOCKS = 8  # the schedules section's MLP: 8 equal blocks


def chunk_stage(params: dict[str, jax.Array], x: jax.Array, *, last: bool) -> jax.Array:
  """Consecutive blocks of `BlockMLP` (params stacked on a leading axis) as one stage function,
  the last one with the classifier."""
  for k in range(params["kernel"].shape[0]):
    x = jax.nn.relu(x @ params["kernel"][k] + params["bias"][k])
  return x @ params["head_kernel"] + params["head_bias"] if last else x


def chunk_split(model: BlockMLP, num_parts: int
                ) -> tuple[list[Callable], list[dict[str, np.ndarray]]]:
  """(stage functions, stage params) of `model` in `num_parts` equal parts of consecutive blocks."""
  per = len(model.blocks) // num_parts
  params = []
  for s in range(num_parts):
    blocks = model.blocks[s * per:(s + 1) * per]
    p = {"kernel": np.stack([np.asarray(b.kernel[...]) for b in blocks]),
         "bias": np.stack([np.asarray(b.bias[...]) for b in blocks])}
    if s == num_parts - 1:
      p.update(head_kernel=np.asarray(model.head.kernel[...]),
               head_bias=np.asarray(model.head.bias[...]))
    params.append(p)
  return [functools.partial(chunk_stage, last=s == num_parts - 1) for s in range(num_parts)], params


def closed_form(name: str, d: int, m: int) -> float | None:
  """The bubble's closed form of the named schedule (F = I = W = 1 unit), None where none."""
  return {"gpipe": (d - 1) / (m + d - 1), "gpipe (flush executor)": (d - 1) / (m + d - 1),
          "1f1b_flush": (d - 1) / (m + d - 1), "zb_h1": (d - 1) / (3 * m + d - 1),
          "interleaved_1f1b": (d - 1) / (2 * m + d - 1)}.get(name)


def temp_bytes(pipe: jp.Pipeline, state, xs: np.ndarray, ys: np.ndarray) -> int:
  return pipe.lower(state, xs, ys).compile().memory_analysis().temp_size_in_bytes


def schedule_pipeline(model: BlockMLP, name: str, d: int, n: int, m: int) -> jp.Pipeline:
  """The Pipeline of the row `name` (a schedule name, or "gpipe (flush executor)")."""
  v = 2 if name in ("interleaved_1f1b", "zbv", "dualpipev") else 1
  stages, _ = chunk_split(model, v * d)
  schedule: str | jp.Schedule = name
  if name == "gpipe (flush executor)":
    schedule = jp.Schedule.named("gpipe", d, m)
  return jp.Pipeline(stages, cross_entropy, optax.sgd(0.01), jp.pipeline_mesh(n, d),
                     schedule=schedule, num_microbatches=m,
                     virtual_stages=2 if name == "interleaved_1f1b" else None, donate=True)


def schedules_section(width: int, batch: int, microbatches: Sequence[int], rounds: int) -> None:
  d, n = 4, 2
  names = ("gpipe", "gpipe (flush executor)", "1f1b_flush", "interleaved_1f1b", "zb_h1", "zbv",
           "dualpipev")
  for m in microbatches:
    if m < 1 or batch % (n * m):
      raise app.UsageError(f"--schedule_batch={batch} with M={m} is not allowed; expected M >= 1 "
                           f"and a batch that is a multiple of N * M = {n * m}.")
  model = BlockMLP(SCHEDULE_BLOCKS, width, NUM_CLASSES, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((1, batch, width)).astype(np.float32)
  ys = rng.integers(0, NUM_CLASSES, (1, batch)).astype(np.int32)
  params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"\nflush schedules: MLP of {SCHEDULE_BLOCKS} blocks of width {width} "
        f"({params / 1e6:.2f}M params), N = {n} pipelines x D = {d} devices, global batch {batch}, "
        f"SGD, sync allreduce; v = 1 schedules: {d} stage functions of {SCHEDULE_BLOCKS // d} "
        f"blocks, v = 2 (interleaved_1f1b, zbv, dualpipev): {2 * d} of "
        f"{SCHEDULE_BLOCKS // (2 * d)}; {rounds} rounds, cases alternated")
  results: dict[tuple[str, int], dict] = {}
  for m in microbatches:
    cases, pipes = [], {}
    for name in names:
      pipe = schedule_pipeline(model, name, d, n, m)
      v = 2 if name in ("interleaved_1f1b", "zbv", "dualpipev") else 1
      state = pipe.init(chunk_split(model, v * d)[1])
      mem = None if name == "gpipe" else temp_bytes(pipe, state, xs, ys)
      holder = {"state": state}

      def run(pipe=pipe, holder=holder):
        holder["state"], metrics = pipe.run(holder["state"], xs, ys)
        jax.block_until_ready(holder["state"].params)
        assert np.all(np.isfinite(metrics["loss"]))

      cases.append(Case(name, run))
      pipes[name] = pipe
      results[name, m] = {"bubble": pipe.bubble, "peak": max(pipe.peak_inflight), "temp": mem}
    for case in cases:
      case.warm_up()
      print(f"  M={m} {case.name}: compile + first run {case.first:.1f} s", flush=True)
    for _ in range(rounds):
      for case in cases:
        case.run()
    for case in cases:
      results[case.name, m].update(
          seconds=statistics.median(case.times),
          ratio=statistics.median(a / b for a, b in zip(case.times, cases[0].times)))
    head = (f"{'M':>3s} {'schedule':24s} {'bubble':>7s} {'formula':>8s} {'peak act':>8s} "
            f"{'temp MiB':>9s} {'s/mini-batch':>12s} {'vs gpipe':>9s}")
    print("\n" + head + "\n" + "-" * len(head))
    for name in names:
      r, form = results[name, m], closed_form(name, d, m)
      temp = "-" if r["temp"] is None else f"{r['temp'] / 2 ** 20:.2f}"
      print(f"{m:3d} {name:24s} {r['bubble']:7.4f} "
            f"{'-' if form is None else f'{form:.4f}':>8s} {r['peak']:8.2f} {temp:>9s} "
            f"{r['seconds']:12.3f} {r['ratio']:8.2f}x", flush=True)
  # the memory target's reference: 1F1B-flush (and GPipe's order on the flush executor) at M = 4,
  # with the same global batch (bigger micro-batches) and with the same micro-batch rows as the
  # largest M (the mini-batch grows with M: what the executor's buffers hold, against M)
  micro_rows = batch // (n * max(microbatches))
  fixed: dict[tuple[str, int], int] = {}
  for name in ("1f1b_flush", "gpipe (flush executor)"):
    pipe = schedule_pipeline(model, name, d, n, 4)
    results[name, 4] = {"temp": temp_bytes(pipe, pipe.init(chunk_split(model, d)[1]), xs, ys),
                        "peak": max(pipe.peak_inflight)}
    print(f"  M=4 {name}: temp {results[name, 4]['temp'] / 2 ** 20:.2f} MiB (global batch "
          f"{batch}), peak activations {results[name, 4]['peak']:.2f}")
    for m in sorted({4, *microbatches}):
      pipe = schedule_pipeline(model, name, d, n, m)
      rows = n * micro_rows * m
      fixed[name, m] = temp_bytes(pipe, pipe.init(chunk_split(model, d)[1]), xs[:, :rows] if
                                  rows <= batch else np.resize(xs, (1, rows, width)),
                                  np.resize(ys, (1, rows)))
    print(f"  {name}, {micro_rows} rows per micro-batch per pipeline (global batch "
          f"{n} x {micro_rows} x M): temp MiB " +
          ", ".join(f"M={m} {fixed[name, m] / 2 ** 20:.2f}" for m in sorted({4, *microbatches})))

  def get(name, m, key):
    return results[name, m][key] if (name, m) in results else float("nan")

  print("\ntargets (issue 34):")
  print(f"  ZB-H1 bubble at D=4, M=8 <= 0.12: {get('zb_h1', 8, 'bubble'):.4f} "
        f"(1F1B-flush {get('1f1b_flush', 8, 'bubble'):.4f}; target text: 0.27)")
  print(f"  interleaved v=2 bubble at M=8 <= 0.16: {get('interleaved_1f1b', 8, 'bubble'):.4f}")
  for m in microbatches:
    print(f"  M={m}: s/mini-batch vs gpipe <= 0.9x: ZB-H1 {get('zb_h1', m, 'ratio'):.2f}x, "
          f"interleaved {get('interleaved_1f1b', m, 'ratio'):.2f}x")
  print(f"  1F1B-flush peak at M=16 = GPipe's / 4: {get('1f1b_flush', 16, 'peak'):.2f} vs "
        f"{get('gpipe', 16, 'peak'):.2f} / 4 = {get('gpipe', 16, 'peak') / 4:.2f}")
  print(f"  1F1B-flush temp at M=16 <= 1.5x M=4, same global batch: "
        f"{get('1f1b_flush', 16, 'temp') / 2 ** 20:.2f} MiB vs "
        f"{get('1f1b_flush', 4, 'temp') / 2 ** 20:.2f} MiB "
        f"({get('1f1b_flush', 16, 'temp') / get('1f1b_flush', 4, 'temp'):.2f}x; GPipe order on "
        f"the flush executor {get('gpipe (flush executor)', 16, 'temp') / 2 ** 20:.2f} vs "
        f"{get('gpipe (flush executor)', 4, 'temp') / 2 ** 20:.2f} MiB)")
  if ("1f1b_flush", 16) in fixed:
    f16, f4 = fixed["1f1b_flush", 16], fixed["1f1b_flush", 4]
    g16, g4 = fixed["gpipe (flush executor)", 16], fixed["gpipe (flush executor)", 4]
    print(f"  1F1B-flush temp at M=16 <= 1.5x M=4, same micro-batch ({micro_rows} rows): "
          f"{f16 / 2 ** 20:.2f} MiB vs {f4 / 2 ** 20:.2f} MiB ({f16 / f4:.2f}x; GPipe order on the "
          f"flush executor {g16 / 2 ** 20:.2f} vs {g4 / 2 ** 20:.2f} MiB, {g16 / g4:.2f}x)")


def main(argv: Sequence[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  if len(jax.devices()) != 8:
    raise app.UsageError(f"expected 8 devices, found {len(jax.devices())} "
                         "(XLA_FLAGS set too late?)")
  unknown = sorted(set(_SECTIONS.value) - set(SECTIONS))
  if unknown:
    raise app.UsageError(f"--sections={unknown[0]} is not allowed; expected some of {SECTIONS}.")
  print(f"jax {jax.__version__}, 8 emulated {jax.default_backend()} devices on {os.cpu_count()} "
        f"cores, {time.strftime('%Y-%m-%d %H:%M')}, load average "
        f"{os.getloadavg()[0]:.1f}")
  if "bubble" in _SECTIONS.value:
    bubble_section()
  if "step" in _SECTIONS.value:
    step_section(_WIDTH.value, _BATCH.value, [int(m) for m in _MICRO.value], _STEPS.value)
  if "compile" in _SECTIONS.value:
    compile_section()
  if "host" in _SECTIONS.value:
    host_section()
  if "schedules" in _SECTIONS.value:
    schedules_section(_SCHED_WIDTH.value, _SCHED_BATCH.value,
                      [int(m) for m in _SCHED_MICRO.value], _SCHED_ROUNDS.value)


if __name__ == "__main__":
  app.run(main)
