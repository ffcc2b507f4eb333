"""One fill's host side: the model it runs under and its placed timeline, both kept in the
state, so that a run, a retry and a restore continue from the state without replaying the fill.

A fill is what the pipelines train between two flushes (1F1B) or from one change of model to the
next (GPipe). Its virtual-time decisions (`jlp.pipeline.timeline`, `jlp.pipeline.placement`) are a
function of its model (`FillModel`: the sync, the cost model, the syncs' knobs, the seed and
whether a plan drives it), its first mini-batch and its starting clocks. A run is a function of
(state, inputs, settings): `FillCache.fill` hands out the `Fill` it kept only when the state
stands exactly where that one was left (the same fill, the same number of chunks taken);
otherwise (a retry from an earlier state, a restore, another Pipeline's state) it continues from
the state's snapshot of its fill (`encode_snapshot`, written after every run), and replays the
fill from its start only for a state without one. A `Fill` is pruned after every run, so its
host memory, its snapshot and a restore's time do not grow with the fill's length.

The snapshot is a pickle, loaded with an unpickler that admits only the classes a fill is made
of (numpy arrays, `random.Random`, jlp.pipeline's classes), so a checkpoint cannot name any
other callable.

The model is recorded in the state (`FillModel.encode`, a fixed-size uint8 vector, so that the
abstract checkpoint target of any Pipeline of the same shape restores it): a 1F1B run with another
model in the middle of a fill is refused (what has run stays as it ran; `flush` drains under the
fill's own model), and a GPipe run with another model starts a new fill at the current clocks.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import pickle
import warnings
import zlib
from typing import Any

import numpy as np

from jlp.pipeline.costs import HetPipe, Hetero, PReduce
from jlp.pipeline.placement import Placement
from jlp.pipeline.timeline import Timeline

__all__ = ["Fill", "FillCache", "FillModel", "decode_snapshot", "drain_nodes",
           "encode_snapshot", "model_capacity", "new_placement", "snapshot_capacity"]


@dataclasses.dataclass(frozen=True)
class FillModel:
  """What a fill's virtual time is a function of, besides its start (module docstring)."""
  sync: str
  hetero: Hetero
  preduce: PReduce
  hetpipe: HetPipe
  seed: int
  planned: bool  # a plan drives the syncs (1F1B: lockstep, equal speeds)

  def encode(self, capacity: int) -> np.ndarray:
    """uint8 [capacity]: the model as JSON, zero-padded."""
    text = json.dumps({"sync": self.sync, "hetero": dataclasses.asdict(self.hetero),
                       "preduce": dataclasses.asdict(self.preduce),
                       "hetpipe": dataclasses.asdict(self.hetpipe), "seed": self.seed,
                       "planned": self.planned}, sort_keys=True).encode()
    if len(text) > capacity:
      raise AssertionError(f"a fill model of {len(text)} bytes, more than {capacity}")  # a bug
    out = np.zeros((capacity,), np.uint8)
    out[:len(text)] = np.frombuffer(text, np.uint8)
    return out

  @classmethod
  def decode(cls, data: Any) -> FillModel | None:
    """The model `encode` wrote (None: an all-zero vector, a state made before any run)."""
    raw = np.asarray(data, np.uint8).tobytes().rstrip(b"\0")
    if not raw:
      return None
    d = json.loads(raw)
    slowdown = d["hetero"].pop("slowdown")
    hetero = Hetero(slowdown=None if slowdown is None else tuple(map(tuple, slowdown)),
                    **d["hetero"])
    return cls(d["sync"], hetero, PReduce(**d["preduce"]), HetPipe(**d["hetpipe"]),
               int(d["seed"]), bool(d["planned"]))

  def describe(self) -> str:
    """The fields a user sets, for error messages."""
    return (f"sync={self.sync!r}, hetero={self.hetero}, preduce={self.preduce}, "
            f"hetpipe={self.hetpipe}, seed={self.seed}, plan={'given' if self.planned else None}")

  def differences(self, other: FillModel) -> list[str]:
    """The names of the fields in which `other` differs."""
    return [f.name for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)]


def model_capacity(num_pipelines: int, num_stages: int) -> int:
  """The bytes `FillModel.encode` gets: room for a [N][S] slowdown table of float reprs."""
  return 2048 + 32 * num_pipelines * num_stages


def new_placement(model: FillModel, schedule: str, num_pipelines: int, num_stages: int,
                  fill_start: int, clock: np.ndarray, fed_start: list[int],
                  total: list[int] | None = None) -> Placement:
  """The placement of a fill from its start (with an end after `total` mini-batches per
  pipeline, or none). With a plan the pipelines run in lockstep with equal speeds: a plan gives
  the matrices, times and finishes by mini-batch."""
  seed = int(np.random.SeedSequence([model.seed, fill_start]).generate_state(1)[0])
  hetero, sync = model.hetero, model.sync
  if model.planned:
    hetero = Hetero(delay_s=0.0)
    sync = "allreduce" if sync in ("preduce", "adpsgd") else sync
  timeline = Timeline(schedule, sync, num_pipelines, num_stages, 1, seed=seed, hetero=hetero,
                      preduce=model.preduce, hetpipe=model.hetpipe, first_batch=fed_start,
                      start=clock, total=total, log=True)
  return Placement(timeline, aligned=sync == "allreduce")


