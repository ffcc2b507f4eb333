"""Sync plans that hold on the cluster they are made for: SeCoPa fitted from whole syncs, a planner
over every topology and the uncompressed sum, and autotuning (docs/hipress.md, "Planning on a live
cluster"). Above `jlp.sync` and `jlp.compression`, whose GradSync and syncs it times.

HiPress's SeCoPa prices a sync from its primitives (encode, decode, one send, ...) timed alone on an
idle device (`jlp.compression.profile.fit_cost_model`, the seed's "per-operation" fit). A real ring
runs 2(W - 1) dependent hops of encode, send and decode with every host's threads sharing the
cores, so on a real cluster those prices are off by 1.3-9x (BENCHMARKS.md). Here:

  * `fit_sync_costs` times whole syncs on the live devices, for each topology the compressor
    supports, at a few sizes and partition counts, and fits the planner's coefficients to them
    by non-negative least squares: per topology a `CostModel` whose formulas (SeCoPa's,
    `jlp.compression.secopa`) reproduce those timings; a line for the uncompressed float32 ring
    all-reduce (what CaSync sends its uncompressed leaves with, all of them packed into one); one
    for XLA's own float32 all-reduce (`lax.psum`); and, for topology "allreduce" (PowerSGD), a
    line in the synced elements. A label that was timed (a topology at one K, the float32 ring,
    psum) is predicted from its own timings, interpolated in size (`SyncFit.predict`): SeCoPa's
    formula cannot follow them on a real cluster (at 100 Mbit/s onebit's PS took 92 ms at K = 1,
    142 at K = 4 and 58 at K = 8), so it prices only the K that were not timed, and a plan picks
    its K among the timed ones: the largest, unless a smaller one is predicted clearly faster
    (`SMALLER_K_AT_MOST`). A `SyncFit` is saved as JSON and reused on the same cluster
    (`SyncFit.load(path, cluster=...)`: None when it was made on another one), like NCCL's
    tuning or Horovod's autotune cache.
  * `rank_plans` prices, for a gradient pytree, every plan the compressor can run: per topology
    (each leaf compressed into its planned K, or left to the float32 ring when that is cheaper),
    and "don't compress" twice: every leaf on the float32 ring ("float32") or summed by
    `lax.psum` ("psum"). Cheapest first.
  * `autotune` times the highest ranked plans (at most `limit`; "don't compress" as psum only;
    with a fit, only those predicted within `DROP_ABOVE` of the fastest) on the live devices,
    with gradient-shaped data, and keeps the fastest; every process takes process 0's choice.

Per-leaf costs add up (HiPress's assumption; jlp sends the uncompressed leaves as one all-reduce,
priced by the float32 line of their total size).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from scipy import optimize

from jlp.compression import base
from jlp.compression.base import invalid
from jlp.compression.secopa import CostModel, LinearCost, leaf_sizes
from jlp.sync import GradSync, reduce_gradients

__all__ = ["FLOAT32", "PSUM", "Plan", "SyncFit", "autotune", "cluster_key", "fit_sync_costs",
           "plan_sync", "rank_plans", "time_in_rounds", "time_syncs_ms"]

#: The plan that compresses nothing: every leaf summed by the float32 ring all-reduce.
FLOAT32 = "float32"
#: The plan that compresses nothing and sums with XLA's own all-reduce (`lax.psum`).
PSUM = "psum"


def cluster_key(devices: Sequence[Any] | None = None) -> str:
  """What identifies "the same cluster" for a saved fit: the processes, devices per process and
  device kind (e.g. "2 processes x 4 cpu")."""
  devices = jax.devices() if devices is None else list(devices)
  processes = sorted({d.process_index for d in devices})
  kinds = sorted({d.device_kind for d in devices})
  return f"{len(processes)} processes x {len(devices) // max(1, len(processes))} {','.join(kinds)}"


@dataclasses.dataclass(frozen=True)
class SyncFit:
  """Sync costs fitted from whole syncs (module docstring).

  models: {topology: CostModel} for "ps" / "ring" (SeCoPa's formulas, coefficients fitted to
    whole compressed syncs on `num_nodes` devices).
  float32: the float32 ring all-reduce of x elements, ms.
  allreduce: topology "allreduce" (PowerSGD): its sync of x elements, ms; None if not fitted.
  psum: XLA's float32 all-reduce (`lax.psum`) of x elements, ms; None if not fitted (a fit
    saved before it was timed).
  samples: (label, elements, measured ms) the fit was made from.
  """
  compressor: str
  num_nodes: int
  cluster: str
  models: tuple[tuple[str, CostModel], ...]
  float32: LinearCost
  allreduce: LinearCost | None = None
  samples: tuple[tuple[str, int, float], ...] = ()
  psum: LinearCost | None = None

  def model(self, topology: str) -> CostModel:
    return dict(self.models)[topology]

  @property
  def topologies(self) -> tuple[str, ...]:
    return tuple(t for t, _ in self.models) + (("allreduce",) if self.allreduce else ())

  def predict(self, label: str, size: int, codec: base.Compressor | None = None) -> float:
    """ms of one sync of `size` elements as the sample `label` ("float32", "psum",
    "allreduce", "ps, K=4", "ring, K=8") runs it: the syncs timed with that label interpolated
    in size (`_interpolate`) when there are two sizes of them, else the fitted line or SeCoPa
    formula."""
    measured = self.measured(label, size)
    if measured is not None:
      return measured
    if label == FLOAT32:
      return self.float32(size)
    if label == "allreduce":
      return self.allreduce(size)
    if label == PSUM:
      return self.psum(size)
    topology, k = _parse(label)
    codec = base.get(self.compressor) if codec is None else codec
    return _compressed_cost(self.model(topology), topology, size, k, self.num_nodes, codec)

  def measured(self, label: str, size: int) -> float | None:
    """The timed syncs of `label` interpolated at `size` (None: fewer than two sizes timed)."""
    by_size: dict[int, list[float]] = {}
    for name, elements, ms in self.samples:
      if name == label:
        by_size.setdefault(elements, []).append(ms)
    if len(by_size) < 2:
      return None
    return _interpolate(sorted((x, statistics.mean(v)) for x, v in by_size.items()), size)

  def partitions(self, topology: str) -> tuple[int, ...]:
    """The partition counts K timed for `topology` at two sizes or more (what a plan picks
    from: SeCoPa's formula prices the others, and on a real cluster misprices them)."""
    sizes: dict[int, set[int]] = {}
    for name, elements, _ in self.samples:
      if name.startswith(f"{topology}, K="):
        sizes.setdefault(_parse(name)[1], set()).add(elements)
    return tuple(sorted(k for k, seen in sizes.items() if len(seen) >= 2))

  def to_dict(self) -> dict[str, Any]:
    return {"compressor": self.compressor, "num_nodes": self.num_nodes, "cluster": self.cluster,
            "models": {t: m.to_dict() for t, m in self.models},
            "float32": self.float32.to_dict(),
            "allreduce": None if self.allreduce is None else self.allreduce.to_dict(),
            "psum": None if self.psum is None else self.psum.to_dict(),
            "samples": [list(s) for s in self.samples]}

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> SyncFit:
    try:
      return cls(compressor=data["compressor"], num_nodes=int(data["num_nodes"]),
                 cluster=data["cluster"],
                 models=tuple((t, CostModel.from_dict(m)) for t, m in data["models"].items()),
                 float32=LinearCost(**data["float32"]),
                 allreduce=None if data["allreduce"] is None else LinearCost(**data["allreduce"]),
                 psum=None if data.get("psum") is None else LinearCost(**data["psum"]),
                 samples=tuple((str(a), int(b), float(c)) for a, b, c in data["samples"]))
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"a sync fit of {sorted(data) if isinstance(data, Mapping) else data!r} "
                       f"is not allowed: {e!r}; expected SyncFit.to_dict()'s keys.") from None

  def save(self, path: str | os.PathLike) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.to_dict(), f, indent=1)
      f.write("\n")
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str | os.PathLike, *, cluster: str | None = None,
           compressor: str | None = None, num_nodes: int | None = None) -> SyncFit | None:
    """The fit saved at `path`, or None when there is none or it was made for another cluster,
    compressor or node count than those given."""
    if not os.path.exists(path):
      return None
    with open(path, encoding="utf-8") as f:
      try:
        fit = cls.from_dict(json.load(f))
      except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not a JSON sync fit: {e}") from None
    for name, want in (("cluster", cluster), ("compressor", compressor),
                       ("num_nodes", num_nodes)):
      if want is not None and getattr(fit, name) != want:
        return None
    return fit


