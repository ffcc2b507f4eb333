"""All-reduce over virtual nodes stacked on a leading axis (CPD's node emulation).

`emulated_allreduce(stacked_tree, ...)` takes leaves of shape (N, ...): the
gradients of N virtual nodes held by one device (e.g. `jax.vmap` over N
micro-batches). Same options and arithmetic as `jlp.collectives.allreduce`.

form="flat": one reduction over all the nodes, numbered node = d·N + v (d the
  device index on `axis_name`, v the virtual node). With axis_name=None the N
  nodes of this device are reduced; with an axis of W devices (inside
  jax.shard_map) the stacked leaves are all-gathered first and the W·N nodes
  reduced on every device. The result is bit-identical to `allreduce` over W·N
  real ranks with the same options: "sequential" is the same fold in node
  order; "ring" reproduces the ring's chunks (chunk k folded over nodes
  k+1, k+2, ..., k mod W·N, the wire casts included) as a `lax.scan` over a
  rotated gather of the chunks; APS uses the multiplier W·N and the max over all
  nodes' exponents. (This emulates the ring's numerics, not its traffic.)

form="cpd": CPD's two-level form (drcut/CPD `example/ResNet18/tools/mix.py` and
  `example/ResNet50/main.py`, docs/cpd.md#emulated-nodes), per leaf:
    1. N == 1 and not cast_single (ResNet18): the leaf is g_0 itself, go to 5;
       cast_single=True (ResNet50) always goes through 2-4;
    2. aps: e = max over v of the leaf exponent with multiplier N (aps=True:
       exact and guarded; aps="cpd": ceil(log2f), floor -100 meaning "none",
       then shift 0); factor = 2^(emax - e); without aps factor = 1;
    3. g_v <- q(g_v · factor) (cast even without APS);
    4. res = the plain fold over v (never Kahan); grad = res / factor (float32);
    5. with axis_name: `allreduce(grads, axis_name, ...)` over the W devices
       (its own APS with multiplier W, the algorithm and kahan as given).
  mean=True divides the result by W·N in float32 (both forms).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jlp.collectives import aps as aps_lib
from jlp.collectives.allreduce import (_invalid, allreduce, axis_size, check_leaves, check_options,
                                       fold_leaves, fold_stacked, quantizer, ring_chunks)
from jlp.formats import FloatFormat

FORMS = ("flat", "cpd")


def _node_count(leaves: list[jax.Array]) -> int:
  counts = set()
  for i, x in enumerate(leaves):
    if x.ndim == 0 or x.shape[0] == 0:
      raise _invalid(f"stacked_tree leaf {i} shape", x.shape,
                     "a leading axis of N >= 1 virtual nodes")
    counts.add(x.shape[0])
  if len(counts) > 1:
    raise _invalid("stacked_tree leading axes", sorted(counts),
                   "the same number N of virtual nodes in every leaf")
  return counts.pop() if counts else 1


def _node_exponents(x: jax.Array, multiplier: int, mode: aps_lib.ApsMode) -> jax.Array:
  """Per-node leaf exponents, shape (N,)."""
  return aps_lib.leaf_exponent(x, multiplier, mode, axis=tuple(range(1, x.ndim)))


def ring_emulated(xs: jax.Array, fmt: FloatFormat | None, kahan: bool) -> jax.Array:
  """The ring all-reduce's result over the n = xs.shape[0] nodes, on one device."""
  n = xs.shape[0]
  flat = xs.reshape(n, -1)
  chunks, size = jax.vmap(lambda f: ring_chunks(f, n)[0])(flat), flat.shape[1]
  hop = jnp.arange(n)[:, None]
  chunk = jnp.arange(n)[None, :]
  rotated = chunks[(chunk + 1 + hop) % n, chunk]  # [hop, chunk, C]: hop t of chunk k: node k+1+t
  return fold_stacked(rotated, fmt, kahan).reshape(-1)[:size].reshape(xs.shape[1:])


