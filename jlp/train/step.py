"""The data-parallel train step: per-node gradients in `jax.shard_map`, a custom-precision
gradient all-reduce (`jlp.collectives`) or a compressed sync (`jlp.compression.sync`), an optax
update on float32 master weights.

One step, for W devices on the mesh axis ("data") and N = `GradSync.emulate_nodes` virtual nodes
per device (docs/cpd.md#emulated-nodes):

  1. The global batch (leading dimension B) is split over the devices (device d holds rows
     [d*B/W, (d+1)*B/W)) and each device's rows into N consecutive micro-batches of b = B/(W*N)
     rows. Micro-batch v of device d is node n = d*N + v.
  2. Every node merges the model from the (replicated) state and computes, on its micro-batch,
     `loss_fn(model, micro_batch) -> (loss, aux)` with BatchNorm in training mode (batch
     statistics of the node's own micro-batch, like unsynchronised DDP), and the gradient of
         loss / (W*N) * loss_scale
     with respect to the float32 parameters, so that the sum of the W*N node gradients is
     loss_scale times the gradient of the mean of the node losses (CPD's convention).
     How a device runs its N nodes (`GradSync.node_map`; measured on XLA:CPU, small CNN):
       "unroll" (default): N isolated copies of the one-node program (optimization barriers
         around each node's inputs and outputs), each compiled as a real device's program, so
         a node's results do not depend on N: bit-identical to W*N devices. Compile time grows
         with N.
       "scan": one node after the other in a loop (`_node_scan`), also bit-identical (for any
         N, N = 1 included) and compiled once whatever N, but XLA:CPU compiles the weight-
         gradient convolution inside a loop body to a slow generic loop (not Eigen): 5-9x slower
         steps on conv nets on CPU.
       "vmap": batched (fast, one program), but the batched convolutions are other programs:
         gradients differ from the devices' in the last bits (not bit-identical).
     "Bit-identical" compares runs with the same node_map (8 devices x 1 node under "scan" run
     the loop too); "unroll" and "scan" differ from each other in the last bits.
  3. The gradients are summed over all nodes with `jlp.collectives` as `GradSync` says (module
     `jlp.sync`), the same sum on every device, then divided by loss_scale in float32
     (skipped when loss_scale == 1, or with unscale_grads=False: CPD's DavidNet never divides
     its static loss scale out, so the optimizer sees loss_scale times the gradient while the
     weight decay it adds is not scaled; docs/cpd.md#compat-switches).
     With `GradSync.compression` (N = 1), `jlp.compression.sync_with_bytes` sums the W device
     gradients (each loss_scale / W times the device's gradient: a compressor with an absolute
     threshold, such as TBQ's, sees them at that scale) with HiPress's CaSync
     (docs/hipress.md#casync): device d encodes with its own compression state (error-feedback
     residuals, DGC's momentum), row d of `TrainState.sync_state`, which the step returns updated;
     compressors that draw use key = fold_in(key(GradSync.seed), step) (the step number before the
     update), folded further per leaf, partition and device by the sync.
  4. `optimizer.update` (any optax transformation, see `jlp.train.optim`) and
     `optax.apply_updates` on the replicated float32 parameters, outside the shard_map.

The state after a step is a deterministic function of the state and the global batch:
  * BatchNorm running statistics: every node updates its own copy from its micro-batch; the new
    statistics are the mean over all W*N nodes, summed in node order (all_gather, then a float32
    fold n = 0, 1, ..., then one division by W*N). So one device emulating N nodes, and W devices
    with N/W nodes each, give the same statistics bit for bit.
  * PRNG state (`nnx.RngKey` variables, e.g. stochastic-rounding streams of a quantized model):
    node n draws from its keys folded with n (`jax.random.fold_in(key, n)`); the stored keys do
    not change. Other non-parameter state (RNG counters, BFP widths, ...) is taken from node 0;
    it evolves identically on every node.
  * FP8 delayed-scaling state (`Fp8Meta` variables of "fp8_delayed" layers, `jlp.nn.fp8_delayed`):
    every node differentiates with respect to them beside the parameters; their gradients are
    the node's new amax histories and call counts (Flax's OVERWRITE_WITH_GRADIENT). The new
    history (kept as it was for a layer with no call) is their
    elementwise max over the N nodes of the device and then over the W devices (`lax.pmax`, after
    the gradient sync: TE all-reduces amaxes with max over the data-parallel group), and each
    scale is recomputed from it (`overwrite_fp8_meta`): the same state on every device, never
    seen by the optimizer or by the gradient sync.
  * Metrics: `loss` (the mean of the node losses, without loss_scale) and the mean over the nodes
    of every entry of `aux` (float32 scalars), each summed in node order as above; and the
    gradient sync's report (`jlp.sync.reduce_gradients`): `wire_bytes` (below), `payload_bytes`
    and `nonfinite`.

Wire bytes: metrics["wire_bytes"] (float32) is the number of bytes one device sends for the
gradient sync of the step, counted from what the program exchanges between devices (the BatchNorm
statistics and metrics exchanged beside it are not counted):
  * uncompressed (`jlp.collectives`, `GradSync.allreduce_wire_bytes`): 4 bytes per float32 that
    leaves the device, whatever fmt the values hold (the emulation carries them as float32), for
    n = the parameter count, W devices, N nodes per device:
      sequential  an all_gather of the device's n values to W-1 peers: (W-1) * 4 * n;
      ring        W-1 hops of one chunk of C = ceil(size / W) values per leaf, then the all_gather
                  of the device's reduced chunk of every leaf: 2 * (W-1) * 4 * sum(C)
                  (3 * ... with Kahan, whose compensation travels beside the sum);
      N > 1, form "flat": the all_gather of the N stacked node gradients: (W-1) * 4 * N * n
                  (the node reduction then runs locally); form "cpd": the local fold sends
                  nothing, then sequential / ring over the W devices as above;
      W = 1: 0. APS's exponent agreement (one pmax of a scalar per leaf) is not counted.
  * compressed: `jlp.compression.sync_with_bytes`: the bytes the sync's collectives move per
    device, averaged over the devices: every payload at its in-jit size (HiPress's wire size,
    sparse payloads at capacity), uncompressed leaves as a float32 ring all-reduce,
    2 * (W-1)/W * 4 * n, and the sync's small bookkeeping psum. metrics["payload_bytes"] is what
    HiPress's wire would carry instead (sparse payloads at their real count, no bookkeeping);
    uncompressed, it equals wire_bytes.

`TrainState` is a NamedTuple of replicated arrays and `nnx.State`s (a plain pytree: orbax saves it
once typed PRNG keys are turned into key data) plus `sync_state`, the compression state of every
device stacked on a leading [W] axis and sharded over the data axis (None without compression;
orbax saves and restores it sharded). Build it with `init_train_state(model, optimizer, mesh,
sync)`; the model for evaluation is `merge_model(graphdef, state)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jlp.nn.fp8_delayed import Fp8Meta, overwrite_fp8_meta
from jlp.nn.rules import ZSEProbe, bfp_zse_metrics
from jlp.numerics.sums import sequential_sum
from jlp.train.mesh import batch_sharding, replicate, replicated
from jlp.sync import GradSync, reduce_gradients

__all__ = [
    "LossFn",
    "TrainState",
    "TrainStep",
    "cross_entropy_loss",
    "init_sync_state",
    "init_train_state",
    "merge_model",
    "node_unroll",
    "split_model",
]

#: loss_fn(model, micro_batch) -> (mean loss over the micro-batch, {name: float32 scalar}).
LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, jax.Array]]]


class TrainState(NamedTuple):
  """Everything a step reads and writes: replicated on the mesh, except `sync_state`."""
  step: jax.Array  # int32 scalar: steps taken
  params: nnx.State  # nnx.Param variables, float32 master weights
  batch_stats: nnx.State  # nnx.BatchStat variables (BatchNorm running mean / var)
  rng_keys: nnx.State  # nnx.RngKey variables
  model_state: nnx.State  # every other variable (RNG counters, BFP widths, ...)
  opt_state: optax.OptState
  # The compressed sync's per-rank state (error-feedback residuals, ...): every rank's state
  # stacked on a leading [W] axis, sharded over the data axis (rank d holds row d); None without
  # compression. Built by `init_sync_state`.
  sync_state: Any = None


def split_model(model: nnx.Module):
  """(graphdef, params, batch_stats, rng_keys, model_state) of an NNX model."""
  return nnx.split(model, nnx.Param, nnx.BatchStat, nnx.RngKey, ...)


def merge_model(graphdef: nnx.GraphDef, state: TrainState) -> nnx.Module:
  """The NNX model of a TrainState (e.g. for evaluation: `merge_model(...).eval()`)."""
  return nnx.merge(graphdef, state.params, state.batch_stats, state.rng_keys, state.model_state)


def sync_state_sharding(mesh: Mesh, sync: GradSync) -> NamedSharding:
  """The sharding of `TrainState.sync_state`: leading [W] axis split over `sync.axis_name`."""
  return NamedSharding(mesh, P(sync.axis_name))


def init_sync_state(params: Any, sync: GradSync, mesh: Mesh) -> Any:
  """The compressed sync's fresh state for gradients shaped like `params`: every rank's state
  (`GradSync.init_state`, the same for all ranks) stacked on a leading [W] axis and sharded over
  `sync.axis_name`; None when `sync` has no compression. Multi-process safe (every process
  builds the rows of its own devices)."""
  if sync.compression is None:
    return None
  num_devices = sync.check_mesh(mesh)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
  one = sync.init_state(shapes, num_devices)
  sharding = sync_state_sharding(mesh, sync)

  def stack(x):
    host = np.asarray(x)
    full = np.broadcast_to(host, (num_devices,) + host.shape)
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])

  return jax.tree.map(stack, one)


def init_train_state(model: nnx.Module, optimizer: optax.GradientTransformation,
                     mesh: Mesh | None = None, sync: GradSync | None = None
                     ) -> tuple[nnx.GraphDef, TrainState]:
  """The model's graphdef and its initial TrainState, replicated on `mesh` when one is given.

  With a compressed `sync` (GradSync.compression set; needs `mesh`), the state also holds the
  compression state of every rank (`init_sync_state`). In a multi-process run every process must
  pass the same model values (same seed).
  """
  graphdef, params, batch_stats, rng_keys, model_state = split_model(model)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if jnp.asarray(leaf).dtype != jnp.float32:
      raise ValueError(f"params{jax.tree_util.keystr(path)}.dtype={jnp.asarray(leaf).dtype} is not "
                       "allowed; expected float32 master weights.")
  if sync is not None and not isinstance(sync, GradSync):
    raise ValueError(f"sync={sync!r} is not allowed; expected None or a jlp.train.GradSync.")
  compressed = sync is not None and sync.compression is not None
  if compressed and mesh is None:
    raise ValueError("mesh=None is not allowed with a compressed sync; expected the data mesh "
                     "(the compression state has one row per device).")
  state = TrainState(jnp.zeros((), jnp.int32), params, batch_stats, rng_keys, model_state,
                     optimizer.init(params))
  if mesh is not None:
    state = replicate(state, mesh)
  if compressed:
    state = state._replace(sync_state=init_sync_state(params, sync, mesh))
  return graphdef, state


def cross_entropy_loss(model: nnx.Module, batch: dict[str, jax.Array]
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Softmax cross-entropy (mean over the batch) of model(batch["image"]) against the integer
  batch["label"]; aux: {"accuracy": top-1 accuracy}."""
  logits = model(batch["image"])
  labels = batch["label"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
  return loss, {"accuracy": accuracy}


def _check_loss_scale(loss_scale: Any) -> float:
  if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
    raise ValueError(f"loss_scale={loss_scale!r} is not allowed; expected a positive finite float.")
  if not (math.isfinite(loss_scale) and loss_scale > 0):
    raise ValueError(f"loss_scale={loss_scale!r} is not allowed; expected a positive finite float.")
  return float(loss_scale)


def _split_fp8(model_state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(the Fp8Meta variables, the rest) of a model state."""
  return nnx.split_state(model_state, Fp8Meta, ...)


def node_unroll(node: Callable[..., Any], per_node: Any, first: jax.Array, n: int) -> Any:
  """node(per_node[v], first + v) for v = 0..n-1, stacked: n copies of the one-node program.

  Each copy's inputs (its micro-batch, its copy of the BatchNorm statistics) and outputs pass
  through optimization barriers, so XLA neither shares nor fuses anything across nodes and
  compiles every copy as it compiles the single node of a real device (n = 1): the results are
  the same bits whatever n is (measured on XLA:CPU).
  """
  outs = []
  for v in range(n):
    inputs = lax.optimization_barrier(jax.tree.map(lambda x, v=v: x[v], per_node))
    outs.append(lax.optimization_barrier(node(inputs, first + v)))
  return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _node_scan(node: Callable[..., Any], per_node: Any, first: jax.Array, n: int) -> Any:
  """node(per_node[v], first + v) for v = 0..n-1, stacked; one node after the other in a loop.

  Written so that a node's results are the same bits whatever n is (n = 1 included), which the
  "W devices x N nodes = W*N devices" exactness needs (each case below was measured on XLA:CPU):
  * the trip count is hidden from the compiler (an optimization barrier), so the loop stays a
    loop for every n: XLA inlines a visible one-trip loop, and the inlined program (other
    convolution layouts and fusions) gives gradients that differ in the last bits;
  * the node's inputs and outputs pass through optimization barriers, so the body compiles the
    same way whatever the shapes of the stacked buffers around it are;
  * whatever varies with n must come in through `per_node` (the caller also passes the
    BatchNorm statistics there, as n copies): a loop-invariant operand lets XLA hoist or fuse
    its arithmetic (e.g. momentum * running_mean) differently for different n.
  The loop body is not the program of `node_unroll` (results differ in the last bits between
  the two modes) and it is slow on XLA:CPU: inside a loop body the weight-gradient convolution
  keeps its non-canonical dimension order (dim_labels f01b_i01o->01bf) and is emitted as a
  generic loop instead of an Eigen convolution (~30x slower for that op, measured).
  """
  one = jax.eval_shape(node, jax.tree.map(lambda x: x[0], per_node), first)
  init = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), one)

  def body(v, acc):
    inputs = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, v, keepdims=False), per_node)
    out = lax.optimization_barrier(node(lax.optimization_barrier(inputs), first + v))
    return jax.tree.map(lambda a, o: lax.dynamic_update_index_in_dim(a, o, v, 0), acc, out)

  return lax.fori_loop(0, lax.optimization_barrier(jnp.asarray(n, first.dtype)), body, init)


class TrainStep:
  """`step(state, batch) -> (state, metrics)`: one data-parallel step, jitted (module docstring).

  Args:
    graphdef: the model's graphdef from `init_train_state`.
    optimizer: an optax GradientTransformation (applied to the summed, unscaled gradient).
    mesh: the data mesh (`jlp.train.data_mesh()`).
    sync: the gradient reduction (`GradSync`); its axis_name must be a mesh axis. A compressed
      sync needs a state built with the same sync (`init_train_state(..., sync=sync)`).
    loss_fn: `loss_fn(model, micro_batch) -> (mean loss, aux dict of float32 scalars)`.
    loss_scale: static loss scale: the node losses are multiplied by it before differentiation
      and the summed gradient is divided by it (float32) before the optimizer.
    unscale_grads: False reproduces CPD's DavidNet (docs/cpd.md#compat-switches, compat only):
      the summed gradient is not divided by loss_scale, so the optimizer gets loss_scale times it.
    donate: donate the input state's buffers to the output state.
    zse_report: the QuantReport of a BFP-quantized model (`jlp.nn.quantize_model`): the metrics
      then hold "zse", {layer path: {"fw", "bwo", "biw"}} (`jlp.nn.bfp_zse_metrics`,
      docs/bfp.md#zero-setting-error): "fw" of the master weights before the update, "bwo" of the
      summed weight gradient, "biw" the mean over the nodes of each node's input-gradient ZSE (the
      gradient of the layer's `ZSEProbe`, taken beside the parameter gradient).

  The batch is any pytree of arrays with a common leading dimension B, a multiple of
  W * emulate_nodes (in a multi-process run: a global array, see `jlp.train.shard_batch`).
  """

  def __init__(self,
               graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation,
               mesh: Mesh,
               sync: GradSync = GradSync(),
               *,
               loss_fn: LossFn = cross_entropy_loss,
               loss_scale: float = 1.0,
               unscale_grads: bool = True,
               donate: bool = False,
               zse_report: Any = None):
    if not isinstance(sync, GradSync):
      raise ValueError(f"sync={sync!r} is not allowed; expected a jlp.train.GradSync.")
    if not isinstance(mesh, Mesh):
      raise ValueError(f"mesh={mesh!r} is not allowed; expected a jax.sharding.Mesh.")
    self.num_devices = sync.check_mesh(mesh)
    if not callable(loss_fn):
      raise ValueError(f"loss_fn={loss_fn!r} is not allowed; expected a callable.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
      raise ValueError(f"optimizer={optimizer!r} is not allowed; expected an optax "
                       "GradientTransformation.")
    self.graphdef = graphdef
    self.optimizer = optimizer
    self.mesh = mesh
    self.sync = sync
    self.loss_fn = loss_fn
    self.loss_scale = _check_loss_scale(loss_scale)
    if not isinstance(unscale_grads, bool):
      raise ValueError(f"unscale_grads={unscale_grads!r} is not allowed; expected True or False.")
    self.unscale_grads = unscale_grads
    self.num_nodes = self.num_devices * sync.emulate_nodes
    #: A node's loss is divided by it before differentiation: every node (W*N), so that the
    #: summed gradient is the mean's; a subclass whose devices keep their own gradients (the
    #: DiLoCo step, jlp.train.diloco_step) sets the device's nodes.
    self.grad_nodes = self.num_nodes
    self.zse_report = zse_report
    state_sharding = replicated(mesh)
    #: The TrainState's shardings (replicated, sync_state split over the axis): a pytree prefix.
    self.state_shardings = TrainState(*[state_sharding] * 6, sync_state_sharding(mesh, sync))
    self.jitted = jax.jit(self._step,
                          in_shardings=(self.state_shardings, batch_sharding(mesh, sync.axis_name)),
                          out_shardings=(self.state_shardings, state_sharding),
                          donate_argnums=(0,) if donate else ())

  def check_state(self, state: TrainState) -> None:
    """ValueError unless `state.sync_state` fits the sync: None without compression, one row
    per device with it (`init_train_state(..., sync=sync)` builds it)."""
    if not isinstance(state, TrainState):
      raise ValueError(f"state of type {type(state).__name__} is not allowed; expected a "
                       "jlp.train.TrainState (init_train_state).")
    if self.sync.compression is None:
      if jax.tree.leaves(state.sync_state):
        raise ValueError("state.sync_state is not allowed without compression; expected None "
                         "(the state was built for a compressed sync).")
      return
    if state.sync_state is None:
      raise ValueError("state.sync_state=None is not allowed with a compressed sync; expected "
                       "the compression state: build the state with "
                       "init_train_state(model, optimizer, mesh, sync).")
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.sync_state)[0]:
      if not np.ndim(leaf) or np.shape(leaf)[0] != self.num_devices:
        raise ValueError(f"state.sync_state{jax.tree_util.keystr(path)} shape={np.shape(leaf)} is "
                         f"not allowed; expected a leading axis of the {self.num_devices} devices.")

  def check_batch(self, batch: Any) -> int:
    """The global batch size B; ValueError unless every leaf has it and W*N divides it."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
      raise ValueError("batch has no arrays; expected a pytree of arrays (e.g. image, label).")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
      raise ValueError(f"batch leading dimensions={sorted(sizes, key=str)} are not allowed; "
                       "expected one common batch dimension on every leaf.")
    size = sizes.pop()
    if size % self.num_devices:
      raise ValueError(f"batch size={size} is not allowed; expected a multiple of the "
                       f"{self.num_devices} devices on mesh axis {self.sync.axis_name!r}.")
    per_device = size // self.num_devices
    if per_device % self.sync.emulate_nodes or per_device == 0:
      raise ValueError(f"emulate_nodes={self.sync.emulate_nodes} is not allowed for a per-device "
                       f"batch of {per_device}; expected a divisor of it.")
    return size

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    self.check_state(state)
    self.check_batch(batch)
    return self.jitted(state, batch)

  # -- the traced program ---------------------------------------------------------------------
  def _node(self, params, batch_stats, rng_keys, model_state, micro_batch, node):
    """(gradient of the scaled node loss, loss, aux, new batch stats, new model state, probe
    gradients: the ZSE probes' gradients when zse_report is set, else an empty state)."""
    keys = jax.tree.map(lambda k: jax.random.fold_in(k, node), rng_keys)
    if self.zse_report is not None:
      probes, others = nnx.split_state(model_state, ZSEProbe, ...)
    else:
      probes, others = nnx.State({}), model_state
    metas, others = _split_fp8(others)

    def scaled_loss(p, probe_values, meta_values):
      model = nnx.merge(self.graphdef, p, batch_stats, keys, probe_values, meta_values, others,
                        copy=True)
      loss, aux = self.loss_fn(model, micro_batch)
      _, _, new_stats, _, new_state = split_model(model)
      scaled = loss / self.grad_nodes
      if self.loss_scale != 1.0:
        scaled = scaled * self.loss_scale
      return scaled, (loss, aux, new_stats, new_state)

    (grads, probe_grads, meta_grads), (loss, aux, new_stats, new_state) = jax.grad(
        scaled_loss, argnums=(0, 1, 2), has_aux=True)(params, probes, metas)
    return grads, loss, aux, new_stats, new_state, probe_grads, meta_grads

  def _node_means(self, tree: Any) -> Any:
    """Means over all W*N nodes of per-node values (leaves stacked [N, ...] on each device),
    each summed in node order: one all_gather of all leaves side by side, then a float32 fold
    over the nodes (elementwise, so packing the leaves together changes no bit)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      return tree
    n = leaves[0].shape[0]
    packed = jnp.concatenate([x.reshape(n, -1).astype(jnp.float32) for x in leaves], axis=1)
    everything = lax.all_gather(packed, self.sync.axis_name, tiled=True)
    means = sequential_sum(everything) / self.num_nodes
    out, start = [], 0
    for x in leaves:
      size = math.prod(x.shape[1:])
      out.append(means[start:start + size].reshape(x.shape[1:]).astype(x.dtype))
      start += size
    return jax.tree.unflatten(treedef, out)

  def _device(self, params, batch_stats, rng_keys, model_state, step, sync_state, batch):
    sync, n = self.sync, self.sync.emulate_nodes
    first = lax.axis_index(sync.axis_name) * n
    micro = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
    # Every node gets its own copy of the BatchNorm statistics (see _node_scan).
    stats_copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), batch_stats)
    node = lambda mb, v: self._node(params, mb[1], rng_keys, model_state, mb[0], v)
    if sync.node_map == "vmap":
      out = jax.vmap(node)((micro, stats_copies), first + jnp.arange(n, dtype=first.dtype))
    elif sync.node_map == "scan":
      out = _node_scan(node, (micro, stats_copies), first, n)
    else:
      out = node_unroll(node, (micro, stats_copies), first, n)
    grads, loss, aux, stats, state, probe_grads, meta_grads = out
    if not sync.uses_emulation:
      grads = jax.tree.map(lambda g: g[0], grads)
    own_state = jax.tree.map(lambda x: x[0], sync_state)  # this rank's row
    grads, own_state, report = reduce_gradients(grads, sync, own_state, step)
    sync_state = jax.tree.map(lambda x: x[None], own_state)
    # The metrics' all_gather after the gradient sync's collectives: XLA:CPU runs independent
    # collectives of one program in any order on each device, and devices waiting in different
    # collectives deadlock (seen: a ring's ppermute against this all_gather).
    per_node, _ = lax.optimization_barrier(((loss, aux, stats, probe_grads), (grads, report)))
    loss, aux, stats, probe_grads = self._node_means(per_node)
    metas, _ = _split_fp8(model_state)
    if jax.tree.leaves(metas):
      # After the node means' all_gather (one collective at a time, see above).
      meta_grads, _ = lax.optimization_barrier((meta_grads, (loss, aux, stats)))
      reduce = lambda h: lax.pmax(jnp.max(h, axis=0), sync.axis_name)
      new_metas = overwrite_fp8_meta(metas, meta_grads, reduce)
    metrics = {"loss": loss, **aux, **report}
    if self.zse_report is not None:
      model = nnx.merge(self.graphdef, params, batch_stats, rng_keys, model_state, copy=True)
      metrics["zse"] = bfp_zse_metrics(model, nnx.merge_state(grads, probe_grads), self.zse_report)
    state = jax.tree.map(lambda x: x[0], state)
    if jax.tree.leaves(metas):
      state = nnx.merge_state(state, new_metas)
    return grads, stats, state, metrics, sync_state

  def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    axis = P(self.sync.axis_name)
    grads, batch_stats, model_state, metrics, sync_state = jax.shard_map(
        self._device,
        mesh=self.mesh,
        in_specs=(P(), P(), P(), P(), P(), axis, axis),
        out_specs=(P(), P(), P(), P(), axis),
        check_vma=False)(state.params, state.batch_stats, state.rng_keys, state.model_state,
                         state.step, state.sync_state, batch)
    if self.loss_scale != 1.0 and self.unscale_grads:
      grads = jax.tree.map(lambda g: g / self.loss_scale, grads)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(state.step + 1, params, batch_stats, state.rng_keys, model_state,
                           opt_state, sync_state)
    return new_state, metrics
