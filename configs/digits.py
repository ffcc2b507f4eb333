r"""A small CNN on scikit-learn's bundled digits (8x8, 10 classes), data-parallel over every device.

The fastest complete run, and the one that works everywhere (the data ships inside scikit-learn):

  python -m experiments.train --config=configs/digits.py --workdir=/tmp/jlp/digits
  python -m experiments.train --config=configs/digits.py:local --workdir=/tmp/jlp/digits_local
  python -m experiments.train --config=configs/digits.py --workdir=/tmp/jlp/digits_e4m3_aps \
      --config.grad_exp=4 --config.grad_man=3 --config.use_aps

The main job (python -m experiments.aps_digits) runs this config with float32, e4m3 and e3m0
gradient all-reduce, each with and without APS.
"""

from jlp.data import config_kwargs
from jlp.train.config import base_config, parse_arg


def get_config(arg=None):
  """Default hyperparameters; `:local` shortens the run to a few seconds."""
  arg = parse_arg(arg, local=False)
  c = base_config()
  c.model.name = "small_cnn"
  c.model.kwargs.width = 16
  c.dataset.name = "digits"
  c.dataset.kwargs = config_kwargs("digits")  # every option, settable by flag
  c.batch_size = 128                 # global: 16 per device on 8 devices
  c.eval_batch_size = 360
  c.max_steps = 300                  # ~27 epochs of the 1,437 training images
  c.log_every = 10
  c.eval_every = 50
  c.checkpoint_every = 100
  c.lr = 0.2
  c.schedule.name = "cosine"
  c.schedule.warmup_steps = 20
  c.momentum = 0.9
  c.weight_decay = 5e-4
  c.wd_exclude = "bn|bias"
  if arg.local:
    c.max_steps = 20
    c.log_every = 5
    c.eval_every = 10
    c.checkpoint_every = 10
  return c
