"""Data-parallel training: mesh and shardings, the jitted step with a custom-precision gradient
all-reduce (CPD, docs/cpd.md) or a compressed sync (HiPress, docs/hipress.md), optax recipes,
multi-process start-up.

    mesh = jlp.train.data_mesh()                       # ('data',) over all global devices
    optimizer = jlp.train.torch_sgd(0.1, momentum=0.9, weight_decay=5e-4,
                                    decay_mask=jlp.train.decay_mask(jlp.train.is_bn_or_bias))
    graphdef, state = jlp.train.init_train_state(model, optimizer, mesh)
    step = jlp.train.TrainStep(graphdef, optimizer, mesh,
                               jlp.train.GradSync(fmt="e4m3", aps=True, emulate_nodes=4))
    state, metrics = step(state, jlp.train.shard_batch(local_batch, mesh))

    # HiPress compression (jlp.compression): onebit with error feedback, CaSync-PS
    sync = jlp.train.GradSync(compression="onebit", topology="ps", min_size=0)
    graphdef, state = jlp.train.init_train_state(model, optimizer, mesh, sync)  # + sync_state
    step = jlp.train.TrainStep(graphdef, optimizer, mesh, sync)   # metrics["wire_bytes"]

Modules: `mesh` (data_mesh, shardings, shard_batch, replicate), `step`
(TrainState, TrainStep), `diloco_step` (DiLoCoStep: every device a jlp.sync.DiLoCo replica), `optim` (SGD / LARS / schedules / weight-decay masks), `distributed`
(jax.distributed start-up, SLURM).
"""

from jlp.train.diloco_step import DiLoCoStep, init_diloco_state
from jlp.train.distributed import initialize
from jlp.train.mesh import batch_sharding, data_mesh, replicate, replicated, shard_batch
from jlp.train.optim import (cpd_lars, cpd_resnet18_lr, decay_mask, is_bn_or_bias, lars,
                             path_contains, step_schedule, torch_sgd, warmup_step_schedule)
from jlp.train.step import (TrainState, TrainStep, cross_entropy_loss, init_sync_state,
                            init_train_state, merge_model, split_model)
from jlp.sync import GradSync

__all__ = [
    "DiLoCoStep",
    "GradSync",
    "TrainState",
    "TrainStep",
    "batch_sharding",
    "cpd_lars",
    "cpd_resnet18_lr",
    "cross_entropy_loss",
    "data_mesh",
    "decay_mask",
    "init_diloco_state",
    "init_sync_state",
    "init_train_state",
    "initialize",
    "is_bn_or_bias",
    "lars",
    "merge_model",
    "path_contains",
    "replicate",
    "replicated",
    "shard_batch",
    "split_model",
    "step_schedule",
    "torch_sgd",
    "warmup_step_schedule",
]
