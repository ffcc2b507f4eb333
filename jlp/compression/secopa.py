"""SeCoPa: HiPress's selective compression and partitioning planner (docs/hipress.md#secopa).

For every gradient of S float32 elements, SeCoPa decides whether to compress it and into how many
partitions K ∈ {1..N} to split it, from a cost model of CaSync's primitives: encode E,
decode D, aggregate A, one ring send R, and the PS gather G and broadcast B of N nodes. Every
primitive costs

    c(x) = max(o, w·x + b)   ms, x = float32 elements

(HiPress's `SeCoPa.py` writes it as "o below (o − b)/w, linear above"; identical whenever
o <= b, which holds for all of its coefficients). With r = the compression ratio and the op counts
of CaSync-PS (co-located servers) and CaSync-Ring:

    PS_orig(K)   = G(S/K) + B(S/K) + (N−1)·A(S/K)
    PS_comp(K)   = G(rS/K) + B(rS/K) + min(K+1, N)·E(S/K) + min(N−1+K, 2(N−1))·D(rS/K)
                   + (N−1)·A(S/K)
    RING_orig(K) = 2(N−1)·R(S/K) + (N−1)·A(S/K)
    RING_comp(K) = 2(N−1)·R(rS/K) + N·E(S/K) + N·D(rS/K) + (N−1)·A(S/K)

compress iff min_K comp < min_K orig; K = the first argmin of the chosen mode. Partitions count as
perfectly parallel (one partition's cost), so an uncompressed gradient always gets K = N.

The ratio. HiPress plans every algorithm with r = 1/16 (TBQ's and 2-bit TernGrad's), whatever it
compresses with. Given the `compressor`, each gradient is planned with that codec's own payload:
rS/K above becomes the float32 elements of one partition's payload on the wire,
wire_bytes(c) / 4 with c = ceil(S/K) (`Compressor.wire_bytes`; sparse codecs at capacity), i.e. the
ratio `compression_ratio(compressor, c)` = wire_bytes(c) / (4c) at that partition size: ~1/32 for
onebit, 1/16 for TBQ, 2*density (+ its 4-byte header) for DGC and GradDrop, b/32 (+ 10 header
bytes) for b-bit TernGrad. Without a compressor, r is `ratio` when given, else the cost model's
`CostModel.ratio` (the seed's 1/16): HiPress's plan. The sums are evaluated in HiPress's order with
Python floats, so `secopa_plan` with `CostModel.seed()` and no compressor writes the lines
HiPress's script writes for the same input, byte for byte (tests). The encode / decode costs E, D
are the model's (the seed's were fitted on HiPress's kernels); `jlp.compression.profile`
fits them for one codec.

`CostModel.seed()` holds HiPress's coefficients (fitted on the authors' local cluster, presumably
56 Gbps; N ∈ {4, 8, 16} only); `jlp.compression.profile.fit_cost_model` fits one on the current
devices. File formats: `read_grads` reads HiPress's input.txt (`name,num_elements` lines),
`write_plan` / `read_plan` its SeCoPaPlan.txt (`name,size,y|n,K` lines, what the script writes;
HiPress's README shows 3 fields). `plan_for_tree` plans a pytree's leaves, keyed by
`jax.tree_util.keystr` of their paths, as the CaSync sync (`jlp.compression.sync`) takes it:
pass the sync's compressor (`plan_for_tree(grads, num_nodes=8, compressor=sync.compression)`).
`static_plan` is HiPress's other selection rule (`--comp-threshold 262144`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax

from jlp.compression import base
from jlp.compression.base import invalid
from jlp.compression.casync import DEFAULT_MIN_SIZE, TOPOLOGIES

__all__ = ["COMP_THRESHOLD", "SEED_COEFFICIENTS", "CostModel", "LinearCost", "PlanEntry",
           "SyncCosts", "TOPOLOGIES", "compression_ratio", "leaf_sizes", "plan_for_tree",
           "read_grads", "read_plan", "secopa_plan", "static_plan", "sync_costs", "write_plan"]

#: HiPress's static rule: compress iff numel > 262144 floats (1 MiB), as `sync`'s default.
COMP_THRESHOLD = DEFAULT_MIN_SIZE


def _finite(field: str, value: Any, *, nonnegative: bool = False) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
      or (nonnegative and value < 0):
    raise invalid(field, value, "a non-negative finite float" if nonnegative else "a finite float")
  return float(value)


@dataclasses.dataclass(frozen=True)
class LinearCost:
  """One primitive's cost in ms of x float32 elements: c(x) = max(o, w·x + b)."""

  w: float
  b: float
  o: float

  def __post_init__(self):
    for name, nonneg in (("w", True), ("b", False), ("o", True)):
      object.__setattr__(self, name, _finite(f"LinearCost.{name}", getattr(self, name),
                                             nonnegative=nonneg))

  def __call__(self, x: float) -> float:
    return max(self.o, self.w * x + self.b)

  def scaled(self, factor: float) -> "LinearCost":
    """The same primitive with its per-element cost w times `factor` (bandwidth / factor)."""
    return LinearCost(self.w * factor, self.b, self.o)

  def to_dict(self) -> dict[str, float]:
    return {"w": self.w, "b": self.b, "o": self.o}


