"""Fits SeCoPa's cost model (jlp.compression.secopa, docs/hipress.md#secopa) on the current devices.

HiPress ships its coefficients but no profiler ("one need to measure and fitting curves in
different cluster", its SeCoPa README); this is that profiler. For every size x in
`sizes` it times, as the median of `repeats` calls after a compiling call (jitted, ms):

  encode E(x)     compressor.encode of x float32 elements, on one device
  decode D(x')    compressor.decode of that payload, on one device; x' = wire_bytes(x) / 4, the
                  payload in float32 elements (SeCoPa calls D with rS/K)
  aggregate A(x)  an add of two x-element arrays, on one device
  ring send R(x)  one `lax.ppermute` hop of x elements per device around the ring of N devices
  gather G(x)     `lax.all_to_all` of N chunks of x elements per device: every device owns one
                  partition of x elements and receives it from all N nodes at once (CaSync-PS's
                  gather of K = N partitions, run in parallel as SeCoPa assumes)
  broadcast B(x)  `lax.all_gather` of x elements per device (every owner sends its partition)

all collectives inside `jax.shard_map` over the mesh axis. Each primitive gets (w, b) from a
least-squares line through its (x, ms) points (numpy.polyfit, degree 1; a negative slope, i.e.
noise, becomes w = 0 with b = the mean) and o = the smallest measured time. The model's ratio r is
the compressor's wire_bytes(x) / (4x) at the largest size (TBQ: 1/16, SeCoPa's constant), the
ratio a plan without a compressor uses; plan with the same compressor
(`secopa_plan(..., cost_model=model, compressor=codec)`) to use its payload at every partition size.

N: G and B are fitted for every node count in `node_counts` (default: the axis size) on the first
N devices along the axis; E, D, A on the first device; R on the whole axis. On emulated CPU
devices (`--xla_force_host_platform_device_count`) the "network" is memory copies between
threads on shared cores, so the fitted communication costs describe this machine, not a cluster
(XLA:CPU's all_to_all measured 4-19x slower here than an all_gather receiving the same bytes, so
a fitted G dominates CaSync-PS's cost on this machine).
The default sizes (2^10..2^20 elements, x2) keep a fit on 8 emulated devices under a minute
(15-30 s here with node counts 4 and 8, as benchmarks/secopa_cluster_bench fits them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jlp.compression import base
from jlp.compression.secopa import CostModel, LinearCost

__all__ = ["DEFAULT_SIZES", "fit_cost_model", "fit_line"]

DEFAULT_SIZES = tuple(2 ** k for k in range(10, 21))  # 2^10 .. 2^20


def fit_line(xs: Sequence[float], ms: Sequence[float]) -> LinearCost:
  """(w, b) by least squares through (x, ms), o = min(ms); w < 0 -> w = 0, b = mean(ms)."""
  xs, ms = np.asarray(xs, np.float64), np.asarray(ms, np.float64)
  if xs.shape != ms.shape or xs.size < 2 or np.unique(xs).size < 2:
    raise base.invalid("sizes", xs.tolist(), "at least two distinct sizes")
  w, b = np.polyfit(xs, ms, 1)
  if w < 0:
    w, b = 0.0, float(np.mean(ms))
  return LinearCost(float(w), float(b), float(np.min(ms)))


def _zeros(shape: tuple[int, ...], sharding) -> jax.Array:
  """float32 zeros laid out by `sharding`, each process making only its own shards (a global
  host array per process would take n^2 x the gathered size in a multi-process fit)."""
  return jax.make_array_from_callback(
      shape, sharding, lambda index: np.zeros(
          [len(range(*i.indices(d))) for i, d in zip(index, shape)], np.float32))


def _time_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def _axis_devices(mesh: Mesh, axis: str) -> list[Any]:
  """The devices along `axis` (index 0 of every other axis)."""
  i = mesh.axis_names.index(axis)
  return list(np.moveaxis(mesh.devices, i, 0).reshape(mesh.devices.shape[i], -1)[:, 0])


def _collective(devices: list[Any], axis: str, body) -> tuple[Any, Any]:
  mesh = Mesh(np.array(devices), (axis,))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                             check_vma=False))
  return fn, NamedSharding(mesh, P(axis))


def fit_cost_model(mesh: Mesh | None = None, axis: str | None = None, *,
                   sizes: Sequence[int] = DEFAULT_SIZES,
                   compressor: base.Compressor | str = "tbq",
                   node_counts: Sequence[int] | None = None, repeats: int = 5) -> CostModel:
  """SeCoPa's CostModel measured on `mesh` (default: all devices on one axis "d") along `axis`
  (default: the mesh's only axis), for `compressor` (an instance or a registered name), with G
  and B for each of `node_counts` (default: the axis size; each in 2..axis size). See the module
  docstring for what is timed."""
  if mesh is None:
    mesh = Mesh(np.array(jax.devices()), ("d",))
  if not isinstance(mesh, Mesh):
    raise base.invalid("mesh", mesh, "a jax.sharding.Mesh or None")
  if axis is None:
    if len(mesh.axis_names) != 1:
      raise base.invalid("axis", axis, f"one of {mesh.axis_names} (the mesh has several axes)")
    axis = mesh.axis_names[0]
  if axis not in mesh.axis_names:
    raise base.invalid("axis", axis, f"one of {mesh.axis_names}")
  devices = _axis_devices(mesh, axis)
  size = len(devices)
  if size < 2:
    raise base.invalid(f"mesh size along {axis!r}", size, "at least 2 devices")
  node_counts = (size,) if node_counts is None else tuple(node_counts)
  for n in node_counts:
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= size:
      raise base.invalid("node_counts entry", n, f"an int in 2..{size} (the devices on {axis!r})")
  if len(set(node_counts)) != len(node_counts) or not node_counts:
    raise base.invalid("node_counts", node_counts, "distinct node counts, at least one")
  sizes = tuple(sizes)
  for x in sizes:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
      raise base.invalid("sizes entry", x, "a positive int (float32 elements)")
  if len(set(sizes)) < 2:
    raise base.invalid("sizes", sizes, "at least two distinct sizes")
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise base.invalid("repeats", repeats, "a positive int")
  codec = base.get(compressor) if isinstance(compressor, str) else compressor
  if not isinstance(codec, base.Compressor):
    raise base.invalid("compressor", compressor,
                       "a jlp.compression Compressor or a registered name")

  # Encode, decode and the add run on this process's first device on the axis (each process of
  # a multi-process run times its own; they run the same collectives).
  one = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
  key = jax.device_put(jax.random.key(0), one) if codec.needs_key else None
  encode = jax.jit(lambda v, s, k: codec.encode(v, s, k))
  add = jax.jit(jnp.add)
  samples: dict[str, list[tuple[float, float]]] = {"encode": [], "decode": [], "aggregate": [],
                                                   "ring_send": []}
  for n in node_counts:
    samples[f"gather{n}"], samples[f"broadcast{n}"] = [], []
  ring = [(i, (i + 1) % size) for i in range(size)]
  send, send_sharding = _collective(devices, axis, lambda v: lax.ppermute(v, axis, ring))
  rng = np.random.default_rng(0)
  for x in sizes:
    v = jax.device_put(rng.standard_normal(x, np.float32), one)
    state = jax.device_put(codec.init(v), one)
    payload, _ = encode(v, state, key)
    decode = jax.jit(lambda p, n=x: codec.decode(p, n))
    samples["encode"].append((x, _time_ms(encode, v, state, key, repeats=repeats)))
    samples["decode"].append((codec.wire_bytes(x) / 4, _time_ms(decode, payload, repeats=repeats)))
    samples["aggregate"].append((x, _time_ms(add, v, v, repeats=repeats)))
    del v, state, payload
    data = _zeros((size * x,), send_sharding)
    samples["ring_send"].append((x, _time_ms(send, data, repeats=repeats)))
    del data
    for n in node_counts:
      gather, sharding = _collective(devices[:n], axis,
                                     lambda v: lax.all_to_all(v, axis, 0, 0, tiled=True))
      data = _zeros((n * n * x,), sharding)
      samples[f"gather{n}"].append((x, _time_ms(gather, data, repeats=repeats)))
      bcast, sharding = _collective(devices[:n], axis,
                                    lambda v: lax.all_gather(v, axis, tiled=True))
      data = _zeros((n * x,), sharding)
      samples[f"broadcast{n}"].append((x, _time_ms(bcast, data, repeats=repeats)))
      del data
  lines = {k: fit_line(*zip(*pts)) for k, pts in samples.items()}
  largest = max(sizes)
  source = (f"fitted: {len(devices)} {one.platform} devices along {axis!r}, "
            f"{type(codec).__name__}, sizes {min(sizes)}..{largest}, median of {repeats}")
  return CostModel(encode=lines["encode"], decode=lines["decode"],
                   aggregate=lines["aggregate"], ring_send=lines["ring_send"],
                   gather={n: lines[f"gather{n}"] for n in node_counts},
                   broadcast={n: lines[f"broadcast{n}"] for n in node_counts},
                   ratio=min(1.0, codec.wire_bytes(largest) / (4 * largest)), source=source)
