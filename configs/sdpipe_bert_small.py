r"""SD-PIPE's BERT job on jlp's BERT-Small: pipelined data parallelism, 4 stages (docs/sdpipe.md).

The seed (`train_bert.py`) pre-trains BERT-base on wiki (4 pipelines x 4 stages, layers
[2, 4, 4, 2], PipeDream 1F1B, AdamW lr 1e-5, weight decay 0.01, 2,000 warm-up iterations, batch
256 = 4 pipelines x 64). jlp has BERT-Small (4 layers: stages embeddings+layer | layer | layer |
layer+head, the stage rule's default) and no wiki pre-training data, so this config trains it
from scratch on SST-2 sentences as configs/hipress_bert_small.py does (jlp.data.glue_tsv: GLUE's
SST-2/{train,dev}.tsv and a BERT vocab.txt, [PAD] = 0 masked out of attention), with the seed's
optimizer: AdamW lr 1e-5, weight decay 0.01 (not on LayerNorm and biases, as BERT), 10 epochs,
linear warm-up over the first epoch (the seed's 2,000 iterations belong to its 500,000-iteration
pre-training) then cosine. HetPipe with the seed's BERT wave barrier (bsp=0). Evaluation and
checkpoints every 260 steps (an epoch, 263 steps at 4 pipelines, rounded down to a multiple of
pipeline.batches_per_call = 10).

  XLA_FLAGS=--xla_force_host_platform_device_count=16 python -m experiments.train \
      --config=configs/sdpipe_bert_small.py:sync=preduce --workdir=W \
      --config.dataset.root=DATA/SST-2       # train.tsv, dev.tsv and vocab.txt

Arguments: sync ("preduce" default, "allreduce", "adpsgd", "hetpipe", "none"), hetero (virtual
stall seconds, probability 0.1 per op; 0.0 default), pipelines (4 default: 16 devices; 2 on 8),
local. `:local` needs no files: 2 pipelines x 4 stages on 8 devices, the bundled digits as
sentences of their 64 pixel values ("digits_tokens"), a 2-layer hidden-32 BERT (stages
embeddings | layer | layer | head), lr 1e-3, 6 steps in calls of 3.
"""

from configs import bert_small_sst2, epoch_cadence, local_bert_digits_tokens, sdpipe_pipeline
from jlp.train.config import base_config, parse_arg

SST2_TRAIN = 67349


def get_config(arg=None):
  arg = parse_arg(arg, local=False, sync="preduce", hetero=0.0, pipelines=4)
  c = base_config()
  bert_small_sst2(c)
  sdpipe_pipeline(c, sync=arg.sync, hetero=arg.hetero, pipelines=arg.pipelines, barrier=True)
  c.log_every = 50
  epoch_cadence(c, SST2_TRAIN, epochs=10)
  c.optimizer = "adamw"
  c.lr = 1e-5
  c.schedule.name = "cosine"
  c.schedule.warmup_steps = SST2_TRAIN // c.batch_size
  c.weight_decay = 0.01
  c.wd_exclude = "norm|bias"
  if arg.local:
    local_bert_digits_tokens(c)
    c.pipeline.pipelines = 2
    c.pipeline.batches_per_call = 3
  return c