def _line(field: str, value: Any) -> LinearCost:
  if isinstance(value, LinearCost):
    return value
  if isinstance(value, Mapping) and set(value) == {"w", "b", "o"}:
    return LinearCost(value["w"], value["b"], value["o"])
  raise invalid(field, value, "a LinearCost or a mapping with keys 'w', 'b', 'o'")


def _per_nodes(field: str, value: Any) -> tuple[tuple[int, LinearCost], ...]:
  items = value.items() if isinstance(value, Mapping) else value
  try:
    pairs = [(n, v) for n, v in items]
  except (TypeError, ValueError):
    raise invalid(field, value, "a mapping {num_nodes: LinearCost}") from None
  out = {}
  for n, v in pairs:
    if isinstance(n, str) and n.isdigit():
      n = int(n)  # JSON object keys
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n in out:
      raise invalid(f"{field} num_nodes", n, "distinct ints >= 2")
    out[n] = _line(f"{field}[{n}]", v)
  if not out:
    raise invalid(field, value, "coefficients for at least one node count")
  return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class CostModel:
  """SeCoPa's cost model: (w, b, o) per primitive (module docstring), gather and broadcast per
  node count N, the compression ratio r used when no compressor is given (HiPress's 1/16 in the
  seed; a fit's is its codec's at the largest size timed), and where the numbers come from.

  gather / broadcast: {N: LinearCost} (stored as sorted ((N, LinearCost), ...) pairs, hashable);
  both must cover the same N. `CostModel.seed()` is HiPress's (N ∈ {4, 8, 16}).
  """

  encode: LinearCost
  decode: LinearCost
  aggregate: LinearCost
  ring_send: LinearCost
  gather: Any
  broadcast: Any
  ratio: float = 1.0 / 16
  source: str = ""

  def __post_init__(self):
    for name in ("encode", "decode", "aggregate", "ring_send"):
      object.__setattr__(self, name, _line(f"CostModel.{name}", getattr(self, name)))
    for name in ("gather", "broadcast"):
      object.__setattr__(self, name, _per_nodes(f"CostModel.{name}", getattr(self, name)))
    if [n for n, _ in self.gather] != [n for n, _ in self.broadcast]:
      raise invalid("CostModel.broadcast node counts", [n for n, _ in self.broadcast],
                    f"the gather's node counts {[n for n, _ in self.gather]}")
    ratio = _finite("CostModel.ratio", self.ratio)
    if not 0 < ratio <= 1:
      raise invalid("CostModel.ratio", self.ratio, "a float in (0, 1]")
    object.__setattr__(self, "ratio", ratio)
    if not isinstance(self.source, str):
      raise invalid("CostModel.source", self.source, "a str")

  @classmethod
  def seed(cls) -> "CostModel":
    """HiPress's coefficients (`SEED_COEFFICIENTS`)."""
    return SEED_COEFFICIENTS

  @property
  def nodes(self) -> tuple[int, ...]:
    """The node counts N this model has gather/broadcast coefficients for."""
    return tuple(n for n, _ in self.gather)

  def check_nodes(self, num_nodes: Any) -> int:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or \
        num_nodes not in self.nodes:
      raise invalid("num_nodes", num_nodes, f"one of {self.nodes} (the node counts of the cost "
                    f"model{' ' + repr(self.source) if self.source else ''})")
    return num_nodes

  def gather_at(self, num_nodes: int) -> LinearCost:
    return dict(self.gather)[self.check_nodes(num_nodes)]

  def broadcast_at(self, num_nodes: int) -> LinearCost:
    return dict(self.broadcast)[self.check_nodes(num_nodes)]

  def scaled_communication(self, factor: float) -> "CostModel":
    """The model with the per-element cost w of R, G and B times `factor` (a network `factor`
    times slower); compute (E, D, A), intercepts and overheads unchanged."""
    factor = _finite("factor", factor)
    if factor <= 0:
      raise invalid("factor", factor, "a positive float")
    return dataclasses.replace(
        self, ring_send=self.ring_send.scaled(factor),
        gather=tuple((n, c.scaled(factor)) for n, c in self.gather),
        broadcast=tuple((n, c.scaled(factor)) for n, c in self.broadcast))

  def to_dict(self) -> dict[str, Any]:
    return {"encode": self.encode.to_dict(), "decode": self.decode.to_dict(),
            "aggregate": self.aggregate.to_dict(), "ring_send": self.ring_send.to_dict(),
            "gather": {str(n): c.to_dict() for n, c in self.gather},
            "broadcast": {str(n): c.to_dict() for n, c in self.broadcast},
            "ratio": self.ratio, "source": self.source}

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
    fields = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, Mapping):
      raise invalid("cost model", data, f"a mapping with keys {sorted(fields)}")
    unknown = sorted(set(data) - fields)
    if unknown:
      raise invalid(f"cost model key {unknown[0]!r}", data[unknown[0]],
                    f"one of {sorted(fields)}")
    missing = sorted(fields - set(data) - {"ratio", "source"})
    if missing:
      raise invalid(f"cost model key {missing[0]!r}", None, "a value (missing)")
    return cls(**data)

  def save(self, path: str | os.PathLike) -> None:
    """Writes the model as JSON (floats in repr form: `load` gives back an equal model)."""
    with open(path, "w", encoding="utf-8") as f:
      json.dump(self.to_dict(), f, indent=2)
      f.write("\n")

  @classmethod
  def load(cls, path: str | os.PathLike) -> "CostModel":
    with open(path, encoding="utf-8") as f:
      try:
        data = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not a JSON cost model: {e}") from None
    return cls.from_dict(data)


