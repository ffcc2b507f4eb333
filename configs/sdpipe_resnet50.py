r"""SD-PIPE's ResNet-50 / ImageNet job: pipelined data parallelism, 4 stages (docs/sdpipe.md).

The seed (Hsword/VLDB2023_SDPipe, `train_resnet.py` with `pipe_4_4`) runs 4 pipelines x 4 stages
(16 GPUs), ResNet-50 cut into bottleneck blocks [4, 4, 4, 4], PipeDream 1F1B with weight stashing
(every mini-batch its own update, docs/sdpipe.md#schedules), Momentum 0.9, lr 1e-2, weight decay
1e-4, 64 images per pipeline ("batch size 256"), epoch 0 a linear warm-up, then lr x 0.2 every 30
epochs, 100 epochs; pipelines synchronised by SD-PIPE's partial reduce (`preduce`) or the baselines.
Here the warm-up starts at 0 (the seed's start value is not known) and the weight decay applies to
every parameter (no exclusion is known); evaluation and checkpoints every epoch (rounded down to a
multiple of pipeline.batches_per_call = 12: 5,004 steps at 4 pipelines).

  XLA_FLAGS=--xla_force_host_platform_device_count=16 python -m experiments.train \
      --config=configs/sdpipe_resnet50.py:sync=preduce,hetero=0.1 --workdir=W \
      --config.dataset.root=DATA      # DATA/train/<wnid>/*.JPEG, DATA/val/<wnid>/*.JPEG
  --config=configs/sdpipe_resnet50.py:sync=allreduce,pipelines=2   # AllReduce on 8 devices

Arguments: sync ("preduce" default, "allreduce", "adpsgd", "hetpipe", "none"), hetero (the seed's
--hetero: stall seconds with probability 0.1 per op, virtual time; 0.0 default), pipelines (4
default: 16 devices; 2 = the seed's pipe_2_4 on 8 devices; the batch is 64 per pipeline), local.
`:local` is a CPU smoke run on 8 devices (2 pipelines x 4 stages): digits at 32x32x3, a width-8
ResNet-50 of one bottleneck per stage (units stem+block | block | block | block+head), 6 steps
in calls of 3.
"""

from configs import epoch_cadence, sdpipe_pipeline
from jlp.data import config_kwargs
from jlp.train.config import base_config, local_digits, parse_arg

IMAGENET_TRAIN = 1281167


def get_config(arg=None):
  arg = parse_arg(arg, local=False, sync="preduce", hetero=0.0, pipelines=4)
  c = base_config()
  c.model.name = "resnet50"
  c.dataset.name = "imagenet"
  c.dataset.root = ""               # $JLP_DATA_DIR/<dataset>, else data/<dataset>
  c.dataset.kwargs = config_kwargs("imagenet")  # every option, settable by flag
  sdpipe_pipeline(c, sync=arg.sync, hetero=arg.hetero, pipelines=arg.pipelines, barrier=False)
  c.pipeline.batches_per_call = 12   # 12 | 5,004 steps per epoch at 4 pipelines
  c.eval_batch_size = 1024           # a multiple of 16 devices
  c.log_every = 50
  epoch_cadence(c, IMAGENET_TRAIN, epochs=100)
  c.lr = 1e-2
  c.schedule.name = "warmup_step"
  c.schedule.init_lr = 0.0
  c.schedule.warmup_epochs = 1
  c.schedule.decay_epochs = (30, 60, 90)
  c.schedule.decay_factor = 0.2      # lr * 0.2 ** (epoch // 30)
  c.momentum = 0.9
  c.weight_decay = 1e-4
  if arg.local:
    local_digits(c, max_steps=6, width=8, stem="cifar", num_blocks=(1, 1, 1, 1))
    c.pipeline.pipelines = 2
    c.pipeline.batches_per_call = 3
    c.log_every = 1
  return c
