"""Custom-precision gradient all-reduce inside `jax.shard_map` (CPD, docs/cpd.md).

`allreduce(tree, axis_name, fmt=..., algorithm=..., kahan=..., aps=..., mean=...)`
sums a pytree of float32 leaves over the W ranks of `axis_name`; every rank gets
the same bits. q is `jlp.numerics.float_cast.float_cast(., fmt)` (identity for
fmt=None), and every arithmetic operation is one float32 operation.

algorithm="sequential" (CPD's `normal_sum_gradients` / `kahan_sum_gradients`,
drcut/CPD `dist_util.py`): `lax.all_gather` of every rank's leaves (packed into one
vector: the fold is elementwise, so packing changes no bit), then on every rank the
fold in rank order 0..W-1 of `jlp.numerics.sums` (`fold_stacked`):
    plain:  s = 0;  s = q(s + g_r)
    kahan:  s = c = 0;  y = q(g_r - c), t = q(s + y), c = q(q(t - s) - y), s = t
The raw g_r enters each add (without APS), so g_0 ends up as q(g_0).

algorithm="ring": a bandwidth-optimal ring (reduce-scatter, then all-gather) in
which every value that crosses the wire is a value of fmt. Each leaf is
flattened, padded with zeros to W·C elements (C = ceil(size / W)) and cut into
W chunks; chunk k is reduced along the ring starting at rank k+1 and ending at
rank k (all mod W), which then holds it:
    rank k+1 computes s = q(0 + x_{k+1}[k]) (Kahan: one Kahan step from
    s = c = 0) and sends it to rank k+2, which computes s = q(s + x_{k+2}[k])
    and forwards it, ... until rank k adds its own chunk last;
so chunk k is the same fold as above over the ranks in the rotated order
k+1, k+2, ..., W-1, 0, ..., k. With kahan=True the compensation c (a value of
fmt) travels beside s. The first hop is q(0 + x) rather than q(x) so that the
ring is exactly this fold (they differ only for x = -0.0, which becomes +0.0).
The reduced chunks are then all-gathered (no further arithmetic; rank k's row
is chunk k). With APS or mean, each rank divides its reduced chunk by 2^shift
(and W) before the all-gather rather than after it: the same float32 operations
on the same values, so the same bits, on 1/W of the data (the gathered values
are fmt values times that agreed scalar). All leaves travel in the same hops
(each hop one `ppermute` of every leaf's chunk side by side, as a bucketed ring
would), each leaf still cut into its own chunks; each leaf is then gathered
by an `all_gather` of its own.
With fmt=None the ring is a float32 ring, equal to `lax.psum` up to float32
rounding (psum's own order is the backend's).

algorithm="psum": `lax.psum` of every leaf (one call), XLA's own all-reduce, in float32 only
(fmt=None, no Kahan, no APS): the uncompressed baseline a planner weighs the others against
(`jlp.sync_tuning`). Its summation order is the backend's, so its bits are not the fold's.

wire="packed" (the default where it applies, `packed_wire`): the values that cross devices are
values of fmt (the ring's partial sums and compensations, its reduced chunks, and with APS the
scaled gradients of the sequential gather), so they travel as fmt's codes, ceil(bits / 8) bytes
each (`jlp.collectives.wire`: 1 for e4m3 and e5m2, 2 for bfloat16- or float16-like formats);
with APS or mean the reduced chunks are gathered as codes and unscaled after the gather (the same
float32 operations on the same values). The APS exponents are agreed by every rank before (one
pmax) and need not travel with the codes. The bits of the result are those of wire="float32".

aps=True / "cpd": see `jlp.collectives.aps`: one exponent per leaf, all leaves'
exponents agreed in a single `lax.pmax`, q(g · 2^shift) summed as above, the sum
divided by 2^shift in float32. mean=True divides the (unscaled) float32 sum by W.

The result is identical on every rank but, like `lax.all_gather`'s, typed as
varying over `axis_name`: return it with out_specs naming the axis, or use
`check_vma=False` for out_specs=P().
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jlp.collectives import aps as aps_lib
from jlp.collectives import wire as wire_lib
from jlp.formats import FloatFormat, as_format
from jlp.numerics.float_cast import float_cast
from jlp.numerics.sums import kahan_step, kahan_sum, sequential_sum

ALGORITHMS = ("sequential", "ring", "psum")


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def check_options(fmt: Any, algorithm: Any, kahan: Any, aps: Any, mean: Any) -> FloatFormat | None:
  """Validates the shared options; returns the FloatFormat (or None)."""
  if algorithm not in ALGORITHMS:
    raise _invalid("algorithm", algorithm, "one of " + ", ".join(map(repr, ALGORITHMS)))
  for field, value in (("kahan", kahan), ("mean", mean)):
    if not isinstance(value, bool):
      raise _invalid(field, value, "True or False")
  if not any(aps is m for m in aps_lib.APS_MODES):
    raise _invalid("aps", aps, "False, True or 'cpd'")
  if fmt is not None:
    given = fmt
    if isinstance(fmt, str):
      try:
        fmt = as_format(fmt)
      except ValueError as e:
        raise _invalid("fmt", given,
                       "None, a FloatFormat or a float format name such as 'e5m2'") from e
    if not isinstance(fmt, FloatFormat):
      raise _invalid("fmt", given, "None, a FloatFormat or a float format name such as 'e5m2' "
                     "(BFP / MX formats cannot be all-reduce wire formats)")
    if fmt.rounding == "stochastic":
      raise _invalid("fmt.rounding", fmt.rounding, "'nearest' or 'truncate' (stochastic "
                     "all-reduce formats are not supported)")
  if aps and fmt is None:
    raise _invalid("aps", aps, "False when fmt=None (APS scales to a low-precision format)")
  if algorithm == "psum" and (fmt is not None or kahan):
    raise _invalid("algorithm", algorithm, "'sequential' or 'ring' with a format or Kahan "
                   "(psum is XLA's float32 all-reduce)")
  return fmt


def check_leaves(tree: Any, field: str = "tree") -> tuple[list[jax.Array], Any]:
  """Flattens `tree`; every leaf must be a float32 array."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = []
  for path, x in with_paths:
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
      raise _invalid(f"{field}{jax.tree_util.keystr(path)}.dtype", str(x.dtype), "float32")
    leaves.append(x)
  return leaves, treedef


