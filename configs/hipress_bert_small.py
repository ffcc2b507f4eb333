r"""HiPress's BERT job with its compressors: BERT-Small on SST-2 sentences (docs/hipress.md).

HiPress's Bert-base runs are MXNet, 16 nodes (128 GPUs), CompLL-onebit over CaSync-PS or
CaSync-Ring (the paper's Figs. 7-8: 628,083 seq/s PS, 606,363 ring; Fig. 11: the ring's sync
430 -> 299 ms). jlp has
BERT-Small (jlp.models.bert: 4 layers, hidden 512, 8 heads, 28.6M parameters at max_len 128) and
no pretrained checkpoints, so this config trains it from scratch on a GLUE-style single-sentence
task, SST-2 by default (jlp.data.text: GLUE's SST-2/{train,dev}.tsv and a BERT vocab.txt, e.g.
bert-base-uncased's 30,522 tokens, tokenized with BERT's WordPiece, [PAD] = id 0 masked out of
attention). HiPress publishes throughput, not a recipe; the optimisation is AdamW (lr 1e-4,
cosine with a 10% warm-up, weight decay 0.01 except LayerNorm and biases, as BERT) at a global
batch of 256 (16 per worker on 16 devices, HiPress's node count), 10 epochs. SGD does not train
this BERT (measured on the `:local` model and data: the loss stays at ln 10 over 3,000 steps at
learning rates 0.1-0.2 and diverges from 0.5, while Adam at 1e-3 reaches 1.57 in 300 steps).

Gradients of more than 262,144 floats are compressed (HiPress's --comp-threshold: the word
embeddings, 15.6M floats, and the 8 MLP kernels, 1.05M each; 24.0M of 28.6M), with the
compressor's fields as HiPress ran them (configs.HIPRESS_COMPRESSOR_KWARGS); every step logs
`wire_bytes`.

  python -m experiments.train --config=configs/hipress_bert_small.py --workdir=W \
      --config.dataset.root=DATA/SST-2       # train.tsv, dev.tsv and vocab.txt
      --config.dataset.kwargs.vocab=PATH     # a vocab.txt elsewhere (its size: model.kwargs.vocab)
  --config=configs/hipress_bert_small.py:compressor=tbq,topology=ring

Arguments: compressor ("onebit" default, "tbq", "terngrad", "dgc", "graddrop", "none"), topology
("ps" default, "ring"; ignored with "none", the float32 baseline: the compression fields then keep
their defaults), local. `:local` needs no files: the bundled digits as sentences of their 64
pixel values ("digits_tokens", 21-token vocabulary), a 2-layer hidden-32 BERT, min_size 0 (every
gradient compressed), a few steps.
"""

from configs import bert_small_sst2, local_bert_digits_tokens, hipress_compression
from jlp.train.config import base_config, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False, compressor="onebit", topology="ps")
  c = base_config()
  bert_small_sst2(c)
  c.batch_size = 256                 # 16 per node x 16 nodes
  c.max_steps = 2630                 # 10 epochs x 263 steps (67,349 // 256)
  c.log_every = 50
  c.eval_every = 263
  c.checkpoint_every = 263
  c.optimizer = "adamw"
  c.lr = 1e-4
  c.schedule.name = "cosine"
  c.schedule.warmup_steps = 263
  c.weight_decay = 0.01
  c.wd_exclude = "norm|bias"         # BERT: no decay on LayerNorm and biases
  hipress_compression(c, arg.compressor, arg.topology)
  if arg.local:
    local_bert_digits_tokens(c)
    if c.compression.name != "none":
      c.compression.min_size = 0       # the tiny model's gradients are all below 262,144 floats
  return c
