"""Gradient synchronisation settings of the data-parallel step (`GradSync`) and the reduction.

`GradSync` says how the per-node gradients of one step are summed (cpd.md §3, §4):

  fmt          None (float32) or the format of every value of the reduction (a FloatFormat or a
               name such as "e4m3"; CPD's numerics: FloatFormat(4, 3, compat="cpd")).
  algorithm    "sequential" (CPD: all_gather, then a fold in rank order with a cast after each add)
               or "ring" (reduce-scatter + all-gather over ppermute, every value on the wire in
               fmt).
  kahan        Kahan-compensated fold (cpd.md §3.1).
  aps          False, True (APS with exact exponents, cpd.md §4) or "cpd" (CPD's log2/ceil rule).
  emulate_nodes  N virtual nodes per device (cpd.md §3.2): each device's batch is split into N
               consecutive micro-batches, node index = device_index * N + v.
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

The reduction itself is `jlp.collectives` (`allreduce` for N == 1, `emulated_allreduce`
otherwise); this module only validates the settings and dispatches, inside `jax.shard_map`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jlp import collectives
from jlp.collectives import ALGORITHMS, APS_MODES, FORMS
from jlp.formats import FloatFormat, as_format

__all__ = ["GradSync", "NODE_MAPS", "reduce_gradients"]

NODE_MAPS = ("unroll", "scan", "vmap")


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def _check_bool(field: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise _invalid(field, value, "True or False")


@dataclasses.dataclass(frozen=True)
class GradSync:
  """How the gradients of the W devices x N virtual nodes are summed (see the module docstring).

  Validated on construction; a format name is turned into its FloatFormat, so two equal settings
  compare and hash equal (usable as a static jit argument).
  """

  fmt: FloatFormat | str | None = None
  algorithm: str = "sequential"
  kahan: bool = False
  aps: bool | str = False
  emulate_nodes: int = 1
  form: str = "flat"
  cast_single: bool = False
  node_map: str = "unroll"
  axis_name: str = "data"

  def __post_init__(self):
    fmt = self.fmt
    if fmt is not None:
      try:
        fmt = as_format(fmt)
      except ValueError as e:
        raise _invalid("fmt", self.fmt,
                       f"None, a FloatFormat or a float format name ({e})") from None
      if not isinstance(fmt, FloatFormat):
        raise _invalid("fmt", self.fmt, "None or a FloatFormat (block formats cannot hold a sum)")
      object.__setattr__(self, "fmt", fmt)
    if self.algorithm not in ALGORITHMS:
      raise _invalid("algorithm", self.algorithm, f"one of {ALGORITHMS}")
    _check_bool("kahan", self.kahan)
    if not any(self.aps is m for m in APS_MODES) and self.aps != "cpd":
      raise _invalid("aps", self.aps, "False, True or 'cpd'")
    if self.aps is not False and fmt is None:
      raise _invalid("aps", self.aps, "False when fmt=None (APS scales into a format's range)")
    if (isinstance(self.emulate_nodes, bool) or not isinstance(self.emulate_nodes, int)
        or self.emulate_nodes < 1):
      raise _invalid("emulate_nodes", self.emulate_nodes, "an int >= 1")
    if self.form not in FORMS:
      raise _invalid("form", self.form, f"one of {FORMS}")
    _check_bool("cast_single", self.cast_single)
    if self.node_map not in NODE_MAPS:
      raise _invalid("node_map", self.node_map, f"one of {NODE_MAPS}")
    if not isinstance(self.axis_name, str) or not self.axis_name:
      raise _invalid("axis_name", self.axis_name, "a mesh axis name such as 'data'")

  def check_mesh(self, mesh: jax.sharding.Mesh) -> int:
    """The number of devices W along `axis_name`; ValueError if the mesh has no such axis."""
    if self.axis_name not in mesh.axis_names:
      raise _invalid("axis_name", self.axis_name, f"an axis of the mesh, one of {mesh.axis_names}")
    return int(mesh.shape[self.axis_name])

  @property
  def uses_emulation(self) -> bool:
    """Whether the reduction goes through `emulated_allreduce` (stacked per-node gradients)."""
    return self.emulate_nodes > 1 or (self.form == "cpd" and self.cast_single)


def reduce_gradients(grads: Any, sync: GradSync) -> Any:
  """The summed gradient on every device; call inside `jax.shard_map` over `sync.axis_name`.

  `grads` holds one gradient per leaf when `sync.uses_emulation` is False, and leaves stacked on
  a leading axis of the device's nodes (in node order) otherwise.
  """
  if sync.uses_emulation:
    return collectives.emulated_allreduce(grads,
                                          fmt=sync.fmt,
                                          algorithm=sync.algorithm,
                                          kahan=sync.kahan,
                                          aps=sync.aps,
                                          mean=False,
                                          form=sync.form,
                                          axis_name=sync.axis_name,
                                          cast_single=sync.cast_single)
  return collectives.allreduce(grads,
                               sync.axis_name,
                               fmt=sync.fmt,
                               algorithm=sync.algorithm,
                               kahan=sync.kahan,
                               aps=sync.aps,
                               mean=False)
