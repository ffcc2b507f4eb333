"""Bytes moved by a compressed sync as the plan's K shrinks (the K-sweep), on 8 emulated devices.

Run: python -m benchmarks.sync_bytes_bench [--elements=1048576] [--compressors=onebit,tbq,dgc]

For every compressor x topology x K in (8, 4, 2, 1), one leaf of --elements float32 per device
(plan {leaf: (True, K)}) beside a 3-element float32 leaf is synchronised with
`jlp.compression.sync_with_bytes`; the table prints, per device averaged over the devices:
  hlo        the bytes the compiled program's collectives move, read from its HLO
             (tests/compression/hlo_bytes.py: all-to-all and all-gather (W-1)/W of their result,
             all-reduce 2(W-1)/W, collective-permute per source-target pair / W);
  wire       the sync's `wire_bytes` (it must equal hlo);
  payload    the sync's `payload_bytes` (HiPress's wire: sparse payloads at their real count);
  vs K=8     hlo / hlo at K = 8.
HiPress moves about 2(W-1)/W of a payload per device whatever K is: K trades load balance and the
number of messages, not volume. Bytes do not depend on the machine: no timing here.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jlp import compression  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "compression"))
import hlo_bytes  # noqa: E402  pylint: disable=g-import-not-at-top

_ELEMENTS = flags.DEFINE_integer("elements", 2 ** 20, "float32 elements of the compressed leaf.")
_COMPRESSORS = flags.DEFINE_list("compressors", ["onebit", "tbq", "terngrad", "dgc", "graddrop"],
                                 "registered compressor names (default parameters).")
W = 8


def program_bytes(comp, topology: str, n: int, k: int) -> tuple[float, float, float]:
  """(HLO bytes, wire_bytes, payload_bytes) of one sync of an n-element leaf in K partitions."""
  mesh = Mesh(np.array(jax.devices()[:W]), ("r",))
  key = jax.random.key(0) if comp.needs_key else None

  def body(tree, key):
    out, _, report = compression.sync_with_bytes(
        jax.tree.map(lambda x: x[0], tree), "r", comp, topology=topology, min_size=3,
        plan={"['g']": (True, k)}, key=key)
    return jax.tree.map(lambda x: x[None], out), jax.tree.map(lambda b: b[None], report)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("r"), P()), out_specs=P("r")))
  rng = np.random.default_rng(0)
  tree = {"g": rng.standard_normal((W, n)).astype(np.float32),
          "s": rng.standard_normal((W, 3)).astype(np.float32)}
  hlo, _ = hlo_bytes.collective_bytes(fn.lower(tree, key).compile().as_text(), W)
  _, report = fn(tree, key)
  return (hlo, float(np.asarray(report["wire_bytes"])[0]),
          float(np.asarray(report["payload_bytes"])[0]))


def main(argv):
  del argv
  n = _ELEMENTS.value
  print(f"K-sweep: one leaf of {n} float32 per device (+ a 3-element uncompressed leaf), W = {W}; "
        "bytes per device")
  print(f"{'compressor':<10} {'topology':<8} {'K':>2} {'hlo':>12} {'wire':>12} {'payload':>12} "
        f"{'vs K=8':>7}")
  for name in _COMPRESSORS.value:
    comp = compression.get(name)
    for topology in ("ps", "ring"):
      base = None
      for k in (8, 4, 2, 1):
        hlo, wire, payload = program_bytes(comp, topology, n, k)
        base = base or hlo
        flag = "" if abs(wire - hlo) <= 1e-6 * hlo else "  ! wire != hlo"
        print(f"{name:<10} {topology:<8} {k:>2} {hlo:>12.1f} {wire:>12.1f} {payload:>12.1f} "
              f"{hlo / base:>7.3f}{flag}", flush=True)


if __name__ == "__main__":
  app.run(main)
