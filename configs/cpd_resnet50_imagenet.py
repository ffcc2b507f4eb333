r"""CPD's ResNet50 / ImageNet recipe (docs/cpd.md#recipes: drcut/CPD example/ResNet50/main.py).

torchvision ResNet50, sub-batch 32 per node on 256 nodes (8 GPUs x --emulate-node 32: global 8,192),
90 epochs, SGD Nesterov momentum 0.9, weight decay 1e-4 except BatchNorm parameters, learning rate
linear warm-up 0.1 -> 3.2 over 5 epochs then x0.1 after epochs 30, 60 and 80; RandomResizedCrop 224
+ flip, eval Resize 256 + CenterCrop 224. The README's run is e5m2 + APS; emulating the 256 nodes
on 8 devices uses CPD's two-level reduction (local APS + sum over the 32 virtual nodes, then across
devices; ResNet50 casts even a single node's gradient):

  python -m experiments.train --config=configs/cpd_resnet50_imagenet.py --workdir=W \
      --config.dataset.root=DATA      # DATA/train/<wnid>/*.JPEG, DATA/val/<wnid>/*.JPEG

`:local` is a CPU smoke run on digits at 32x32x3 with a width-8 ResNet50 of one bottleneck per stage
and 2 emulated nodes per device (two-level reduction, one loop body).
"""

from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False)
  c = base_config()
  c.seed = 42
  c.model.name = "resnet50"
  c.dataset.name = "imagenet"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs("imagenet")  # every option, settable by flag
  c.batch_size = 8192                # 32 per node x 256 nodes
  c.eval_batch_size = 1024
  c.max_steps = 14076                # 90 epochs of 1,281,167 images
  c.log_every = 50
  c.eval_every = 1564
  c.checkpoint_every = 1000
  c.lr = 3.2
  c.schedule.name = "warmup_step"
  c.schedule.init_lr = 0.1
  c.schedule.warmup_epochs = 5
  c.schedule.decay_epochs = (30, 60, 80)
  c.momentum = 0.9
  c.nesterov = True
  c.weight_decay = 1e-4
  c.wd_exclude = "bn"                # main.py: no decay for parameters whose name contains 'bn'
  c.grad_exp = 5
  c.grad_man = 2
  c.use_aps = True
  c.emulate_nodes = 32
  c.emulate_form = "cpd"
  c.emulate_node_map = "scan"        # one loop body for the 32 nodes (unrolling 32 copies compiles slowly)
  if arg.local:
    local_digits(c, max_steps=8, width=8, stem="cifar", num_blocks=(1, 1, 1, 1))
    c.emulate_nodes = 2
  return c
