"""Split a `jlp.models` NNX network into S pipeline stages, pure functions (docs/sdpipe.md#stages).

A model is cut into a sequence of *units* (per-model rules, `STAGE_RULES`); stage s runs a
contiguous group of `boundaries[s]` units. Each stage is a pure, jittable function

    stage_s(params_s, x, state_s) -> (y, new_state_s)

over the variables of the modules its units own:

  params_s  {"<module path>/<variable>": float32 array} of the stage's `nnx.Param`s, e.g.
            "layer1/0/conv1/kernel" (paths as `jlp.models.module_path`, list indices in decimal);
  state_s   the same for every other variable of those modules: BatchNorm running stats,
            Dropout / stochastic-rounding RNG streams (typed PRNG keys as their uint32
            `jax.random.key_data`, re-wrapped inside the stage), RNG counters, BFP widths, ZSE
            probes; {} for a stage without any.

The stage merges its own modules (one NNX graph per stage, so quantized layers keep their
`jlp.nn` adapters and their state), runs its units in train mode (BatchNorm normalises with batch
statistics and updates its running stats; Dropout draws from the stage's RNG streams) and returns
the updated state. Stage 0 takes what the model takes (NHWC float32 images; BERT: token ids, see
`bert`); stage S-1 returns the logits; in between the values are float32 arrays or tuples of them.
Composing the stages is the model's own train-mode forward, op for op: the same ops in the same
order on the same values, so eager composition equals `model(x)` bit for bit, and the new state
equals the model's (tests/pipeline/stages_test.py). `StageSplit.merge(params, state)` rebuilds the
whole model.

Units and default boundaries (`boundaries` counts units, stem and head included), one module per
model family (its docstring has the details):

  resnet     ResNet (resnet18, resnet50; any stem): stem, every residual block, head. Default:
             the blocks evenly, stem with stage 0, head with stage S-1 (ResNet-50 at S=4:
             boundaries (5, 4, 4, 5)).
  bert       Bert (bert_small): embeddings, every encoder layer, head. Default: 12 layers at S=4
             -> layers [2, 4, 4, 2], otherwise the layers evenly.
  small_cnn  SmallCNN (small_cnn): conv1, bn1+ReLU, conv2, bn2+ReLU, head. Defaults: a table
             for S=1..5 (S=2 (2, 3), S=4 (2, 1, 1, 1)).
  vgg        VGG (vgg19): every conv+BN+ReLU group of `features`, head. Default: the conv groups
             evenly, head with stage S-1.
  mlp        MLP (mlp): every hidden Linear+ReLU, head. Default: the units evenly (the default
             three hidden layers at S=4: one unit each).

Errors (ValueError): a model type without a rule (lists the supported ones), num_stages not an
integer from 1 to the unit count, boundaries not num_stages integers >= 1 summing to the unit
count, a variable shared between modules of different stages.

Quantize before splitting (`jlp.nn.quantize_model(model, rules)`, then `split_model`): the split
works on a copy of the model (`nnx.clone`, switched to train mode), so later changes to `model`
do not reach the stages.

Modules: `base` (`Unit`, `StageRule`, the default-partition helpers the families share), the
family modules above (unit functions, default boundaries, the family's `RULE`), `split`
(`STAGE_RULES` built from the families' `RULE`s, `Stage`, `StageSplit`, `split_model`). A new
model family is a module like these whose `RULE` is added to `split.STAGE_RULES`.
"""

from jlp.pipeline.stages.base import StageRule, Unit
from jlp.pipeline.stages.split import STAGE_RULES, Stage, StageSplit, split_model

__all__ = ["STAGE_RULES", "Stage", "StageRule", "StageSplit", "Unit", "split_model"]
