"""The input pipeline: batches as a pure function of (seed, step), per-process slices, prefetching.

Global batch at step s (size B over a dataset of N examples), by `Sampler.kind`:
  "epoch" (default): epoch e = s // steps_per_epoch uses the permutation
      Generator(PCG64(SeedSequence([seed, 0, e]))).permutation(N); step s takes
      its positions [j * B, (j + 1) * B), j = s % steps_per_epoch.
  "fixed": the permutation of epoch 0 in every epoch (torch's DistributedSampler
      without set_epoch, as DavidNet runs it, docs/cpd.md).
  "sequential": 0, 1, ..., N - 1 in every epoch (evaluation).
  "once": CPD's DistributedGivenIterationSampler (docs/cpd.md): the run's
      T * B positions are arange(N) tiled and cut to T * B, shuffled once with
      np.random.RandomState(seed).shuffle (CPD: np.random.seed(0)); worker r of
      `world_size` owns the r-th contiguous chunk of T * B / world_size and
      takes its next B / world_size at every step. The global batch is the
      concatenation over workers, so sharding it over `world_size` data-parallel
      devices gives each device CPD rank r's batch. Needs total_steps = T.
steps_per_epoch = N // B with drop_last (the default), else ceil(N / B): then
the last batch of an epoch is padded to B with index 0 and "mask" False.

Every batch is {"image", "label", "mask"} (numpy); "mask" is True for real
examples. Augmentation randomness for step s is drawn for the whole global
batch from Generator(PCG64(SeedSequence([seed, 1, s]))) (`Dataset.draw`).
Process p of P gets rows [p * B / P, (p + 1) * B / P) of the global batch and
only loads those examples, so the union over processes is the single-process
batch; batch(s) never depends on earlier calls, which is what makes resuming
at any step bit-exact.

`Prefetcher` runs an iterator on a background thread with a bounded queue,
optionally placing each batch on devices (`jax.make_array_from_process_local_data`
with a sharding), and stops the thread on close() / exit from a `with` block.

Worker processes (`worker_processes=W > 0`, datasets that read files): `iterate`
and `prefetch` load batches in W processes with Grain (grain.MapDataset.range ->
map -> to_iter_dataset -> mp_prefetch). Each step's batch for this process is cut
into chunks of min(ceil(B_local / W), MAX_CHUNK_ROWS) rows; element k of the range
is chunk k % chunks of step start + k // chunks, and its map computes exactly
those rows of batch(step) (a dataset's `get` works row by row, which is also what
makes the per-process slices add up to the global batch). mp_prefetch gives
worker w the elements w, w + W, ... and interleaves them back in order, so the
chunks arrive in order and are copied into batch(step), bit for bit the batch of
the calling process. Workers start with "spawn" (a fresh interpreter, never a
fork of a process running JAX's threads: programs that use workers need the
`if __name__ == "__main__":` guard), ignore SIGINT (Ctrl-C is the parent's to
handle), keep JAX on the CPU, load with one thread (a dataset's `num_workers`
is set to 1 in the worker's copy: threads on top of processes only contend), and
hand the arrays over in a ring of shared-memory slots that each worker reuses
(jlp.data.shared_ring; /dev/shm must hold W * (2 * worker_buffer + 3) chunks:
raise Docker's --shm-size if needed). An exception in a worker (a DataFileError
naming a bad file, a ValueError) is raised in the consumer with its type and
message when the iteration reaches its batch; closing the iterator (or the
Prefetcher over it) stops and joins the workers and frees the shared memory.
Datasets held in memory (`Dataset.in_memory`: digits, CIFAR; TokenDataset;
DigitsSegmentation) never start workers.

Not taken from Grain: its index samplers and sharding (grain.IndexSampler,
MapDataset.shuffle / random_map, ShardByJaxProcess), whose streams are not the
ones above (the samplers' index streams are specified bit for bit); its
per-element shared-memory copies (replaced by the ring: a new segment per chunk
costs a page fault per 4 KiB page); and its checkpointable iterator state: the
state of this pipeline is the step, which the runner checkpoints (resuming at
step s starts the workers at s).

Streams: the "once" sampler uses numpy's legacy RandomState, whose stream is
frozen; the others use PCG64 Generators, which numpy keeps stable in practice
but does not promise across versions.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jlp.data import shared_ring
from jlp.data.dataset import Batch, Dataset

SAMPLERS = ("epoch", "fixed", "sequential", "once")
_PERMUTATION_STREAM = 0
_AUGMENT_STREAM = 1


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def _generator(*words: int) -> np.random.Generator:
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(words))))


@functools.lru_cache(maxsize=4)
def _epoch_permutation(size: int, seed: int, epoch: int) -> np.ndarray:
  perm = _generator(seed, _PERMUTATION_STREAM, epoch).permutation(size)
  perm.setflags(write=False)
  return perm


@functools.lru_cache(maxsize=2)
def _given_iteration_indices(size: int, seed: int, total: int) -> np.ndarray:
  """CPD's gen_new_list over the whole run (before the per-rank cut)."""
  indices = np.arange(size)[:total]
  indices = np.tile(indices, (total - 1) // indices.shape[0] + 1)[:total]
  np.random.RandomState(seed).shuffle(indices)
  indices.setflags(write=False)
  return indices


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Which examples form the global batch at each step (see the module docstring)."""
  size: int
  global_batch_size: int
  seed: int = 0
  kind: str = "epoch"
  drop_last: bool = True
  total_steps: int | None = None
  world_size: int = 1

  def __post_init__(self):
    if not isinstance(self.size, int) or self.size < 1:
      raise _invalid("size", self.size, "a positive int (the dataset is empty)")
    if not isinstance(self.global_batch_size, int) or self.global_batch_size < 1:
      raise _invalid("global_batch_size", self.global_batch_size, "a positive int")
    if not isinstance(self.seed, int) or self.seed < 0:
      raise _invalid("seed", self.seed, "an int >= 0")
    if self.kind not in SAMPLERS:
      raise _invalid("kind", self.kind, "one of " + ", ".join(map(repr, SAMPLERS)))
    if self.drop_last and self.kind != "once" and self.global_batch_size > self.size:
      raise _invalid("global_batch_size", self.global_batch_size,
                     f"at most the dataset size {self.size} with drop_last=True")
    if self.kind == "once":
      if not isinstance(self.total_steps, int) or self.total_steps < 1:
        raise _invalid("total_steps", self.total_steps, "a positive int for kind='once'")
      if (not isinstance(self.world_size, int) or self.world_size < 1
          or self.global_batch_size % self.world_size):
        raise _invalid("world_size", self.world_size,
                       f"a positive divisor of global_batch_size={self.global_batch_size}")
      if self.seed >= 2**32:
        raise _invalid("seed", self.seed, "below 2**32 for kind='once' (RandomState)")

  @property
  def steps_per_epoch(self) -> int:
    """Steps in one pass over the data ("once": the whole run, total_steps)."""
    if self.kind == "once":
      return self.total_steps
    if self.drop_last:
      return self.size // self.global_batch_size
    return -(-self.size // self.global_batch_size)

  def indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset indices (B,), mask (B,)) of the global batch at `step` (>= 0)."""
    if not isinstance(step, (int, np.integer)) or step < 0:
      raise _invalid("step", step, "an int >= 0")
    step = int(step)
    b = self.global_batch_size
    if self.kind == "once":
      if step >= self.total_steps:
        raise _invalid("step", step, f"below total_steps={self.total_steps} for kind='once'")
      run = _given_iteration_indices(self.size, self.seed, self.total_steps * b)
      per_worker = b // self.world_size
      chunk = self.total_steps * per_worker
      starts = np.arange(self.world_size) * chunk + step * per_worker
      idx = run[starts[:, None] + np.arange(per_worker)].reshape(-1)
      return idx, np.ones(b, bool)
    epoch, j = divmod(step, self.steps_per_epoch)
    if self.kind == "sequential":
      order = np.arange(self.size)
    else:
      order = _epoch_permutation(self.size, self.seed, 0 if self.kind == "fixed" else epoch)
    idx = order[j * b:(j + 1) * b]
    mask = np.ones(b, bool)
    if idx.shape[0] < b:
      mask[idx.shape[0]:] = False
      idx = np.concatenate([idx, np.zeros(b - idx.shape[0], idx.dtype)])
    return np.asarray(idx), mask


class Pipeline:
  """Batches of one dataset for this process: `batch(step)`, `iterate(start_step)`, `prefetch`.

  Args:
    dataset: a jlp.data Dataset (e.g. from get_dataset).
    global_batch_size: examples per step over all processes (a multiple of process_count).
    seed: data seed (order and augmentation).
    sampler: "epoch", "fixed", "sequential" or "once" (module docstring).
    drop_last: drop the last incomplete batch of each epoch (else pad it, mask False).
    total_steps, world_size: for sampler="once" (CPD's run length and worker count).
    process_index, process_count: this process's slice (default: jax's).
    worker_processes: load batches in this many processes (Grain's mp_prefetch; module
      docstring) in `iterate` and `prefetch`; 0 (the default): in the calling process
      (`prefetch`: its background thread). Ignored (0) for datasets held in memory.
    worker_buffer: chunks each worker keeps ready (Grain's per_worker_buffer_size).
  """

  def __init__(self, dataset: Dataset, global_batch_size: int, *, seed: int = 0,
               sampler: str = "epoch", drop_last: bool = True, total_steps: int | None = None,
               world_size: int = 1, process_index: int | None = None,
               process_count: int | None = None, worker_processes: int = 0,
               worker_buffer: int = 1):
    if not isinstance(dataset, Dataset):
      raise _invalid("dataset", type(dataset).__name__, "a jlp.data.Dataset")
    self.sampler = Sampler(dataset.size, global_batch_size, seed, sampler, drop_last,
                           total_steps, world_size)
    process_count = jax.process_count() if process_count is None else process_count
    process_index = jax.process_index() if process_index is None else process_index
    if not isinstance(process_count, int) or process_count < 1:
      raise _invalid("process_count", process_count, "a positive int")
    if not isinstance(process_index, int) or not 0 <= process_index < process_count:
      raise _invalid("process_index", process_index, f"an int in 0..{process_count - 1}")
    if global_batch_size % process_count:
      raise _invalid("global_batch_size", global_batch_size,
                     f"a multiple of process_count={process_count}")
    self.dataset = dataset
    self.seed = seed
    self.process_index, self.process_count = process_index, process_count
    self.local_batch_size = global_batch_size // process_count
    self._rows = slice(process_index * self.local_batch_size,
                       (process_index + 1) * self.local_batch_size)
    if (isinstance(worker_processes, bool) or not isinstance(worker_processes, int)
        or worker_processes < 0):
      raise _invalid("worker_processes", worker_processes, "an int >= 0")
    if isinstance(worker_buffer, bool) or not isinstance(worker_buffer, int) or worker_buffer < 1:
      raise _invalid("worker_buffer", worker_buffer, "a positive int")
    self.worker_processes = 0 if holds_data_in_memory(dataset) else worker_processes
    self.worker_buffer = worker_buffer

  @property
  def global_batch_size(self) -> int:
    return self.sampler.global_batch_size

  @property
  def steps_per_epoch(self) -> int:
    return self.sampler.steps_per_epoch

  def batch(self, step: int) -> Batch:
    """This process's rows of the global batch at `step`: {"image", "label", "mask"}."""
    return self.rows(step, 0, self.local_batch_size)

  def rows(self, step: int, lo: int, hi: int) -> Batch:
    """Rows [lo, hi) of batch(step) (what one worker process loads)."""
    idx, mask = self.sampler.indices(step)
    b = self.global_batch_size
    params = self.dataset.draw(_generator(self.seed, _AUGMENT_STREAM, int(step)), b)
    rows = slice(self._rows.start + lo, self._rows.start + hi)
    local = {k: v[rows] for k, v in params.items()}
    out = self.dataset.get(idx[rows], local)
    out["mask"] = mask[rows]
    return out

  def iterate(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
    """batch(start_step), batch(start_step + 1), ...: num_steps of them, or until
    total_steps for sampler="once", else without end. With worker_processes, the
    batches are loaded in worker processes (module docstring); close the iterator
    (or exhaust it) to stop them."""
    stop = None if num_steps is None else start_step + num_steps
    if self.sampler.kind == "once":
      stop = self.sampler.total_steps if stop is None else min(stop, self.sampler.total_steps)
    if self.worker_processes and (stop is None or stop > start_step):
      return self._worker_batches(start_step, stop)
    return self._batches(start_step, stop)

  def _batches(self, start: int, stop: int | None) -> Iterator[Batch]:
    step = start
    while stop is None or step < stop:
      yield self.batch(step)
      step += 1

  def _worker_batches(self, start: int, stop: int | None) -> Iterator[Batch]:
    grain = _import_grain()
    local = self.local_batch_size
    rows = min(-(-local // self.worker_processes), MAX_CHUNK_ROWS)
    chunks = -(-local // rows)
    steps = _UNBOUNDED_STEPS if stop is None else stop - start
    # Chunks of one worker that can be unread when it writes the next: its queue and the
    # consumer-side prefetch thread's buffer (worker_buffer each), the one that thread holds,
    # and the one being copied below; one slot more is the slot being written.
    slots = 2 * self.worker_buffer + 3
    prefix = shared_ring.new_prefix()
    source = (grain.MapDataset.range(steps * chunks)
              .map(_ChunkLoader(self, start, rows, chunks, prefix, slots))
              .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
              .mp_prefetch(grain.MultiprocessingOptions(num_workers=self.worker_processes,
                                                        per_worker_buffer_size=self.worker_buffer),
                           worker_init_fn=_worker_init))
    reader = shared_ring.RingReader(prefix, self.worker_processes, slots)
    iterator = iter(source)
    try:
      for step in (itertools.count(start) if stop is None else range(start, stop)):
        yield _assemble(iterator, chunks, local, step, reader)
    finally:
      iterator.close()  # stops and joins the worker processes
      reader.close()  # unlinks the workers' shared memory
      # Grain's closed iterators are cyclic garbage holding semaphores; collected at a random
      # later moment, their finalizers can run inside a resource-tracker call, which then warns
      # "ResourceTracker called reentrantly". Collect them here instead.
      gc.collect()

  def __iter__(self) -> Iterator[Batch]:
    return self.iterate()

  def prefetch(self, start_step: int = 0, num_steps: int | None = None, *, size: int = 2,
               sharding: jax.sharding.Sharding | None = None) -> Prefetcher:
    """iterate(start_step, num_steps) on a background thread (see Prefetcher)."""
    return Prefetcher(self.iterate(start_step, num_steps), size=size, sharding=sharding)


_END = object()
# Rows of one chunk, the unit of work of a worker process: a step's batch of B_local rows is
# cut into ceil(B_local / W) rows, at most this many (the shared memory a worker holds is a few
# chunks: 64 ImageNet crops are 38 MB).
MAX_CHUNK_ROWS = 64
_UNBOUNDED_STEPS = 2**40  # "without end" for Grain's range (a MapDataset has a length)


def holds_data_in_memory(dataset: Dataset) -> bool:
  """Whether `dataset` holds its examples in memory (`Dataset.in_memory`): worker processes would
  only add their start-up and the copies."""
  return bool(dataset.in_memory)


class _ChunkLoader:
  """Grain's map in the worker processes: element k -> rows [j * rows, (j + 1) * rows) of the
  batch at step start + k // chunks, j = k % chunks, left in the worker's ring of shared-memory
  slots (jlp.data.shared_ring); returns the Slot. Pickled with the Pipeline into each worker."""

  def __init__(self, pipeline: Pipeline, start: int, rows: int, chunks: int, prefix: str,
               slots: int):
    self.pipeline, self.start, self.rows, self.chunks = pipeline, start, rows, chunks
    self.prefix, self.slots = prefix, slots
    self._writer = None

  def __getstate__(self):
    return {**self.__dict__, "_writer": None}

  def __setstate__(self, state):
    self.__dict__.update(state)
    # The worker's copy of the dataset loads with one thread: the processes are the
    # parallelism, and threads on top only contend (ImageNet-style: 2.2 ms of CPU per image
    # with one thread per worker, 2.5-2.6 ms with 2 or 8).
    if isinstance(getattr(self.pipeline.dataset, "num_workers", None), int):
      self.pipeline.dataset.num_workers = 1

  def __call__(self, k: int) -> shared_ring.Slot:
    step, j = divmod(int(k), self.chunks)
    lo = j * self.rows
    part = self.pipeline.rows(self.start + step, lo,
                              min(lo + self.rows, self.pipeline.local_batch_size))
    if self._writer is None:  # the first chunk of this worker
      self._writer = shared_ring.RingWriter(self.prefix, _WORKER_INDEX, self.slots)
    return self._writer.put(int(k) + 1, part)


def _import_grain():
  """grain, with its absl flags usable outside an absl program (pytest, notebooks): Grain
  reads some flags (e.g. grain_enable_multiprocess_worker_profiling) directly, which raises
  before absl has parsed the command line; they then keep their defaults, as Grain itself
  marks the flags it passes to its workers."""
  import grain  # pylint: disable=import-outside-toplevel  (only where workers are used)
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    for name in flags.FLAGS:
      if name.startswith("grain_") and not flags.FLAGS[name].present:
        flags.FLAGS[name].present = 1
  return grain


_WORKER_INDEX = 0  # in a worker process: its index (names its shared-memory slots)


def _worker_init(index: int, count: int) -> None:  # pylint: disable=unused-argument
  """In each worker: its index; Ctrl-C (SIGINT reaches the whole process group) is the
  parent's to handle (it stops the workers when it closes the iterator); JAX, which the worker
  imports with jlp but never needs, is kept off the accelerators; and the worker exits when its
  parent is gone (killed without closing the iterator, Grain's workers would wait forever)."""
  global _WORKER_INDEX
  _WORKER_INDEX = index
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:
    sys.modules["jax"].config.update("jax_platforms", "cpu")
  parent = os.getppid()

  def exit_with_parent():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(1)  # pylint: disable=protected-access

  threading.Thread(target=exit_with_parent, name="jlp-worker-parent-watch", daemon=True).start()


def _assemble(chunks: Iterator[shared_ring.Slot], count: int, rows: int, step: int,
              reader: shared_ring.RingReader) -> Batch:
  """The batch at `step` (`rows` rows) from its next `count` chunks, each copied out of its
  worker's slot as it arrives."""
  out, row = None, 0
  for _ in range(count):
    slot = next(chunks)
    views = reader.views(slot)
    if out is None:
      out = {k: np.empty((rows,) + v.shape[1:], v.dtype) for k, v in views.items()}
    for key, view in views.items():
      if view.shape[1:] != out[key].shape[1:]:
        raise ValueError(
            f"the batch at step {step} has {key!r} rows of different shapes "
            f"{sorted({view.shape[1:], out[key].shape[1:]})}; one batch needs one shape "
            "(evaluation batches: images of one size).")
      out[key][row:row + view.shape[0]] = view
    row += next(iter(views.values())).shape[0]
    del views
    reader.check(slot)
  return out


class Prefetcher:
  """Iterates `source` on a daemon thread, keeping up to `size` items ready.

  With `sharding`, every array leaf becomes a global jax.Array via
  `jax.make_array_from_process_local_data(sharding, leaf)` (the leaf is this
  process's slice; on one process that is `jax.device_put`). An exception in
  the source is raised in the consumer. close() (or leaving a `with` block, or
  exhausting the iterator) stops and joins the thread.
  """

  def __init__(self, source: Iterable[Any], size: int = 2,
               sharding: jax.sharding.Sharding | None = None):
    if not isinstance(size, int) or size < 1:
      raise _invalid("size", size, "a positive int")
    self._source = iter(source)
    self._sharding = sharding
    self._queue: queue.Queue = queue.Queue(maxsize=size)
    self._stop = threading.Event()
    self._done = False
    self._thread = threading.Thread(target=self._run, name="jlp-data-prefetch", daemon=True)
    self._thread.start()

  def _place(self, item: Any) -> Any:
    if self._sharding is None:
      return item
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self._sharding, np.asarray(x)), item)

  def _put(self, item: Any) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.05)
        return True
      except queue.Full:
        continue
    return False

  def _run(self) -> None:
    try:
      for item in self._source:
        if self._stop.is_set() or not self._put(("item", self._place(item))):
          return
      self._put(("end", _END))
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the consumer)
      self._put(("error", e))
    finally:
      close = getattr(self._source, "close", None)
      if close is not None:
        close()

  def __iter__(self) -> Prefetcher:
    return self

  def __next__(self) -> Any:
    if self._done:
      raise StopIteration
    while True:
      try:
        kind, value = self._queue.get(timeout=0.1)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          self._done = True
          raise StopIteration from None
    if kind == "item":
      return value
    self.close()
    if kind == "error":
      raise value
    raise StopIteration

  def close(self, timeout: float | None = 10.0) -> None:
    """Stops the thread (it finishes the batch it is building) and waits for it."""
    self._done = True
    self._stop.set()
    while True:
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    """Whether the background thread is still running."""
    return self._thread.is_alive()

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __del__(self):
    if hasattr(self, "_stop"):
      self._stop.set()