#: HiPress's coefficients, `SeCoPa.py`: ms per float32 element, ms, ms.
SEED_COEFFICIENTS = CostModel(
    encode=LinearCost(1.4133e-8, 5.8938e-2, 0.05408),
    decode=LinearCost(6.2041e-9, 1.3956e-1, 0.07287),
    aggregate=LinearCost(0, 0, 0),
    ring_send=LinearCost(8.5005e-7, 2.0337e-1, 0.09766),
    gather={4: LinearCost(2.7156e-6, 4.1930e-1, 0.15573),
            8: LinearCost(6.1167e-6, 8.0768e-1, 0.28778),
            16: LinearCost(1.2937e-5, 1.4406, 0.59503)},
    broadcast={4: LinearCost(2.7157e-6, 2.2156e-1, 0.14820),
               8: LinearCost(6.1172e-6, 2.7285e-1, 0.29666),
               16: LinearCost(1.2915e-5, 4.5538e-1, 0.58353)},
    ratio=1.0 / 16,
    source="HiPress SeCoPa.py (authors' local cluster)")


class SyncCosts(NamedTuple):
  """Modelled sync time (ms) of one gradient for K = 1..N: orig[K-1] and comp[K-1]."""
  orig: tuple[float, ...]
  comp: tuple[float, ...]


