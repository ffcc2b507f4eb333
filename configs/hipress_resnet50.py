r"""HiPress's ResNet50 job (docs/hipress.md#recipes): ResNet50 / ImageNet, DGC over CaSync-Ring.

HiPress's ResNet50 runs are TensorFlow, 16 nodes (128 GPUs), HiPress-CaSync-Ring(CompLL-DGC)
against Horovod's Ring(OSS-DGC) (the paper's Figs. 7-8: 38,864 img/s, 1.17x). HiPress publishes
throughput, not a training recipe: the optimisation here is Goyal et al.'s ImageNet-in-an-hour one
(SGD momentum 0.9, weight decay 1e-4 except BatchNorm, 90 epochs, linear warm-up 0.1 -> 0.1 x
B/256 over 5 epochs, x0.1 after epochs 30, 60 and 80) at a global batch of 1,024 (64 per worker on
16 devices, HiPress's node count; 128 per worker on 8), torchvision's ResNet50 v1.5 (jlp.models).

Gradients of more than 262,144 floats are compressed (HiPress's --comp-threshold: 18 of the
161 leaves, 21.05M of the 25.56M floats), DGC with HiPress's fields (density 0.001, sample rate
0.001, momentum 0.9; configs.HIPRESS_COMPRESSOR_KWARGS); every step logs `wire_bytes`.

  python -m experiments.train --config=configs/hipress_resnet50.py --workdir=W \
      --config.dataset.root=DATA      # DATA/train/<wnid>/*.JPEG, DATA/val/<wnid>/*.JPEG
  --config=configs/hipress_resnet50.py:compressor=onebit,topology=ps   # another compressor / PS
  --config=configs/hipress_resnet50.py:compressor=none                 # the float32 baseline

Arguments: compressor ("dgc" default, "onebit", "tbq", "terngrad", "graddrop", "none"), topology
("ring" default, "ps"; ignored with "none", the float32 baseline: the compression fields then keep
their defaults), local. `:local` is a CPU smoke run on digits at 32x32x3 with a width-8
ResNet50 of one bottleneck per stage and min_size 1024 (its 11 conv kernels of more than 1,024
floats compressed; min_size 0 compresses all 53 gradients but compiles ~3x slower on CPU).
"""

from configs import hipress_compression
from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False, compressor="dgc", topology="ring")
  c = base_config()
  c.model.name = "resnet50"
  c.dataset.name = "imagenet"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs("imagenet")  # every option, settable by flag
  c.batch_size = 1024                # 64 per node x 16 nodes
  c.eval_batch_size = 1000
  c.max_steps = 112590               # 90 epochs x 1,251 steps (1,281,167 // 1,024)
  c.log_every = 50
  c.eval_every = 6255                # every 5 epochs
  c.checkpoint_every = 1251
  c.lr = 0.4                         # 0.1 x 1024 / 256
  c.schedule.name = "warmup_step"
  c.schedule.init_lr = 0.1
  c.schedule.warmup_epochs = 5
  c.schedule.decay_epochs = (30, 60, 80)
  c.momentum = 0.9
  c.weight_decay = 1e-4
  c.wd_exclude = "bn"
  hipress_compression(c, arg.compressor, arg.topology)
  if arg.local:
    local_digits(c, max_steps=6, width=8, stem="cifar", num_blocks=(1, 1, 1, 1))
    c.lr = 0.05
    c.schedule.init_lr = 0.05
    if c.compression.name != "none":
      c.compression.min_size = 1024    # the width-8 net's conv kernels (all below 262,144 floats)
  return c