class Fill:
  """The host side of one 1F1B fill as the executor runs it: its never-ending placement, cut into
  runs and pruned after each, and what a flush needs to drain it without replaying the fill.

  A flush gives the fill an end after the chunks taken (`Timeline(total=...)`, docs/sdpipe.md):
  replayed from the fill's start, that timeline agrees with the never-ending one until the
  never-ending one starts a forward of a mini-batch not taken, or processes an event the end
  changes (`Placement.agrees_with_its_end`). So after every run the fill keeps a copy of its
  pruned placement (a start point), and drops the start points older than the latest one that
  still agrees: the drain continues that copy with the end set, and runs what it places less
  what the runs since the copy took (`taken`). The first start point is the fill's start (None):
  the drain then replays the fill with its end, as when a pipeline has taken no chunk at all.
  """

  def __init__(self, key: Any, origin: dict[str, Any]):
    self.key = key
    self.origin = origin  # `new_placement`'s arguments
    self.placement = new_placement(**origin)
    self.starts: list[tuple[float, int, Placement | None]] = [(-math.inf, 0, None)]
    self.taken: list[tuple[int, frozenset]] = []  # (chunks taken after a run, its nodes)

  def end_run(self, nodes: list[tuple], keep_updates_from: list[int]) -> None:
    """After a run took `nodes` (its tables made): keeps the start points a flush may need,
    prunes the placement (each pipeline keeps the leave times of its updates from
    keep_updates_from[i] on) and adds a start point at it."""
    placement = self.placement
    self.taken.append((placement.taken_chunks, frozenset(nodes)))
    first = next(k for k in range(len(self.starts) - 1, -1, -1)
                 if self.starts[k][2] is None or placement.agrees_with_its_end(self.starts[k][2]))
    self.starts = self.starts[first:]
    oldest = self.starts[0][1]
    self.taken = [(chunks, taken) for chunks, taken in self.taken if chunks > oldest]
    placement.prune([max(0, keep) for keep in keep_updates_from])
    self.starts.append((placement.timeline.now, placement.taken_chunks,
                        copy.deepcopy(placement)))

  def drain(self) -> tuple[Placement, list[tuple], dict[tuple, Any]]:
    """The flush: the fill with its end after the chunks taken, placed to the end; the nodes the
    runs did not take, in cut order; and the groups restricted so that every update averages
    once (`drain_nodes`)."""
    _, chunks, start = self.starts[0]
    if start is None:
      placement = new_placement(**self.origin, total=self.placement.taken_counts)
    else:
      placement = copy.deepcopy(start)
      placement.end_at(self.placement.taken_counts)
    placement.finish()
    done = set()
    for taken_chunks, taken in self.taken:
      if taken_chunks > chunks:
        done |= taken
    nodes, override = drain_nodes(placement, done)
    return placement, nodes, override


def drain_nodes(placement: Placement, done: set[tuple]) -> tuple[list[tuple], dict[tuple, Any]]:
  """A flush's nodes: those `placement` (finished) has not taken yet, less those the runs took
  (`done`, named by content). A group the drain forms over a member update that already averaged
  in a run (the drain may form groups otherwise, or earlier) averages only its other members:
  every update averages once. Returns the nodes in cut order and the groups so restricted, by
  node."""
  averaged = {(i, node[1], m) for node in done if node[0] == "mix"
              for i, m in zip(node[2], node[3], strict=True)}
  nodes, override = [], {}
  groups = dict((node, group) for group, node in placement.groups)
  for node in placement.take(None):
    if node in done:
      continue
    if node[0] == "mix":
      kept = tuple(i for i, m in zip(node[2], node[3], strict=True)
                   if (i, node[1], m) not in averaged)
      if not kept:
        continue
      if kept != node[2]:
        override[node] = groups[node]._replace(members=kept)
    nodes.append(node)
  return nodes, override


