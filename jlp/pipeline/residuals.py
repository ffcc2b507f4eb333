"""What a flush schedule's F keeps of a stage's forward for its B, I and W, and a backward cut
into ZB's I and W (jlp.pipeline.flush; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Both are read off jaxprs: `Residuals` says which leaves of a stage's `jax.vjp` function F keeps
(those that depend on the stage's input; `depends`) and how B rebuilds the function from them,
and `split_backward` cuts a backward's jaxpr into the equations its input gradient needs (I) and
those its weight gradient needs from I's dots (W), so that I + W does each of B's dots once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from jlp.pipeline.packing import Packer

__all__ = ["KEEP", "REDO", "Residuals", "Split", "depends", "split_backward"]

_DOTS = ("dot_general", "conv_general_dilated")


def _live(eqns: Sequence[Any], outvars: Sequence[Any], given: set[Any] = frozenset()
          ) -> tuple[set[int], set[Any]]:
  """(the indices of the equations that `outvars` need, the vars of `given` they read): a
  backward walk that takes the vars of `given` as inputs (effects kept)."""
  is_var = lambda v: isinstance(v, jax.extend.core.Var)
  live = {v for v in outvars if is_var(v)}
  needed = set()
  for k in range(len(eqns) - 1, -1, -1):
    eqn = eqns[k]
    if eqn.effects or any(is_var(v) and v in live and v not in given for v in eqn.outvars):
      needed.add(k)
      live.update(v for v in eqn.invars if is_var(v))
  return needed, live & given


def _run(eqns: Sequence[Any], env: dict[Any, Any], outvars: Sequence[Any]) -> list[Any]:
  """Evaluates `eqns` (of one jaxpr, in order) from `env` (var -> value); the values of
  `outvars`: the equations as a jaxpr of their free variables, run by `jaxpr_as_fun`."""
  core = jax.extend.core
  defined = {v for eqn in eqns for v in eqn.outvars}
  free = list(dict.fromkeys(v for v in [*(v for eqn in eqns for v in eqn.invars), *outvars]
                            if isinstance(v, core.Var) and v not in defined))
  effects = frozenset().union(*(eqn.effects for eqn in eqns))
  jaxpr = core.Jaxpr([], free, list(outvars), list(eqns), effects)
  return list(core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, []))(*[env[v] for v in free]))


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
  """A stage's backward (its jaxpr from the kept values to the weight gradient's leaves and the
  packed input gradient) cut into I and W: I runs the equations the input gradient needs and keeps the results
  of its dots (dot_general, convolutions) that the weight gradient reads (in ZB's terms: the
  layers' output gradients, before the activation's derivative), W runs what the weight gradient
  needs from those. So I + W does each of B's dots once; W redoes only I's elementwise steps
  after a kept dot, so that each gradient comes from the same operations as in B (the same bits:
  fused into a reduction, an elementwise step read back from a buffer rounded differently)."""
  consts: tuple[Any, ...]
  jaxpr: Any  # jax.extend.core.Jaxpr: (the backward's flat inputs) -> (gw leaves, gx)
  num_gw: int  # the first num_gw outputs are the weight gradient's leaves
  i_eqns: tuple[int, ...]
  w_eqns: tuple[int, ...]
  carried: tuple[Any, ...]  # the vars I keeps for W

  def _env(self, args: Sequence[Any]) -> dict[Any, Any]:
    env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
    env.update(zip(self.jaxpr.invars, args, strict=True))
    return env

  def input_half(self, args: Sequence[Any]) -> tuple[Any, list[Any]]:
    """(the input gradient, the values kept for W)."""
    eqns = [self.jaxpr.eqns[k] for k in self.i_eqns]
    out = _run(eqns, self._env(args), [*self.jaxpr.outvars[self.num_gw:], *self.carried])
    return out[0], out[1:]

  def weight_half(self, args: Sequence[Any], carried: Sequence[Any]) -> list[Any]:
    """The weight gradient's leaves, from the values I kept."""
    env = self._env(args)
    env.update(zip(self.carried, carried, strict=True))
    return _run([self.jaxpr.eqns[k] for k in self.w_eqns], env,
                self.jaxpr.outvars[:self.num_gw])


