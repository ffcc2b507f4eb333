"""The data-parallel mesh and the shardings of the train step.

`data_mesh()` is a 1-D ('data',) mesh over all global devices (every process's, in
`jax.devices()` order) with `AxisType.Auto`: `jax.make_mesh` defaults to Explicit axes in jax
0.11, under which shard_map rejects unsharded inputs, so the axis type is given.
Parameters, optimizer state and BatchNorm statistics are replicated (`replicated`); batches are
split along their leading dimension (`batch_sharding`), device d holding rows
[d * B/W, (d + 1) * B/W) of the global batch.

`shard_batch` builds the global batch from each process's local part with
`jax.make_array_from_process_local_data`: process p passes the rows of its own devices (in
`jax.devices()` order the devices of one process are consecutive here, since the mesh is built
from `jax.devices()`), so the global batch is the concatenation of the processes' local batches in
process order. In a single process it is the same as `jax.device_put`. `replicate` places host
values (the initial train state) on every device of every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

__all__ = ["batch_sharding", "data_mesh", "replicate", "replicated", "shard_batch"]


def data_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = "data") -> Mesh:
  """A 1-D mesh named `axis_name` over `devices` (default: all global devices), Auto axis type."""
  devices = jax.devices() if devices is None else list(devices)
  if not devices:
    raise ValueError("devices=[] is not allowed; expected at least one device.")
  if not isinstance(axis_name, str) or not axis_name:
    raise ValueError(f"axis_name={axis_name!r} is not allowed; expected a non-empty string.")
  return Mesh(np.asarray(devices, dtype=object), (axis_name,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of parameters, optimizer state and metrics: a full copy on every device."""
  return NamedSharding(mesh, P())


def replicate(tree: Any, mesh: Mesh) -> Any:
  """`tree` as global arrays replicated on `mesh` (also across processes: every process must hold
  the same values). Typed PRNG keys stay typed keys."""
  sharding = replicated(mesh)

  def one(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      impl = jax.random.key_impl(x)
      return jax.random.wrap_key_data(one(jax.random.key_data(x)), impl=impl)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(one, tree)


def batch_sharding(mesh: Mesh, axis_name: str = "data") -> NamedSharding:
  """Leading (batch) dimension split over `axis_name`, the rest replicated."""
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name={axis_name!r} is not allowed; expected an axis of the mesh, one "
                     f"of {mesh.axis_names}.")
  return NamedSharding(mesh, P(axis_name))


def shard_batch(local_batch: Any, mesh: Mesh, axis_name: str = "data") -> Any:
  """The global batch (a pytree of jax.Arrays sharded along the batch) from this process's part.

  Args:
    local_batch: a pytree of arrays whose leading dimension is this process's share of the
      batch (the whole batch in a single process); equal on every leaf.
    mesh: the data mesh.
    axis_name: the batch axis of the mesh.
  """
  sharding = batch_sharding(mesh, axis_name)
  local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  leaves = jax.tree.leaves(local_batch)
  if not leaves:
    raise ValueError("local_batch has no arrays; expected a pytree of arrays.")
  for leaf in leaves:
    rows = np.shape(leaf)[0] if np.ndim(leaf) else None
    if rows is None or rows % local_devices:
      raise ValueError(f"local_batch leading dimension={rows!r} is not allowed; expected a "
                       f"multiple of this process's {local_devices} device(s) on every leaf.")
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                      local_batch)