def reduce_nodes(leaves: list[jax.Array], fmt: FloatFormat | None, algorithm: str, kahan: bool,
                 aps: aps_lib.ApsMode) -> list[jax.Array]:
  """allreduce's arithmetic over the leading node axis of every leaf (no mean)."""
  n = leaves[0].shape[0] if leaves else 1
  if aps and leaves:
    exps = jnp.stack([jnp.max(_node_exponents(x, n, aps)) for x in leaves])
    factors = aps_lib.shift_factors(exps, fmt, aps)
  q = quantizer(fmt)
  if aps:
    leaves = [q(x * factors[i]) for i, x in enumerate(leaves)]
  if algorithm == "sequential":
    out = fold_leaves(leaves, fmt, kahan)
  else:
    out = [ring_emulated(x, fmt, kahan) for x in leaves]
  return [s / factors[i] for i, s in enumerate(out)] if aps else out


def _cpd_local(leaves: list[jax.Array], fmt: FloatFormat | None, aps: aps_lib.ApsMode,
               cast_single: bool) -> list[jax.Array]:
  """CPD's local level (steps 1-4 of the module docstring) on every leaf: its own APS factor
  (multiplier N), q(g_v · 2^shift), the plain fold over the nodes, the unscale."""
  n = leaves[0].shape[0] if leaves else 1
  if n == 1 and not cast_single:
    return [x[0] for x in leaves]
  factors = [aps_lib.local_shift_factors(jnp.max(_node_exponents(x, n, aps)), fmt, aps)
             if aps else None for x in leaves]
  q = quantizer(fmt)
  sums = fold_leaves([q(x * f) if aps else q(x) for x, f in zip(leaves, factors)], fmt, False)
  return [s / f if aps else s for s, f in zip(sums, factors)]


def emulated_allreduce(stacked_tree: Any, *, fmt: FloatFormat | str | None = None,
                       algorithm: str = "sequential", kahan: bool = False,
                       aps: aps_lib.ApsMode = False, mean: bool = False, form: str = "flat",
                       axis_name: Any = None, cast_single: bool = False,
                       wire: str | None = "float32") -> Any:
  """All-reduce over N virtual nodes stacked on each leaf's leading axis (module docstring).

  Args:
    stacked_tree: float32 leaves of shape (N, ...), the same N in every leaf.
    fmt, algorithm, kahan, aps, mean: as `jlp.collectives.allreduce`.
    form: "flat" (one reduction over all W·N nodes) or "cpd" (CPD's two-level form).
    wire: form="cpd": the wire of its all-reduce over the W devices (`jlp.collectives.allreduce`;
      the same bits either way).
    axis_name: None (this device's N nodes only) or a mesh axis of an enclosing
      jax.shard_map whose W devices each hold N nodes.
    cast_single: form="cpd" with N == 1: False skips the local cast (ResNet18's
      mix.py), True casts anyway (ResNet50's main.py).

  Returns:
    The reduced tree, leaves without the node axis, identical on every device.
  """
  fmt = check_options(fmt, algorithm, kahan, aps, mean)
  if algorithm == "psum":
    raise _invalid("algorithm", algorithm, "'sequential' or 'ring' with emulated nodes (their "
                   "sum is a fold in node order)")
  if form not in FORMS:
    raise _invalid("form", form, "one of " + ", ".join(map(repr, FORMS)))
  if not isinstance(cast_single, bool):
    raise _invalid("cast_single", cast_single, "True or False")
  leaves, treedef = check_leaves(stacked_tree, "stacked_tree")
  n = _node_count(leaves)
  w = 1 if axis_name is None else axis_size(axis_name)
  if form == "flat":
    if axis_name is not None:
      leaves = [lax.all_gather(x, axis_name, tiled=True) for x in leaves]
    out = reduce_nodes(leaves, fmt, algorithm, kahan, aps)
  else:
    out = _cpd_local(leaves, fmt, aps, cast_single)
    if axis_name is not None:
      out = allreduce(out, axis_name, fmt=fmt, algorithm=algorithm, kahan=kahan, aps=aps,
                      wire=wire)
  if mean:
    out = [s / jnp.float32(w * n) for s in out]
  return jax.tree.unflatten(treedef, out)
