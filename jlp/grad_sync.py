"""The settings of one gradient synchronisation (`GradSync`, docs in `jlp.sync`, which re-exports
everything here): a frozen, hashable dataclass validated on construction, with what the settings
imply (the wire, the bytes each device sends, the compression state's layout). Below `jlp.sync`
(the reduction) and `jlp.diloco`, which both take a GradSync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jlp.collectives.allreduce import packed_wire
from jlp._checks import invalid, is_int
from jlp.collectives import ALGORITHMS, APS_MODES, FORMS
from jlp.compression import COMPRESSORS, Compressor, get as get_compressor
from jlp.compression.casync import DEFAULT_MIN_SIZE, SYNC_TOPOLOGIES, check_pairing
from jlp.compression.casync import init_state as init_compression_state
from jlp.formats import FloatFormat, as_format

__all__ = ["GradSync", "NODE_MAPS", "Plan", "SYNC_REPORT", "normalise_plan"]

NODE_MAPS = ("unroll", "scan", "vmap")
#: What `reduce_gradients` reports (the metrics of a step), with its dtypes.
SYNC_REPORT = {"wire_bytes": jnp.float32, "payload_bytes": jnp.float32, "nonfinite": jnp.int32}
#: A SeCoPa plan as GradSync stores it: ((keystr(path), compress, K), ...) sorted by path.
Plan = tuple[tuple[str, bool, int], ...]


def _check_bool(field: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise invalid(field, value, "True or False")


def normalise_plan(plan: Any) -> Plan:
  """A SeCoPa plan, {keystr(path): (compress, K)} or ((path, compress, K), ...), as the sorted
  tuple GradSync stores (ValueError naming the bad entry)."""
  if isinstance(plan, dict):
    items = []
    for path, entry in plan.items():
      if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
        raise invalid(f"plan[{path!r}]", entry, "a pair (compress: bool, K: int >= 1)")
      items.append((path, *entry))
  elif isinstance(plan, (tuple, list)):
    items = list(plan)
  else:
    raise invalid("plan", plan, "None, a dict {keystr(path): (compress, K)} or a tuple of "
                   "(path, compress, K) triples")
  out = []
  for item in items:
    if not (isinstance(item, (tuple, list)) and len(item) == 3):
      raise invalid("plan entry", item, "a triple (path: str, compress: bool, K: int >= 1)")
    path, compress, k = item
    if not isinstance(path, str):
      raise invalid("plan path", path, "a jax.tree_util.keystr of a gradient leaf")
    if not isinstance(compress, (bool, np.bool_)):
      raise invalid(f"plan[{path!r}] compress", compress, "True or False")
    if not is_int(k) or k < 1:
      raise invalid(f"plan[{path!r}] K", k, "an int >= 1 (the number of partitions)")
    out.append((path, bool(compress), int(k)))
  paths = [p for p, _, _ in out]
  if len(set(paths)) != len(paths):
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    raise invalid("plan paths", repeated, "each gradient path at most once")
  return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class GradSync:
  """How the gradients of the W devices x N virtual nodes are summed (see the module docstring).

  Validated on construction; a format name is turned into its FloatFormat, a compressor name into
  its Compressor and a plan dict into a sorted tuple, so two equal settings compare and hash equal
  (usable as a static jit argument).
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
  compression: Compressor | str | None = None
  topology: str = "ps"
  min_size: int = DEFAULT_MIN_SIZE
  plan: Plan | dict | None = None
  seed: int = 0
  wire: str | None = None

  def __post_init__(self):
    fmt = self.fmt
    if fmt is not None:
      try:
        fmt = as_format(fmt)
      except ValueError as e:
        raise invalid("fmt", self.fmt,
                       f"None, a FloatFormat or a float format name ({e})") from None
      if not isinstance(fmt, FloatFormat):
        raise invalid("fmt", self.fmt, "None or a FloatFormat (block formats cannot hold a sum)")
      object.__setattr__(self, "fmt", fmt)
    if self.algorithm not in ALGORITHMS:
      raise invalid("algorithm", self.algorithm, f"one of {ALGORITHMS}")
    _check_bool("kahan", self.kahan)
    if not any(self.aps is m for m in APS_MODES) and self.aps != "cpd":
      raise invalid("aps", self.aps, "False, True or 'cpd'")
    if self.aps is not False and fmt is None:
      raise invalid("aps", self.aps, "False when fmt=None (APS scales into a format's range)")
    if (isinstance(self.emulate_nodes, bool) or not isinstance(self.emulate_nodes, int)
        or self.emulate_nodes < 1):
      raise invalid("emulate_nodes", self.emulate_nodes, "an int >= 1")
    if self.form not in FORMS:
      raise invalid("form", self.form, f"one of {FORMS}")
    _check_bool("cast_single", self.cast_single)
    if self.node_map not in NODE_MAPS:
      raise invalid("node_map", self.node_map, f"one of {NODE_MAPS}")
    if not isinstance(self.axis_name, str) or not self.axis_name:
      raise invalid("axis_name", self.axis_name, "a mesh axis name such as 'data'")
    if self.algorithm == "psum" and (fmt is not None or self.kahan or self.uses_emulation):
      raise invalid("algorithm", self.algorithm,
                     "'sequential' or 'ring' with fmt, kahan or emulated nodes (psum is XLA's "
                     "float32 all-reduce of real devices)")
    # Which values cross devices as the format's codes (raises for an impossible "packed").
    packed_wire(fmt, self.algorithm, self.aps, self.wire)
    self._check_compression()

  @property
  def packed(self) -> bool:
    """Whether the (uncompressed) reduction sends the format's codes (`wire`)."""
    if self.uses_emulation and self.form == "flat":
      return False
    return packed_wire(self.fmt, self.algorithm, self.aps, self.wire)

  def _check_compression(self) -> None:
    compressor = self.compression
    if isinstance(compressor, str):
      if compressor not in COMPRESSORS:
        raise invalid("compression", compressor,
                       f"None, a jlp.compression.Compressor or one of {sorted(COMPRESSORS)}")
      compressor = get_compressor(compressor)
      object.__setattr__(self, "compression", compressor)
    if compressor is not None and not isinstance(compressor, Compressor):
      raise invalid("compression", compressor,
                     "None, a jlp.compression.Compressor or a registered compressor name")
    if self.topology not in SYNC_TOPOLOGIES:
      raise invalid("topology", self.topology, f"one of {SYNC_TOPOLOGIES}")
    if not is_int(self.min_size) or self.min_size < 0:
      raise invalid("min_size", self.min_size, "an int >= 0 (elements; 0 compresses every leaf)")
    object.__setattr__(self, "min_size", int(self.min_size))
    if self.plan is not None:
      object.__setattr__(self, "plan", normalise_plan(self.plan))
    if not is_int(self.seed):
      raise invalid("seed", self.seed, "an int")
    object.__setattr__(self, "seed", int(self.seed))
    if compressor is None:
      for field, default in (("topology", "ps"), ("min_size", DEFAULT_MIN_SIZE), ("plan", None)):
        if getattr(self, field) != default:
          raise invalid(field, getattr(self, field),
                         f"{default!r} without compression (it only applies to a compressed sync)")
      return
    check_pairing(compressor, self.topology)
    why = "with compression (the compressed sync sums float32 gradients of real devices)"
    if self.fmt is not None:
      raise invalid("fmt", self.fmt, f"None {why}")
    if self.aps is not False:
      raise invalid("aps", self.aps, f"False {why}")
    if self.kahan:
      raise invalid("kahan", self.kahan, f"False {why}")
    if self.algorithm != "sequential":
      raise invalid("algorithm", self.algorithm,
                     "'sequential' with compression (the compressed sync's topology is `topology`)")
    if self.emulate_nodes != 1:
      raise invalid("emulate_nodes", self.emulate_nodes,
                     "1 with compression (CaSync exchanges payloads between the devices of the "
                     "mesh axis; emulated nodes are not compressed)")
    if self.uses_emulation:
      raise invalid("cast_single", self.cast_single,
                     "False with compression (form='cpd' with cast_single emulates nodes)")

  def check_mesh(self, mesh: jax.sharding.Mesh) -> int:
    """The number of devices W along `axis_name`; ValueError if the mesh has no such axis."""
    if self.axis_name not in mesh.axis_names:
      raise invalid("axis_name", self.axis_name, f"an axis of the mesh, one of {mesh.axis_names}")
    return int(mesh.shape[self.axis_name])

  @property
  def uses_emulation(self) -> bool:
    """Whether the reduction goes through `emulated_allreduce` (stacked per-node gradients)."""
    return self.emulate_nodes > 1 or (self.form == "cpd" and self.cast_single)

  @property
  def plan_dict(self) -> dict[str, tuple[bool, int]] | None:
    """The plan as `jlp.compression.sync` takes it: {keystr(path): (compress, K)}, or None."""
    return None if self.plan is None else {p: (c, k) for p, c, k in self.plan}

  def init_state(self, grads: Any, num_devices: int) -> Any:
    """One rank's fresh compression state for gradients shaped like `grads` (arrays or
    ShapeDtypeStructs) over `num_devices` ranks; None without compression."""
    if self.compression is None:
      return None
    return init_compression_state(grads, self.compression, num_devices, topology=self.topology,
                                  min_size=self.min_size, plan=self.plan_dict, seed=self.seed)

  def allreduce_wire_bytes(self, sizes: Sequence[int], num_devices: int) -> int:
    """Bytes one device sends in the uncompressed (CPD) reduction of leaves of `sizes` elements
    (one node's) over `num_devices` devices: 4 per float32 that crosses devices.

      sequential:  one all_gather of every leaf: (W-1) * 4 * n
      ring:        W-1 hops of one chunk per leaf, then one all_gather of each leaf's reduced
                   chunk: (W-1) * 4 * sum(C) * 2 (3 with Kahan: the compensation travels too),
                   C = ceil(size / W) per leaf
      psum:        counted as the float32 ring (XLA picks its all-reduce's algorithm)
      emulated nodes, form="flat":  the all_gather of the N stacked nodes: (W-1) * 4 * N * n
      emulated nodes, form="cpd":   the local fold sends nothing; then as above over W devices
    with n = sum(sizes). APS's exponent agreement (one pmax of one scalar per leaf) is not
    counted. With a packed wire (`packed`: the values that cross are the format's, sent as its
    codes) each value counts ceil(fmt.bits / 8) bytes instead of 4.
    """
    w = int(num_devices)
    if w <= 1:
      return 0
    total = sum(int(s) for s in sizes)
    if self.uses_emulation and self.form == "flat":
      return 4 * (w - 1) * self.emulate_nodes * total
    size = -(-self.fmt.bits // 8) if self.packed else 4
    if self.algorithm == "sequential":
      return size * (w - 1) * total
    chunks = sum(-(-int(s) // w) if s else 1 for s in sizes)
    return size * (w - 1) * chunks * (3 if self.kahan else 2)