class FillCache:
  """The fill a pipeline has been running (module docstring)."""

  def __init__(self):
    self._key: Any = None
    self._fill: Fill | None = None
    self._timeline: Timeline | None = None

  def clear(self) -> None:
    self._key, self._fill, self._timeline = None, None, None

  def fill(self, model: FillModel, schedule: str, num_pipelines: int, num_stages: int, *,
           fill_start: int, clock: np.ndarray, fed_start: list[int], position: int,
           keep_updates_from: list[int] | None = None, snapshot: Any = None) -> Fill:
    """The 1F1B fill (`Fill`) standing at `position` chunks taken: the kept one if it stands
    there, else the state's `snapshot` (`encode_snapshot`) if it does, else the fill replayed
    from its start (`new_placement`), keeping each pipeline's leave times from
    keep_updates_from[i] (and from S + 1 before its chunks taken) on."""
    key = (model, fill_start, clock.tobytes(), tuple(fed_start))
    fill = self._fill
    if fill is not None and fill.key == key and fill.placement.taken_chunks == position:
      return fill
    fill = decode_snapshot(snapshot)
    if fill is None or fill.key != key or fill.placement.taken_chunks != position:
      fill = Fill(key, dict(model=model, schedule=schedule, num_pipelines=num_pipelines,
                            num_stages=num_stages, fill_start=fill_start, clock=np.array(clock),
                            fed_start=list(fed_start)))
      if position:
        placement = fill.placement
        nodes = placement.take(placement.chunk_cut(position), position)
        fill.end_run(nodes, [min(taken - num_stages - 1, math.inf if keep_updates_from is None
                                 else keep_updates_from[i])
                             for i, taken in enumerate(placement.taken_counts)])
    self._key, self._fill, self._timeline = key, fill, None
    return fill

  def timeline(self, model: FillModel, schedule: str, num_pipelines: int, num_stages: int,
               num_microbatches: int, *, fill_start: int, clock: np.ndarray) -> Timeline:
    """GPipe's timeline of the fill: a query (its decisions never change once taken), kept
    between runs."""
    key = ("gpipe", model, fill_start, clock.tobytes())
    if self._key != key or self._timeline is None:
      seed = int(np.random.SeedSequence([model.seed, fill_start]).generate_state(1)[0])
      self._fill = None
      self._timeline = Timeline(schedule, model.sync, num_pipelines, num_stages,
                                num_microbatches, seed=seed, hetero=model.hetero,
                                preduce=model.preduce, hetpipe=model.hetpipe,
                                first_batch=fill_start, start=clock)
      self._key = key
    return self._timeline


def snapshot_capacity(num_pipelines: int, num_stages: int) -> int:
  """The bytes of the state's snapshot of its fill (`encode_snapshot`): 4x and more the largest
  seen (compressed, about 20 KiB + 1.3 KiB per device: 28 KiB at 2 x 4, 88 KiB at 8 x 8, a
  pipeline 3x slow, HetPipe or PReduce)."""
  return (128 << 10) + (8 << 10) * num_pipelines * num_stages


def encode_snapshot(fill: Fill, capacity: int) -> np.ndarray:
  """uint8 [capacity]: the fill pickled and compressed, after an 8-byte length; all zeros when it
  does not fit (a restore then replays the fill: the same bits, slower)."""
  data = zlib.compress(pickle.dumps(fill, protocol=pickle.HIGHEST_PROTOCOL), 1)
  out = np.zeros((capacity,), np.uint8)
  if len(data) + 8 <= capacity:
    out[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    out[8:8 + len(data)] = np.frombuffer(data, np.uint8)
  else:
    warnings.warn(f"The pipeline's fill snapshot takes {len(data)} bytes, more than the "
                  f"state's {capacity}: a restore will replay the fill.", stacklevel=3)
  return out


def decode_snapshot(data: Any) -> Fill | None:
  """The fill `encode_snapshot` wrote (None: none)."""
  if data is None:
    return None
  raw = np.asarray(data, np.uint8)
  length = int(np.frombuffer(raw[:8].tobytes(), np.int64)[0])
  if length == 0:
    return None
  return _Unpickler(io.BytesIO(zlib.decompress(raw[8:8 + length].tobytes()))).load()


class _Unpickler(pickle.Unpickler):
  """Loads what a fill pickles and nothing else: a snapshot in a checkpoint from elsewhere cannot
  name any other callable."""

  _ALLOWED = {("builtins", name) for name in ("set", "frozenset", "slice", "range", "complex")}
  _ALLOWED |= {("random", "Random"), ("collections", "OrderedDict")}
  _ALLOWED |= {(module, name) for module in ("numpy", "numpy.core.multiarray",
                                             "numpy._core.multiarray", "numpy.core.numeric",
                                             "numpy._core.numeric", "numpy.dtypes")
               for name in ("ndarray", "dtype", "_reconstruct", "_frombuffer", "scalar",
                            "Float64DType", "Float32DType", "Int64DType", "Int32DType",
                            "BoolDType")}

  def find_class(self, module: str, name: str) -> Any:
    if (module, name) in self._ALLOWED:
      return super().find_class(module, name)
    if module.startswith("jlp.pipeline."):
      found = super().find_class(module, name)
      if isinstance(found, type):
        return found
    raise pickle.UnpicklingError(f"a pipeline fill snapshot may not load {module}.{name}")
