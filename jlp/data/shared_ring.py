"""Arrays handed from a worker process to the consumer through reused shared-memory slots.

Grain's multiprocessing copies every array a worker returns into a new
shared-memory segment, which the consumer maps and unlinks. A new segment is
new memory: on this project's VM every 4 KiB page of it costs a page fault
(about 3.7 us, 0.55 ms for one 224x224x3 float32 image, a quarter of the cost of
decoding the JPEG and cropping it). Here each worker instead writes into a ring
of `slots` segments that it creates once and reuses: `RingWriter.put` copies a
dict of arrays into the next slot and returns a small picklable `Slot` (segment
name, generation, sequence number, layout) that travels through Grain's queue,
and `RingReader.read` / `views` map the segment once and read the arrays.

Segments are named `<prefix><worker>_<slot>`, so the consumer, which chooses the
prefix, unlinks all of them in `RingReader.close()` once the workers have stopped
(also those whose chunks it never read); the workers never unlink them, since
Grain may stop a worker whose last chunks are still waiting to be read. A slot
that must grow (a larger chunk) is recreated under the same name with the next
generation, and the reader maps it again.

Reuse is safe when a slot is read before its worker comes round to it again:
`slots` must exceed the number of chunks that can be in flight between the
writer and the reader (jlp.data.pipeline derives it from Grain's buffer sizes).
Each slot starts with a sequence number that the writer clears before writing
and sets after; the reader checks it before and after copying and raises
RuntimeError if the slot was rewritten meanwhile, so a wrong count is an error,
never a silently wrong batch.
"""

from __future__ import annotations

import dataclasses
import secrets
from multiprocessing import shared_memory

import numpy as np

_HEADER = 64  # bytes before the data: the sequence number (int64), then padding
_ALIGN = 64


def _aligned(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


def new_prefix() -> str:
  """A fresh name prefix for one iteration's segments (short: macOS allows 31 characters)."""
  return f"jlp{secrets.token_hex(4)}_"


def segment_name(prefix: str, worker: int, slot: int) -> str:
  return f"{prefix}{worker}_{slot}"


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where a worker left one dict of arrays: segment `name` (its `generation`), the sequence
  number `seq`, and (key, byte offset, shape, dtype) of each array."""
  name: str
  generation: int
  seq: int
  layout: tuple[tuple[str, int, tuple[int, ...], str], ...]


def _unlink_name(name: str) -> None:
  try:
    segment = shared_memory.SharedMemory(name=name)
  except FileNotFoundError:
    return
  segment.unlink()
  segment.close()


def _close(segment: shared_memory.SharedMemory) -> None:
  try:
    segment.close()
  except BufferError:  # an array still views it: the mapping goes with the process
    pass


class RingWriter:
  """The worker side: `put(seq, arrays)` -> Slot, into segments `<prefix><worker>_<k>`."""

  def __init__(self, prefix: str, worker: int, slots: int):
    if slots < 1:
      raise ValueError(f"slots={slots!r} is not allowed; expected a positive int.")
    self._names = [segment_name(prefix, worker, k) for k in range(slots)]
    self._segments: list[shared_memory.SharedMemory | None] = [None] * slots
    self._generations = [0] * slots
    self._count = 0

  def put(self, seq: int, arrays: dict[str, np.ndarray]) -> Slot:
    if seq <= 0:
      raise ValueError(f"seq={seq!r} is not allowed; expected a positive int.")
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    layout, size = [], _HEADER
    for key, value in arrays.items():
      layout.append((key, size, tuple(value.shape), value.dtype.str))
      size += _aligned(value.nbytes)
    k = self._count % len(self._segments)
    self._count += 1
    segment = self._segments[k]
    if segment is None or segment.size < size:
      if segment is not None:  # read by now (the ring's invariant): replace it, same name
        segment.unlink()
        _close(segment)
      segment = shared_memory.SharedMemory(name=self._names[k], create=True, size=size)
      self._segments[k] = segment
      self._generations[k] += 1
    header = np.ndarray((1,), np.int64, buffer=segment.buf)
    header[0] = 0
    for (_, offset, shape, dtype), value in zip(layout, arrays.values(), strict=True):
      np.copyto(np.ndarray(shape, dtype, buffer=segment.buf, offset=offset), value)
    header[0] = seq
    del header
    return Slot(self._names[k], self._generations[k], seq, tuple(layout))


class RingReader:
  """The consumer side: `read(slot)` -> dict of arrays (copies), or `views(slot)` then
  `check(slot)`; `close()` unmaps and unlinks every segment of the given workers and slots
  (call it once they have stopped)."""

  def __init__(self, prefix: str, workers: int, slots: int):
    self._names = [segment_name(prefix, w, k) for w in range(workers) for k in range(slots)]
    self._segments: dict[str, tuple[int, shared_memory.SharedMemory]] = {}

  def _segment(self, slot: Slot) -> shared_memory.SharedMemory:
    cached = self._segments.get(slot.name)
    if cached is not None and cached[0] == slot.generation:
      return cached[1]
    if cached is not None:
      _close(cached[1])
    segment = shared_memory.SharedMemory(name=slot.name)
    self._segments[slot.name] = (slot.generation, segment)
    return segment

  def views(self, slot: Slot) -> dict[str, np.ndarray]:
    """Views of the slot's arrays (valid until its worker reuses the slot: copy them, then
    `check`)."""
    segment = self._segment(slot)
    self.check(slot)
    return {key: np.ndarray(shape, dtype, buffer=segment.buf, offset=offset)
            for key, offset, shape, dtype in slot.layout}

  def check(self, slot: Slot) -> None:
    """RuntimeError unless the slot still holds the data of `slot` (not rewritten)."""
    seq = int(np.ndarray((1,), np.int64, buffer=self._segment(slot).buf)[0])
    if seq != slot.seq:
      raise RuntimeError(
          f"a worker process rewrote shared-memory slot {slot.name} (chunk {slot.seq}, now "
          f"{seq}) before it was read: more chunks were in flight than the ring has slots "
          "(a change in Grain's buffering?); use worker_processes=0, and please report it.")

  def read(self, slot: Slot) -> dict[str, np.ndarray]:
    views = self.views(slot)
    out = {k: np.array(v) for k, v in views.items()}
    del views
    self.check(slot)
    return out

  def close(self) -> None:
    for _, segment in self._segments.values():
      _close(segment)
    self._segments.clear()
    for name in self._names:
      _unlink_name(name)