def split_backward(closed: Any, num_gw: int) -> Split | None:
  """The `Split` of a backward's closed jaxpr, None where W would need none of I's values (no
  shared work) or they hold PRNG keys."""
  jaxpr = closed.jaxpr
  eqns = jaxpr.eqns
  i_set, _ = _live(eqns, jaxpr.outvars[num_gw:])
  dots = {v for k in i_set if eqns[k].primitive.name in _DOTS for v in eqns[k].outvars}
  w_set, read = _live(eqns, jaxpr.outvars[:num_gw], dots)
  carried = tuple(v for k in sorted(i_set) for v in eqns[k].outvars if v in read)
  if not carried or any(jnp.issubdtype(v.aval.dtype, jax.dtypes.extended) for v in carried):
    return None
  return Split(tuple(closed.consts), jaxpr, num_gw, tuple(sorted(i_set)), tuple(sorted(w_set)),
               carried)


KEEP, REDO = -1, -2  # `Residuals.sources`: a residual kept by F / recomputed in B from the weights


@dataclasses.dataclass(frozen=True, eq=False)
class Residuals:
  """What F keeps of each stage's forward for B, I and W: the leaves of the stage's `jax.vjp`
  function (its residuals) that depend on the stage's input. Of the others, those that are one of
  the values kept anyway (the weights, which do not change within a mini-batch, the input, the
  stashed state, the targets) are taken from there, and the rest, functions of the weights, state
  and targets only (a slice of stacked weights, a cast or quantized weight, one-hot targets), are
  recomputed in B from those (the rest of that forward is dead code there). Found once per stage
  from its forward's jaxpr (`jlp.pipeline.flush`); the kept leaves are packed into one ring per
  dtype, sized like the state stash (a value lives from F to the last of B, I and W)."""
  treedefs: tuple[Any, ...]  # per stage: the vjp function's pytree structure
  # per stage, per leaf: its index among the leaves of (weights, input, state, targets), KEEP or
  # REDO
  sources: tuple[tuple[int, ...], ...]
  keys: tuple[tuple[Any, ...], ...]  # per stage, per KEEP leaf: its PRNG key impl, None: not a key
  packer: Packer  # per stage its KEEP leaves (keys as their key data)
  # Zero-bubble schedules (with I and W actions): per stage its backward cut into I and W (None:
  # none, I and W each run the whole backward and drop half), and the values I keeps for W.
  splits: tuple[Split | None, ...] = ()
  carried: Packer | None = None

  def keep(self, s: int, vjp_fn: Any) -> dict[str, jax.Array]:
    """Stage s's kept residuals of `vjp_fn` as the packer's {dtype: [L]} buffers."""
    leaves = jax.tree.leaves(vjp_fn)
    sources = self.sources[s]
    if len(leaves) != len(sources):
      raise ValueError(f"stage {s}: a forward with {len(leaves)} residuals is not allowed; "
                       f"expected {len(sources)} (its jaxpr's).")
    kept = [leaf for leaf, src in zip(leaves, sources, strict=True) if src == KEEP]
    kept = [a if impl is None else jax.random.key_data(a)
            for a, impl in zip(kept, self.keys[s], strict=True)]
    for a, (dtype, _, _) in zip(kept, self.packer.layouts[s], strict=True):
      if np.dtype(a.dtype).name != dtype:
        raise ValueError(f"stage {s}: a residual of dtype {a.dtype} is not allowed; expected "
                         f"{dtype} (its jaxpr's).")
    return self.packer.pack(s, kept)

  def restore(self, s: int, kept: dict[str, jax.Array], known: Any,
              forward: Callable[[], Any]) -> Any:
    """Stage s's vjp function from its kept buffers, `known` = (weights, input, state, targets)
    and, for the REDO leaves, `forward()`: the stage's forward under `jax.vjp` again (its vjp
    function)."""
    known = jax.tree.leaves(known)
    stored = iter(a if impl is None else jax.random.wrap_key_data(a, impl=impl)
                  for a, impl in zip(self.packer.unpack(s, kept), self.keys[s], strict=True))
    redo = jax.tree.leaves(forward()) if REDO in self.sources[s] else None
    leaves = [next(stored) if src == KEEP else redo[k] if src == REDO else known[src]
              for k, src in enumerate(self.sources[s])]
    return jax.tree.unflatten(self.treedefs[s], leaves)


def depends(jaxpr: Any, inputs: Sequence[bool]) -> list[bool]:
  """Per output of `jaxpr` (a jax.extend.core.Jaxpr), whether it depends on an input marked in
  `inputs` (an equation's outputs depend on all its inputs: conservative for nested jaxprs)."""
  marked = {v for v, m in zip(jaxpr.invars, inputs, strict=True) if m}
  is_var = lambda v: isinstance(v, jax.extend.core.Var)
  for eqn in jaxpr.eqns:
    if any(is_var(v) and v in marked for v in eqn.invars):
      marked.update(v for v in eqn.outvars if is_var(v))
  return [is_var(v) and v in marked for v in jaxpr.outvars]
