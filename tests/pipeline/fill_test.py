"""jlp.pipeline.fill through `Pipeline`: a run is a function of (state, inputs, settings), a model
changes only between fills, and every update and average counts once.

The reference is a linear probe, not the code under test: every stage is x + p_s trained with
sgd(1) on a loss whose gradient with respect to p_s is minus the one-hot code of the chunk
(one pipeline's rows of one mini-batch), whatever the weights. So after a flush, the sum over
the pipelines of p_s counts how often each chunk was applied at stage s: averaging models in
groups keeps that sum (a group's mean replaces its members), so with syncs none, allreduce,
preduce and adpsgd every chunk must count exactly once at every stage.
"""

import pickle

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jlp.pipeline import Hetero, Pipeline, pipeline_mesh
from jlp.pipeline.fill import (FillCache, FillModel, drain_nodes, encode_snapshot,
                               snapshot_capacity)

N, S, ROWS = 2, 2, 2
CODES = 64  # room for 32 mini-batches of N chunks
SLOW = Hetero(slowdown=((1.0,) * S, (2.0,) * S))
STALLS = Hetero(delay_s=0.05, probability=0.3)


def _stage(p, x):
  return x + p["p"]


def _loss(y, target):
  return -jnp.mean(jnp.sum(y * target, -1))


def _batches(first, count):
  """Mini-batches first, ..., first + count - 1: chunk (b, i) has code b * N + i."""
  xs = np.zeros((count, N * ROWS, CODES), np.float32)
  ys = np.zeros((count, N * ROWS, CODES), np.float32)
  for b in range(count):
    for i in range(N):
      ys[b, i * ROWS:(i + 1) * ROWS, (first + b) * N + i] = 1
  return xs, ys


def _pipe(schedule="1f1b", sync="none", **kw):
  return Pipeline([_stage] * S, _loss, optax.sgd(1.0), pipeline_mesh(N, S), schedule=schedule,
                  sync=sync, **kw)


def _init(pipe):
  return pipe.init([{"p": np.zeros((CODES,), np.float32)}] * S)


def _applied(pipe, state, fed):
  """[S, fed * N]: how often each chunk was applied at each stage, summed over pipelines."""
  return np.stack([p["p"].sum(0) for p in pipe.stage_params(state)])[:, :fed * N]


def _leaves(pipe, state):
  return [pipe.stage_params(state), pipe.stage_state(state), pipe.virtual_clocks(state)]


def _assert_same(a, b):
  for x, y in zip(np.concatenate([np.ravel(v) for v in _flat(a)]),
                  np.concatenate([np.ravel(v) for v in _flat(b)]), strict=True):
    assert x.tobytes() == y.tobytes()


def _flat(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(v) for v in jax.tree.leaves(tree)]


@pytest.mark.parametrize("sync", ["none", "preduce"])
def test_a_run_again_from_an_earlier_state_does_what_it_did(sync):
  """s2 = run(s1, xs); the same call again from s1 (a retry, a notebook cell run twice) computes
  s2 bit for bit, and its flush applies every chunk once at every stage."""
  # Runs of 3 mini-batches: the other tests' run programs (compiled once).
  pipe = _pipe(sync=sync, hetero=SLOW)
  s1, _ = pipe.run(_init(pipe), *_batches(0, 3))
  s2, m2 = pipe.run(s1, *_batches(3, 3))
  again, m2b = pipe.run(s1, *_batches(3, 3))
  assert m2b["ticks"] == m2["ticks"] > 0
  np.testing.assert_array_equal(m2b["updates"], m2["updates"])
  np.testing.assert_array_equal(m2b["loss"], m2["loss"])
  _assert_same(_leaves(pipe, again), _leaves(pipe, s2))
  drained, _ = pipe.flush(again)
  np.testing.assert_allclose(_applied(pipe, drained, 6), 1.0, atol=1e-6)
  # The state the retry left behind continues as the first one would.
  s3, _ = pipe.run(s2, *_batches(6, 3))
  s3b, _ = pipe.run(again, *_batches(6, 3))
  _assert_same(_leaves(pipe, s3b), _leaves(pipe, s3))


