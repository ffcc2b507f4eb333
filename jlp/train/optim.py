"""Optimizers and learning-rate schedules of the CPD recipes, as optax transformations.

SGD (`torch_sgd`): PyTorch's SGD (dampening 0) on float32 master weights, as CPD uses it
(docs/cpd.md#recipes):
    d = g + wd * w            (wd only where the decay mask is True)
    buf = m * buf + d         (buf starts at 0, so the first buf is d, as in torch)
    w = w - lr * buf          (Nesterov: w = w - lr * (d + m * buf))
= optax.chain(add_decayed_weights(wd, mask), sgd(lr, momentum, nesterov)): optax.trace keeps
buf = g + m * buf and the learning rate (a schedule of the step count) multiplies buf, as torch's.

Weight-decay masks (`decay_mask`): a predicate over parameter paths ("layer1/0/bn1/scale", the
"/"-joined NNX path, as `jlp.models.module_path`) returns True for the parameters that get no
decay; `is_bn_or_bias` (every BatchNorm / LayerNorm scale and every bias: the usual "no decay
for BN and biases") and `path_contains("bn")` (CPD's ResNet50 rule: names containing "bn",
docs/cpd.md#recipes) are provided.

LARS (docs/cpd.md#recipes). CPD's rule, on every parameter, no epsilon:
    local_lr = 0.001 * ||w|| / (||g|| + wd * ||w||)
    buf = m * buf + lr * local_lr * (g + wd * w);   w = w - buf
`lars` is optax.lars set up closest to it (trust coefficient 0.001, eps 0, decay and trust
ratio on every parameter, momentum 0.9). optax's trust ratio is
    0.001 * ||w|| / ||g + wd * w||
(the norm of the decayed gradient, not CPD's bound ||g|| + wd ||w||), so the two agree exactly in
exact arithmetic only when wd = 0 (or g is a non-negative multiple of w); and where ||w|| or the
update norm is 0 optax uses a ratio of 1, where CPD's parameter never moves (||w|| = 0: every
BatchNorm beta at initialisation) or becomes NaN (both norms 0). `cpd_lars` is CPD's formula
itself (compat, NaN case included).

Schedules: `step_schedule` (piecewise constant), `warmup_step_schedule` (linear warm-up, then
piecewise constant), `cpd_resnet18_lr` (CPD ResNet18's `adjust_learning_rate`).
optax counts updates from 0; CPD counts steps from 1, so optax count c is CPD step c + 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "cpd_lars",
    "cpd_resnet18_lr",
    "decay_mask",
    "is_bn_or_bias",
    "lars",
    "param_path",
    "path_contains",
    "step_schedule",
    "torch_sgd",
    "warmup_step_schedule",
]

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def _check_nonneg(field: str, value: Any) -> float:
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
      or not math.isfinite(value)):
    raise _invalid(field, value, "a finite float >= 0")
  return float(value)


def _check_lr(learning_rate: Any) -> ScalarOrSchedule:
  if callable(learning_rate):
    return learning_rate
  _check_nonneg("learning_rate", learning_rate)
  return learning_rate


# -- weight-decay masks -----------------------------------------------------------------------


def param_path(key_path: tuple) -> str:
  """A parameter's "/"-joined path from a jax key path ('layer1/0/bn1/scale'); the trailing
  `.value` attribute of an nnx.Variable leaf is dropped."""
  parts = []
  for k in key_path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != "value":
        parts.append(k.name)
    else:
      parts.append(str(k))
  return "/".join(parts)


def is_bn_or_bias(path: str) -> bool:
  """True for biases and normalisation scales (BatchNorm / LayerNorm 'scale' and 'bias')."""
  return path.rsplit("/", 1)[-1] in ("bias", "scale")


def path_contains(*substrings: str) -> Callable[[str], bool]:
  """A predicate: True when the path contains any of `substrings` (CPD ResNet50: "bn")."""
  if not substrings or not all(isinstance(s, str) and s for s in substrings):
    raise _invalid("substrings", substrings, "one or more non-empty strings")
  return lambda path: any(s in path for s in substrings)


def decay_mask(no_decay: Callable[[str], bool]) -> Callable[[Any], Any]:
  """An optax mask function: True (decay) for every parameter whose path `no_decay` rejects."""
  if not callable(no_decay):
    raise _invalid("no_decay", no_decay, "a callable path -> bool")

  def mask(params):
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree.unflatten(treedef, [not no_decay(param_path(p)) for p, _ in flat])

  return mask


# -- SGD ----------------------------------------------------------------------------------------


def torch_sgd(learning_rate: ScalarOrSchedule,
              momentum: float = 0.0,
              *,
              nesterov: bool = False,
              weight_decay: float = 0.0,
              decay_mask: Any = None) -> optax.GradientTransformation:
  """PyTorch / CPD SGD (module docstring). `decay_mask`: None (decay everything), a pytree of
  bools or a function params -> bools (e.g. `decay_mask(is_bn_or_bias)`)."""
  learning_rate = _check_lr(learning_rate)
  momentum = _check_nonneg("momentum", momentum)
  weight_decay = _check_nonneg("weight_decay", weight_decay)
  if not isinstance(nesterov, bool):
    raise _invalid("nesterov", nesterov, "True or False")
  if nesterov and momentum == 0:
    raise _invalid("nesterov", nesterov, "False when momentum=0 (as torch)")
  parts = []
  if weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
  parts.append(optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov))
  return optax.chain(*parts)


# -- LARS ---------------------------------------------------------------------------------------


def lars(learning_rate: ScalarOrSchedule,
         momentum: float = 0.9,
         *,
         weight_decay: float = 1e-4,
         trust_coefficient: float = 0.001,
         eps: float = 0.0,
         decay_mask: Any = True,
         trust_ratio_mask: Any = True,
         nesterov: bool = False) -> optax.GradientTransformation:
  """optax.lars with CPD's constants (module docstring: where it differs from CPD).

  `decay_mask` (optax's weight_decay_mask): True (decay every parameter), a pytree of bools or a
  function params -> bools such as `decay_mask(is_bn_or_bias)`; a masked-out parameter gets no
  weight decay, and its trust ratio is taken over its plain gradient (`trust_ratio_mask` still
  applies to it). With u = -lr * trust ratio * (g + wd * w) and buf = momentum * buf + u
  (optax.trace), the update is buf, or with `nesterov` u + momentum * buf."""
  if not isinstance(nesterov, bool):
    raise _invalid("nesterov", nesterov, "True or False")
  return optax.lars(_check_lr(learning_rate),
                    weight_decay=_check_nonneg("weight_decay", weight_decay),
                    weight_decay_mask=decay_mask,
                    trust_coefficient=_check_nonneg("trust_coefficient", trust_coefficient),
                    eps=_check_nonneg("eps", eps),
                    trust_ratio_mask=trust_ratio_mask,
                    momentum=_check_nonneg("momentum", momentum),
                    nesterov=nesterov)


class CpdLarsState(NamedTuple):
  count: jax.Array
  buf: Any


def cpd_lars(learning_rate: ScalarOrSchedule,
             momentum: float = 0.9,
             *,
             weight_decay: float = 1e-4,
             trust_coefficient: float = 0.001) -> optax.GradientTransformation:
  """CPD's LARS exactly (docs/cpd.md#recipes), on every parameter; the update is -buf.

  float32 per parameter tensor: local_lr = tc * ||w|| / (||g|| + wd * ||w||);
  d = g + wd * w; buf = m * buf + (lr * local_lr) * d. No guard: ||w|| = 0 gives local_lr 0, and
  ||w|| = ||g|| = 0 gives NaN, as in CPD.
  """
  learning_rate = _check_lr(learning_rate)
  momentum = _check_nonneg("momentum", momentum)
  weight_decay = _check_nonneg("weight_decay", weight_decay)
  trust_coefficient = _check_nonneg("trust_coefficient", trust_coefficient)

  def init(params):
    return CpdLarsState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("cpd_lars needs params: call update(grads, state, params).")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    lr = jnp.asarray(lr, jnp.float32)

    def one(g, w, buf):
      w_norm = jnp.sqrt(jnp.sum(jnp.square(w)))
      g_norm = jnp.sqrt(jnp.sum(jnp.square(g)))
      local_lr = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm)
      return momentum * buf + (lr * local_lr) * (g + weight_decay * w)

    buf = jax.tree.map(one, grads, params, state.buf)
    return jax.tree.map(jnp.negative, buf), CpdLarsState(state.count + 1, buf)

  return optax.GradientTransformation(init, update)


# -- schedules ----------------------------------------------------------------------------------


def _check_boundaries(boundaries_and_scales: Mapping[int, float] | None) -> dict[int, float]:
  out = {}
  for k, v in (boundaries_and_scales or {}).items():
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise _invalid("boundaries_and_scales", boundaries_and_scales, "{step (int >= 0): scale}")
    out[k] = _check_nonneg(f"boundaries_and_scales[{k}]", v)
  return out


def step_schedule(base_lr: float, boundaries_and_scales: Mapping[int, float] | None = None
                  ) -> optax.Schedule:
  """base_lr times the product of the scales of every boundary b <= count (optax's
  piecewise_constant_schedule)."""
  return optax.piecewise_constant_schedule(_check_nonneg("base_lr", base_lr),
                                           _check_boundaries(boundaries_and_scales))


def warmup_step_schedule(base_lr: float,
                         warmup_steps: int,
                         boundaries_and_scales: Mapping[int, float] | None = None,
                         *,
                         warmup_init: float = 0.0) -> optax.Schedule:
  """Linear warm-up from warmup_init (count 0) to base_lr (count warmup_steps), then base_lr
  with the step decays of `boundaries_and_scales` (absolute update counts; the scale applies
  from count b on, b >= warmup_steps)."""
  base_lr = _check_nonneg("base_lr", base_lr)
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise _invalid("warmup_steps", warmup_steps, "an int >= 0")
  bounds = _check_boundaries(boundaries_and_scales)
  if warmup_steps == 0:
    return optax.piecewise_constant_schedule(base_lr, bounds)
  warm = optax.linear_schedule(_check_nonneg("warmup_init", warmup_init), base_lr, warmup_steps)
  if any(b < warmup_steps for b in bounds):
    raise _invalid("boundaries_and_scales", boundaries_and_scales,
                   f"boundaries >= warmup_steps={warmup_steps}")
  after = optax.piecewise_constant_schedule(base_lr,
                                            {b - warmup_steps: s for b, s in bounds.items()})
  return optax.join_schedules([warm, after], [warmup_steps])


def cpd_resnet18_lr(world_size: int,
                    batch_size: int = 512,
                    emulate_nodes: int = 1,
                    dataset_size: int = 50000) -> optax.Schedule:
  """CPD ResNet18/CIFAR10's learning rate (`adjust_learning_rate`), by optax count.

  ipe = ceil(dataset_size / (world_size * batch_size * emulate_nodes)), warmup = 5 ipe; at CPD
  step s = count + 1: s <= warmup: 0.1 + 1.5 s / warmup; else 1.6, x0.1 once s > 40 ipe, x0.1
  again once s > 80 ipe. The values are computed in float64 (Python, as CPD) and rounded once to
  float32 (the value torch multiplies the float32 buffer with), then looked up by count.
  """
  for field, v in (("world_size", world_size), ("batch_size", batch_size),
                   ("emulate_nodes", emulate_nodes), ("dataset_size", dataset_size)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise _invalid(field, v, "an int >= 1")
  ipe = math.ceil(dataset_size / (world_size * batch_size * emulate_nodes))
  warmup = 5 * ipe
  last = 80 * ipe + 1  # constant from CPD step 80 ipe + 1 on

  def lr_at(step: int) -> float:
    if step <= warmup:
      return 0.1 + 1.5 * step / warmup
    lr = 1.6
    if step > 40 * ipe:
      lr *= 0.1
    if step > 80 * ipe:
      lr *= 0.1
    return lr

  table = jnp.asarray(np.array([lr_at(s) for s in range(1, last + 1)], np.float32))

  def schedule(count):
    return table[jnp.clip(jnp.asarray(count), 0, last - 1)]

  return schedule
