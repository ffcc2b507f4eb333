"""The DiLoCo train step (config.diloco.period > 0): every device is a replica of
`jlp.sync.DiLoCo` with its own parameters, BatchNorm statistics and inner optimizer state.

One step, for W devices on the mesh axis ("data"):
  1. The global batch is split over the devices as in `jlp.train.TrainStep` (device d holds rows
     [d*B/W, (d+1)*B/W)); each device computes, with its own parameters and BatchNorm
     statistics, the gradient of loss * loss_scale on its rows (its own mean loss: nothing is
     summed over the devices), divided by loss_scale in float32 (unless loss_scale == 1 or
     unscale_grads=False).
  2. `DiLoCo.step` (jlp.diloco): the inner optimizer's update on the device's parameters, then the
     outer steps and merges due after this inner step (the outer gradients averaged over the
     devices), and `DiLoCo.sync_model_state` on the BatchNorm statistics (averaged at outer steps
     with average_state=True; per device otherwise).
  3. Metrics: `loss` and the loss function's aux values, the means over the devices summed in
     device order (as TrainStep's); `wire_bytes` (= `payload_bytes`) the bytes one device sent
     for the outer gradients in this step (`DiLoCoState.wire_bytes`: 0 on the steps where no
     fragment syncs); `nonfinite` the non-finite elements of the devices' gradients (summed over
     them).

`TrainState` for this step: `params`, `batch_stats` and `opt_state` (the `DiLoCoState`: outer
params, outer optimizer states per fragment, the inner optimizer state, the inner step count and
the last step's wire bytes) hold every device's copy stacked on a leading [W] axis, sharded over
the data axis (orbax saves and restores them sharded, so a resume is bit-exact: the outer params
also hold an overlapped fragment's pending update); `step`, `rng_keys` and `model_state` are
replicated as in TrainStep (the keys are folded with the device index, the rest is device 0's).
`global_state` is the model DiLoCo trains: the outer params with the devices' mean BatchNorm
statistics (what the runner evaluates). Build the state with `init_diloco_state`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jlp.diloco import DiLoCo
from jlp.sync import GradSync
from jlp.train.mesh import batch_sharding, replicate, replicated
from jlp.train.step import (LossFn, TrainState, TrainStep, cross_entropy_loss, node_unroll,
                            split_model)

__all__ = ["DiLoCoStep", "init_diloco_state"]


def _stacked(tree: Any, mesh: Mesh, axis_name: str = "data") -> Any:
  """`tree` (the same values for every device) stacked on a leading [W] axis, sharded over
  `axis_name` (every process builds the rows of its own devices)."""
  sharding = NamedSharding(mesh, P(axis_name))
  w = mesh.shape[axis_name]

  def one(x):
    host = np.asarray(x)
    full = np.broadcast_to(host, (w,) + host.shape)
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])
  return jax.tree.map(one, tree)


def init_diloco_state(model: nnx.Module, diloco: DiLoCo, mesh: Mesh, axis_name: str = "data"
                      ) -> tuple[nnx.GraphDef, TrainState]:
  """The model's graphdef and the DiLoCo step's initial TrainState (module docstring): every
  device starts from the model's parameters, statistics and `diloco.init(params)`."""
  graphdef, params, batch_stats, rng_keys, model_state = split_model(model)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if jnp.asarray(leaf).dtype != jnp.float32:
      raise ValueError(f"params{jax.tree_util.keystr(path)}.dtype={jnp.asarray(leaf).dtype} is not "
                       "allowed; expected float32 master weights.")
  host = jax.device_get(diloco.init(params))
  state = TrainState(
      replicate(jnp.zeros((), jnp.int32), mesh), _stacked(params, mesh, axis_name),
      _stacked(batch_stats, mesh, axis_name), replicate(rng_keys, mesh),
      replicate(model_state, mesh), _stacked(host, mesh, axis_name), None)
  return graphdef, state


