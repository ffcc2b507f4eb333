"""Tests for jlp.data.pipeline: samplers, per-process slices, resume, prefetching.

References: a transcription of CPD's DistributedGivenIterationSampler
(cpd.md §6.1: np.random.seed, tile, shuffle once, rank r's contiguous chunk),
set arithmetic over indices, and the single-process batch itself (for the
per-process and resume properties, which are equalities between two ways of
computing the same batch).
"""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jlp.data import ArrayDataset, CropFlip, Normalization, Pipeline, Prefetcher, Sampler


def _dataset(n=40, augment=True):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(n, 6, 6, 3), dtype=np.uint8)
  labels = np.arange(n) % 10
  crop_flip = CropFlip(crop=6, padding=2, flip=True) if augment else None
  return ArrayDataset("toy", "train", images, labels, 10,
                      Normalization((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), crop_flip)


def _equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_epoch_sampler_visits_every_example_once_per_epoch_and_reshuffles():
  s = Sampler(size=40, global_batch_size=8, seed=3)
  assert s.steps_per_epoch == 5
  epochs = [np.concatenate([s.indices(e * 5 + j)[0] for j in range(5)]) for e in range(3)]
  for order in epochs:
    np.testing.assert_array_equal(np.sort(order), np.arange(40))
  assert not np.array_equal(epochs[0], epochs[1])
  other_seed = Sampler(size=40, global_batch_size=8, seed=4)
  assert not np.array_equal(other_seed.indices(0)[0], s.indices(0)[0])


def test_fixed_and_sequential_samplers():
  fixed = Sampler(40, 8, seed=1, kind="fixed")
  np.testing.assert_array_equal(fixed.indices(2)[0], fixed.indices(7)[0])  # epochs 0 and 1
  seq = Sampler(40, 8, kind="sequential")
  np.testing.assert_array_equal(seq.indices(6)[0], np.arange(8, 16))


def test_drop_last_false_pads_the_last_batch_with_mask_false():
  s = Sampler(size=10, global_batch_size=4, kind="sequential", drop_last=False)
  assert s.steps_per_epoch == 3
  idx, mask = s.indices(2)
  np.testing.assert_array_equal(idx[:2], [8, 9])
  np.testing.assert_array_equal(mask, [True, True, False, False])
  assert Sampler(size=10, global_batch_size=4).steps_per_epoch == 2  # drop_last


def _cpd_given_iteration(dataset_len, total_iter, batch_size, world_size, rank, seed):
  """CPD's DistributedGivenIterationSampler.gen_new_list (per rank), transcribed."""
  np.random.seed(seed)
  total_size = total_iter * batch_size
  all_size = total_size * world_size
  indices = np.arange(dataset_len)
  indices = indices[:all_size]
  num_repeat = (all_size - 1) // indices.shape[0] + 1
  indices = np.tile(indices, num_repeat)
  indices = indices[:all_size]
  np.random.shuffle(indices)
  beg = total_size * rank
  return indices[beg:beg + total_size]


@pytest.mark.parametrize("world_size", [1, 4])
def test_once_sampler_matches_cpd_given_iteration_sampler(world_size):
  total_steps, per_rank, n = 7, 3, 17
  s = Sampler(size=n, global_batch_size=per_rank * world_size, seed=0, kind="once",
              total_steps=total_steps, world_size=world_size)
  ranks = [_cpd_given_iteration(n, total_steps, per_rank, world_size, r, 0)
           for r in range(world_size)]
  for step in range(total_steps):
    idx, mask = s.indices(step)
    assert mask.all()
    expect = np.concatenate([r[step * per_rank:(step + 1) * per_rank] for r in ranks])
    np.testing.assert_array_equal(idx, expect)
  with pytest.raises(ValueError, match="total_steps=7"):
    s.indices(7)


@pytest.mark.parametrize("sampler", ["epoch", "once"])
def test_process_slices_partition_the_global_batch(sampler):
  ds = _dataset()
  kw = dict(seed=5, sampler=sampler, total_steps=12 if sampler == "once" else None)
  whole = Pipeline(ds, 8, process_index=0, process_count=1, **kw)
  for step in (0, 3, 6):  # step 6 is in the second epoch
    parts = [Pipeline(ds, 8, process_index=p, process_count=4, **kw).batch(step)
             for p in range(4)]
    for p in parts:
      assert p["image"].shape == (2, 6, 6, 3)
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    _equal(joined, whole.batch(step))


def test_batches_are_augmented_and_depend_on_the_seed():
  ds = _dataset()
  a = Pipeline(ds, 8, seed=1, process_count=1, process_index=0)
  b = Pipeline(ds, 8, seed=2, process_count=1, process_index=0)
  _equal(a.batch(4), Pipeline(ds, 8, seed=1, process_count=1, process_index=0).batch(4))
  assert not np.array_equal(a.batch(4)["image"], b.batch(4)["image"])
  batch = a.batch(0)
  assert batch["image"].dtype == np.float32 and batch["label"].dtype == np.int32
  assert batch["mask"].all()
  np.testing.assert_array_equal(batch["label"], ds.labels[a.sampler.indices(0)[0]])


def test_start_at_step_equals_iterate_to_step():
  pipe = Pipeline(_dataset(), 8, seed=7, process_count=1, process_index=0)
  full = list(pipe.iterate(0, 12))
  resumed = list(Pipeline(_dataset(), 8, seed=7, process_count=1, process_index=0)
                 .iterate(9, 3))
  for a, b in zip(full[9:], resumed, strict=True):
    _equal(a, b)
  # Out of order calls give the same batches (no hidden iterator state).
  _equal(pipe.batch(3), full[3])
  _equal(pipe.batch(11), full[11])


def test_once_iteration_stops_at_total_steps():
  pipe = Pipeline(_dataset(), 8, sampler="once", total_steps=5, process_count=1,
                  process_index=0)
  assert len(list(pipe.iterate(2))) == 3
  assert pipe.steps_per_epoch == 5


def test_pipeline_argument_errors():
  ds = _dataset()
  with pytest.raises(ValueError, match="global_batch_size=6"):
    Pipeline(ds, 6, process_index=0, process_count=4)
  with pytest.raises(ValueError, match="process_index=4"):
    Pipeline(ds, 8, process_index=4, process_count=4)
  with pytest.raises(ValueError, match="kind='shuffle'"):
    Pipeline(ds, 8, sampler="shuffle")
  with pytest.raises(ValueError, match="total_steps=None"):
    Pipeline(ds, 8, sampler="once")
  with pytest.raises(ValueError, match="global_batch_size=64"):
    Pipeline(ds, 64)
  with pytest.raises(ValueError, match="step=-1"):
    Pipeline(ds, 8).batch(-1)


def test_default_process_index_and_count_come_from_jax():
  pipe = Pipeline(_dataset(), 8)
  assert (pipe.process_index, pipe.process_count) == (jax.process_index(), jax.process_count())


def test_prefetcher_yields_the_same_sequence_and_stops():
  pipe = Pipeline(_dataset(), 8, seed=2, process_count=1, process_index=0)
  expect = list(pipe.iterate(3, 6))
  with pipe.prefetch(3, 6, size=2) as batches:
    got = list(batches)
  assert len(got) == 6
  for a, b in zip(expect, got, strict=True):
    _equal(a, b)
  assert not batches.alive


def test_prefetcher_stops_cleanly_when_the_consumer_leaves_early():
  produced = []

  def endless():
    i = 0
    while True:
      produced.append(i)
      yield i
      i += 1

  with Prefetcher(endless(), size=2) as it:
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.2)  # the thread fills the queue and blocks
    assert it.alive
  assert not it.alive
  assert len(produced) <= 3 + 2 + 2  # bounded queue: never ran far ahead
  assert not any(t.name == "jlp-data-prefetch" for t in threading.enumerate())


def test_prefetcher_raises_the_source_error_in_the_consumer():
  def failing():
    yield 1
    raise RuntimeError("decode failed")

  it = Prefetcher(failing())
  assert next(it) == 1
  with pytest.raises(RuntimeError, match="decode failed"):
    next(it)
  with pytest.raises(StopIteration):
    next(it)
  assert not it.alive


def test_prefetcher_places_batches_with_a_sharding():
  devices = jax.devices()
  assert len(devices) == 8  # tests/conftest.py
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  pipe = Pipeline(_dataset(), 16, seed=1, process_count=1, process_index=0)
  with pipe.prefetch(0, 2, sharding=sharding) as batches:
    placed = list(batches)
  for step, batch in enumerate(placed):
    assert isinstance(batch["image"], jax.Array)
    assert batch["image"].sharding == sharding
    assert len(batch["image"].addressable_shards) == 8
    _equal({k: np.asarray(v) for k, v in batch.items()}, pipe.batch(step))
