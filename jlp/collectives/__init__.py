"""Low-precision gradient all-reduce (CPD, docs/cpd.md#all-reduce): sequential and ring, Kahan, APS.

`allreduce` runs inside `jax.shard_map` over a mesh axis; `emulated_allreduce`
reduces virtual nodes stacked on a leading axis (one device emulating N nodes,
CPD's flat and two-level forms), bit-identical to the real thing.
"""

from jlp.collectives.allreduce import ALGORITHMS, allreduce
from jlp.collectives.aps import APS_MODES
from jlp.collectives.emulated import FORMS, emulated_allreduce

__all__ = ["ALGORITHMS", "APS_MODES", "FORMS", "allreduce", "emulated_allreduce"]
