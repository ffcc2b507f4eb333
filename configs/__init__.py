"""Experiment configs: one `get_config(arg)` per file, and the settings several of them share."""

from jlp.compression.casync import DEFAULT_MIN_SIZE
from jlp.data import config_kwargs

#: The compressor fields HiPress ran with (docs/hipress.md#compressors), by compressor name.
HIPRESS_COMPRESSOR_KWARGS = {
    # the onebit kernel is not public; jlp's is Seide's two-means 1-bit SGD with EF.
    "onebit": {"scale_mode": "two_means"},
    # the MXNet op's default threshold (HiPress's PyTorch example scripts pass 2).
    "tbq": {"threshold": 1.0},
    # the shipped scripts' bitwidth 2, enable_random 0 (deterministic rounding, no EF).
    "terngrad": {"bitwidth": 2, "stochastic": False},
    # s_percent 0.001, sample_rate 0.001, momentum 0.9 (dgc_new's defaults).
    "dgc": {"density": 0.001, "sample_rate": 0.001, "momentum": 0.9},
    # drop_ratio 0.999 in every script, sample_rate 0.001.
    "graddrop": {"drop_ratio": 0.999, "sample_rate": 0.001},
}
#: HiPress's --comp-threshold: compress a gradient iff it has more than this many floats.
HIPRESS_MIN_SIZE = DEFAULT_MIN_SIZE


def hipress_compression(c, compressor: str, topology: str):
  """Sets c.compression to `compressor` (a name of HIPRESS_COMPRESSOR_KWARGS) with HiPress's
  fields, over CaSync `topology` ("ps" or "ring"), compressing gradients of more than
  HIPRESS_MIN_SIZE floats; returns c. "none" (the float32 baseline) leaves c.compression at its
  defaults: without a compressor, topology, min_size and kwargs do nothing, and validation
  refuses them. Unknown names are left to the config's validation.
  DGC's momentum correction is the momentum (Lin et al. 2018, §3.2: each worker accumulates
  u = m u + g and sends from v += u), so with DGC the SGD momentum is turned off
  (c.momentum = 0): both at once compound to 1/(1-m)^2 times the step (AdamW has no momentum
  field; its first moment, adam_b1, is left as it is)."""
  if compressor == "none":
    return c
  c.compression.name = compressor
  c.compression.topology = topology
  c.compression.min_size = HIPRESS_MIN_SIZE
  c.compression.kwargs = dict(HIPRESS_COMPRESSOR_KWARGS.get(compressor, {}))
  if compressor == "dgc" and c.optimizer == "sgd":
    c.momentum = 0.0
  return c

#: SD-PIPE's per-pipeline batch (the paper's "batch size 256" = 4 pipelines x 64).
SDPIPE_BATCH_PER_PIPELINE = 64


def sdpipe_pipeline(c, *, sync: str, hetero: float, pipelines: int, barrier: bool):
  """Sets c.pipeline to SD-PIPE's artifact runs (docs/sdpipe.md#recipes): PipeDream 1F1B over 4
  stages (the stage rule's default split: ResNet-50 blocks [4, 4, 4, 4], BERT by layers),
  `pipelines` pipelines (4: the seed's pipe_4_4 on 16 devices) of SDPIPE_BATCH_PER_PIPELINE rows
  each (c.batch_size = 64 x pipelines), `sync` across them, the seed's --hetero `hetero`;
  HetPipe's wave `barrier` (the seed's BERT run) and pull every 10 batches; returns c. Unknown
  names are left to the config's validation."""
  c.pipeline.schedule = "1f1b"
  c.pipeline.stages = 4
  c.pipeline.pipelines = pipelines
  c.pipeline.sync = sync
  c.pipeline.hetero = hetero
  c.pipeline.barrier = barrier
  c.batch_size = SDPIPE_BATCH_PER_PIPELINE * pipelines
  return c


def epoch_cadence(c, train_size: int, epochs: int):
  """max_steps = `epochs` epochs of c.batch_size over `train_size` examples; eval_every and
  checkpoint_every = one epoch rounded down to a multiple of c.pipeline.batches_per_call (they
  run between pipeline calls); returns c."""
  steps_per_epoch = train_size // c.batch_size
  c.max_steps = epochs * steps_per_epoch
  c.eval_every = c.checkpoint_every = max(
      c.pipeline.batches_per_call,
      steps_per_epoch - steps_per_epoch % c.pipeline.batches_per_call)
  return c


def bert_small_sst2(c):
  """BERT-Small on SST-2 TSVs with bert-base-uncased's vocab.txt (WordPiece), in place: the model
  and data fields the HiPress and SD-PIPE BERT configs share."""
  c.model.name = "bert_small"
  c.model.kwargs.vocab = 30522       # bert-base-uncased's vocab.txt
  c.model.kwargs.max_len = 128
  c.model.kwargs.pad_id = 0          # [PAD]: not attended
  c.dataset.name = "glue_tsv"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs("glue_tsv", max_len=c.model.kwargs.get_ref("max_len"))
  c.eval_batch_size = 896            # SST-2 dev (872) in one padded batch, 16 | 896
  return c


def local_bert_digits_tokens(c):
  """The `:local` CPU smoke variant of a BERT config, in place: the bundled digits as 64-token
  sentences, a 2-layer BERT of width 32, six steps with evaluation and checkpoints every three."""
  c.dataset.name = "digits_tokens"
  c.dataset.root = ""
  c.dataset.kwargs = config_kwargs("digits_tokens", max_len=66)
  c.model.kwargs = {"vocab": 21, "max_len": 66, "hidden": 32, "num_layers": 2, "heads": 2,
                    "mlp_dim": 64, "pad_id": 0}
  c.batch_size = 64
  c.eval_batch_size = 120
  c.max_steps = 6
  c.log_every = 1
  c.eval_every = c.checkpoint_every = 3
  c.schedule.warmup_steps = 0
  c.lr = 1e-3
  return c
