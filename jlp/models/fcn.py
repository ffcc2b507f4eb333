"""FCN for semantic segmentation (mmsegmentation `fcn_r50-d8`, the Cityscapes net of CPD,
docs/cpd.md#recipes), Flax NNX, NHWC.

backbone      dilated ResNet (default ResNetV1c-50: deep stem, strides (1, 2, 1, 1), dilations
              (1, 1, 2, 4) -> output stride 8), see `jlp.models.resnet.ResNet`
decode_head   FCNHead on the last stage: `convs` = num_convs x ConvModule(3x3 conv, BN, ReLU),
              `conv_cat` = ConvModule on concat(input, convs output), `dropout` (0.1),
              `conv_seg` = 1x1 conv (bias) -> classes
auxiliary_head FCNHead on stage 3 (1 conv, no concat, 256 channels); used for the auxiliary loss
              (weight 0.4 in mmseg), returned when calling with ``return_aux=True``

Logits are bilinearly upsampled to the input size (half-pixel centres, align_corners=False).
Paths mirror mmseg: "backbone/stem/0", "backbone/layer1/0/conv1", "backbone/layer1/0/downsample/0",
"decode_head/convs/0/conv", "decode_head/conv_cat/conv", "decode_head/conv_seg",
"auxiliary_head/convs/0/conv", ...
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jlp.models.resnet import ResNet, batch_norm, conv2d

__all__ = ["FCN", "FCNHead", "ConvModule", "fcn"]


class ConvModule(nnx.Module):
  """mmcv ConvModule: conv (no bias, followed by BN) + BN + ReLU."""

  def __init__(self, c_in, c_out, kernel=3, dilation=1, *, use_running_average=False, rngs):
    self.conv = conv2d(c_in, c_out, kernel, 1, dilation=dilation, init="kaiming", rngs=rngs)
    self.bn = batch_norm(c_out, use_running_average=use_running_average, rngs=rngs)

  def __call__(self, x):
    return jax.nn.relu(self.bn(self.conv(x)))


class FCNHead(nnx.Module):
  """mmseg FCNHead (convs, optional conv_cat, dropout, conv_seg)."""

  def __init__(
      self,
      in_channels: int,
      channels: int,
      num_classes: int,
      *,
      num_convs: int = 2,
      kernel: int = 3,
      dilation: int = 1,
      concat_input: bool = True,
      dropout: float = 0.1,
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    ura = use_running_average
    convs = []
    for i in range(num_convs):
      convs.append(
          ConvModule(in_channels if i == 0 else channels,
                     channels,
                     kernel,
                     dilation,
                     use_running_average=ura,
                     rngs=rngs))
    self.convs = nnx.List(convs)
    self.conv_cat = (ConvModule(
        in_channels +
        channels, channels, kernel, use_running_average=ura, rngs=rngs) if concat_input else None)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    # mmseg initialises conv_seg with N(0, 0.01), bias 0.
    self.conv_seg = nnx.Conv(
        channels,
        num_classes,
        (1, 1),
        padding="VALID",
        kernel_init=nnx.initializers.normal(0.01),
        bias_init=nnx.initializers.zeros,
        rngs=rngs,
    )

  def __call__(self, x):
    out = x
    for conv in self.convs:
      out = conv(out)
    if self.conv_cat is not None:
      out = self.conv_cat(jnp.concatenate([x, out], axis=-1))
    return self.conv_seg(self.dropout(out))


class FCN(nnx.Module):
  """Fully convolutional network: dilated ResNet backbone + FCNHead (+ auxiliary FCNHead).

    Args:
      num_classes: 19 (Cityscapes).
      block, num_blocks, width: the backbone (default bottleneck (3, 4, 6, 3), 64: ResNet50).
      dilated: True -> output stride 8 (strides (1, 2, 1, 1), dilations (1, 1, 2, 4)); False -> 32.
      stem: "deep" (ResNetV1c, mmseg's default for FCN) or "imagenet".
      channels, aux_channels: head widths (512, 256).
      aux: build the auxiliary head on stage 3.
      dropout: head dropout (0.1; switch with model.eval() / model.train()).
    """

  def __init__(
      self,
      num_classes: int = 19,
      *,
      block: str = "bottleneck",
      num_blocks: Sequence[int] = (3, 4, 6, 3),
      width: int = 64,
      dilated: bool = True,
      stem: str = "deep",
      channels: int = 512,
      aux_channels: int = 256,
      aux: bool = True,
      dropout: float = 0.1,
      in_channels: int = 3,
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    strides, dilations = ((1, 2, 1, 1), (1, 1, 2, 4)) if dilated else ((1, 2, 2, 2), (1,) * 4)
    ura = use_running_average
    self.backbone = ResNet(
        block,
        num_blocks,
        None,
        width=width,
        stem=stem,
        strides=strides,
        dilations=dilations,
        naming="torchvision",
        init="kaiming",
        in_channels=in_channels,
        use_running_average=ura,
        rngs=rngs,
    )
    c3, c4 = self.backbone.stage_channels[2], self.backbone.stage_channels[3]
    self.decode_head = FCNHead(
        c4,
        channels,
        num_classes,
        num_convs=2,
        concat_input=True,
        dropout=dropout,
        use_running_average=ura,
        rngs=rngs,
    )
    self.auxiliary_head = (FCNHead(
        c3,
        aux_channels,
        num_classes,
        num_convs=1,
        concat_input=False,
        dropout=dropout,
        use_running_average=ura,
        rngs=rngs,
    ) if aux else None)

  def __call__(self, x, *, return_aux: bool = False):
    """Logits (N, H, W, classes) at the input resolution; with ``return_aux`` (needs aux=True)
        the pair (logits, auxiliary logits)."""
    n, h, w, _ = x.shape
    feats = self.backbone.features(x)
    out = self.decode_head(feats[-1])
    out = jax.image.resize(out, (n, h, w, out.shape[-1]), "bilinear")
    if not return_aux:
      return out
    if self.auxiliary_head is None:
      raise ValueError("return_aux=True needs a model built with aux=True")
    a = self.auxiliary_head(feats[2])
    a = jax.image.resize(a, (n, h, w, a.shape[-1]), "bilinear")
    return out, a


def fcn(num_classes: int = 19, *, rngs: nnx.Rngs | None = None, **kwargs) -> FCN:
  """FCN-ResNet50-D8 (mmseg fcn_r50-d8) with the knobs of `FCN`."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return FCN(num_classes, rngs=rngs, **kwargs)