class PlanEntry(NamedTuple):
  """One line of a SeCoPa plan: `name,size,y|n,K`."""
  name: str
  size: int
  compress: bool
  partitions: int


def _topology(topology: Any) -> str:
  if not isinstance(topology, str) or topology.lower() not in TOPOLOGIES:
    raise invalid("topology", topology, "'ps' or 'ring' (case-insensitive)")
  return topology.lower()


def _size(field: str, size: Any) -> int:
  if isinstance(size, bool) or not isinstance(size, int) or size < 0:
    raise invalid(field, size, "a non-negative int (float32 elements)")
  return size


def _check_model(cost_model: Any) -> CostModel:
  model = SEED_COEFFICIENTS if cost_model is None else cost_model
  if not isinstance(model, CostModel):
    raise invalid("cost_model", model, "a jlp.compression.secopa.CostModel or None")
  return model


def _codec(compressor: Any) -> base.Compressor:
  if isinstance(compressor, str) and compressor in base.COMPRESSORS:
    return base.get(compressor)
  if not isinstance(compressor, base.Compressor):
    raise invalid("compressor", compressor, "None, a jlp.compression.Compressor or one of "
                  f"{sorted(base.COMPRESSORS)}")
  return compressor


def compression_ratio(compressor: base.Compressor | str, size: int) -> float:
  """wire_bytes(size) / (4·size): the bytes one payload of `size` float32 elements puts on the
  wire over the bytes of the elements (sparse codecs at capacity); the ratio SeCoPa plans a
  partition of `size` elements with (module docstring). May exceed 1 for tiny sizes."""
  codec = _codec(compressor)
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise invalid("size", size, "a positive int (float32 elements)")
  return codec.wire_bytes(size) / (4 * size)


def _payload(model: CostModel, compressor: Any, ratio: Any) -> Callable[[int, int], float]:
  """payload(S, K): float32 elements of one compressed partition of a gradient of S elements cut
  in K (rS/K in the module docstring's formulas)."""
  if compressor is not None:
    if ratio is not None:
      raise invalid("ratio", ratio, "None when a compressor is given (the compressor's own ratio "
                    "is used at each partition size)")
    codec = _codec(compressor)
    return lambda s, k: codec.wire_bytes(-(-s // k)) / 4 if s else 0.0
  if ratio is None:
    r = model.ratio
  else:
    r = _finite("ratio", ratio)
    if not 0 < r <= 1:
      raise invalid("ratio", ratio, "None or a float in (0, 1]")
  return lambda s, k: s * r / k  # HiPress's order of operations


def sync_costs(size: int, *, num_nodes: int, topology: str,
               cost_model: CostModel | None = None,
               compressor: base.Compressor | str | None = None,
               ratio: float | None = None) -> SyncCosts:
  """The four formulas of the module docstring for one gradient of `size` elements, evaluated
  in HiPress's order (Python floats). The compressed payload: `compressor`'s at each partition
  size, else the ratio `ratio`, else `cost_model.ratio` (module docstring)."""
  model = _check_model(cost_model)
  topology = _topology(topology)
  n = model.check_nodes(num_nodes)
  s = _size("size", size)
  payload = _payload(model, compressor, ratio)
  return _costs(s, n, topology, model, payload)


def _costs(s: int, n: int, topology: str, model: CostModel,
           payload: Callable[[int, int], float]) -> SyncCosts:
  enc, dec, agg = model.encode, model.decode, model.aggregate
  orig, comp = [], []
  if topology == "ps":
    gather, bcast = model.gather_at(n), model.broadcast_at(n)
    for k in range(1, n + 1):
      aggr = (n - 1) * agg(s / k)
      small = payload(s, k)
      orig.append(gather(s / k) + bcast(s / k) + aggr)
      comp.append(gather(small) + bcast(small) + min(k + 1, n) * enc(s / k)
                  + min(n - 1 + k, 2 * (n - 1)) * dec(small) + aggr)
  else:
    send = model.ring_send
    for k in range(1, n + 1):
      aggr = (n - 1) * agg(s / k)
      small = payload(s, k)
      orig.append(2 * (n - 1) * send(s / k) + aggr)
      comp.append(2 * (n - 1) * send(small) + n * enc(s / k) + n * dec(small) + aggr)
  return SyncCosts(tuple(orig), tuple(comp))


def _grads(grads: Any) -> list[tuple[str, int]]:
  if isinstance(grads, (str, bytes, Mapping)) or not isinstance(grads, Iterable):
    raise invalid("grads", grads, "a sequence of (name, size) pairs")
  out = []
  for i, item in enumerate(grads):
    if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], str):
      raise invalid(f"grads[{i}]", item, "a (name: str, size: int) pair")
    out.append((item[0], _size(f"grads[{i}] size", item[1])))
  return out


