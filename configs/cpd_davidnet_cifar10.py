r"""CPD's DavidNet / CIFAR-10 recipe (example/DavidNet, Myrtle's ResNet-9; docs/cpd.md#recipes).

Batch 512 per node on 8 nodes, 24 epochs, SGD Nesterov momentum 0.9, weight decay 5e-4 x 512 on the
summed loss (so 5e-4 per sample), learning rate piecewise linear over epochs [0, 5, 24] ->
[0, 0.4, 0] divided by 512 (the loss is a sum over the batch), times the linear warm-up factor
step / 62 for the first 62 steps; the README's run is e5m2 + APS:

  python -m experiments.train --config=configs/cpd_davidnet_cifar10.py --workdir=W \
      --config.dataset.root=DATA --config.grad_exp=5 --config.grad_man=2 --config.use_aps

jlp averages the loss over the global batch (so lr and weight decay here are per-sample values:
0.4 and 5e-4); the gradient that enters the all-reduce is the per-node sum scaled by 1/(512·8)
instead of CPD's raw sum, which only changes APS's shift, not its result (APS is equivariant to
power-of-two scales; 4,096 is one). CPD's static --loss_scale (default 1) is never divided out
of the gradient; jlp divides it out unless --config.unscale_grads=False (that bug, compat only).
`:local` is a CPU smoke run on digits at 32x32x3, width 8.
"""

from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False)
  c = base_config()
  c.model.name = "davidnet"
  c.dataset.name = "cifar10"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  # every option, settable by flag; the recipe: reflect pad 4, crop 32, flip, Cutout 8x8
  c.dataset.kwargs = config_kwargs("cifar10", recipe="davidnet")
  c.batch_size = 4096
  c.eval_batch_size = 1000
  c.max_steps = 288                    # 24 epochs x 12 steps (drop_last)
  c.log_every = 4
  c.eval_every = 48
  c.checkpoint_every = 48
  c.lr = 0.4
  c.schedule.name = "piecewise_linear"
  c.schedule.epochs = (0, 5, 24)
  c.schedule.scales = (0.0, 1.0, 0.0)  # multiples of lr at those epochs
  c.schedule.warmup_steps = 62         # ceil(50000 * 5 / 4096)
  c.momentum = 0.9
  c.nesterov = True
  c.weight_decay = 5e-4
  c.grad_exp = 5
  c.grad_man = 2
  c.use_aps = True
  if arg.local:
    local_digits(c, max_steps=12, width=8)
    c.schedule.warmup_steps = 4
  return c
