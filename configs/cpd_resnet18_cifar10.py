r"""CPD's ResNet18 / CIFAR-10 recipe (example/ResNet18: mix.py, res18_cifar.yaml; docs/cpd.md).

The kuangliu CIFAR ResNet18, batch 512 per node on 8 nodes (global 4,096), SGD momentum 0.9, weight
decay 1e-4 on every parameter, CPD's learning-rate rule (linear warm-up 0.1 -> 1.6 over 5 epochs,
x0.1 after epochs 40 and 80), 1,221 steps (100 epochs); only the gradient all-reduce is low precision
(mix.py's default e5m2). The README's runs are flag changes:

  python -m experiments.train --config=configs/cpd_resnet18_cifar10.py --workdir=W \
      --config.dataset.root=DATA                                  # needs DATA/cifar-10-batches-py
      --config.grad_exp=4 --config.grad_man=3 --config.use_aps    # e4m3 + APS
      --config.grad_exp=3 --config.grad_man=0 --config.use_aps    # e3m0 + APS
      --config.use_lars / --config.use_kahan / --config.emulate_nodes=8

`:local` is a CPU smoke run on the bundled digits (upsampled to 32x32x3) with a width-8 ResNet18.
"""

from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False)
  c = base_config()
  c.seed = 24                        # torch.manual_seed(24)
  c.model.name = "resnet18"
  c.dataset.name = "cifar10"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs("cifar10")  # every option, settable by flag
  c.batch_size = 4096                # 512 per node x 8 nodes
  c.eval_batch_size = 1000
  c.max_steps = 1221                 # ceil(50000 * 100 / 4096)
  c.log_every = 10
  c.eval_every = 50                  # val_freq
  c.checkpoint_every = 200
  c.lr = 1.6                         # the rule's peak (it starts at 0.1; jlp.train.cpd_resnet18_lr)
  c.schedule.name = "cpd_resnet18"
  c.momentum = 0.9
  c.weight_decay = 1e-4
  c.grad_exp = 5                     # mix.py default gradient format e5m2
  c.grad_man = 2
  if arg.local:
    local_digits(c, max_steps=12, width=8)
  return c