def axis_size(axis_name: Any, field: str = "axis_name") -> int:
  """The size of a mesh axis bound by an enclosing shard_map (ValueError if none is)."""
  try:
    return lax.axis_size(axis_name)
  except (NameError, KeyError, TypeError) as e:
    raise _invalid(field, axis_name, "the name of a mesh axis of an enclosing jax.shard_map") from e


def quantizer(fmt: FloatFormat | None) -> Callable[[jax.Array], jax.Array]:
  return (lambda v: v) if fmt is None else (lambda v: float_cast(v, fmt))


def fold_step(fmt: FloatFormat | None, kahan: bool):
  """One step of the fold of `jlp.numerics.sums` (deterministic fmt), on a carry (s, c)."""
  q = quantizer(fmt)

  def step(carry, x):
    s, c = carry
    if not kahan:
      return q(s + x), c
    return kahan_step(s, c, x, lambda v, slot: q(v))
  return step


def fold_stacked(xs: jax.Array, fmt: FloatFormat | None, kahan: bool) -> jax.Array:
  """The fold over the leading axis in index order: `jlp.numerics.sums.sequential_sum` /
  `kahan_sum` (deterministic fmt; also inside shard_map on gathered values)."""
  return (kahan_sum if kahan else sequential_sum)(xs, fmt=fmt)