def _interpolate(points: Sequence[tuple[int, float]], size: int) -> float:
  """Piecewise-linear in size through `points` [(size, ms)] sorted by size; beyond them, the
  nearest segment's line, its slope clamped at >= 0 (a noisy pair of timings must not predict
  a larger sync as cheaper), and never below 0."""
  xs = [float(x) for x, _ in points]
  ys = [float(y) for _, y in points]
  if xs[0] <= size <= xs[-1]:
    return float(np.interp(size, xs, ys))
  (x0, y0), (x1, y1) = ((xs[-2], ys[-2]), (xs[-1], ys[-1])) if size > xs[-1] else \
      ((xs[0], ys[0]), (xs[1], ys[1]))
  slope = max(0.0, (y1 - y0) / (x1 - x0))
  end_x, end_y = (x1, y1) if size > xs[-1] else (x0, y0)
  return max(0.0, end_y + slope * (size - end_x))


def _parse(label: str) -> tuple[str, int]:
  topology, k = label.split(", K=")
  return topology, int(k)


def _label(topology: str, k: int) -> str:
  return f"{topology}, K={k}"


def _payload(codec: base.Compressor, size: int, k: int) -> float:
  return codec.wire_bytes(-(-size // k)) / 4


def _features(topology: str, size: int, k: int, n: int, codec: base.Compressor
              ) -> dict[str, float]:
  """The coefficients of SeCoPa's compressed formula (jlp.compression.secopa) for one sync, as
  {coefficient: its factor}: the formula is linear in (w, b) of each primitive."""
  part, small = size / k, _payload(codec, size, k)
  if topology == "ps":
    encodes, decodes = min(k + 1, n), min(n - 1 + k, 2 * (n - 1))
    return {"gather.w": small, "gather.b": 1.0, "encode.w": encodes * part,
            "encode.b": encodes, "decode.w": decodes * small, "decode.b": decodes,
            "aggregate.w": (n - 1) * part}
  return {"ring_send.w": 2 * (n - 1) * small, "ring_send.b": 2 * (n - 1),
          "encode.w": n * part, "encode.b": n, "decode.w": n * small, "decode.b": n,
          "aggregate.w": (n - 1) * part}


def _compressed_cost(model: CostModel, topology: str, size: int, k: int, n: int,
                     codec: base.Compressor) -> float:
  values = _coefficients(model, topology, n)
  return sum(values[name] * factor for name, factor in _features(topology, size, k, n,
                                                                 codec).items())


def _coefficients(model: CostModel, topology: str, n: int) -> dict[str, float]:
  gather = model.gather_at(n) if topology == "ps" else LinearCost(0, 0, 0)
  return {"gather.w": gather.w, "gather.b": gather.b, "encode.w": model.encode.w,
          "encode.b": model.encode.b, "decode.w": model.decode.w, "decode.b": model.decode.b,
          "aggregate.w": model.aggregate.w, "ring_send.w": model.ring_send.w,
          "ring_send.b": model.ring_send.b}


def fit_from_samples(samples: Sequence[tuple[str, int, float]], *, compressor: str,
                     num_nodes: int, cluster: str) -> SyncFit:
  """A `SyncFit` from (label, elements, ms) samples of whole syncs: "float32", "psum" and
  "allreduce" samples get a line each (least squares, slope and intercept >= 0); "ps, K=k" /
  "ring, K=k" samples, per topology, SeCoPa's coefficients by non-negative least squares."""
  codec = base.get(compressor)
  by_kind: dict[str, list[tuple[int, int, float]]] = {}
  for label, size, ms in samples:
    if label in (FLOAT32, PSUM, "allreduce"):
      by_kind.setdefault(label, []).append((0, size, ms))
    else:
      topology, k = _parse(label)
      by_kind.setdefault(topology, []).append((k, size, ms))
  if FLOAT32 not in by_kind:
    raise invalid("samples", [s[0] for s in samples], "some 'float32' samples")

  def line(points: list[tuple[int, int, float]]) -> LinearCost:
    a = np.array([[size, 1.0] for _, size, _ in points])
    (w, b), _ = optimize.nnls(a, np.array([ms for _, _, ms in points]))
    return LinearCost(float(w), float(b), 0.0)

  models = []
  for topology in ("ps", "ring"):
    points = by_kind.get(topology)
    if not points:
      continue
    rows = [_features(topology, size, k, num_nodes, codec) for k, size, _ in points]
    names = sorted({name for row in rows for name in row})
    # Columns in ms per unit, scaled to comparable magnitudes for the solver.
    matrix = np.array([[row.get(name, 0.0) for name in names] for row in rows])
    scale = np.maximum(np.abs(matrix).max(axis=0), 1e-30)
    solution, _ = optimize.nnls(matrix / scale, np.array([ms for _, _, ms in points]))
    got = dict(zip(names, (solution / scale).tolist()))
    lc = lambda key: LinearCost(got.get(f"{key}.w", 0.0), got.get(f"{key}.b", 0.0), 0.0)
    gather = lc("gather")
    models.append((topology, CostModel(
        encode=lc("encode"), decode=lc("decode"), aggregate=lc("aggregate"),
        ring_send=lc("ring_send"), gather={num_nodes: gather},
        broadcast={num_nodes: LinearCost(0, 0, 0)}, ratio=min(1.0, codec.wire_bytes(1 << 20) / (
            4 << 20)), source=f"fitted from whole {topology} syncs on {cluster}")))
  return SyncFit(compressor=compressor, num_nodes=num_nodes, cluster=cluster,
                 models=tuple(models), float32=line(by_kind[FLOAT32]),
                 allreduce=line(by_kind["allreduce"]) if "allreduce" in by_kind else None,
                 psum=line(by_kind[PSUM]) if PSUM in by_kind else None,
                 samples=tuple((str(a), int(b), float(c)) for a, b, c in samples))


# -- plans ----------------------------------------------------------------------------------------
class Plan(NamedTuple):
  """One way to sync a gradient pytree: `label` ("float32", "psum", "ps", "ring", "allreduce"),
  the GradSync fields that run it, and its predicted ms (nan: not priced)."""
  label: str
  topology: str | None  # None: no compression (float32 ring, or psum for label "psum")
  leaf_plan: tuple[tuple[str, tuple[bool, int]], ...]  # CaSync's {keystr(path): (compress, K)}
  predicted_ms: float

  def grad_sync(self, compressor: base.Compressor, seed: int = 0) -> GradSync:
    """The `jlp.sync.GradSync` that runs this plan."""
    if self.topology is None:
      return GradSync(algorithm="psum" if self.label == PSUM else "ring")
    if self.topology == "allreduce":
      return GradSync(compression=compressor, topology="allreduce", min_size=0, seed=seed)
    return GradSync(compression=compressor, topology=self.topology, min_size=0,
                    plan=dict(self.leaf_plan), seed=seed)


#: A partition count below the largest one timed is planned only when predicted at most this
#: fraction of the largest's time (`_pick_partitions`).
SMALLER_K_AT_MOST = 0.8


def _pick_partitions(costs: Mapping[int, float]) -> tuple[int, float]:
  """(K, ms) for one leaf from {K: predicted ms}: the largest K, unless a smaller K is predicted
  at most `SMALLER_K_AT_MOST` of its time. At the largest K every node owns a partition (K = N);
  at a smaller K the decode, sum and encode of the owners run on K devices while the rest wait,
  which a predicted gain within the fit's noise does not pay for. In the cluster study's runs
  with fresh fits (BENCHMARKS.md), every K < N planned was predicted within 20 % of K = N, and
  it ran 1.05-2.5x slower than K = N in 5 of its 7 cells."""
  widest = max(costs)
  k, ms = min(costs.items(), key=lambda kv: kv[1])
  return (k, ms) if ms <= SMALLER_K_AT_MOST * costs[widest] else (widest, costs[widest])


def rank_plans(tree: Any, compressor: base.Compressor | str, fit: SyncFit | None = None, *,
               num_nodes: int | None = None, min_size: int = 0) -> list[Plan]:
  """Every plan for `tree`'s leaves, cheapest first (module docstring): "float32", "psum", and per
  topology the compressor runs ("ps", "ring": each leaf in the largest K the fit timed
  (`SyncFit.partitions`; SeCoPa's range when it timed none), or a smaller K predicted at most
  `SMALLER_K_AT_MOST` of that one's time, or on the float32 ring when cheaper; "allreduce": the
  compressor's own routing). Without a fit, the CaSync plans are the sync's own rule on each
  topology (a leaf of more than `min_size` elements compressed into K = min(N, size) partitions,
  the rest on the float32 ring) and nothing is priced."""
  codec = base.get(compressor) if isinstance(compressor, str) else compressor
  leaves = leaf_sizes(tree)
  n = fit.num_nodes if fit is not None else num_nodes
  if n is None:
    raise invalid("num_nodes", num_nodes, "the device count when no fit is given")
  total = sum(size for _, size in leaves)
  nan = float("nan")
  plans = [Plan(FLOAT32, None, (), fit.predict(FLOAT32, total) if fit else nan),
           Plan(PSUM, None, (), fit.predict(PSUM, total) if fit and fit.psum else nan)]
  for topology in codec.topologies:
    if topology == "allreduce":
      priced = fit is not None and fit.allreduce is not None
      plans.append(Plan("allreduce", "allreduce", (),
                        fit.predict("allreduce", total) if priced else nan))
      continue
    if fit is None or topology not in fit.topologies:
      entries = tuple((name, (True, min(n, size)) if size and size > min_size else (False, 1))
                      for name, size in leaves)
      plans.append(Plan(topology, topology, entries, nan))
      continue
    timed = fit.partitions(topology)
    best = {}  # a non-empty leaf's planned K and its ms
    for name, size in leaves:
      if size:
        ks = [k for k in timed if k <= size] or range(1, min(n, size) + 1)
        costs = {k: fit.predict(_label(topology, k), size, codec) for k in ks}
        best[name] = _pick_partitions(costs)

    def priced(compressed: set[str]) -> float:
      dense = sum(size for name, size in leaves if name not in compressed)
      return sum(best[name][1] for name in compressed) + (fit.predict(FLOAT32, dense)
                                                          if dense else 0.0)
    # HiPress's rule: a leaf is compressed when that costs less than adding it to the float32
    # all-reduce of the dense leaves (the line's slope). Compressing every leaf instead saves
    # that all-reduce whole (its intercept too): the cheaper of the two.
    marginal = {name for name, size in leaves if size and best[name][1] < fit.float32.w * size}
    cost, chosen = min(((priced(s), s) for s in (marginal, set(best))), key=lambda o: o[0])
    entries = tuple((name, (True, best[name][0]) if name in chosen else (False, 1))
                    for name, _ in leaves)
    plans.append(Plan(topology, topology, entries, cost))
  return sorted(plans, key=lambda p: (math.isnan(p.predicted_ms), p.predicted_ms))


def plan_sync(tree: Any, compressor: base.Compressor | str, fit: SyncFit) -> Plan:
  """The plan `fit` predicts fastest for `tree` (`rank_plans`' first)."""
  return rank_plans(tree, compressor, fit)[0]


# -- timing ---------------------------------------------------------------------------------------
def _sync_program(sync: Any, tree: Any, mesh: Mesh, axis: str) -> Callable[[Any], Any]:
  num_devices = mesh.devices.size

  def body(grads):
    state = sync.init_state(grads, num_devices) if sync.compression is not None else None
    summed, _, _ = reduce_gradients(grads, sync, state, jnp.int32(0))
    return summed
  specs = jax.tree.map(lambda _: P(axis), tree)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs,
                               check_vma=False))


