"""Tests for jlp.data.Pipeline with worker processes (Grain's mp_prefetch).

References: Pipeline.batch(step) in the calling process (the batches with
workers must equal it bit for bit), the DataFileError that decode_rgb raises for
the same file in the calling process, and multiprocessing's list of live child
processes. Worker start-up (a spawned interpreter importing jlp) takes seconds, so
only two tests start workers.
"""

import multiprocessing
import os

import numpy as np
import pytest
from PIL import Image

from jlp.data import ArrayDataset, Normalization, Pipeline, get_dataset, pipeline, shared_ring
from jlp.data.dataset import DataFileError


def write_imagenet(root, per_class=(3, 2, 2)):
  """Tiny JPEGs of a few sizes in class folders (train/ and an empty val/ class)."""
  rng = np.random.default_rng(0)
  for c, count in enumerate(per_class):
    os.makedirs(os.path.join(root, "train", f"n{c:02d}"))
    os.makedirs(os.path.join(root, "val", f"n{c:02d}"))
    for k in range(count):
      h, w = ((12, 16), (16, 12), (10, 10))[(c + k) % 3]
      Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
          os.path.join(root, "train", f"n{c:02d}", f"{k}.JPEG"), quality=90)


def _workers_alive():
  return [p for p in multiprocessing.active_children() if p.name.startswith("grain-")]


def _equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    assert type(a[k]) is np.ndarray, (k, type(a[k]))
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_worker_batches_are_batch_of_each_step_and_close_stops_the_workers(tmp_path,
                                                                           monkeypatch):
  write_imagenet(tmp_path)
  ds = get_dataset("imagenet", root=tmp_path, split="train", crop_size=5, resize_size=6)
  # Process 1 of 2 loads 3 rows a step, in chunks of one row over 2 workers (each worker
  # takes every other chunk: rows 0 and 2 of one step, row 1 of the next); 7 images at
  # batch 6: one step per epoch, so the steps cross epochs (a new permutation each).
  monkeypatch.setattr(pipeline, "MAX_CHUNK_ROWS", 1)
  kw = dict(seed=4, process_index=1, process_count=2)
  pipe = Pipeline(ds, 6, worker_processes=2, **kw)
  reference = Pipeline(ds, 6, **kw)
  with pipe.prefetch(2, 4, size=1) as batches:
    got = list(batches)
  assert len(got) == 4
  for step, batch in zip(range(2, 6), got, strict=True):
    _equal(batch, reference.batch(step))
  assert not _workers_alive()
  # Leaving early (chunks of 2 and 1 rows now): the workers stop with the iterator.
  monkeypatch.setattr(pipeline, "MAX_CHUNK_ROWS", 64)
  iterator = pipe.iterate(7)
  _equal(next(iterator), reference.batch(7))
  assert _workers_alive()
  iterator.close()
  assert not _workers_alive()


def test_an_error_in_a_worker_reaches_the_consumer_with_its_type_and_message(tmp_path):
  write_imagenet(tmp_path)
  ds = get_dataset("imagenet", root=tmp_path, split="train", crop_size=5, resize_size=6)
  pipe = Pipeline(ds, 4, seed=3, process_index=0, process_count=1, worker_processes=2)
  steps = [pipe.sampler.indices(s)[0] for s in range(4)]
  bad = next(s for s in range(4) if 3 in steps[s])
  with open(ds.paths[3], "r+b") as f:
    f.truncate(os.path.getsize(ds.paths[3]) // 2)
  with pytest.raises(DataFileError) as expected:
    ds.get(np.array([3]), {k: v[:1] for k, v in ds.draw(np.random.default_rng(0), 1).items()})
  got = []
  with pytest.raises(DataFileError) as raised:
    with pipe.prefetch(0, 4) as batches:
      for batch in batches:
        got.append(batch)
  assert str(raised.value) == str(expected.value)
  assert raised.value.path == ds.paths[3]
  assert len(got) == bad  # the batches before the bad one came through
  assert not _workers_alive()


def test_datasets_in_memory_never_start_workers():
  ds = ArrayDataset("toy", "train", np.zeros((8, 2, 2, 3), np.uint8), np.arange(8), 8,
                    Normalization((0.5,) * 3, (0.5,) * 3))
  pipe = Pipeline(ds, 4, process_index=0, process_count=1, worker_processes=4)
  assert pipe.worker_processes == 0
  assert len(list(pipe.iterate(0, 3))) == 3
  assert not _workers_alive()


def test_worker_options_are_checked():
  ds = ArrayDataset("toy", "train", np.zeros((8, 2, 2, 3), np.uint8), np.arange(8), 8,
                    Normalization((0.5,) * 3, (0.5,) * 3))
  with pytest.raises(ValueError, match="worker_processes=-1"):
    Pipeline(ds, 4, worker_processes=-1)
  with pytest.raises(ValueError, match="worker_processes=True"):
    Pipeline(ds, 4, worker_processes=True)
  with pytest.raises(ValueError, match="worker_buffer=0"):
    Pipeline(ds, 4, worker_buffer=0)


def test_shared_ring_slots_are_reused_and_a_rewritten_slot_is_an_error():
  prefix = shared_ring.new_prefix()
  writer = shared_ring.RingWriter(prefix, 0, slots=2)
  reader = shared_ring.RingReader(prefix, 1, 2)
  arrays = [{"image": np.full((2, 3), i, np.float32), "label": np.arange(i, i + 2)}
            for i in range(3)]
  slots = [writer.put(i + 1, a) for i, a in enumerate(arrays[:2])]
  for slot, a in zip(slots, arrays[:2], strict=True):
    _equal(reader.read(slot), a)
  third = writer.put(3, arrays[2])
  assert third.name == slots[0].name  # the first slot, reused
  _equal(reader.read(third), arrays[2])
  with pytest.raises(RuntimeError, match="rewrote shared-memory slot"):
    reader.read(slots[0])  # its data were replaced by the third put
  bigger = {"image": np.ones((50, 3), np.float32)}
  fourth = writer.put(4, bigger)  # slot 1 grows: a new segment under the same name
  assert (fourth.name, fourth.generation) == (slots[1].name, slots[1].generation + 1)
  _equal(reader.read(fourth), bigger)
  reader.close()
  assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
