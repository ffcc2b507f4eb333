"""What a compressed sync sees of a gradient pytree, shared by CaSync (`jlp.compression.casync`)
and PowerSGD (`jlp.compression.powersgd`): its float32 leaves by path (`leaf_specs`), whether a
state is one rank's or its shard_map block (`state_form`), and a leaf's count of NaNs and
infinities (`nonfinite_count`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp._checks import invalid

__all__ = ["leaf_specs", "nonfinite_count", "state_form"]


def nonfinite_count(x: jax.Array) -> jax.Array:
  """int32: the number of NaNs and infinities in x, counted only where there is one. x * 0 sums
  to zero over finite x and to NaN otherwise: one float reduction, where XLA:CPU ran the int32
  count over a 1536 x 1536 leaf as a materialized int32 copy and a reduce-window (inside a
  PowerSGD sync of 8 devices, the largest op after the dots)."""
  def none(x):
    # typed like the count (varying over the shard_map axes x varies over)
    return jnp.sum(x.reshape(-1)[:0] != 0, dtype=jnp.int32)
  return lax.cond(jnp.isfinite(jnp.sum(x * 0)), none,
                  lambda x: jnp.sum(~jnp.isfinite(x), dtype=jnp.int32), x)


def leaf_specs(tree: Any) -> list[tuple[str, tuple[int, ...]]]:
  """(keystr(path), shape) of every leaf (arrays or ShapeDtypeStructs), all float32."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path)
    dtype = getattr(x, "dtype", None)
    if dtype is None:
      dtype = jnp.asarray(x).dtype
    if jnp.dtype(dtype) != jnp.float32:
      raise invalid(f"tree{name}.dtype", str(dtype), "float32")
    out.append((name, tuple(int(d) for d in np.shape(x))))
  return out


def _describe(tree: Any) -> Any:
  return jax.tree.map(lambda a: f"{jnp.dtype(a.dtype).name}{list(np.shape(a))}", tree)


def state_form(state: Any, expected: Any, kind: str = "") -> bool:
  """Whether `state` is in block form ([1, ...] leaves, a shard_map block) rather than as
  init_state gives it (`expected`); ValueError if it is neither (`kind`, e.g. "PowerSGD ", names
  the state in the message)."""
  def matches(lead):
    return jax.tree.structure(state) == jax.tree.structure(expected) and all(
        tuple(np.shape(a)) == lead + tuple(b.shape) and jnp.dtype(a.dtype) == b.dtype
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)))
  if matches(()):
    return False
  if matches((1,)):
    return True
  raise invalid("state", _describe(state),
                f"None, one rank's {kind}state as init_state gives it, {_describe(expected)}, or "
                "its shard_map block (each leaf with a leading axis of 1)")
