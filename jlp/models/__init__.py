"""jlp model zoo (Flax NNX): ResNet18 (CIFAR), ResNet50 (ImageNet), DavidNet, VGG19-BN, FCN, small BERT,
the digits CNN and an MLP.

All models take NHWC float32 images (BERT: int token ids), keep float32 params and compute every
parameter GEMM in an `nnx.Linear`, `nnx.Conv` or `nnx.Einsum`, so quantization rules that replace a
layer's ``dot_general`` / ``conv_general_dilated`` reach all of them. Activation-activation products
(BERT's q·kᵀ and probs·v) are `jnp.einsum` calls inside the attention module, not param layers.

Registry::

    model = jlp.models.get_model("resnet18", num_classes=10, width=8, rngs=nnx.Rngs(0))

names: "resnet18", "resnet50", "davidnet", "vgg19", "fcn", "bert_small", "small_cnn", "mlp" (`MODELS` maps
each to its builder; `rngs` defaults to ``nnx.Rngs(0)``). Train/eval: ``model.train()`` /
``model.eval()`` (BatchNorm ``use_running_average``, Dropout ``deterministic``).

Module paths (flax 0.12.12, checked)
------------------------------------
``nnx.iter_modules(model)`` (``model.iter_modules()`` is deprecated) and ``nnx.iter_graph(model)``
yield ``(path, node)`` where ``path`` is a *tuple*: attribute names are ``str``, indices into an
``nnx.List`` are ``int``, e.g. ``('layer1', 0, 'conv1')`` and ``('layer2', 0, 'shortcut', 0)``; the
root is ``()``. Order: children before their parent, attributes in sorted name order, list
items by index (e.g. ``classifier`` before ``layers/0/...``). The string form used throughout
jlp is ``"/".join(map(str, path))``: ``"layer1/0/conv1"``, ``"layer2/0/shortcut/0"``,
``"linear"`` (root: ``""``). `module_path` / `named_modules` / `gemm_modules` below produce it.

A BFPsim / PyTorch name maps to that form by dropping the leading ``"net."`` and replacing ``"."``
with ``"/"`` (`bfpsim_to_path`): ``net.layer1.0.conv1`` -> ``layer1/0/conv1``,
``net.layer2.0.shortcut.0`` -> ``layer2/0/shortcut/0``, ``net.conv1`` -> ``conv1``,
``net.linear`` -> ``linear`` (CIFAR ResNet18); ``fc`` and ``layerN/i/downsample/0`` for the
torchvision-style ResNets (ImageNet ResNet18/50, FCN backbone under ``backbone/``).
GEMM-free modules that sit in PyTorch nn.Sequential lists (ReLU, MaxPool) are kept as parameter-free
modules in the NNX lists so that the indices agree (VGG ``features/3`` = PyTorch ``features.3``).
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from jlp.models.bert import Bert, bert_small
from jlp.models.davidnet import DavidNet, davidnet
from jlp.models.fcn import FCN, fcn
from jlp.models.mlp import MLP, mlp
from jlp.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50
from jlp.models.small_cnn import SmallCNN, small_cnn
from jlp.models.vgg import VGG, vgg19

__all__ = [
    "GEMM_TYPES",
    "MODELS",
    "BasicBlock",
    "Bert",
    "Bottleneck",
    "DavidNet",
    "FCN",
    "MLP",
    "ResNet",
    "SmallCNN",
    "VGG",
    "bert_small",
    "bfpsim_to_path",
    "davidnet",
    "fcn",
    "gemm_modules",
    "get_model",
    "mlp",
    "module_path",
    "named_modules",
    "resnet18",
    "resnet50",
    "small_cnn",
    "vgg19",
]

#: Layer types whose GEMM (dot_general / conv_general_dilated / einsum) quantization rules replace.
GEMM_TYPES = (nnx.Linear, nnx.Conv, nnx.Einsum)

MODELS: dict[str, Callable[..., nnx.Module]] = {
    "resnet18": resnet18,
    "resnet50": resnet50,
    "davidnet": davidnet,
    "vgg19": vgg19,
    "fcn": fcn,
    "bert_small": bert_small,
    "small_cnn": small_cnn,
    "mlp": mlp,
}


def get_model(name: str, **kwargs) -> nnx.Module:
  """Build a zoo model by name (see `MODELS`); kwargs go to the builder (e.g. num_classes, width,
    num_blocks, rngs; BERT: vocab, max_len, hidden, num_layers, heads, mlp_dim)."""
  try:
    builder = MODELS[name]
  except KeyError:
    raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}") from None
  return builder(**kwargs)


def module_path(path: tuple) -> str:
  """NNX path tuple -> jlp path string: ('layer1', 0, 'conv1') -> 'layer1/0/conv1'."""
  return "/".join(str(p) for p in path)


def named_modules(model: nnx.Module) -> dict[str, nnx.Module]:
  """All submodules keyed by path string (in nnx.iter_modules order: children first; root '')."""
  return {module_path(p): m for p, m in nnx.iter_modules(model)}


def gemm_modules(model: nnx.Module) -> dict[str, nnx.Module]:
  """The Linear / Conv / Einsum submodules keyed by path string."""
  return {k: m for k, m in named_modules(model).items() if isinstance(m, GEMM_TYPES)}


def bfpsim_to_path(key: str) -> str:
  """BFPsim config key -> path string: 'net.layer1.0.conv1' -> 'layer1/0/conv1'."""
  if key.startswith("net."):
    key = key[len("net."):]
  return key.replace(".", "/")