def test_another_model_in_the_middle_of_a_fill_is_refused():
  """1F1B: a run under another cost model (or seed, through a new Pipeline restoring the state)
  while mini-batches are in flight is refused before anything runs; the flush drains under the
  fill's own model, after which the new model starts a fill of its own."""
  pipe = _pipe(sync="preduce", hetero=SLOW)
  state, _ = pipe.run(_init(pipe), *_batches(0, 3))
  with pytest.raises(ValueError, match=r"run with another hetero is not allowed in the middle "
                                       r"of a fill.*`flush\(state\)` first"):
    pipe.run(state, *_batches(3, 3), hetero=Hetero())
  reseeded = _pipe(sync="preduce", hetero=SLOW, seed=5)
  reseeded.init([{"p": np.zeros((CODES,), np.float32)}] * S)
  with pytest.raises(ValueError, match="another seed is not allowed in the middle of a fill"):
    reseeded.run(state, *_batches(3, 3))
  # Draining under the fill's model: the same bits from either Pipeline.
  drained, _ = pipe.flush(state)
  drained_too, _ = reseeded.flush(state)
  _assert_same(_leaves(pipe, drained_too), _leaves(pipe, drained))
  state, _ = pipe.run(drained, *_batches(3, 3), hetero=Hetero())
  state, _ = pipe.flush(state, hetero=Hetero())
  np.testing.assert_allclose(_applied(pipe, state, 6), 1.0, atol=1e-6)
  assert pipe.fill_model(state) is None  # an empty pipeline: the next run starts a fill


def test_gpipe_starts_a_new_fill_under_a_new_model():
  """GPipe holds nothing in flight between runs: another cost model applies from the next
  mini-batch on, and the virtual clocks go on from where they stood."""
  pipe = _pipe(schedule="gpipe", sync="preduce", hetero=SLOW)
  state, first = pipe.run(_init(pipe), *_batches(0, 4))
  state, second = pipe.run(state, *_batches(4, 4), hetero=Hetero())
  assert second["virtual_time"].min() > first["virtual_time"].max()
  np.testing.assert_allclose(np.diff(second["virtual_time"]),
                             np.diff(second["virtual_time"])[0], rtol=1e-9)  # equal speeds
  np.testing.assert_allclose(_applied(pipe, state, 8), 1.0, atol=1e-6)


@pytest.mark.parametrize("sync", ["none", "allreduce", "preduce", "adpsgd"])
def test_every_chunk_counts_once_through_retries_and_flushes(sync):
  """Under stalls, for several seeds: runs of 3 and 3 with a retry of the second, then the flush,
  then a second fill of 3 with another cost model: every chunk applied exactly once at every stage
  (the sum over pipelines of the probe's weights)."""
  for seed in (42, 48):
    pipe = _pipe(sync=sync, hetero=STALLS, seed=seed)
    s1, _ = pipe.run(_init(pipe), *_batches(0, 3))
    pipe.run(s1, *_batches(3, 3))
    state, _ = pipe.run(s1, *_batches(3, 3))
    state, _ = pipe.flush(state)
    state, _ = pipe.run(state, *_batches(6, 3), hetero=SLOW)
    state, _ = pipe.flush(state, hetero=SLOW)
    np.testing.assert_allclose(_applied(pipe, state, 9), 1.0, atol=1e-5,
                               err_msg=f"seed={seed}")


