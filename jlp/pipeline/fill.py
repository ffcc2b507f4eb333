"""One fill's host side: the model it runs under, kept in the state, and its placed timeline,
rebuilt from the state whenever the state is not where the kept one stands.

A fill is what the pipelines train between two flushes (1F1B) or from one change of model to the
next (GPipe). Its virtual-time decisions (`jlp.pipeline.timeline`, `jlp.pipeline.placement`) are a
function of its model (`FillModel`: the sync, the cost model, the syncs' knobs, the seed and
whether a plan drives it), its first mini-batch and its starting clocks. A run is a function of
(state, inputs, settings): `FillCache.placement` hands out the placement it kept only when the
state stands exactly where that placement was left (the same fill, the same number of chunks
taken), and replays the fill otherwise (a retry from an earlier state, a restore, another
Pipeline's state).

The model is recorded in the state (`FillModel.encode`, a fixed-size uint8 vector, so that the
abstract checkpoint target of any Pipeline of the same shape restores it): a 1F1B run with another
model in the middle of a fill is refused (what has run stays as it ran; `flush` drains under the
fill's own model), and a GPipe run with another model starts a new fill at the current clocks.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from jlp.pipeline.costs import HetPipe, Hetero, PReduce
from jlp.pipeline.placement import Placement
from jlp.pipeline.timeline import Timeline

__all__ = ["FillCache", "FillModel", "model_capacity"]


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


class FillCache:
  """The placed timeline of the fill a pipeline has been running (module docstring)."""

  def __init__(self):
    self._key: Any = None
    self._placement: Placement | None = None

  def clear(self) -> None:
    self._key, self._placement = None, None

  def placement(self, model: FillModel, schedule: str, num_pipelines: int, num_stages: int, *,
                fill_start: int, clock: np.ndarray, fed_start: list[int], position: int | None,
                total: list[int] | None = None) -> Placement:
    """The 1F1B placement of the fill (`jlp.pipeline.placement`), advanced and taken up to
    `position` chunks (None: a fresh replay, for a flush's end `total`). The kept one if it
    stands there; otherwise the fill replayed from its start, with the runs before `position`
    taken. With a plan the pipelines run in lockstep with equal speeds (a plan gives the
    matrices, times and finishes by mini-batch)."""
    key = (model, fill_start, clock.tobytes(), tuple(fed_start))
    if (position is not None and self._placement is not None and self._key == key
        and self._placement.taken_chunks == position):
      return self._placement
    seed = int(np.random.SeedSequence([model.seed, fill_start]).generate_state(1)[0])
    hetero, sync = model.hetero, model.sync
    if model.planned:
      hetero = Hetero(delay_s=0.0)
      sync = "allreduce" if sync in ("preduce", "adpsgd") else sync
    timeline = Timeline(schedule, sync, num_pipelines, num_stages, 1, seed=seed, hetero=hetero,
                        preduce=model.preduce, hetpipe=model.hetpipe, first_batch=fed_start,
                        start=clock, total=total, log=True)
    placement = Placement(timeline, aligned=sync == "allreduce")
    if position is None:
      return placement
    if position:
      placement.take(placement.chunk_cut(position))
      placement.taken_chunks = position
    self._key, self._placement = key, placement
    return placement

  def timeline(self, model: FillModel, schedule: str, num_pipelines: int, num_stages: int,
               num_microbatches: int, *, fill_start: int, clock: np.ndarray) -> Timeline:
    """GPipe's timeline of the fill: a query (its decisions never change once taken), kept
    between runs."""
    key = ("gpipe", model, fill_start, clock.tobytes())
    if self._key != key:
      seed = int(np.random.SeedSequence([model.seed, fill_start]).generate_state(1)[0])
      self._placement = None
      self._timeline = Timeline(schedule, model.sync, num_pipelines, num_stages,
                                num_microbatches, seed=seed, hetero=model.hetero,
                                preduce=model.preduce, hetpipe=model.hetpipe,
                                first_batch=fill_start, start=clock)
      self._key = key
    return self._timeline
