"""One process of tests/train/multiprocess_test.py, and the computations both sides run.

    python multiprocess_driver.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

joins the process group on 127.0.0.1:PORT (jlp.train.initialize, gloo), runs `all_cases` on the
global mesh with this process's share of the data, and writes the results (replicated, so every
process holds all of them) to OUT_DIR/process_<id>.npz. The test runs `all_cases` in its own
8-device process and compares. Here the compressed train run also checkpoints its state after
STEPS steps (the per-device compression state sharded over both processes) to OUT_DIR/ckpt,
restores it into a fresh state and takes one more step; the test's run does not checkpoint.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

GLOBAL_DEVICES = 8
BATCH = 32  # global train batch: 4 rows per device, 2 nodes of 2 rows each
STEPS = 2
ALLREDUCE_CASES = {
    "fp32_sequential": dict(fmt=None, algorithm="sequential"),
    "e4m3_ring_kahan_aps": dict(fmt="e4m3", algorithm="ring", kahan=True, aps=True),
    "e5m2_sequential_apscpd": dict(fmt="e5m2", algorithm="sequential", aps="cpd"),
}
# Compressed syncs (jlp.compression.sync_with_bytes in a shard_map), two calls each with the
# per-device state carried: name -> (compressor name, its fields, topology, SeCoPa plan). Leaves of
# more than SYNC_MIN_SIZE elements are compressed ('a', 'b') in K = W partitions unless the plan
# says otherwise: 'a' in K = 3 < W; DGC_PLAN also sends 'b' by the float32 ring all-reduce (DGC
# compiles slowly). The keyed compressors draw from fold_in(key(SYNC_SEED), call). CaSync-Ring with error
# feedback state (onebit) and keyed (stochastic TernGrad), CaSync-PS keyed, sparse, with DGC's
# stateless server; the PS with state and K = W is the compressed train step's.
SYNC_SHAPES = {"a": (3, 37), "b": (64,), "c": (5,)}
SYNC_MIN_SIZE = 40
SYNC_PLAN = {"['a']": (True, 3)}
DGC_PLAN = {"['a']": (True, 3), "['b']": (False, 8)}
SYNC_SEED = 11
SYNC_CASES = {
    "onebit_ring_k3": ("onebit", {}, "ring", SYNC_PLAN),
    "terngrad_stochastic_ring_k3": ("terngrad", dict(stochastic=True), "ring", SYNC_PLAN),
    "dgc_ps_k3": ("dgc", dict(density=0.1, sample_rate=0.25), "ps", DGC_PLAN),
}


def psum_leaves(case: str) -> list[str]:
  """The leaves SYNC_CASES[case] sends uncompressed (by sync's float32 ring all-reduce)."""
  plan = SYNC_CASES[case][3]
  return [name for name, shape in SYNC_SHAPES.items()
          if not plan.get(f"['{name}']", (int(np.prod(shape)) > SYNC_MIN_SIZE,))[0]]


def global_data():
  """Per-device gradients (rows = devices) and the global train batch, the same everywhere."""
  rng = np.random.default_rng(7)
  grads = (rng.standard_normal((GLOBAL_DEVICES, 3, 37)) * 0.01).astype(np.float32)
  batch = {"image": rng.standard_normal((BATCH, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, BATCH).astype(np.int32)}
  return grads, batch


def sync_data():
  """Per-device gradient trees (leaves stacked on [GLOBAL_DEVICES]) for the compressed syncs, two
  calls' worth: [call 0, call 1]."""
  rng = np.random.default_rng(8)
  return [{name: rng.standard_normal((GLOBAL_DEVICES,) + shape).astype(np.float32)
           for name, shape in SYNC_SHAPES.items()} for _ in range(2)]


def _part(x: np.ndarray, part: int, parts: int) -> np.ndarray:
  share = len(x) // parts
  return x[part * share:(part + 1) * share]


def _wire_bytes(report):
  """The wire bytes of `sync_with_bytes`'s third output: a float32 scalar, or a report dict."""
  return report["wire_bytes"] if isinstance(report, dict) else report


def compressed_syncs(mesh, part: int, parts: int) -> dict[str, np.ndarray]:
  """SYNC_CASES: every call's sums, wire bytes and the new per-device state (all rows)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import jlp.compression as jc  # pylint: disable=g-import-not-at-top
  import jlp.train  # pylint: disable=g-import-not-at-top

  calls = sync_data()
  out = {}
  for name, (codec, fields, topology, plan) in SYNC_CASES.items():
    compressor = jc.get(codec, **fields)
    options = dict(topology=topology, min_size=SYNC_MIN_SIZE, plan=plan)
    one = jc.init_state(jax.tree.map(lambda x: x[0], calls[0]), compressor, GLOBAL_DEVICES,
                        **options)
    stacked = jax.tree.map(
        lambda a: _part(np.broadcast_to(np.asarray(a), (GLOBAL_DEVICES,) + a.shape), part, parts),
        one)
    state = jlp.train.shard_batch(stacked, mesh) if jax.tree.leaves(stacked) else stacked

    def body(grads, state, call, compressor=compressor, options=options):
      grads, state = jax.tree.map(lambda x: x[0], (grads, state))
      key = None
      if compressor.needs_key:
        key = jax.random.fold_in(jax.random.key(SYNC_SEED), call)
      total, state, report = jc.sync_with_bytes(grads, "data", compressor, state, key=key,
                                                **options)
      state = jax.tree.map(lambda x: x[None], state)
      # Every device's new state, gathered: each process then holds (and writes) all rows.
      return total, state, lax.all_gather(state, "data", tiled=True), _wire_bytes(report)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                              out_specs=(P(), P("data"), P(), P()), check_vma=False))
    for i, grads in enumerate(calls):
      local = jax.tree.map(lambda x: _part(x, part, parts), grads)
      total, state, rows, wire = f(jlp.train.shard_batch(local, mesh), state,
                                   jlp.train.replicate(np.int32(i), mesh))
      prefix = f"sync/{name}/{i}/"
      out[prefix + "wire_bytes"] = np.asarray(wire.addressable_data(0))
      for path, leaf in jax.tree_util.tree_flatten_with_path((total, rows))[0]:
        what = ("sum", "state")[path[0].idx]
        out[prefix + what + jax.tree_util.keystr(path[1:])] = np.asarray(leaf.addressable_data(0))
  return out


def all_cases(part: int = 0, parts: int = 1, checkpoint_dir: str | None = None
              ) -> dict[str, np.ndarray]:
  """Every result, on the global ('data',) mesh, from this process's part of the data (the
  data's rows cut into `parts` equal consecutive parts, in process order). With
  `checkpoint_dir`, the compressed train run goes through a checkpoint before its last step."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import jlp.collectives  # pylint: disable=g-import-not-at-top
  import jlp.train  # pylint: disable=g-import-not-at-top
  import tiny_models  # pylint: disable=g-import-not-at-top

  mesh = jlp.train.data_mesh()
  grads, batch = global_data()
  g = jlp.train.shard_batch(_part(grads, part, parts), mesh)
  out = {}
  for name, opts in ALLREDUCE_CASES.items():
    f = jax.jit(jax.shard_map(lambda x, o=opts: jlp.collectives.allreduce(x[0], "data", **o),
                              mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False))
    out["allreduce/" + name] = np.asarray(f(g).addressable_data(0))

  model = tiny_models.build("small_cnn", dict(width=4))  # numpy-filled: no eager init compiles
  optimizer = jlp.train.torch_sgd(0.1, momentum=0.9, weight_decay=1e-3,
                                  decay_mask=jlp.train.decay_mask(jlp.train.is_bn_or_bias))
  graphdef, state = jlp.train.init_train_state(model, optimizer, mesh)
  step = jlp.train.TrainStep(graphdef, optimizer, mesh,
                             jlp.train.GradSync(fmt="e4m3", aps=True, emulate_nodes=2))
  local_batch = jax.tree.map(lambda x: _part(x, part, parts), batch)
  for i in range(STEPS):
    state, metrics = step(state, jlp.train.shard_batch(local_batch, mesh))
    out[f"train/loss{i}"] = np.asarray(metrics["loss"].addressable_data(0))
  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  for path, leaf in flat:
    out["train/state" + jax.tree_util.keystr(path)] = np.asarray(leaf.addressable_data(0))

  # A compressed sync (onebit, CaSync-PS): the per-device error-feedback state lives on the
  # devices of every process (sharded over 'data'); the second step's update depends on it.
  sync = jlp.train.GradSync(compression="onebit", min_size=0)
  graphdef, state = jlp.train.init_train_state(tiny_models.build("small_cnn", dict(width=4)),
                                               optimizer, mesh, sync)
  step = jlp.train.TrainStep(graphdef, optimizer, mesh, sync)

  def record(i, metrics):  # every metric (the loss, the sync's wire bytes or report)
    for path, leaf in jax.tree_util.tree_flatten_with_path(metrics)[0]:
      out[f"compressed/metrics{i}" + jax.tree_util.keystr(path)] = np.asarray(
          leaf.addressable_data(0))

  for i in range(STEPS):
    state, metrics = step(state, jlp.train.shard_batch(local_batch, mesh))
    record(i, metrics)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    out["compressed/params" + jax.tree_util.keystr(path)] = np.asarray(leaf.addressable_data(0))

  # One more step, in the two-process run from a checkpoint: the state (the residuals sharded
  # over the processes' devices) saved by both processes, restored into a fresh state.
  if checkpoint_dir is not None:
    from jlp.train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
    checkpoints = Checkpointer(checkpoint_dir)
    checkpoints.save(STEPS, state, {"step": STEPS})
    checkpoints.wait()
    _, fresh = jlp.train.init_train_state(tiny_models.build("small_cnn", dict(width=4)),
                                          optimizer, mesh, sync)
    state, meta = checkpoints.restore(STEPS, fresh)
    checkpoints.close()
    assert meta == {"step": STEPS}, meta
  state, metrics = step(state, jlp.train.shard_batch(local_batch, mesh))
  record(STEPS, metrics)
  everything = jax.jit(lambda x: x, out_shardings=jlp.train.replicated(mesh))  # all rows here
  for name, tree in (("params", state.params), ("sync_state", everything(state.sync_state))):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      out[f"resumed/{name}" + jax.tree_util.keystr(path)] = np.asarray(leaf.addressable_data(0))

  out.update(compressed_syncs(mesh, part, parts))
  return out


def main(argv):
  process_id, num_processes, port, out_dir = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
  import jlp.train  # pylint: disable=g-import-not-at-top
  info = jlp.train.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                              initialization_timeout=60)
  assert info["global_devices"] == GLOBAL_DEVICES, info
  out = all_cases(process_id, num_processes, checkpoint_dir=os.path.join(out_dir, "ckpt"))
  np.savez(os.path.join(out_dir, f"process_{process_id}.npz"), **out)


if __name__ == "__main__":
  main(sys.argv)