def _device_tree(tree: Any, mesh: Mesh, axis: str, seed: int = 0) -> Any:
  """`tree`'s shapes, float32 values, one copy per device along `axis`: per leaf one
  standard-normal draw, which device d holds rolled by d along the leaf's first axis (different
  values on every device at the cost of one draw, not W)."""
  rng = np.random.default_rng(seed)
  sharding = NamedSharding(mesh, P(axis))
  w = mesh.devices.size

  def make(leaf):
    one = rng.standard_normal(leaf.shape or (1,)).astype(np.float32)
    rows = one.shape[0]

    def shard(index):
      start = index[0].start or 0
      return np.roll(one, start // rows, axis=0)
    return jax.make_array_from_callback((w * rows,) + one.shape[1:], sharding, shard)
  return jax.tree.map(make, tree)


def time_in_rounds(calls: Sequence[Callable[[], Any]], repeats: int, *,
                   drop_above: float | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> list[list[float]]:
  """Wall ms of each of `calls` (each runs a program to completion), in `repeats` rounds that call
  every one once, in an order rotated by one from round to round. A change of load during the
  timing (another process, another host's threads on the same cores) then falls on every call
  alike, not on whichever was being timed then. With `drop_above`, a call slower than
  `drop_above` times the fastest of the first round is not called again (it cannot be the
  fastest; with several processes, process 0's first round decides). Every process of a
  multi-host run calls them in the same order. Returns each call's times, in the order given."""
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise invalid("repeats", repeats, "an int >= 1")
  times: list[list[float]] = [[] for _ in calls]
  live = list(range(len(calls)))
  for r in range(repeats):
    for j in range(len(live)):
      i = live[(j + r) % len(live)]
      start = clock()
      calls[i]()
      times[i].append(1000 * (clock() - start))
    if r == 0 and drop_above is not None and live:
      fastest = min(times[i][0] for i in live)
      keep = np.array([times[i][0] <= drop_above * fastest for i in live])
      if jax.process_count() > 1:  # every process goes on calling the same programs
        keep = multihost_utils.broadcast_one_to_all(keep)
      live = [i for i, kept in zip(live, np.asarray(keep).tolist()) if kept]
  return times


def time_syncs_ms(syncs: Sequence[Any], tree: Any, *, mesh: Mesh | None = None,
                  axis: str = "data", repeats: int = 3, drop_above: float | None = None,
                  seed: int = 0) -> list[float]:
  """Median wall ms of each of `syncs` on one pytree shaped like `tree` (one copy per device:
  leaves of shape [n, ...] become [W * n, ...] sharded along `axis`): each compiled and called
  once, then timed in rounds (`time_in_rounds`)."""
  mesh = Mesh(np.array(jax.devices()), (axis,)) if mesh is None else mesh
  flat = jax.tree.map(lambda a: jax.ShapeDtypeStruct((math.prod(a.shape),), jnp.float32), tree)
  data = _device_tree(flat, mesh, axis, seed)
  programs = [_sync_program(sync, flat, mesh, axis) for sync in syncs]
  for fn in programs:
    jax.block_until_ready(fn(data))
  times = time_in_rounds([lambda fn=fn: jax.block_until_ready(fn(data)) for fn in programs],
                         repeats, drop_above=drop_above)
  return [statistics.median(t) for t in times]


#: Rounds of timing a fit takes the median of. On the namespaced cluster unshaped, a median of 3
#: timed XLA's psum at 1M elements 29.6 ms in one fit and 24.5 in another: as far apart as the
#: plans a fit chooses between there (BENCHMARKS.md). The timing costs little beside compiling
#: the syncs.
FIT_REPEATS = 11


def fit_sync_costs(compressor: base.Compressor | str, *, sizes: Sequence[int] = (
    1 << 14, 1 << 16, 1 << 18), partitions: Sequence[int] | None = None,
                   mesh: Mesh | None = None, axis: str = "data", repeats: int = FIT_REPEATS,
                   cluster: str | None = None,
                   timer: Callable[[Sequence[Any], Any], Sequence[float]] | None = None
                   ) -> SyncFit:
  """Times whole syncs of one gradient of each size in `sizes` on the live devices and fits a
  `SyncFit` (module docstring): the float32 ring, and for each topology the compressor supports
  ("ps" / "ring" at each K in `partitions`, default 1, N/2 and N; "allreduce" once per size).
  With several processes every one fits process 0's timings (so all plan alike). `cluster`
  names the cluster in the fit (default `cluster_key()`; add what the devices do not tell, such
  as the link's shaping). The syncs of one size are timed in rounds (`time_syncs_ms`);
  `timer(syncs, tree) -> [ms]` replaces that timing (tests)."""
  codec = base.get(compressor) if isinstance(compressor, str) else compressor
  if not isinstance(codec, base.Compressor):
    raise invalid("compressor", compressor, "a jlp.compression Compressor or a registered name")
  mesh = Mesh(np.array(jax.devices()), (axis,)) if mesh is None else mesh
  n = mesh.devices.size
  if n < 2:
    raise invalid("devices", n, "at least 2")
  sizes = tuple(sizes)
  if len(set(sizes)) < 2 or not all(isinstance(s, int) and s >= 1 for s in sizes):
    raise invalid("sizes", sizes, "at least two distinct positive ints")
  ks = tuple(sorted({1, max(1, n // 2), n})) if partitions is None else tuple(partitions)
  if not ks or not all(isinstance(k, int) and 1 <= k <= n for k in ks):
    raise invalid("partitions", partitions, f"ints in [1, {n}]")
  timer = timer or (lambda syncs, tree: time_syncs_ms(syncs, tree, mesh=mesh, axis=axis,
                                                      repeats=repeats))
  samples = []
  for size in sizes:
    tree = {"g": jax.ShapeDtypeStruct((size,), jnp.float32)}
    labelled = [(FLOAT32, GradSync(algorithm="ring")), (PSUM, GradSync(algorithm="psum"))]
    for topology in codec.topologies:
      if topology == "allreduce":
        labelled.append(("allreduce", GradSync(compression=codec, topology="allreduce",
                                               min_size=0)))
        continue
      labelled += [(_label(topology, k), GradSync(compression=codec, topology=topology,
                                                  min_size=0, plan={"['g']": (True, k)}))
                   for k in ks if k <= size]
    ms = timer([sync for _, sync in labelled], tree)
    samples += [(label, size, float(m)) for (label, _), m in zip(labelled, ms, strict=True)]
  if jax.process_count() > 1:
    ms = multihost_utils.broadcast_one_to_all(np.array([m for _, _, m in samples], np.float64))
    samples = [(label, size, float(m)) for (label, size, _), m in zip(samples, ms, strict=True)]
  name = next((n_ for n_, c in base.COMPRESSORS.items() if c is type(codec)), type(codec).__name__)
  return fit_from_samples(samples, compressor=name, num_nodes=n,
                          cluster=cluster or cluster_key(list(mesh.devices.flat)))


# -- autotune -------------------------------------------------------------------------------------
#: A plan this many times slower than the fastest in autotune's first round is not timed again.
DROP_ABOVE = 2.0


class Autotuned(NamedTuple):
  """What `autotune` chose: the plan, and the ms measured for each plan timed, by label in the
  order timed (empty when the fit left one plan to time: see `autotune`)."""
  plan: Plan
  measured_ms: dict[str, float]

  def to_dict(self) -> dict[str, Any]:
    return {"label": self.plan.label, "topology": self.plan.topology,
            "leaf_plan": [[k, list(v)] for k, v in self.plan.leaf_plan],
            "predicted_ms": self.plan.predicted_ms, "measured_ms": self.measured_ms}

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Autotuned:
    plan = Plan(data["label"], data["topology"],
                tuple((k, (bool(v[0]), int(v[1]))) for k, v in data["leaf_plan"]),
                float(data["predicted_ms"]))
    return cls(plan, {k: float(v) for k, v in data["measured_ms"].items()})


def tree_digest(tree: Any) -> str:
  """A short digest of `tree`'s leaf paths and shapes (what a saved choice was made for)."""
  text = ";".join(f"{name}:{size}" for name, size in leaf_sizes(tree))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def autotune(tree: Any, compressor: base.Compressor | str, *, fit: SyncFit | None = None,
             limit: int = 4, min_size: int = 0, mesh: Mesh | None = None, axis: str = "data",
             repeats: int = 3, seed: int = 0,
             timer: Callable[[Sequence[Any], Any], Sequence[float]] | None = None
             ) -> Autotuned:
  """Times the `limit` plans `rank_plans` ranks highest (all of them without a fit; their CaSync
  plans compress the leaves of more than `min_size` elements) on gradient-shaped data and keeps
  the fastest; with several processes every process takes process 0's choice.

  Each candidate costs the runner a train-step compile (1.4-2 s for digits_wide here). So with
  a fit, a plan predicted more than `DROP_ABOVE` times slower than the plan predicted fastest
  is not timed: the whole-sync fit's predictions were within +-30 % of the measured sync in
  91-94 % of the cluster study's cells at 1M and 4M elements, and such a plan is all but
  certain to lose. When that leaves one plan, it is chosen without timing
  (`Autotuned.measured_ms` is then empty). "Don't compress" is timed once, as "psum": the
  float32 ring sums the same float32 mean and took 0.87-1.65x psum's time in the cluster
  study's rows (BENCHMARKS.md; at most 5 % faster on the shaped links). A run that wants the
  ring configures it (`GradSync(algorithm="ring")`).

  The plans are timed in `repeats` rounds (`time_in_rounds`); a plan more than `DROP_ABOVE`
  times slower than the fastest in the first round is not timed again, and its measured ms is
  that first time. `timer(syncs, tree) -> [ms]` replaces the timing (tests)."""
  codec = base.get(compressor) if isinstance(compressor, str) else compressor
  if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
    raise invalid("limit", limit, "an int >= 1")
  mesh = Mesh(np.array(jax.devices()), (axis,)) if mesh is None else mesh
  ranked = [plan for plan in rank_plans(tree, codec, fit, num_nodes=mesh.devices.size,
                                       min_size=min_size) if plan.label != FLOAT32][:limit]
  # Cheapest first, unpriced (NaN) last: a NaN prediction compares False and is timed.
  plans = [p for p in ranked if not p.predicted_ms > DROP_ABOVE * ranked[0].predicted_ms]
  if len(plans) == 1:
    return Autotuned(plans[0], {})
  timer = timer or (lambda syncs, t: time_syncs_ms(syncs, t, mesh=mesh, axis=axis,
                                                   repeats=repeats, drop_above=DROP_ABOVE,
                                                   seed=seed))
  ms = timer([p.grad_sync(codec, seed) for p in plans], tree)
  measured = {p.label: float(m) for p, m in zip(plans, ms, strict=True)}
  best = min(range(len(plans)), key=lambda i: measured[plans[i].label])
  if jax.process_count() > 1:
    best = int(multihost_utils.broadcast_one_to_all(np.int32(best)))
  return Autotuned(plans[best], measured)