@pytest.mark.parametrize("sync", ["none", "allreduce"])
def test_idle_fraction_is_the_idle_share_of_virtual_time(sync):
  """Pipeline 1 twice as slow, no stalls: the devices' busy time is known from the cost model
  (every op of pipeline i at stage s lasts fwd_s or bwd_s times its slowdown), so the idle share
  over the run and the flush is 1 - busy / (N * S * the virtual time trained)."""
  pipe = _pipe(sync=sync, hetero=SLOW)
  state, run = pipe.run(_init(pipe), *_batches(0, 12))
  state, drain = pipe.flush(state)
  updates = run["updates"] + drain["updates"]
  np.testing.assert_array_equal(updates, [12, 12] if sync == "allreduce" else updates)
  slow = np.asarray(SLOW.slowdown)
  busy = sum(updates[i] * (SLOW.fwd_s + SLOW.bwd_s) * slow[i].sum() for i in range(N))
  span = run["virtual_span"] + drain["virtual_span"]
  assert span == pytest.approx(pipe.virtual_seconds(state))
  joined = (run["idle_fraction"] * run["virtual_span"]
            + drain["idle_fraction"] * drain["virtual_span"]) / span
  assert joined == pytest.approx(1 - busy / (N * S * span), rel=1e-9)
  if sync == "allreduce":  # the fast pipeline waits for the slow one at every update
    assert joined > 0.2
  else:  # each pipeline by its own clock: busy but for the fill and the drain
    assert joined < 0.15


# Cases whose flush forms some groups otherwise, or earlier, than the never-ending timeline of the
# fill did (found by searching seeds): preduce's seed 48 and adpsgd's seed 42 are the review's.
@pytest.mark.parametrize("sync, num_pipelines, num_stages, seed",
                         [("preduce", 2, 4, 48), ("preduce", 4, 2, 12), ("adpsgd", 2, 4, 42),
                          ("adpsgd", 4, 2, 58)])
def test_a_flush_averages_every_update_once(sync, num_pipelines, num_stages, seed):
  """Host side only: the fill cut into runs of 3 and 3 mini-batches, then the flush's drain.
  Every (pipeline, stage, update) is a member of at most one average across the runs and the
  drain, and every member update of a group the drain's timeline formed is in one of them."""
  from jlp.pipeline import HetPipe, PReduce  # pylint: disable=g-import-not-at-top
  n, s = num_pipelines, num_stages
  model = FillModel(sync, STALLS, PReduce(), HetPipe(), seed, False)
  fill = FillCache().fill(model, "1f1b", n, s, fill_start=0, clock=np.zeros((n, s)),
                          fed_start=[0] * n, position=0)
  ran = []
  for fed in (3 * n, 6 * n):
    placement = fill.placement
    nodes = placement.take(placement.chunk_cut(fed), fed)
    ran += nodes
    fill.end_run(nodes, [0] * n)
  drain, drained, override = fill.drain()
  groups = dict((node, group) for group, node in drain.groups)
  groups.update(override)
  members = lambda node: dict(zip(node[2], node[3], strict=True))
  before = [(i, node[1], m) for node in ran if node[0] == "mix" for i, m in members(node).items()]
  after = [(i, node[1], members(node)[i]) for node in drained if node[0] == "mix"
           for i in groups[node].members]
  assert len(before + after) == len(set(before + after))
  formed = {(i, node[1], m) for _, node in drain.groups for i, m in members(node).items()}
  assert formed <= set(before) | set(after)
  assert not set(drained) & set(ran)  # nothing a run ran runs again


# -- host side: pruning, start points, snapshots (no devices) -------------------------------------
def _reference_runs(model, n, s, runs):
  """The fill as the executor ran it before pruning and start points: one never-pruned
  placement cut into `runs` (mini-batches each), then the flush replayed from the fill's start
  with its end (`Timeline(total=...)`), less what the runs took. Returns each run's nodes with
  their local ticks, and the drain's."""
  from jlp.pipeline.timeline import Timeline  # pylint: disable=g-import-not-at-top
  from jlp.pipeline.placement import Placement  # pylint: disable=g-import-not-at-top

  def placement(total=None):
    seed = int(np.random.SeedSequence([model.seed, 0]).generate_state(1)[0])
    timeline = Timeline("1f1b", model.sync, n, s, 1, seed=seed, hetero=model.hetero,
                        preduce=model.preduce, hetpipe=model.hetpipe, first_batch=0,
                        start=np.zeros((n, s)), total=total, log=True)
    return Placement(timeline, aligned=model.sync == "allreduce")

  endless, out, taken, fed = placement(), [], set(), 0
  for count in runs:
    fed += count * n
    nodes = endless.take(endless.chunk_cut(fed), fed)
    out.append((nodes, endless.local_ticks(nodes)))
    taken |= set(nodes)
  replay = placement(total=endless.taken_counts)
  replay.finish()
  nodes, override = drain_nodes(replay, taken)
  return out, (nodes, replay.local_ticks(nodes), override)


