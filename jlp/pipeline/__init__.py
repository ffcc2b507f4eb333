"""Pipelined data-parallel training (SD-PIPE, Miao et al., PVLDB 16(9) 2023; docs/sdpipe.md).

    mesh = jlp.pipeline.pipeline_mesh(num_pipelines=2, num_stages=4)     # axes ("data", "stage")
    split = jlp.pipeline.split_model(model, num_stages=4)                 # zoo stage rules
    pipe = jlp.pipeline.Pipeline(split.stages, loss_fn, optax.sgd(0.1), mesh, schedule="1f1b",
                                 sync="preduce", stateful=True,
                                 hetero=jlp.pipeline.Hetero(delay_s=0.1))
    state = pipe.init(split.params, split.state)
    state, metrics = pipe.run(state, xs, ys)      # loss, virtual_time of the completed batches
    state, metrics = pipe.flush(state)            # 1F1B: complete the mini-batches in flight

Modules: `executor` (`Pipeline`, the public object: checks, state, runs and flush), `program` (the
jitted per-device program: ticks, exchanges, updates), `buffers` (the ring buffers' layout),
`sync_modes` (one strategy per sync across pipelines), `schedules` (GPipe / 1F1B tick tables, the
never-ending 1F1B table cut into runs, bubble fraction), `schedule_data` (flush schedules as data:
`Schedule`, torch's compute-only CSV, the rules, the named generators, `bubble` and
`peak_inflight`), `flush` (the program that runs any flush schedule: 1F1B-flush, interleaved
1F1B, ZB-H1, ZB-V, DualPipeV, a torch CSV), `timeline` (a pipeline's virtual time,
decided as its runs need it), `simulator` (the event model of a whole run: `simulate`,
`preduce_schedule`, AD-PSGD matchings; it re-exports the public names of the next three),
`costs` (the configuration and cost model: `Hetero`, `PReduce`, `HetPipe`, op durations),
`preduce` (SD-PIPE's partial-reduce group scheduler, apart from any event queue), `rounds`
(groups onto the executor's rounds: the mixing matrices), `stages` (`split_model`: ResNet,
BERT, the digits CNN, VGG into S stages, one module per family), `packing` (stages' pytrees as
flat buffers).
"""

from jlp.pipeline.executor import Pipeline, PipelineState, pipeline_mesh
from jlp.pipeline.schedule_data import (FLUSH_SCHEDULES, Action, Overlap, Schedule, bubble,
                                        peak_inflight)
from jlp.pipeline.schedules import SCHEDULES, Table, bubble_fraction, stage_order, tick_table
from jlp.pipeline.stages import STAGE_RULES, StageSplit, split_model
from jlp.pipeline.simulator import (SYNC_MODES, HetPipe, Hetero, PReduce, SyncPlan,
                                    adpsgd_matchings, preduce_schedule, simulate)

__all__ = [
    "Action",
    "FLUSH_SCHEDULES",
    "Overlap",
    "SCHEDULES",
    "Schedule",
    "STAGE_RULES",
    "SYNC_MODES",
    "StageSplit",
    "HetPipe",
    "Hetero",
    "PReduce",
    "Pipeline",
    "PipelineState",
    "SyncPlan",
    "Table",
    "adpsgd_matchings",
    "bubble",
    "bubble_fraction",
    "peak_inflight",
    "pipeline_mesh",
    "preduce_schedule",
    "simulate",
    "split_model",
    "stage_order",
    "tick_table",
]
