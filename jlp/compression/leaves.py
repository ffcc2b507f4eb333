"""What a compressed sync sees of a gradient pytree, shared by CaSync (`jlp.compression.casync`)
and PowerSGD (`jlp.compression.powersgd`): its float32 leaves by path (`leaf_specs`), and whether a
state is one rank's or its shard_map block (`state_form`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jlp._checks import invalid

__all__ = ["leaf_specs", "state_form"]


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