def _fill_runs(model, n, s, runs, snapshot_every=0):
  """The same through `Fill` (pruned after every run; with snapshot_every, restored from its
  encoded snapshot every that many runs)."""
  cache = FillCache()
  kw = dict(fill_start=0, clock=np.zeros((n, s)), fed_start=[0] * n)
  fill, out, fed = cache.fill(model, "1f1b", n, s, position=0, **kw), [], 0
  for r, count in enumerate(runs):
    fed += count * n
    placement = fill.placement
    nodes = placement.take(placement.chunk_cut(fed), fed)
    out.append((nodes, placement.local_ticks(nodes)))
    fill.end_run(nodes, [c - s - 1 for c in placement.taken_counts])
    if snapshot_every and (r + 1) % snapshot_every == 0:
      data = encode_snapshot(fill, snapshot_capacity(n, s))
      cache.clear()
      fill = cache.fill(model, "1f1b", n, s, position=fed, snapshot=data, **kw)
  placement, nodes, override = fill.drain()
  return out, (nodes, placement.local_ticks(nodes), override)


UNEVEN = Hetero(slowdown=((1.0,) * 2, (2.0,) * 2, (1.3,) * 2, (1.0,) * 2), delay_s=0.03)
MODELS = [("none", STALLS, False), ("allreduce", STALLS, False), ("preduce", STALLS, False),
          ("adpsgd", STALLS, False), ("hetpipe", STALLS, False), ("preduce", UNEVEN, False),
          ("hetpipe", UNEVEN, False), ("hetpipe", UNEVEN, True)]


@pytest.mark.parametrize("sync, hetero, barrier", MODELS)
def test_a_pruned_fill_runs_and_drains_as_the_whole_one(sync, hetero, barrier):
  """4 pipelines x 2 stages, HetPipe pulling every 3rd mini-batch (with and without its wave
  barrier), runs of 1 to 5 mini-batches (3 seeds): every run takes the same nodes at the same
  ticks as the never-pruned placement, and the flush from the kept start point drains exactly
  what the fill replayed from its start with its end drains (nodes, ticks, restricted groups);
  also through snapshots."""
  from jlp.pipeline import HetPipe, PReduce  # pylint: disable=g-import-not-at-top
  for seed, runs in ((3, (1, 2, 5, 1, 1, 3, 4)), (48, (3, 3, 2, 5)), (7, (5, 1, 1, 1, 4, 2))):
    model = FillModel(sync, hetero, PReduce(), HetPipe(pull_every=3, barrier=barrier), seed,
                      False)
    expected = _reference_runs(model, 4, 2, runs)
    assert _fill_runs(model, 4, 2, runs) == expected, seed
    assert _fill_runs(model, 4, 2, runs, snapshot_every=2) == expected, seed


