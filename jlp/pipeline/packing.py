"""One pytree per pipeline stage as flat buffers of a common length, one buffer per dtype.

A pipeline runs every stage as the same SPMD program (`jax.shard_map` over the "stage" axis), so
every device must hold arrays of the same shapes although the stages' parameters, optimizer states
and activations differ. `Packer` lays stage s's leaves end to end (in `jax.tree.flatten` order,
each raveled in C order), one buffer per dtype, zero-padded to the longest stage; `pack(s, tree)`
and `unpack(s, buffers)` convert both ways, exactly (a copy, no arithmetic). Leading axes of the
buffers (pipelines, stash slots) are kept by `unpack`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

__all__ = ["Packer"]


class Packer:
  """Flat per-dtype buffers for one pytree per stage (module docstring).

  Args:
    trees: one pytree per stage of arrays or jax.ShapeDtypeStructs (shapes and dtypes only are
      used).
  """

  def __init__(self, trees: Sequence[Any]):
    self.treedefs = []
    self.layouts: list[list[tuple[str, int, tuple[int, ...]]]] = []
    sizes: dict[str, int] = {}
    for tree in trees:
      leaves, treedef = jax.tree.flatten(tree)
      offsets: dict[str, int] = {}
      layout = []
      for leaf in leaves:
        dtype = np.dtype(leaf.dtype).name
        shape = tuple(int(d) for d in np.shape(leaf))
        layout.append((dtype, offsets.get(dtype, 0), shape))
        offsets[dtype] = offsets.get(dtype, 0) + math.prod(shape)
      for dtype, size in offsets.items():
        sizes[dtype] = max(sizes.get(dtype, 0), size)
      self.treedefs.append(treedef)
      self.layouts.append(layout)
    #: dtype name -> buffer length (the longest stage's total size of that dtype).
    self.sizes = dict(sorted(sizes.items()))

  @property
  def num_stages(self) -> int:
    return len(self.treedefs)

  def zeros(self, leading: tuple[int, ...] = (), xp: Any = np) -> dict[str, Any]:
    """Zero buffers with leading axes `leading` (numpy by default, `xp=jnp` for traced code)."""
    return {d: xp.zeros(leading + (n,), d) for d, n in self.sizes.items()}

  def pack(self, stage: int, tree: Any, xp: Any = jnp) -> dict[str, Any]:
    """Stage `stage`'s `tree` as {dtype: [L_dtype]} buffers (jnp by default, `xp=np` on the host)."""
    leaves = jax.tree.leaves(tree)
    layout = self.layouts[stage]
    if len(leaves) != len(layout):
      raise ValueError(f"stage {stage}: a pytree of {len(leaves)} leaves is not allowed; expected "
                       f"{len(layout)} (the structure given at construction).")
    for leaf, (_, _, shape) in zip(leaves, layout, strict=True):
      if tuple(np.shape(leaf)) != shape:
        raise ValueError(f"stage {stage}: a leaf of shape {np.shape(leaf)} is not allowed; "
                         f"expected {shape}.")
    out = {d: xp.zeros((n,), d) for d, n in self.sizes.items()}
    for leaf, (dtype, offset, shape) in zip(leaves, layout, strict=True):
      flat = xp.ravel(xp.asarray(leaf, dtype))
      if xp is np:
        out[dtype][offset:offset + flat.shape[0]] = flat
      else:
        # Each leaf written in place: a concatenation here made XLA:CPU compile the weight-
        # gradient dots that produce the leaves on a slow path (10x, measured).
        out[dtype] = lax.dynamic_update_slice(out[dtype], flat, (offset,))
    return out

  def unpack(self, stage: int, buffers: dict[str, Any]) -> Any:
    """Stage `stage`'s pytree from its buffers; leading axes of the buffers are kept."""
    leaves = []
    for dtype, offset, shape in self.layouts[stage]:
      buf = buffers[dtype]
      lead = tuple(buf.shape[:-1])
      leaves.append(buf[..., offset:offset + math.prod(shape)].reshape(lead + shape))
    return jax.tree.unflatten(self.treedefs[stage], leaves)

  def structs(self, stage: int) -> Any:
    """Stage `stage`'s pytree as jax.ShapeDtypeStructs (for abstract evaluation)."""
    leaves = [jax.ShapeDtypeStruct(shape, dtype) for dtype, _, shape in self.layouts[stage]]
    return jax.tree.unflatten(self.treedefs[stage], leaves)
