"""Gradient compression (HiPress, docs/hipress.md): compressors with HiPress's wire formats and
error feedback, compression-aware synchronisation (CaSync PS and ring; PowerSGD over
all-reduces) inside `jax.shard_map`, and
the SeCoPa planner.

    c = jlp.compression.get("onebit")                  # or OneBit(), TBQ(threshold=1.0), ...
    payload, state = c.encode(grad, c.init(grad))      # fixed-shape packed arrays
    approx = c.decode(payload, grad.size)
    wire = c.to_bytes(payload)                         # HiPress's bytes, byte for byte
    summed, state = jlp.compression.sync(grads, "data", c, state, topology="ps")  # in shard_map
    plan = jlp.compression.plan_for_tree(grads, num_nodes=8, topology="ring", compressor=c)
                                                       # SeCoPa, each partition at c's own size

A new compressor is a small frozen dataclass with a payload layout and two functions over
unpacked fields (`jlp.compression.base`; docs/tour.md, "Writing a compressor").
"""

from jlp.compression import ops
from jlp.compression.base import COMPRESSORS, Compressor, get, register
from jlp.compression.casync import (SYNC_TOPOLOGIES, TOPOLOGIES, init_state, leaf_routes, sync,
                                   sync_with_bytes)
from jlp.compression.codecs import DGC, TBQ, DGCServer, GradDrop, OneBit, TernGrad
from jlp.compression.contrib import QSGD, EFSignSGD
from jlp.compression.layout import Header, Packed, Scalars, Sparse
from jlp.compression.powersgd import PowerSGD
from jlp.compression.profile import fit_cost_model
from jlp.compression.secopa import CostModel, compression_ratio, plan_for_tree, secopa_plan

__all__ = ["COMPRESSORS", "Compressor", "CostModel", "DGC", "DGCServer", "EFSignSGD", "GradDrop",
           "Header", "OneBit", "Packed", "PowerSGD", "QSGD", "Scalars", "Sparse", "SYNC_TOPOLOGIES",
           "TBQ", "TernGrad", "TOPOLOGIES", "compression_ratio", "get", "fit_cost_model",
           "init_state", "leaf_routes", "ops", "plan_for_tree", "register", "secopa_plan", "sync",
           "sync_with_bytes"]