class DiLoCoStep(TrainStep):
  """`step(state, batch) -> (state, metrics)`: one DiLoCo inner step on every device, jitted
  (module docstring). `diloco.inner` is the per-device optimizer."""

  def __init__(self, graphdef: nnx.GraphDef, diloco: DiLoCo, mesh: Mesh, *,
               loss_fn: LossFn = cross_entropy_loss, loss_scale: float = 1.0,
               unscale_grads: bool = True, donate: bool = False, axis_name: str = "data"):
    if not isinstance(diloco, DiLoCo):
      raise ValueError(f"diloco={diloco!r} is not allowed; expected a jlp.sync.DiLoCo.")
    self.diloco = diloco
    super().__init__(graphdef, diloco.inner, mesh, GradSync(axis_name=axis_name),
                     loss_fn=loss_fn, loss_scale=loss_scale, unscale_grads=unscale_grads,
                     donate=False)
    self.grad_nodes = 1  # each device differentiates its own mean loss
    rep, per = replicated(mesh), NamedSharding(mesh, P(axis_name))
    self.state_shardings = TrainState(rep, per, per, rep, rep, per, None)
    self.jitted = jax.jit(self._step, in_shardings=(self.state_shardings,
                                                    batch_sharding(mesh, axis_name)),
                          out_shardings=(self.state_shardings, rep),
                          donate_argnums=(0,) if donate else ())
    self.global_state = jax.jit(self._global, in_shardings=(self.state_shardings,),
                                out_shardings=TrainState(*[rep] * 6, None))

  def check_state(self, state: TrainState) -> None:
    if not isinstance(state, TrainState):
      raise ValueError(f"state of type {type(state).__name__} is not allowed; expected a "
                       "jlp.train.TrainState (init_diloco_state).")
    for name in ("params", "opt_state"):
      for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state, name))[0]:
        if not np.ndim(leaf) or np.shape(leaf)[0] != self.num_devices:
          raise ValueError(f"state.{name}{jax.tree_util.keystr(path)} shape={np.shape(leaf)} is "
                           f"not allowed; expected a leading axis of the {self.num_devices} "
                           "devices (init_diloco_state).")

  def _global(self, state: TrainState) -> TrainState:
    """The outer params and the devices' mean BatchNorm statistics, replicated."""
    outer = jax.tree.map(lambda x: x[0], state.opt_state.outer_params)  # the same on every row
    stats = jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype),
                         state.batch_stats)
    return TrainState(state.step, outer, stats, state.rng_keys, state.model_state, None, None)

  def _device(self, params, batch_stats, rng_keys, model_state, step, dstate, batch):
    del step
    axis = self.sync.axis_name
    row = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731  (this device's row)
    params, batch_stats, dstate = row(params), row(batch_stats), row(dstate)
    first = lax.axis_index(axis)
    node = lambda mb, v: self._node(params, mb[1], rng_keys, model_state, mb[0], v)  # noqa: E731
    one = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
    grads, loss, aux, stats, state, _, _ = node_unroll(node, (one(batch), one(batch_stats)),
                                                        first, 1)
    grads, stats, state = row(grads), row(stats), row(state)
    if self.loss_scale != 1.0 and self.unscale_grads:
      grads = jax.tree.map(lambda g: g / self.loss_scale, grads)
    nonfinite = sum((jnp.sum(~jnp.isfinite(g), dtype=jnp.int32) for g in jax.tree.leaves(grads)),
                    jnp.zeros((), jnp.int32))
    params, dstate = self.diloco.step(params, grads, dstate, axis_name=axis)
    stats = self.diloco.sync_model_state(stats, dstate, axis_name=axis)
    # The metrics' collectives after DiLoCo's (one collective at a time, see TrainStep._device).
    (loss, aux, nonfinite), _ = lax.optimization_barrier(((loss, aux, nonfinite),
                                                          (params, dstate, stats)))
    loss, aux = self._node_means((loss, aux))
    metrics = {"loss": loss, **aux, "wire_bytes": dstate.wire_bytes,
               "payload_bytes": dstate.wire_bytes, "nonfinite": lax.psum(nonfinite, axis)}
    return one(params), one(stats), state, metrics, one(dstate)

  def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    axis = P(self.sync.axis_name)
    params, batch_stats, model_state, metrics, dstate = jax.shard_map(
        self._device,
        mesh=self.mesh,
        in_specs=(axis, axis, P(), P(), P(), axis, axis),
        out_specs=(axis, axis, P(), P(), axis),
        check_vma=False)(state.params, state.batch_stats, state.rng_keys, state.model_state,
                         state.step, state.opt_state, batch)
    return TrainState(state.step + 1, params, batch_stats, state.rng_keys, model_state, dstate,
                      None), metrics
