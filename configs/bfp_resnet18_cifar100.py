r"""BFPsim's ResNet18 / CIFAR-100 recipe with FlexBlock presets (docs/bfp.md#recipe).

The kuangliu CIFAR ResNet18, batch 128, 200 epochs, SGD lr 0.1 momentum 0.9 weight decay 5e-4 (every
parameter), cosine annealing stepped once per epoch, RandomCrop 32 pad 4 + flip, CIFAR-100 mean/std;
BFP on every GEMM by a BFPsim preset, switched at epoch boundaries by the precision schedule
`ResNet18_CIFAR100_Mixed` (FB16 for epochs 0-19, FB12LG16 for 20-179, FB16 from 180) with the
intended semantics (optimizer state and schedule continue; BFPsim's code always re-applied the
epoch-0 preset and restarted the optimizer). BatchNorm trains in train mode and the
test set uses the test transform (BFPsim's bugs, docs/bfp.md#compat-switches,
are not copied).

  python -m experiments.train --config=configs/bfp_resnet18_cifar100.py --workdir=W \
      --config.dataset.root=DATA      # needs DATA/cifar-100-python/{train,test,meta}
      --config.bfp.controller=Simple/0.1/0.3/0/1   # BFPsim's dynamic precision control
  --config=configs/bfp_resnet18_cifar100.py:preset=ResNet18_FB12   # a fixed preset, no schedule

Arguments: local, preset. `preset=NAME` (a BFPsim preset name or JSON path) replaces the schedule
with that preset for the whole run (bfp.preset=NAME, bfp.schedule={}); `--config.bfp.preset` alone
is refused while the schedule is set, since the schedule decides the preset.
`:local` is a CPU smoke run on digits at 32x32x3 with a width-8 ResNet18 of one block per stage
(the preset's rules for the missing blocks match nothing), a two-entry schedule (FB16, then
FB12LG16 from epoch 1) and the Simple controller on 2-step windows.
"""

from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False, preset="")
  c = base_config()
  c.model.name = "resnet18"
  c.dataset.name = "cifar100"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs("cifar100")  # every option, settable by flag
  c.batch_size = 128
  c.eval_batch_size = 100
  c.max_steps = 78200                # 200 epochs x 391 steps
  c.log_every = 50
  c.eval_every = 391
  c.checkpoint_every = 391
  c.lr = 0.1
  c.schedule.name = "cosine_epochs"  # CosineAnnealingLR(T_max=200) stepped per epoch
  c.schedule.epochs = 200
  c.momentum = 0.9
  c.weight_decay = 5e-4
  c.bfp.schedule = {"0": "ResNet18_FB16", "20": "ResNet18_FB12LG16", "180": "ResNet18_FB16"}
  c.bfp.window = 0                   # controller window: one epoch (len(trainloader))
  if arg.local:
    local_digits(c, max_steps=8, batch_size=32, width=8, num_blocks=(1, 1, 1, 1))
    c.schedule.epochs = 1
    c.bfp.schedule = {"0": "ResNet18_FB16", "1": "ResNet18_FB12LG16"}
    c.bfp.controller = "Simple/0.1/0.3/0/1"
    c.bfp.window = 2
  if arg.preset:
    c.bfp.schedule = {}
    c.bfp.preset = arg.preset
  return c
