"""One gradient synchronisation for both training loops: the settings (`GradSync`) and the
reduction (`reduce_gradients`), used by the data-parallel step (`jlp.train`) and by the pipelines'
sync="allreduce" (`jlp.pipeline`). A layer below both: it imports neither.

`GradSync` says how the per-node gradients of one step are summed, either with CPD's custom-
precision all-reduce (docs/cpd.md#all-reduce) or with a HiPress compressor (docs/hipress.md#casync):

  fmt          None (float32) or the format of every value of the reduction (a FloatFormat or a
               name such as "e4m3"; CPD's numerics: FloatFormat(4, 3, compat="cpd")).
  algorithm    "sequential" (CPD: all_gather, then a fold in rank order with a cast after each add)
               or "ring" (reduce-scatter + all-gather over ppermute, every value on the wire in
               fmt), or "psum" (XLA's float32 all-reduce, `lax.psum`: fmt None, no Kahan, real
               devices only).
  kahan        Kahan-compensated fold (docs/cpd.md#sums).
  aps          False, True (APS with exact exponents, docs/cpd.md#aps) or "cpd" (CPD's log2/ceil
               rule).
  emulate_nodes  N virtual nodes per device (docs/cpd.md#emulated-nodes): each device's batch is
               split into N consecutive micro-batches, node index = device_index * N + v.
  form         how N > 1 nodes are reduced: "flat" (one reduction over all W*N nodes in node
               order; bit-identical to W*N real devices) or "cpd" (CPD's two levels: the N local
               nodes with their own APS factor, then the W devices).
  cast_single  with form="cpd": cast the local gradients even when N == 1 (CPD's ResNet50 does,
               its ResNet18 does not).
  node_map     how a device runs its N nodes: "unroll" (default: N isolated copies of the
               one-node program; bit-identical to W*N devices, compile time grows with N),
               "scan" (a loop: also bit-identical and compiled once, but 5-9x slower conv steps
               on XLA:CPU) or "vmap" (batched: fast, not bit-identical). See jlp.train.step.
  axis_name    the mesh axis the gradients are reduced over ("data").

Compressed synchronisation (HiPress's CaSync, `jlp.compression.sync`):

  compression  None (the CPD all-reduce above) or a `jlp.compression.Compressor` (or a registered
               name such as "onebit", built with its default fields). Gradients are then summed by
               `jlp.compression.sync_with_bytes`: leaves of more than `min_size` elements (or as
               `plan` says) are encoded, exchanged and decoded, each device with its own state
               (error-feedback residuals, ...: `TrainState.sync_state`), the others summed by
               one float32 ring all-reduce.
  topology     "ps" (CaSync-PS: co-located aggregators, partitions to their owners and back) or
               "ring"
               (CaSync-Ring: decode-merge-encode at every reduce hop), docs/hipress.md#casync;
               "allreduce" for PowerSGD (its P and Q summed by all-reduces, its Q drawn from
               `seed`; jlp.compression.powersgd), and PowerSGD only with it.
  min_size     compress a leaf iff it has more than min_size elements (HiPress's
               --comp-threshold, default 262144 floats = 1 MiB); leaves named in `plan` follow it.
  plan         None or a SeCoPa plan (`jlp.compression.secopa`): {keystr(path): (compress, K)},
               stored as the sorted tuple ((path, compress, K), ...) so that GradSync stays
               hashable (a dict is converted on construction; `plan_dict` gives it back).
  seed         the random stream of compressors that draw (`Compressor.needs_key`): step s
               (the step count before the update) uses key = fold_in(key(seed), s), which the
               sync folds further per leaf, partition, device and encode.
  The compressed sync runs over the W real devices of `axis_name` with float32 gradients: it
  excludes fmt, aps, kahan, algorithm="ring" (the compressed topology is `topology`) and
  emulated nodes (emulate_nodes > 1 or form="cpd" with cast_single), each rejected on
  construction; without compression, topology, min_size and plan must keep their defaults.

The CPD reduction is `jlp.collectives` (`allreduce` for N == 1, `emulated_allreduce` otherwise);
this module dispatches inside `jax.shard_map`; the settings, their validation and the bytes each
device sends (`GradSync.allreduce_wire_bytes`, convention in jlp.train.step) are
`jlp.grad_sync`'s, re-exported here with `jlp.diloco.DiLoCo`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jlp import collectives
from jlp._checks import invalid
from jlp.collectives import ALGORITHMS, APS_MODES, FORMS
from jlp.compression.casync import (DEFAULT_MIN_SIZE, SYNC_TOPOLOGIES, TOPOLOGIES,
                                   sync_with_bytes)
from jlp.diloco import DiLoCo
from jlp.grad_sync import NODE_MAPS, SYNC_REPORT, GradSync, Plan, normalise_plan

__all__ = ["ALGORITHMS", "APS_MODES", "DEFAULT_MIN_SIZE", "DiLoCo", "FORMS", "GradSync",
           "NODE_MAPS", "Plan", "SYNC_REPORT", "SYNC_TOPOLOGIES", "TOPOLOGIES", "normalise_plan",
           "reduce_gradients"]


def reduce_gradients(grads: Any, sync: GradSync, sync_state: Any = None,
                     step: jax.Array | None = None, stream: jax.Array | int | None = None
                     ) -> tuple[Any, Any, dict[str, jax.Array]]:
  """(summed gradient, new sync state, report) on every device; call inside `jax.shard_map` over
  `sync.axis_name`.

  `grads` holds one gradient per leaf when `sync.uses_emulation` is False, and leaves stacked on
  a leading axis of the device's nodes (in node order) otherwise. With compression,
  `sync_state` is this rank's compression state (`GradSync.init_state`), `step` the step number
  that selects the random stream (compressors that draw) and `stream` one more id folded into
  it where several syncs run in one step (a pipeline's stage index); without, the state passes
  through. The report (the same on every device, the metrics of the step):
    wire_bytes     float32, the bytes this device's collectives move (`allreduce_wire_bytes`;
                   `jlp.compression.sync_with_bytes` with compression: payloads at capacity);
    payload_bytes  float32, the bytes of the payloads on HiPress's wire (sparse ones at their
                   real count; equal to wire_bytes without compression);
    nonfinite      int32, the non-finite gradient elements: over every rank's gradient with
                   compression (the state is then left as it was), in the sum without.
  """
  if sync.compression is not None:
    key = None
    if sync.compression.needs_key:
      if step is None:
        raise invalid("step", step, "the step number (the compressor draws random numbers)")
      key = jax.random.fold_in(jax.random.key(sync.seed), step)
      if stream is not None:
        key = jax.random.fold_in(key, stream)
    return sync_with_bytes(grads, sync.axis_name, sync.compression, sync_state,
                           topology=sync.topology, min_size=sync.min_size, plan=sync.plan_dict,
                           key=key)
  num_devices = lax.axis_size(sync.axis_name)
  if sync.uses_emulation:
    sizes = [x[0].size for x in jax.tree.leaves(grads)]
    summed = collectives.emulated_allreduce(grads,
                                            fmt=sync.fmt,
                                            algorithm=sync.algorithm,
                                            kahan=sync.kahan,
                                            aps=sync.aps,
                                            mean=False,
                                            form=sync.form,
                                            axis_name=sync.axis_name,
                                            cast_single=sync.cast_single,
                                            wire=sync.wire if sync.packed else "float32")
  else:
    sizes = [x.size for x in jax.tree.leaves(grads)]
    summed = collectives.allreduce(grads,
                                   sync.axis_name,
                                   fmt=sync.fmt,
                                   algorithm=sync.algorithm,
                                   kahan=sync.kahan,
                                   aps=sync.aps,
                                   mean=False,
                                   wire=sync.wire)
  wire = jnp.float32(sync.allreduce_wire_bytes(sizes, num_devices))
  nonfinite = sum((jnp.sum(~jnp.isfinite(g), dtype=jnp.int32) for g in jax.tree.leaves(summed)),
                  jnp.zeros((), jnp.int32))
  return summed, sync_state, {"wire_bytes": wire, "payload_bytes": wire, "nonfinite": nonfinite}
