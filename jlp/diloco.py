"""DiLoCo and Streaming DiLoCo: local inner steps, an outer step on the averaged pseudo-gradient.

DiLoCo (Douillard et al., arXiv 2311.08105): every replica runs `period` (H) inner steps of its own
optimizer (`inner`, any optax transform; its state stays per replica) on its own data. Then the
outer gradient Delta = outer_params - params (this sign) is averaged over the replicas, the outer
optimizer (`outer`, any optax transform; DiLoCo's is Nesterov SGD, lr 0.7, momentum 0.9) updates
the outer params, and every replica continues from exactly them: the params are assigned the outer
values (bit-identical on every replica), not moved by params + (outer - params). Special cases:
outer SGD lr 1 without momentum is FedAvg; H = 1 with inner SGD is data-parallel SGD.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512), the same rules per fragment:

  fragments  P: the parameter leaves, in `jax.tree.leaves` order, are cut into P contiguous groups
             of about equal element count. Cut f (f = 1 .. P-1) is the leaf index j with
             lo <= j <= L - (P - f) (lo = previous cut + 1, so no fragment is empty) that
             minimises |P * c_j - f * N| (c_j: elements of the leaves before j, N: all elements;
             the smallest j on a tie). `fragment_bounds` gives the cuts.
  offsets    inner steps are numbered n = 1, 2, ... (n = the step count after the inner update).
             Fragment f takes its Delta and makes its outer step after inner step n iff
             (n - o_f) % H == 0, o_f = (f * H) // P (P <= H, so the offsets are distinct).
             P = 1: after every H-th inner step. Fragment f > 0 first syncs after o_f steps.
  overlap    tau (0 <= tau < H): the fragment's outer params, computed when its Delta was taken
             at step n, replace (merge into) the replica's fragment after inner step n + tau:
             params_f = alpha * params_f + (1 - alpha) * outer_f in float32 (alpha = 0: assigned
             exactly). The tau inner steps in between run on the local params. tau = 0 merges at
             step n itself. The outer params hold the pending fragment until then.
  outer_format  the replicas' Deltas cross as a format's codes (`jlp.collectives.wire`: a
             fragment's codes as one vector, two to a byte for formats of at most 4 bits such as
             e2m1, one byte each up to 8 bits) with one power-of-two scale per fragment, APS's
             guarded rule: e_f = ceil(log2(max |Delta| over the fragment's leaves and all
             replicas)) (one pmax of a scalar), factor_f = 2^clip(emax - e_f, -126, 126); each
             replica sends code(q(Delta * factor_f)) (q: the cast to the format), every replica
             decodes all of them, sums them in float32 in rank order and divides by factor_f,
             then by W. So a small Delta does not round to zero. Formats of at most 8 bits
             without `compat`; a NaN in Delta crosses as NaN except in formats with "ieee"
             specials and no mantissa ("e3m0"), where it crosses as inf.
  outer_sync None (the float32 mean: a sum over `jlp.collectives.allreduce` in rank order,
             divided by W) or a `jlp.sync.GradSync` without compression (its fmt, APS, algorithm
             and packed wire; its axis_name is replaced by step's), then divided by W. Excludes
             outer_format.

`average_state=True`: `sync_model_state` averages non-parameter model state (BatchNorm
statistics) in float32 after every H-th inner step; by default it stays per replica.

Wire bytes (one replica's sends, `fragment_wire_bytes`; the jlp convention of
`GradSync.allreduce_wire_bytes`): float32 sync (W - 1) * 4 * n per fragment of n elements, a
GradSync as it counts, outer_format (W - 1) * ceil(n / 2) for at most 4 bits, (W - 1) * n up to 8;
the scale's pmax is not counted.
`state.wire_bytes` holds the bytes of the last step (0 on steps where no fragment syncs); the
model-state average of `average_state` is not counted.

Hashing: DiLoCo is a frozen dataclass, usable as a static jit argument. optax transforms compare
and hash by identity (two `optax.sgd(0.1)` calls are different), so build the transforms once and
reuse the same DiLoCo to avoid recompiling.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jlp import collectives
from jlp._checks import invalid, is_int
from jlp.collectives import aps as aps_lib
from jlp.collectives import wire as wire_lib
from jlp.formats import FloatFormat, as_format
from jlp.grad_sync import GradSync
from jlp.numerics.float_cast import float_cast

__all__ = ["DiLoCo", "DiLoCoState", "fragment_bounds"]


class DiLoCoState(NamedTuple):
  """One replica's DiLoCo state (a pytree)."""
  outer_params: Any  # the outer params (the last global params of every fragment)
  outer_states: tuple  # the outer optimizer's state per fragment (over its list of leaves)
  inner_state: Any  # this replica's inner optimizer state
  step: jax.Array  # int32, inner steps done
  wire_bytes: jax.Array  # float32, bytes this replica sent in the last step


