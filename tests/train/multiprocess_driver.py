"""One process of tests/train/multiprocess_test.py, and the computations both sides run.

    python multiprocess_driver.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

joins the process group on 127.0.0.1:PORT (jlp.train.initialize, gloo), runs `all_cases` on the
global mesh with this process's share of the data, and writes the results (replicated, so every
process holds all of them) to OUT_DIR/process_<id>.npz. The test runs `all_cases` in its own
8-device process and compares.
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


def global_data():
  """Per-device gradients (rows = devices) and the global train batch, the same everywhere."""
  rng = np.random.default_rng(7)
  grads = (rng.standard_normal((GLOBAL_DEVICES, 3, 37)) * 0.01).astype(np.float32)
  batch = {"image": rng.standard_normal((BATCH, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, BATCH).astype(np.int32)}
  return grads, batch


def _part(x: np.ndarray, part: int, parts: int) -> np.ndarray:
  share = len(x) // parts
  return x[part * share:(part + 1) * share]


def all_cases(part: int = 0, parts: int = 1) -> dict[str, np.ndarray]:
  """Every result, on the global ('data',) mesh, from this process's part of the data (the
  data's rows cut into `parts` equal consecutive parts, in process order)."""
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
  for i in range(STEPS):
    state, metrics = step(state, jlp.train.shard_batch(local_batch, mesh))
    for name in ("loss", "wire_bytes"):
      out[f"compressed/{name}{i}"] = np.asarray(metrics[name].addressable_data(0))
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    out["compressed/params" + jax.tree_util.keystr(path)] = np.asarray(leaf.addressable_data(0))
  return out


def main(argv):
  process_id, num_processes, port, out_dir = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
  import jlp.train  # pylint: disable=g-import-not-at-top
  info = jlp.train.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                              initialization_timeout=60)
  assert info["global_devices"] == GLOBAL_DEVICES, info
  out = all_cases(process_id, num_processes)
  np.savez(os.path.join(out_dir, f"process_{process_id}.npz"), **out)


if __name__ == "__main__":
  main(sys.argv)