def secopa_plan(grads: Iterable[tuple[str, int]], *, num_nodes: int, topology: str,
                cost_model: CostModel | None = None,
                compressor: base.Compressor | str | None = None,
                ratio: float | None = None) -> list[PlanEntry]:
  """SeCoPa's plan for gradients [(name, float32 elements), ...] on `num_nodes` nodes with
  CaSync-PS (topology "ps") or CaSync-Ring ("ring"): [(name, size, compress, K), ...] in input
  order. cost_model: None = HiPress's (`CostModel.seed()`, N ∈ {4, 8, 16}).

  compressor: the codec the sync compresses with (an instance or a registered name): each
  gradient is planned with its payload at each partition size (module docstring). Without it,
  every gradient is planned with the ratio `ratio`, or with None `cost_model.ratio` (HiPress's
  1/16 in the seed: HiPress's plan). At most one of compressor and ratio."""
  model = _check_model(cost_model)
  topology = _topology(topology)
  n = model.check_nodes(num_nodes)
  payload = _payload(model, compressor, ratio)
  plan = []
  for name, size in _grads(grads):
    costs = _costs(size, n, topology, model, payload)
    best_orig, best_comp = min(costs.orig), min(costs.comp)
    if best_orig > best_comp:
      plan.append(PlanEntry(name, size, True, costs.comp.index(best_comp) + 1))
    else:
      plan.append(PlanEntry(name, size, False, costs.orig.index(best_orig) + 1))
  return plan


def static_plan(grads: Iterable[tuple[str, int]], *, num_nodes: int,
                comp_threshold: int = COMP_THRESHOLD) -> list[PlanEntry]:
  """HiPress's static rule (`--comp-threshold`): compress iff size > comp_threshold, every
  gradient in K = num_nodes partitions (one per owner node)."""
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
    raise invalid("num_nodes", num_nodes, "a positive int")
  threshold = _size("comp_threshold", comp_threshold)
  return [PlanEntry(name, size, size > threshold, num_nodes) for name, size in _grads(grads)]


