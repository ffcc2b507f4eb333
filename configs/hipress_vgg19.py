r"""HiPress's VGG19 job with its compressors (docs/hipress.md#recipes): VGG19-BN on CIFAR-10.

HiPress's headline VGG19 runs are MXNet on ImageNet, 16 nodes (128 GPUs), CompLL-onebit over
CaSync-PS or CaSync-Ring (the paper's Figs. 7-8: 23,507 img/s PS, 23,097 ring). jlp's "vgg19" is
the CIFAR VGG19-BN (kuangliu: 16 convs, one 512->10 classifier, 20.0M parameters; jlp.models.vgg),
not ImageNet's VGG19 with its three fully connected layers (whose 102.8M-float fc6 dominates
HiPress's sync), so this config trains it on CIFAR-10. HiPress publishes throughput, not a
training recipe: the optimisation is kuangliu's CIFAR one (SGD momentum 0.9, weight decay 5e-4,
200 epochs, cosine) at a global batch of 512 (32 per worker on 16 devices, HiPress's node count;
64 per worker on 8), the learning rate scaled linearly from 0.1 at 128 with a 5-epoch warm-up.

Gradients of more than 262,144 floats are compressed (HiPress's --comp-threshold: here the
12 conv kernels from 3x3x128x256 = 294,912 floats on, 19.76M of the 20.04M), with the compressor's
fields as HiPress ran them (configs.HIPRESS_COMPRESSOR_KWARGS); the other 54 leaves are summed
in float32. Every step logs `wire_bytes`, the bytes one device sends for the sync.

  python -m experiments.train --config=configs/hipress_vgg19.py --workdir=W \
      --config.dataset.root=DATA                     # needs DATA/cifar-10-batches-py
  python -m experiments.train --config=configs/hipress_vgg19.py:compressor=tbq,topology=ring ...
  --config=configs/hipress_vgg19.py:compressor=none  # the float32 baseline

Arguments: compressor ("onebit" default, "tbq", "terngrad", "dgc", "graddrop", "none"), topology
("ps" default, "ring"; ignored with "none", the float32 baseline: the compression fields then keep
their defaults), local. `:local` is a CPU smoke run on digits at 32x32x3 with a width-8
VGG19 and min_size 1024 (its 14 conv kernels of more than 1,024 floats compressed; min_size 0
compresses all 66 gradients but compiles ~3x slower on CPU), a few steps.
"""

from configs import hipress_compression
from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False, compressor="onebit", topology="ps")
  c = base_config()
  c.model.name = "vgg19"
  c.dataset.name = "cifar10"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs("cifar10")  # every option, settable by flag
  c.batch_size = 512                 # 32 per node x 16 nodes
  c.eval_batch_size = 1000
  c.max_steps = 19400                # 200 epochs x 97 steps (50,000 // 512)
  c.log_every = 50
  c.eval_every = 485                 # every 5 epochs
  c.checkpoint_every = 970
  c.lr = 0.4                         # 0.1 x 512 / 128
  c.schedule.name = "cosine"
  c.schedule.warmup_steps = 485      # 5 epochs
  c.momentum = 0.9
  c.weight_decay = 5e-4
  hipress_compression(c, arg.compressor, arg.topology)
  if arg.local:
    local_digits(c, max_steps=6, width=8)
    c.lr = 0.05
    c.schedule.warmup_steps = 0
    if c.compression.name != "none":
      c.compression.min_size = 1024    # the width-8 net's conv kernels (all below 262,144 floats)
  return c
