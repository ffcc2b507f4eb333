"""ResNets in Flax NNX: ResNet18 for CIFAR (kuangliu / BFPsim / CPD) and ResNet50 for ImageNet
(torchvision v1.5), plus the dilated / deep-stem variant FCN uses as its backbone.

Inputs are NHWC float32; every parameter GEMM is an `nnx.Conv` or `nnx.Linear` so that quantization
rules (which replace a layer's ``conv_general_dilated`` / ``dot_general``) reach all of them.

Attribute names follow the PyTorch sources, so a PyTorch / BFPsim name maps to an NNX path by dropping
``net.`` and replacing ``.`` with ``/`` (see :mod:`jlp.models`):

* ``naming="kuangliu"`` (CIFAR ResNet18 of BFPsim and CPD): ``conv1``, ``bn1``, ``layer1``..``layer4``
  (lists of blocks), each block ``conv1``/``bn1``/``conv2``/``bn2`` (+ ``conv3``/``bn3`` for
  Bottleneck) and, when the shape changes, ``shortcut`` = [1x1 conv, BN] (paths ``shortcut/0``,
  ``shortcut/1``); classifier ``linear``.
* ``naming="torchvision"`` (ImageNet ResNet18/50): the same, but the projection is ``downsample``
  (``downsample/0``, ``downsample/1``) and the classifier is ``fc``.
* ``stem="deep"`` (mmsegmentation ResNetV1c, FCN backbone): ``stem`` = [conv, bn, relu] x 3, paths
  ``stem/0``, ``stem/1``, ``stem/3``, ``stem/4``, ``stem/6``, ``stem/7`` (indices as in mmseg).

Initialisation follows the PyTorch sources: ``init="torch"`` is PyTorch's default (kaiming_uniform
with a = sqrt(5) for weights, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for biases; kuangliu), and
``init="kaiming"`` is torchvision's ResNet init (kaiming_normal, fan_out, ReLU gain for convs; PyTorch
default for the classifier). BatchNorm: gamma 1, beta 0, PyTorch momentum 0.1 (= Flax momentum 0.9),
eps 1e-5. Train/eval mode: ``model.train()`` / ``model.eval()`` (NNX sets ``use_running_average``
of every BatchNorm), or ``use_running_average=`` at construction.

BFPsim compatibility: ``bfpsim_inplace_fi`` (False; set by
``jlp.nn.quantize_model(..., bfpsim_inplace_fi=True)``) on the ResNet and its blocks reproduces the
side effect of BFPsim's in-place input quantization (`jlp.nn.inplace_fi`,
docs/bfp.md#compat-switches): every activation that feeds a conv with a BFP x role is quantized
where it is produced and the quantized tensor feeds all its consumers (identity shortcut, projection
conv, stage outputs, the producing ReLU's backward mask).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jlp.nn.inplace_fi import quantize_for_conv

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "MaxPool",
    "ReLU",
    "ResNet",
    "batch_norm",
    "conv2d",
    "linear",
    "resnet18",
    "resnet50",
    "torch_bias_init",
    "torch_kernel_init",
]

# --------------------------------------------------------------------------------------------------
# Shared layer helpers (used by every CNN of the zoo)
# --------------------------------------------------------------------------------------------------


def torch_kernel_init():
  """PyTorch's default Conv2d/Linear weight init: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in))."""
  return nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
  """PyTorch's default bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def _kaiming_fan_out():
  """torchvision ResNet conv init: kaiming_normal_(mode="fan_out", nonlinearity="relu")."""
  return nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def conv2d(
    in_ch: int,
    out_ch: int,
    kernel: int,
    stride: int = 1,
    padding: int | None = None,
    dilation: int = 1,
    *,
    bias: bool = False,
    init: str = "torch",
    rngs: nnx.Rngs,
) -> nnx.Conv:
  """An `nnx.Conv` with PyTorch semantics: symmetric explicit zero padding (default
    dilation*(kernel-1)//2, i.e. PyTorch's ``padding=k//2``), HWIO kernel, NHWC activations."""
  if padding is None:
    padding = dilation * (kernel - 1) // 2
  fan_in = in_ch * kernel * kernel
  if init == "torch":
    kinit = torch_kernel_init()
  elif init == "kaiming":
    kinit = _kaiming_fan_out()
  else:
    raise ValueError(f"unknown init {init!r}; expected 'torch' or 'kaiming'")
  return nnx.Conv(
      in_ch,
      out_ch,
      (kernel, kernel),
      strides=(stride, stride),
      padding=((padding, padding), (padding, padding)),
      kernel_dilation=(dilation, dilation),
      use_bias=bias,
      kernel_init=kinit,
      bias_init=torch_bias_init(fan_in),
      rngs=rngs,
  )


def linear(in_f: int, out_f: int, *, bias: bool = True, rngs: nnx.Rngs) -> nnx.Linear:
  """An `nnx.Linear` with PyTorch's default init."""
  return nnx.Linear(
      in_f,
      out_f,
      use_bias=bias,
      kernel_init=torch_kernel_init(),
      bias_init=torch_bias_init(in_f),
      rngs=rngs,
  )


def batch_norm(
    num_features: int,
    *,
    use_running_average: bool = False,
    scale_init: float = 1.0,
    rngs: nnx.Rngs,
) -> nnx.BatchNorm:
  """`nnx.BatchNorm` with PyTorch's defaults (momentum 0.1 -> Flax 0.9, eps 1e-5)."""
  return nnx.BatchNorm(
      num_features,
      use_running_average=use_running_average,
      momentum=0.9,
      epsilon=1e-5,
      scale_init=nnx.initializers.constant(scale_init),
      rngs=rngs,
  )


class ReLU(nnx.Module):
  """Parameter-free ReLU, so lists of layers keep PyTorch's nn.Sequential indices."""

  def __call__(self, x):
    return jax.nn.relu(x)


class MaxPool(nnx.Module):
  """Parameter-free max pooling on NHWC with PyTorch's symmetric ``padding`` (pads with -inf)."""

  def __init__(self, window: int, stride: int | None = None, padding: int = 0):
    self.window = window
    self.stride = window if stride is None else stride
    self.padding = padding

  def __call__(self, x):
    p = self.padding
    return nnx.max_pool(
        x,
        (self.window, self.window),
        strides=(self.stride, self.stride),
        padding=((p, p), (p, p)),
    )


def run_sequence(layers, x):
  """Apply the modules of a list in order (like PyTorch's nn.Sequential)."""
  for layer in layers:
    x = layer(x)
  return x


# --------------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------------


def _projection(in_ch, out_ch, stride, init, use_running_average, rngs):
  return nnx.List([
      conv2d(in_ch, out_ch, 1, stride, padding=0, init=init, rngs=rngs),
      batch_norm(out_ch, use_running_average=use_running_average, rngs=rngs),
  ])


def _inplace_fi(owner: nnx.Module, conv: nnx.Conv, x: jax.Array, after_relu: bool = True):
  """x as `conv`'s in-place BFP input quantization leaves it, when owner.bfpsim_inplace_fi."""
  if not owner.bfpsim_inplace_fi:
    return x
  return quantize_for_conv(conv, x, after_relu=after_relu)


class BasicBlock(nnx.Module):
  """ResNet basic block: 3x3 conv-BN-ReLU, 3x3 conv-BN, + shortcut, ReLU.

    The shortcut is identity, or [1x1 conv (stride), BN] stored under ``shortcut_name``
    ("shortcut" in kuangliu's CIFAR code, "downsample" in torchvision) when the shape changes.
    """

  expansion = 1

  def __init__(
      self,
      in_planes: int,
      planes: int,
      stride: int = 1,
      dilation: int = 1,
      *,
      shortcut_name: str = "shortcut",
      init: str = "torch",
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    ura = use_running_average
    self.conv1 = conv2d(in_planes, planes, 3, stride, dilation=dilation, init=init, rngs=rngs)
    self.bn1 = batch_norm(planes, use_running_average=ura, rngs=rngs)
    self.conv2 = conv2d(planes, planes, 3, 1, dilation=dilation, init=init, rngs=rngs)
    self.bn2 = batch_norm(planes, use_running_average=ura, rngs=rngs)
    self.shortcut_name = shortcut_name
    self.bfpsim_inplace_fi = False
    out = planes * self.expansion
    proj = None
    if stride != 1 or in_planes != out:
      proj = _projection(in_planes, out, stride, init, ura, rngs)
    setattr(self, shortcut_name, proj)

  def __call__(self, x):
    """x: the block input, already quantized for conv1 by `ResNet` when bfpsim_inplace_fi."""
    out = jax.nn.relu(self.bn1(self.conv1(x)))
    out = _inplace_fi(self, self.conv2, out)
    out = self.bn2(self.conv2(out))
    proj = getattr(self, self.shortcut_name)
    sc = x if proj is None else run_sequence(proj, x)
    return jax.nn.relu(out + sc)


class Bottleneck(nnx.Module):
  """torchvision v1.5 bottleneck: 1x1 conv, 3x3 conv (carries the stride and dilation), 1x1 conv
    (x4 channels), each followed by BN, ReLU after the residual add; projection as in BasicBlock."""

  expansion = 4

  def __init__(
      self,
      in_planes: int,
      planes: int,
      stride: int = 1,
      dilation: int = 1,
      *,
      shortcut_name: str = "downsample",
      init: str = "kaiming",
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    ura = use_running_average
    out = planes * self.expansion
    self.conv1 = conv2d(in_planes, planes, 1, 1, padding=0, init=init, rngs=rngs)
    self.bn1 = batch_norm(planes, use_running_average=ura, rngs=rngs)
    self.conv2 = conv2d(planes, planes, 3, stride, dilation=dilation, init=init, rngs=rngs)
    self.bn2 = batch_norm(planes, use_running_average=ura, rngs=rngs)
    self.conv3 = conv2d(planes, out, 1, 1, padding=0, init=init, rngs=rngs)
    self.bn3 = batch_norm(out, use_running_average=ura, rngs=rngs)
    self.shortcut_name = shortcut_name
    self.bfpsim_inplace_fi = False
    proj = None
    if stride != 1 or in_planes != out:
      proj = _projection(in_planes, out, stride, init, ura, rngs)
    setattr(self, shortcut_name, proj)

  def __call__(self, x):
    """x: the block input, already quantized for conv1 by `ResNet` when bfpsim_inplace_fi."""
    out = jax.nn.relu(self.bn1(self.conv1(x)))
    out = _inplace_fi(self, self.conv2, out)
    out = jax.nn.relu(self.bn2(self.conv2(out)))
    out = _inplace_fi(self, self.conv3, out)
    out = self.bn3(self.conv3(out))
    proj = getattr(self, self.shortcut_name)
    sc = x if proj is None else run_sequence(proj, x)
    return jax.nn.relu(out + sc)


_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}
_NAMING = {"kuangliu": ("shortcut", "linear"), "torchvision": ("downsample", "fc")}

# --------------------------------------------------------------------------------------------------
# ResNet
# --------------------------------------------------------------------------------------------------


class ResNet(nnx.Module):
  """Generic ResNet (NHWC in, logits out).

    Args:
      block: "basic" or "bottleneck".
      num_blocks: blocks per stage (4 stages).
      num_classes: classifier outputs; None builds a headless backbone (use `features`).
      width: channels of the first stage (stages use width x (1, 2, 4, 8), times the block expansion
        at the output); 64 is the paper network.
      stem: "cifar" (3x3 conv stride 1, no pooling), "imagenet" (7x7 conv stride 2 + 3x3 max pool
        stride 2) or "deep" (mmseg ResNetV1c: three 3x3 convs, first stride 2, + max pool).
      strides, dilations: per stage (dilated backbones for segmentation use strides (1, 2, 1, 1),
        dilations (1, 1, 2, 4)).
      naming: "kuangliu" (shortcut / linear) or "torchvision" (downsample / fc); default: kuangliu
        for the cifar stem, torchvision otherwise.
      init: "torch" (PyTorch default) or "kaiming" (torchvision); default: torch for the cifar stem.
      in_channels: input channels (3).
      use_running_average: initial BatchNorm mode (False = train); switch later with
        model.train() / model.eval().
    """

  def __init__(
      self,
      block: str = "basic",
      num_blocks: Sequence[int] = (2, 2, 2, 2),
      num_classes: int | None = 10,
      *,
      width: int = 64,
      stem: str = "cifar",
      strides: Sequence[int] = (1, 2, 2, 2),
      dilations: Sequence[int] = (1, 1, 1, 1),
      naming: str | None = None,
      init: str | None = None,
      in_channels: int = 3,
      use_running_average: bool = False,
      rngs: nnx.Rngs,
  ):
    if block not in _BLOCKS:
      raise ValueError(f"unknown block {block!r}; expected one of {sorted(_BLOCKS)}")
    if stem not in ("cifar", "imagenet", "deep"):
      raise ValueError(f"unknown stem {stem!r}; expected 'cifar', 'imagenet' or 'deep'")
    if not (len(num_blocks) == len(strides) == len(dilations) == 4):
      raise ValueError("num_blocks, strides and dilations need 4 entries (one per stage)")
    naming = naming or ("kuangliu" if stem == "cifar" else "torchvision")
    if naming not in _NAMING:
      raise ValueError(f"unknown naming {naming!r}; expected one of {sorted(_NAMING)}")
    init = init or ("torch" if stem == "cifar" else "kaiming")
    shortcut_name, classifier_name = _NAMING[naming]
    block_cls = _BLOCKS[block]
    ura = use_running_average
    self.stem_type = stem
    self.classifier_name = classifier_name
    self.bfpsim_inplace_fi = False

    if stem == "cifar":
      self.conv1 = conv2d(in_channels, width, 3, 1, init=init, rngs=rngs)
      self.bn1 = batch_norm(width, use_running_average=ura, rngs=rngs)
    elif stem == "imagenet":
      self.conv1 = conv2d(in_channels, width, 7, 2, padding=3, init=init, rngs=rngs)
      self.bn1 = batch_norm(width, use_running_average=ura, rngs=rngs)
      self.maxpool = MaxPool(3, 2, padding=1)
    else:  # deep stem, mmseg ResNetV1c: stem_channels = width, first two convs width // 2
      half = max(width // 2, 1)
      self.stem = nnx.List([
          conv2d(in_channels, half, 3, 2, init=init, rngs=rngs),
          batch_norm(half, use_running_average=ura, rngs=rngs),
          ReLU(),
          conv2d(half, half, 3, 1, init=init, rngs=rngs),
          batch_norm(half, use_running_average=ura, rngs=rngs),
          ReLU(),
          conv2d(half, width, 3, 1, init=init, rngs=rngs),
          batch_norm(width, use_running_average=ura, rngs=rngs),
          ReLU(),
      ])
      self.maxpool = MaxPool(3, 2, padding=1)

    in_planes = width
    stage_channels = []
    for i, (n, s, d) in enumerate(zip(num_blocks, strides, dilations)):
      planes = width * 2**i
      blocks = []
      for j in range(n):
        blocks.append(
            block_cls(
                in_planes,
                planes,
                s if j == 0 else 1,
                d,
                shortcut_name=shortcut_name,
                init=init,
                use_running_average=ura,
                rngs=rngs,
            ))
        in_planes = planes * block_cls.expansion
      setattr(self, f"layer{i + 1}", nnx.List(blocks))
      stage_channels.append(in_planes)
    self.stage_channels = tuple(stage_channels)
    self.out_channels = in_planes
    # PyTorch's Linear default init, in kuangliu's and in torchvision's ResNet alike.
    head = None if num_classes is None else linear(in_planes, num_classes, rngs=rngs)
    setattr(self, classifier_name, head)

  def features(self, x) -> list:
    """Stem and the four stages; returns the list of the four stage outputs (NHWC).

    With bfpsim_inplace_fi, each block input is quantized here, where it is produced, for the
    block's conv1 (after a ReLU, or after the max pool of the ImageNet / deep stems), so the
    shortcut and the stage outputs see the quantized values, as in BFPsim.
    """
    if self.stem_type == "deep":
      prev = None
      for layer in self.stem:
        if isinstance(layer, nnx.Conv) and prev is not None:
          x = _inplace_fi(self, layer, x, after_relu=isinstance(prev, ReLU))
        x = layer(x)
        prev = layer
      x = self.maxpool(x)
    else:
      x = jax.nn.relu(self.bn1(self.conv1(x)))
      if self.stem_type == "imagenet":
        x = self.maxpool(x)
    layers = (self.layer1, self.layer2, self.layer3, self.layer4)
    blocks = [block for layer in layers for block in layer]
    if blocks:
      x = _inplace_fi(self, blocks[0].conv1, x, after_relu=self.stem_type == "cifar")
    outs = []
    done = 0
    for layer in layers:
      for block in layer:
        x = block(x)
        done += 1
        if done < len(blocks):
          x = _inplace_fi(self, blocks[done].conv1, x)
      outs.append(x)
    return outs

  def __call__(self, x):
    x = self.features(x)[-1]
    head = getattr(self, self.classifier_name)
    if head is None:
      return x
    # Global average pooling (kuangliu's avg_pool2d(4) on the 4x4 map of a 32x32 input).
    x = jnp.mean(x, axis=(1, 2))
    return head(x)


def resnet18(
    num_classes: int = 10,
    *,
    width: int = 64,
    num_blocks: Sequence[int] = (2, 2, 2, 2),
    stem: str = "cifar",
    rngs: nnx.Rngs | None = None,
    **kwargs,
) -> ResNet:
  """ResNet18. Default: the CIFAR net of BFPsim / CPD (kuangliu; 3x3 stem, 10 classes,
    11,173,962 parameters). ``stem="imagenet"`` gives torchvision's resnet18 (names downsample/fc)."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return ResNet("basic", num_blocks, num_classes, width=width, stem=stem, rngs=rngs, **kwargs)


def resnet50(
    num_classes: int = 1000,
    *,
    width: int = 64,
    num_blocks: Sequence[int] = (3, 4, 6, 3),
    stem: str = "imagenet",
    rngs: nnx.Rngs | None = None,
    **kwargs,
) -> ResNet:
  """ResNet50 for ImageNet (torchvision v1.5: stride on the 3x3 conv; 25,557,032 parameters)."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return ResNet("bottleneck", num_blocks, num_classes, width=width, stem=stem, rngs=rngs, **kwargs)