def fragment_bounds(sizes: list[int], fragments: int) -> tuple[int, ...]:
  """Leaf index cuts (0, j_1, ..., j_{P-1}, L) of P contiguous fragments (module docstring)."""
  n_leaves, total = len(sizes), sum(sizes)
  if n_leaves < fragments:
    raise invalid("fragments", fragments, f"at most the number of parameter leaves ({n_leaves})")
  before = [0]
  for s in sizes:
    before.append(before[-1] + s)
  cuts = [0]
  for f in range(1, fragments):
    lo, hi = cuts[-1] + 1, n_leaves - (fragments - f)
    cuts.append(min(range(lo, hi + 1), key=lambda j: (abs(fragments * before[j] - f * total), j)))
  cuts.append(n_leaves)
  return tuple(cuts)


def _varying(tree: Any, axis_name: str) -> Any:
  """`tree` with every leaf varying over `axis_name` (so both branches of a cond inside
  shard_map agree on their types; a no-op on leaves that already vary)."""
  def one(x):
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    vma = mat.varying if mat is not None else getattr(aval, "vma", None)
    if vma is None or axis_name in vma:
      return x
    return lax.pcast(x, (axis_name,), to="varying")
  return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True)
class DiLoCo:
  """DiLoCo / Streaming DiLoCo (module docstring). `init` once per replica, `step` once per inner
  step inside `jax.shard_map` over the replicas' axis."""

  inner: optax.GradientTransformation
  outer: optax.GradientTransformation
  period: int
  fragments: int = 1
  overlap: int = 0
  alpha: float = 0.0
  outer_sync: Any = None
  outer_format: FloatFormat | str | None = None
  average_state: bool = False

  def __post_init__(self):
    for field in ("inner", "outer"):
      t = getattr(self, field)
      if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
        raise invalid(field, t, "an optax GradientTransformation")
    if not is_int(self.period) or self.period < 1:
      raise invalid("period", self.period, "an int >= 1 (inner steps per outer step)")
    if not is_int(self.fragments) or not 1 <= self.fragments <= self.period:
      raise invalid("fragments", self.fragments, "an int with 1 <= fragments <= period")
    if not is_int(self.overlap) or not 0 <= self.overlap < self.period:
      raise invalid("overlap", self.overlap, "an int with 0 <= overlap < period")
    if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
        or not 0.0 <= self.alpha <= 1.0:
      raise invalid("alpha", self.alpha, "a float in [0, 1]")
    object.__setattr__(self, "alpha", float(self.alpha))
    if not isinstance(self.average_state, bool):
      raise invalid("average_state", self.average_state, "True or False")
    if self.outer_sync is not None:
      if not isinstance(self.outer_sync, GradSync):
        raise invalid("outer_sync", self.outer_sync, "None or a jlp.sync.GradSync")
      if self.outer_sync.compression is not None or self.outer_sync.uses_emulation:
        raise invalid("outer_sync", self.outer_sync,
                      "a GradSync without compression or emulated nodes (not supported yet)")
      if self.outer_format is not None:
        raise invalid("outer_format", self.outer_format, "None with outer_sync")
    if self.outer_format is not None:
      try:
        fmt = as_format(self.outer_format)
      except ValueError as e:
        raise invalid("outer_format", self.outer_format, f"a float format name ({e})") from None
      if not isinstance(fmt, FloatFormat) or fmt.bits > 8 or fmt.compat is not None \
          or fmt.rounding == "stochastic":
        raise invalid("outer_format", self.outer_format,
                      "a FloatFormat of at most 8 bits, without compat, not stochastic")
      object.__setattr__(self, "outer_format", fmt)

  # -- layout -------------------------------------------------------------------------------
  def offsets(self) -> tuple[int, ...]:
    """o_f = (f * period) // fragments: fragment f syncs after inner step n iff
    (n - o_f) % period == 0."""
    return tuple((f * self.period) // self.fragments for f in range(self.fragments))

  def bounds(self, params: Any) -> tuple[int, ...]:
    return fragment_bounds([int(x.size) for x in jax.tree.leaves(params)], self.fragments)

  def fragment_wire_bytes(self, params: Any, num_devices: int) -> tuple[int, ...]:
    """Bytes one replica sends when each fragment syncs (module docstring)."""
    leaves = jax.tree.leaves(params)
    cuts = self.bounds(params)
    w = int(num_devices)
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
      sizes = [int(x.size) for x in leaves[lo:hi]]
      if w <= 1:
        out.append(0)
      elif self.outer_format is not None:
        out.append((w - 1) * wire_lib.vector_bytes(self.outer_format, sum(sizes)))
      else:
        out.append((self.outer_sync or GradSync()).allreduce_wire_bytes(sizes, w))
    return tuple(out)

  def wire_bytes(self, params: Any, num_devices: int, step: int) -> int:
    """Bytes one replica sends after inner step `step` (1-based; 0 when nothing syncs)."""
    per = self.fragment_wire_bytes(params, num_devices)
    return sum(b for b, o in zip(per, self.offsets()) if (step - o) % self.period == 0)

  # -- state --------------------------------------------------------------------------------
  def init(self, params: Any) -> DiLoCoState:
    """One replica's fresh state for `params` (the same params on every replica)."""
    leaves = jax.tree.leaves(params)
    cuts = self.bounds(params)
    outer_params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    outer_states = tuple(self.outer.init(list(leaves[lo:hi]))
                         for lo, hi in zip(cuts[:-1], cuts[1:]))
    return DiLoCoState(outer_params, outer_states, self.inner.init(params),
                       jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

  # -- the step -----------------------------------------------------------------------------
  def _mean(self, deltas: list[jax.Array], axis_name: str, w: int) -> list[jax.Array]:
    """The replicas' mean of this fragment's Deltas, the same bits on every replica."""
    deltas = [d.astype(jnp.float32) for d in deltas]
    if self.outer_format is not None:
      fmt = self.outer_format
      m = jnp.zeros((), jnp.float32)
      for d in deltas:
        m = jnp.maximum(m, jnp.max(jnp.abs(d), initial=0.0))
      e = lax.pmax(aps_lib.exact_ceil_log2(m), axis_name)
      factor = aps_lib.shift_factors(e, fmt, True)
      # The fragment's codes as one vector (two to a byte for formats of at most 4 bits).
      codes = jnp.concatenate([wire_lib.encode(float_cast(d * factor, fmt), fmt).reshape(-1)
                               for d in deltas])
      n = codes.shape[0]
      if fmt.bits <= 4:
        gathered = wire_lib.unpack_nibbles(
            lax.all_gather(wire_lib.pack_nibbles(codes), axis_name), n)
      else:
        gathered = lax.all_gather(codes, axis_name)
      values = wire_lib.decode(gathered, fmt)
      summed = values[0]
      for r in range(1, w):
        summed = summed + values[r]
      summed = (summed / factor) / jnp.float32(w)
      out, start = [], 0
      for d in deltas:
        out.append(summed[start:start + d.size].reshape(d.shape))
        start += d.size
      return out
    if self.outer_sync is not None:
      sync = self.outer_sync
      summed = collectives.allreduce(deltas, axis_name, fmt=sync.fmt, algorithm=sync.algorithm,
                                     kahan=sync.kahan, aps=sync.aps, mean=False, wire=sync.wire)
    else:
      summed = collectives.allreduce(deltas, axis_name)
    return [s / jnp.float32(w) for s in summed]

  def _merge(self, local: list[jax.Array], outer: list[jax.Array]) -> list[jax.Array]:
    if self.alpha == 0.0:
      return list(outer)
    a = jnp.float32(self.alpha)
    return [(a * p.astype(jnp.float32) + (1 - a) * o.astype(jnp.float32)).astype(p.dtype)
            for p, o in zip(local, outer)]

  def step(self, params: Any, grads: Any, state: DiLoCoState, axis_name: str = "data"
           ) -> tuple[Any, DiLoCoState]:
    """One inner step of this replica, then the outer steps and merges due after it (module
    docstring); call inside `jax.shard_map` over `axis_name`."""
    updates, inner_state = self.inner.update(grads, state.inner_state, params)
    params = optax.apply_updates(params, updates)
    n = state.step + 1
    w = lax.axis_size(axis_name)
    leaves, treedef = jax.tree.flatten(params)
    outer_leaves, outer_def = jax.tree.flatten(state.outer_params)
    cuts = self.bounds(params)
    per_bytes = self.fragment_wire_bytes(params, w)
    outer_states = list(state.outer_states)
    wire = jnp.zeros((), jnp.float32)
    tau, h = self.overlap, self.period
    for f, (lo, hi, o) in enumerate(zip(cuts[:-1], cuts[1:], self.offsets())):
      p_f, q_f, s_f = _varying((list(leaves[lo:hi]), list(outer_leaves[lo:hi]),
                                outer_states[f]), axis_name)

      def outer_step(args):
        p, q, s = args
        delta = [a - b for a, b in zip(q, p)]  # Delta = outer - local (the DiLoCo sign)
        mean = [m.astype(x.dtype) for m, x in zip(self._mean(delta, axis_name, w), q)]
        upd, s = self.outer.update(mean, s, q)
        q = optax.apply_updates(q, upd)
        if tau == 0:
          p = self._merge(p, q)
        return _varying((list(p), list(q), s), axis_name)

      sync = (n - o) % h == 0
      p_f, q_f, s_f = lax.cond(sync, outer_step, lambda args: (list(args[0]), list(args[1]),
                                                               args[2]), (p_f, q_f, s_f))
      if tau > 0:
        due = ((n - tau - o) % h == 0) & (n - tau >= 1)
        p_f = lax.cond(due, lambda a: _varying(self._merge(a[0], a[1]), axis_name),
                       lambda a: list(a[0]), (p_f, q_f))
      leaves[lo:hi], outer_leaves[lo:hi], outer_states[f] = p_f, q_f, s_f
      wire = wire + jnp.where(sync, jnp.float32(per_bytes[f]), jnp.float32(0))
    params = jax.tree.unflatten(treedef, leaves)
    new_state = DiLoCoState(jax.tree.unflatten(outer_def, outer_leaves), tuple(outer_states),
                            inner_state, n, wire)
    return params, new_state

  def sync_model_state(self, model_state: Any, state: DiLoCoState, axis_name: str = "data"
                       ) -> Any:
    """Non-parameter model state after `step`: averaged in float32 over the replicas after every
    period-th inner step with average_state=True, else (and on other steps) as it is."""
    if not self.average_state or not jax.tree.leaves(model_state):
      return model_state
    w = lax.axis_size(axis_name)

    def average(ms):
      leaves, tdef = jax.tree.flatten(ms)
      summed = collectives.allreduce([x.astype(jnp.float32) for x in leaves], axis_name)
      return jax.tree.unflatten(tdef, [(s / jnp.float32(w)).astype(x.dtype)
                                       for s, x in zip(summed, leaves)])
    return lax.cond(state.step % self.period == 0, average, lambda ms: ms, model_state)