def leaf_sizes(tree: Any) -> list[tuple[str, int]]:
  """[(jax.tree_util.keystr(path), number of elements)] of `tree`'s leaves (arrays or
  jax.ShapeDtypeStructs), the (name, size) pairs the planners take."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, "shape", None)
    if shape is None:
      raise invalid(f"tree{jax.tree_util.keystr(path)}", leaf, "an array or jax.ShapeDtypeStruct")
    out.append((jax.tree_util.keystr(path), math.prod(shape)))
  return out


def plan_for_tree(tree: Any, *, num_nodes: int, topology: str = "ps",
                  cost_model: CostModel | None = None, comp_threshold: int | None = None,
                  compressor: base.Compressor | str | None = None,
                  ratio: float | None = None) -> dict[str, tuple[bool, int]]:
  """{jax.tree_util.keystr(path): (compress, K)} for every leaf of `tree` (arrays or
  jax.ShapeDtypeStruct; size = number of elements): SeCoPa's plan (`secopa_plan`: pass the sync's
  `compressor` to plan with its own ratio; without it, `ratio` or the cost model's, HiPress's
  1/16), or with `comp_threshold` the static rule (`static_plan`, which needs no ratio). This
  dict is what `jlp.compression.sync` takes as its plan."""
  grads = leaf_sizes(tree)
  if comp_threshold is None:
    plan = secopa_plan(grads, num_nodes=num_nodes, topology=topology, cost_model=cost_model,
                       compressor=compressor, ratio=ratio)
  else:
    _topology(topology)
    _payload(_check_model(cost_model), compressor, ratio)  # validated, not used
    plan = static_plan(grads, num_nodes=num_nodes, comp_threshold=comp_threshold)
  return {e.name: (e.compress, e.partitions) for e in plan}


def _lines(path: str | os.PathLike) -> Iterable[tuple[str, str]]:
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      line = line.rstrip("\r\n")
      if line.strip():
        yield f"{os.fspath(path)} line {i}", line


def read_grads(path: str | os.PathLike) -> list[tuple[str, int]]:
  """HiPress's input.txt: one `name,num_float32_elements` line per gradient (blank lines
  skipped); names are kept as written."""
  grads = []
  for where, line in _lines(path):
    fields = line.split(",")
    try:
      size = int(fields[1]) if len(fields) == 2 and fields[0] else -1
    except ValueError:
      size = -1
    if size < 0:
      raise invalid(where, line, "'name,num_elements' (a name and a non-negative int)")
    grads.append((fields[0], size))
  return grads


def write_plan(path: str | os.PathLike, plan: Iterable[tuple[str, int, bool, int]]) -> None:
  """Writes `name,size,y|n,K` lines, as HiPress's SeCoPa.py does."""
  lines = []
  for i, entry in enumerate(plan):
    if not isinstance(entry, (tuple, list)) or len(entry) != 4:
      raise invalid(f"plan[{i}]", entry, "a (name, size, compress, K) tuple")
    name, size, compress, k = entry
    if not isinstance(name, str) or not name or any(c in name for c in ",\r\n"):
      raise invalid(f"plan[{i}] name", name, "a non-empty str without ',' or line breaks")
    _size(f"plan[{i}] size", size)
    if not isinstance(compress, bool):
      raise invalid(f"plan[{i}] compress", compress, "a bool")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise invalid(f"plan[{i}] K", k, "a positive int")
    lines.append(f"{name},{size},{'y' if compress else 'n'},{k}\n")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(lines)


def read_plan(path: str | os.PathLike) -> list[PlanEntry]:
  """A plan file of `name,size,y|n,K` lines (what `write_plan` and HiPress's script write)."""
  plan = []
  for where, line in _lines(path):
    fields = line.split(",")
    try:
      ok = len(fields) == 4 and fields[0] and fields[2] in ("y", "n")
      size, k = (int(fields[1]), int(fields[3])) if ok else (-1, 0)
    except ValueError:
      size, k = -1, 0
    if size < 0 or k < 1:
      raise invalid(where, line, "'name,size,y|n,K' (size >= 0, K >= 1)")
    plan.append(PlanEntry(fields[0], size, fields[2] == "y", k))
  return plan
