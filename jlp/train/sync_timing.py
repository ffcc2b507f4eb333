"""Wall-clock seconds of one gradient sync over every device of a run, one process or many (the
rows of `python -m experiments.cluster_study`, which runs this on the cluster launcher's hosts).

Each case syncs one float32 gradient of `size` elements per device with
`jlp.sync.reduce_gradients` (float32 `lax.psum` for the baseline), jitted inside one
`jax.shard_map` over all devices; the compression state is a fresh one made inside the program
(a memset of the residual, included in the time). Every case is compiled and called once, then
timed in `repeats` rounds that call each case once (`jlp.sync_tuning.time_in_rounds`: a change of
load during the timing falls on every case alike); the median is reported, with the sync's
`wire_bytes` (per device).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jlp.sync import GradSync, reduce_gradients
from jlp.sync_tuning import time_in_rounds

__all__ = ["CASES", "time_syncs"]

#: (name, GradSync or None for float32 psum) of the cluster study's rows.
CASES: tuple[tuple[str, GradSync | None], ...] = (
    ("float32 psum", None),
    ("float32 ring", GradSync(algorithm="ring")),
    ("e4m3 ring, packed wire", GradSync(fmt="e4m3", algorithm="ring")),
    ("e4m3 ring, float32 wire", GradSync(fmt="e4m3", algorithm="ring", wire="float32")),
    ("onebit PS", GradSync(compression="onebit", min_size=0)),
    ("onebit ring", GradSync(compression="onebit", topology="ring", min_size=0)),
    ("tbq PS", GradSync(compression="tbq", min_size=0)),
    ("tbq ring", GradSync(compression="tbq", topology="ring", min_size=0)),
    ("dgc PS", GradSync(compression="dgc", min_size=0)),
    ("dgc ring", GradSync(compression="dgc", topology="ring", min_size=0)),
)


def _program(sync: GradSync | None, mesh: Mesh, size: int):
  num_devices = mesh.devices.size

  def body(g):
    grads = {"g": g}
    if sync is None:
      wire = 2.0 * (num_devices - 1) / num_devices * 4 * size  # a ring all-reduce's bytes
      return lax.psum(g, "data"), jnp.float32(wire)[None]
    state = sync.init_state(grads, num_devices)
    summed, _, report = reduce_gradients(grads, sync, state, jnp.int32(0))
    return summed["g"], report["wire_bytes"][None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                               check_vma=False))


def time_syncs(size: int, repeats: int = 5,
               cases: Sequence[tuple[str, GradSync | None]] = CASES) -> list[dict]:
  """[{"case", "ms" (median), "ms_all", "wire_bytes"}] over all of jax.devices(). A case that
  lowers to the same program as an earlier one (a plan that chose a fixed row's sync) is not
  timed again: its row repeats that case's times and names it in "same_program_as"."""
  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("data",))
  W = len(devices)
  rng = np.random.default_rng(0)
  host = rng.standard_normal(W * size).astype(np.float32)
  x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("data")),
                                   lambda index: host[index])
  programs, wires, program_of_case, index_of_text = [], [], [], {}
  for name, sync in cases:
    fn = _program(sync, mesh, size)
    text = fn.lower(x).as_text()
    if text not in index_of_text:
      index_of_text[text] = len(programs)
      out, wire = fn(x)
      jax.block_until_ready(out)
      programs.append((name, fn))
      wires.append(float(np.asarray(wire.addressable_shards[0].data)[0]))
    program_of_case.append(index_of_text[text])
  times = time_in_rounds([lambda fn=fn: jax.block_until_ready(fn(x)) for _, fn in programs],
                         repeats)
  rows = []
  for (name, _), i in zip(cases, program_of_case, strict=True):
    row = {"case": name, "ms": float(np.median(times[i])), "ms_all": times[i],
           "wire_bytes": wires[i]}
    if programs[i][0] != name:
      row["same_program_as"] = programs[i][0]
    rows.append(row)
  return rows