def fold_leaves(stacked: list[jax.Array], fmt: FloatFormat | None, kahan: bool,
                axis_name: Any = None, codes: bool = False) -> list[jax.Array]:
  """`fold_stacked` of every leaf (each (N, ...)) over its leading axis, all leaves packed side
  by side into one (N, total) array: the fold is elementwise, so packing changes no bit, and
  the whole tree costs one scan. With `axis_name`, the packed arrays of the W ranks are first
  all-gathered along the leading axis (rank-major: (W·N, total)); with `codes` (values of fmt)
  as fmt's codes (`jlp.collectives.wire`)."""
  if not stacked:
    return []
  n = stacked[0].shape[0]
  packed = jnp.concatenate([x.reshape(n, -1) for x in stacked], axis=1)
  if axis_name is not None:
    if codes:
      packed = wire_lib.decode(lax.all_gather(wire_lib.encode(packed, fmt), axis_name,
                                              tiled=True), fmt)
    else:
      packed = lax.all_gather(packed, axis_name, tiled=True)
  sums = fold_stacked(packed, fmt, kahan)
  out, start = [], 0
  for x in stacked:
    size = x[0].size
    out.append(sums[start:start + size].reshape(x.shape[1:]))
    start += size
  return out


def ring_chunks(flat: jax.Array, n: int) -> tuple[jax.Array, int]:
  """flat (size,) -> (n, C) chunks, zero padded; returns (chunks, size)."""
  size = flat.shape[0]
  c = -(-size // n) if size else 1
  return jnp.pad(flat, (0, n * c - size)).reshape(n, c), size


def _ring_allreduce(leaves: list[jax.Array], axis_name: Any, n: int, fmt: FloatFormat | None,
                    kahan: bool, prepares: list[Callable[[jax.Array], jax.Array]],
                    finishes: list[Callable[[jax.Array], jax.Array]], codes: bool = False
                    ) -> list[jax.Array]:
  """The ring of the module docstring for every leaf, all leaves in the same hops: each hop
  sends every leaf's chunk side by side in one `ppermute` (the hop arithmetic is elementwise
  and each leaf keeps its own chunks, so the bits are those of one ring per leaf; only the
  number of collectives changes: W - 1 hops for the whole tree, then one all_gather per leaf).

  `prepares[i]` maps leaf i's own chunks just before their add (the APS cast q(g · 2^shift),
  chunk by chunk rather than in a pass of its own); `finishes[i]` maps its reduced chunk before
  the all-gather (the unscale and the mean: each element goes through the same float32
  operations as after a gather, on 1/W of the data). With `codes` every hop and the gather
  carry fmt's codes (`jlp.collectives.wire`) and `finishes` run after the gather."""
  chunked = [ring_chunks(x.reshape(-1), n) for x in leaves]
  widths = [chunks.shape[1] for chunks, _ in chunked]
  step = fold_step(fmt, kahan)
  rank = lax.axis_index(axis_name)
  zeros = lax.optimization_barrier(jnp.zeros((sum(widths),), jnp.float32))  # see sums._zeros

  def own(k):  # this rank's chunk k of every leaf, side by side
    return jnp.concatenate([prepare(lax.dynamic_index_in_dim(chunks, k % n, keepdims=False))
                            for prepare, (chunks, _) in zip(prepares, chunked)])
  carry = step((zeros, zeros), own(rank - 1))  # rank r starts chunk r - 1
  if not kahan:
    carry = carry[0]
  to_next = [(i, (i + 1) % n) for i in range(n)]

  def send(values):
    if not codes:
      return lax.ppermute(values, axis_name, to_next)
    return jax.tree.map(lambda v: wire_lib.decode(v, fmt),
                        lax.ppermute(jax.tree.map(lambda v: wire_lib.encode(v, fmt), values),
                                     axis_name, to_next))

  def hop(t, carry):  # receives chunk r - 2 - t from rank r - 1; without Kahan carry = s
    wire = send(carry)
    out = step(wire if kahan else (wire, zeros), own(rank - 2 - t))
    return out if kahan else out[0]
  if n > 1:
    carry = lax.fori_loop(0, n - 1, hop, carry)
  reduced = carry[0] if kahan else carry
  # Rank r now holds the reduced chunk r of every leaf; one all_gather per leaf puts each leaf's
  # chunks in order without a copy (one gather of all of them would need a transpose).
  offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
  if codes:  # the reduced chunks are values of fmt: gather their codes, then finish
    return [finish(wire_lib.decode(lax.all_gather(wire_lib.encode(reduced[a:b], fmt), axis_name),
                                   fmt).reshape(-1)[:size].reshape(x.shape))
            for x, finish, (_, size), a, b in zip(leaves, finishes, chunked, offsets, offsets[1:])]
  return [lax.all_gather(finish(reduced[a:b]), axis_name).reshape(-1)[:size].reshape(x.shape)
          for x, finish, (_, size), a, b in zip(leaves, finishes, chunked, offsets, offsets[1:])]


WIRES = ("packed", "float32")


def packed_wire(fmt: FloatFormat | None, algorithm: str, aps: Any, wire: str | None) -> bool:
  """Whether the reduction sends fmt's codes: `wire` ("packed", "float32", or None: packed
  where it can be). The values that cross devices are fmt's in the ring, and in the sequential
  gather only with APS (without it the raw gradients are gathered); `wire_lib.packable(fmt)`."""
  if wire is not None and wire not in WIRES:
    raise _invalid("wire", wire, "None, 'packed' or 'float32'")
  possible = wire_lib.packable(fmt) and (algorithm == "ring" or bool(aps))
  if wire == "packed" and not possible:
    raise _invalid("wire", wire, "'float32' or None here: a packed wire needs a format of at most "
                   "16 bits without compat (and, with 'ieee' specials, man >= 1), and the ring "
                   "or APS (the sequential gather of raw gradients carries float32)")
  return possible if wire is None else wire == "packed"


def allreduce(tree: Any, axis_name: Any, *, fmt: FloatFormat | str | None = None,
              algorithm: str = "sequential", kahan: bool = False,
              aps: aps_lib.ApsMode = False, mean: bool = False, wire: str | None = None) -> Any:
  """Sum (or mean) over `axis_name` of a pytree of float32 leaves, inside jax.shard_map.

  Args:
    tree: this rank's float32 leaves (e.g. gradients).
    axis_name: a mesh axis of the enclosing shard_map.
    fmt: the wire/accumulation format (a FloatFormat or a name such as "e5m2";
      None: float32). Stochastic formats are rejected.
    algorithm: "sequential" (all_gather + fold in rank order, CPD), "ring" or "psum"
      (`lax.psum`, float32 only).
    kahan: Kahan-compensated fold (the compensation travels in fmt in the ring).
    aps: False, True (exact guarded APS) or "cpd" (CPD's log2f rule, bugs included).
    mean: divide the float32 result by the number of ranks.
    wire: "packed" (the values that cross devices travel as fmt's codes, ceil(fmt.bits / 8)
      bytes each: `jlp.collectives.wire`), "float32", or None (packed where it can be:
      `packed_wire`). The result is the same bits either way.

  Returns:
    The reduced tree, bit-identical on every rank (see the module docstring).
  """
  fmt = check_options(fmt, algorithm, kahan, aps, mean)
  codes = packed_wire(fmt, algorithm, aps, wire)
  leaves, treedef = check_leaves(tree)
  n = axis_size(axis_name)
  if aps:
    exps = jnp.stack([aps_lib.leaf_exponent(g, n, aps) for g in leaves]) if leaves else None
    factors = aps_lib.shift_factors(lax.pmax(exps, axis_name), fmt, aps) if leaves else None
  q = quantizer(fmt)
  prepares, finishes = [], []
  for i in range(len(leaves)):
    prepares.append((lambda v, f=factors[i]: q(v * f)) if aps else (lambda v: v))

    def finish(s, i=i):
      if aps:
        s = s / factors[i]
      return s / jnp.float32(n) if mean else s
    finishes.append(finish)
  if algorithm == "psum":
    out = [f(x) for f, x in zip(finishes, lax.psum(leaves, axis_name))]
  elif algorithm == "sequential":
    sums = fold_leaves([p(g)[None] for p, g in zip(prepares, leaves)], fmt, kahan, axis_name,
                       codes=codes)
    out = [f(x) for f, x in zip(finishes, sums)]
  else:
    out = (_ring_allreduce(leaves, axis_name, n, fmt, kahan, prepares, finishes, codes)
           if leaves else [])
  return jax.tree.unflatten(treedef, out)