@pytest.mark.parametrize("sync", ["preduce", "hetpipe"])
def test_a_long_fill_keeps_flat_host_memory(sync):
  """The pickled fill (what the host keeps and a checkpoint holds) does not grow with the fill's
  length, although the fast pipeline runs ever further ahead of one twice as slow: its largest
  size over runs 41-50 is within 1.25x of that over runs 11-20 (4 mini-batches a run)."""
  from jlp.pipeline import HetPipe, PReduce  # pylint: disable=g-import-not-at-top
  hetero = Hetero(delay_s=0.03, probability=0.2, slowdown=((1.0,) * 2, (2.0,) * 2))
  model = FillModel(sync, hetero, PReduce(), HetPipe(pull_every=3), 1, False)
  fill = FillCache().fill(model, "1f1b", 2, 2, fill_start=0, clock=np.zeros((2, 2)),
                          fed_start=[0, 0], position=0)
  sizes = {}
  for r in range(1, 51):
    placement = fill.placement
    nodes = placement.take(placement.chunk_cut(r * 4 * 2), r * 4 * 2)
    fill.end_run(nodes, [c - 3 for c in placement.taken_counts])
    sizes[r] = len(pickle.dumps(fill))
  early, late = max(sizes[r] for r in range(11, 21)), max(sizes[r] for r in range(41, 51))
  assert late < 1.25 * early, (early, late)
  assert abs(placement.taken_counts[0] - placement.taken_counts[1]) > 60  # far apart


def test_a_snapshot_loads_only_what_a_fill_is_made_of():
  """A checkpoint's snapshot that names another callable is refused while loading; one too large
  for the state's buffer is left out (a restore then replays the fill), with a warning."""
  import os  # pylint: disable=g-import-not-at-top
  import zlib  # pylint: disable=g-import-not-at-top
  from jlp.pipeline.fill import decode_snapshot  # pylint: disable=g-import-not-at-top

  class Evil:
    def __reduce__(self):
      return (os.getcwd, ())
  data = zlib.compress(pickle.dumps(Evil()))
  raw = np.zeros((8 + len(data),), np.uint8)
  raw[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
  raw[8:] = np.frombuffer(data, np.uint8)
  with pytest.raises(pickle.UnpicklingError, match="may not load posix.getcwd"):
    decode_snapshot(raw)
  fill = FillCache().fill(FillModel("none", STALLS, *_knobs(), 0, False), "1f1b", 2, 2,
                          fill_start=0, clock=np.zeros((2, 2)), fed_start=[0, 0], position=0)
  with pytest.warns(UserWarning, match="a restore will replay the fill"):
    small = encode_snapshot(fill, 64)
  assert decode_snapshot(small) is None and decode_snapshot(
      encode_snapshot(fill, snapshot_capacity(2, 2))).key == fill.key


def _knobs():
  from jlp.pipeline import HetPipe, PReduce  # pylint: disable=g-import-not-at-top
  return PReduce(), HetPipe()


def test_hetpipe_waves_wait_only_for_the_pipelines_that_reach_them():
  """HetPipe's wave barrier, a pipeline twice as slow, 7 chunks (4 and 3 mini-batches): the
  flush's wave at the 4th mini-batch closes without the pipeline that has only 3, and the next
  fill, whose pipelines start at counts 4 and 3, does not wait at the wave the first already
  made (both ran out of events before)."""
  from jlp.pipeline import HetPipe, PReduce  # pylint: disable=g-import-not-at-top
  model = FillModel("hetpipe", Hetero(slowdown=((1.0,) * 2, (2.0,) * 2)), PReduce(),
                    HetPipe(pull_every=2, barrier=True), 1, False)
  kw = dict(clock=np.zeros((2, 2)), position=0)
  fill = FillCache().fill(model, "1f1b", 2, 2, fill_start=0, fed_start=[0, 0], **kw)
  placement = fill.placement
  fill.end_run(placement.take(placement.chunk_cut(7), 7), [0, 0])
  assert placement.taken_counts == [4, 3]
  drain, nodes, _ = fill.drain()
  assert {("pull", 0, s, 3) for s in range(2)} <= set(nodes)  # pipeline 0's 2nd pull
  assert drain.timeline.wave_members(2) == [0]
  after = FillCache().fill(model, "1f1b", 2, 2, fill_start=1, fed_start=[4, 3], **kw)
  assert after.placement.timeline.wave_members(2) == [1]  # pipeline 0 made it already
  after.placement.take(after.placement.chunk_cut(12), 12)
  assert after.placement.taken_counts[1] >= 3
