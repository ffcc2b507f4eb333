r"""CPD's FCN / Cityscapes recipe (docs/cpd.md#recipes: drcut/mmcv APS_support + mmsegmentation
v0.5.0 `fcn_r50-d8_769x769_40k_cityscapes`).

FCN with a dilated ResNet50-V1c backbone (output stride 8), 8 GPUs x 1 image... here batch 8 global,
SGD lr 0.01 momentum 0.9 weight decay 5e-4, poly decay (power 0.9, min lr 1e-4) over 40k steps,
per-pixel cross-entropy ignoring label 255 plus 0.4 x the auxiliary head's loss; the gradient
all-reduce is hard-coded e4m3 without APS in CPD (edit line 27 there; a flag here):

  python -m experiments.train --config=configs/cpd_fcn_cityscapes.py --workdir=W \
      --config.dataset.root=DATA      # DATA/leftImg8bit/{train,val}/<city>/*, DATA/gtFine/...
      --config.use_aps                # the APS variant

`:local` is a CPU smoke run on a segmentation task made from the digits (each foreground pixel
labelled with its digit, background class 10) with a width-4 FCN.
"""

from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, local=False)
  c = base_config()
  c.task = "segmentation"
  c.model.name = "fcn"
  c.dataset.name = "cityscapes"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs(
      "cityscapes",
      crop_size=769,
      cat_max_ratio=0.75,  # mmseg RandomCrop's re-draws (1.0: off)
      photometric=True)    # mmseg PhotoMetricDistortion on the crops
  c.batch_size = 8
  c.eval_batch_size = 8
  c.max_steps = 40000
  c.log_every = 50
  c.eval_every = 4000
  c.checkpoint_every = 4000
  c.lr = 0.01
  c.schedule.name = "poly"
  c.schedule.power = 0.9
  c.schedule.min_lr = 1e-4
  c.momentum = 0.9
  c.weight_decay = 5e-4
  c.grad_exp = 4
  c.grad_man = 3
  if arg.local:
    local_digits(c, max_steps=6, batch_size=16, width=4, num_blocks=(1, 1, 1, 1), channels=16,
                 aux_channels=8)
    c.dataset.name = "digits_segmentation"
    c.dataset.kwargs = config_kwargs("digits_segmentation", variant="32x32x3")
    c.eval_batch_size = 64
  return c
