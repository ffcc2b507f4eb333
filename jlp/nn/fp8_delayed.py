"""The per-layer state of TE's DelayedScaling (`jlp.gemm.fp8_delayed`) in an NNX model.

A layer quantized with a `DelayedScaling` GemmQuant (`jlp.nn.recipe_rules("fp8_delayed")`) holds,
in its adapter (`QDotGeneral` / `QConv` / `QEinsum`), an `Fp8DelayedState` module with six `Fp8Meta`
variables, under "<layer path>/<hook>/fp8":

  x_amax_history, w_amax_history, dy_amax_history    float32 [amax_history_len], zeros at first
  x_scale, w_scale, dy_scale                          float32 scalars, 1.0 at first

They are model state (not nnx.Param: optimizers never see them; checkpoints save them with the
rest of the model state). Their gradients (taken with `wrt=Fp8Meta`) are the updated histories
and, for the scales, the number of calls (Flax's OVERWRITE_WITH_GRADIENT, `jlp.gemm.fp8_delayed`);
`overwrite_fp8_meta` writes the histories back and recomputes the scales, and leaves the state of a
layer that was not called as it was. A layer called more than once in one differentiated function
(shared weights) would get the sum of its calls' updates, not TE's max over them, so that call
raises a ValueError while tracing. A plain single-device loop:

  grads, meta_grads = nnx.grad(loss, argnums=..., wrt=...)   # meta_grads: the Fp8Meta gradients
  nnx.update(model, overwrite_fp8_meta(nnx.state(model, Fp8Meta), meta_grads))

`jlp.train.TrainStep` does this itself, taking the elementwise max of the new histories over its
nodes and devices first (TE all-reduces the amaxes with max over the data-parallel group) and
recomputing each scale from the reduced history, so every device keeps the same state.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jlp.gemm.fp8_delayed import (TENSORS, DelayedScaling, compute_scale, fp8_grad_qdq, fp8_qdq)

__all__ = ["Fp8DelayedState", "Fp8Meta", "overwrite_fp8_meta"]

_HIGHEST = lax.Precision.HIGHEST


def _differentiated_tracer_types() -> tuple[type, ...]:
  """The tracer types of a value being differentiated (jax.grad's linearize, jax.jvp); none
  where a JAX version lacks them (the second-call check then never fires)."""
  try:
    from jax._src.interpreters import ad  # pylint: disable=g-import-not-at-top
  except ImportError:
    return ()
  return tuple(t for t in (getattr(ad, "LinearizeTracer", None), getattr(ad, "JVPTracer", None))
               if isinstance(t, type))


_DIFFERENTIATED = _differentiated_tracer_types()
# Each layer state's x history as seen by its last differentiated call.
_LAST_CALL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Fp8Meta(nnx.Variable):
  """An FP8 amax history or scale of a DelayedScaling layer (module docstring). Not an
  nnx.Param: a history's gradient is its new value and a scale's the number of calls, both read
  by `overwrite_fp8_meta`. A scale variable carries `scaled_max` (fp8_max · 2^-margin) and `algo`
  (amax_compute_algo) as metadata, so the update needs nothing but the state."""


class Fp8DelayedState(nnx.Module):
  """The amax histories and scales of one DelayedScaling layer, and its quantized GEMMs."""

  def __init__(self, cfg: DelayedScaling):
    if not isinstance(cfg, DelayedScaling):
      raise ValueError(f"cfg={cfg!r} is not allowed; expected a jlp DelayedScaling.")
    self.cfg = cfg
    for t in TENSORS:
      setattr(self, f"{t}_amax_history",
              Fp8Meta(jnp.zeros((cfg.amax_history_len,), jnp.float32), kind="amax_history"))
      setattr(self, f"{t}_scale", Fp8Meta(jnp.ones((), jnp.float32), kind="scale",
                                          scaled_max=cfg.scaled_max(t),
                                          algo=cfg.amax_compute_algo))

  def _args(self, t: str):
    cfg = self.cfg
    return (getattr(self, f"{t}_scale")[...], getattr(self, f"{t}_amax_history")[...],
            cfg.dtype_name(t), cfg.scaled_max(t), cfg.amax_compute_algo)

  def qdq(self, t: str, x: jax.Array) -> jax.Array:
    """Tensor `t` ("x" or "w") quantized and dequantized with its delayed scale (float32)."""
    return fp8_qdq(jnp.asarray(x, jnp.float32), *self._args(t))

  def grad_qdq(self, y: jax.Array) -> jax.Array:
    """y unchanged; its gradient quantized with dy's delayed scale."""
    return fp8_grad_qdq(y, *self._args("dy"))

  def _refuse_a_second_call(self) -> None:
    """Raises if this layer was already called in the function being differentiated: both
    calls then read the same tracer of the history."""
    history = self.x_amax_history[...]
    if not isinstance(history, _DIFFERENTIATED):
      return
    last = _LAST_CALL.get(self)
    if last is not None and last() is history:
      raise ValueError(
          "A layer quantized with DelayedScaling (quant_recipe 'fp8_delayed') was called twice "
          "in one differentiated function; this is not allowed: the amax-history updates of the "
          "calls would add up instead of taking TE's max over them. Expected one call per "
          "layer and step (give a layer used twice its own copy, or quantize it with a "
          "stateless recipe such as 'fp8_current').")
    _LAST_CALL[self] = weakref.ref(history)

  def bilinear(self, op: Callable[[jax.Array, jax.Array], jax.Array], lhs: jax.Array,
               rhs: jax.Array, out_dtype: Any) -> jax.Array:
    """op(x̃, w̃) in float32 with the gradient's quantization, cast to out_dtype."""
    self._refuse_a_second_call()
    for name, a in (("lhs", lhs), ("rhs", rhs)):
      if not jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={jnp.asarray(a).dtype} is not allowed with a quantizing "
                         "cfg; expected a floating dtype (float32, bfloat16, float16).")
    y = op(self.qdq("x", lhs), self.qdq("w", rhs))
    return self.grad_qdq(y).astype(out_dtype)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    prec = _HIGHEST if precision is None else precision
    op = lambda a, b: lax.dot_general(a, b, dimension_numbers, precision=prec,
                                      preferred_element_type=jnp.float32)
    return self.bilinear(op, lhs, rhs, out_dtype)

  def conv(self, lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
           dimension_numbers=None, feature_group_count=1, preferred_element_type=None):
    out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    op = lambda a, b: lax.conv_general_dilated(
        a, b, window_strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
        precision=_HIGHEST, preferred_element_type=jnp.float32)
    return self.bilinear(op, lhs, rhs, out_dtype)


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _value(x: Any) -> jax.Array:
  return x.get_value() if isinstance(x, nnx.Variable) else x


def overwrite_fp8_meta(meta: nnx.State, meta_grads: nnx.State,
                       reduce: Callable[[jax.Array], jax.Array] | None = None) -> nnx.State:
  """The new Fp8Meta state: each amax history becomes its gradient (after `reduce`, e.g. a max
  over devices), each scale is recomputed from its new history and its old value
  (`jlp.gemm.fp8_delayed.compute_scale`, with the scale's `scaled_max` and `algo` metadata). A
  tensor whose scale gradient (its call count, after `reduce`) is 0 keeps its history and scale:
  its layer was not called.

  Args:
    meta: the Fp8Meta variables before the step (`nnx.state(model, Fp8Meta)`).
    meta_grads: their gradients, of the same structure.
    reduce: applied to every new history and call count (None: as is).

  Returns:
    A state of the structure of `meta`, to `nnx.update` the model (or merge into its state).
  """
  reduce = (lambda a: a) if reduce is None else reduce
  grads = {path: _value(g) for path, g in
           jax.tree_util.tree_flatten_with_path(meta_grads, is_leaf=_is_var)[0]}
  metas = dict(jax.tree_util.tree_flatten_with_path(meta, is_leaf=_is_var)[0])

  def scale_path(path):
    name = str(path[-1].key if hasattr(path[-1], "key") else path[-1])
    return path[:-1] + (type(path[-1])(name[:-len("amax_history")] + "scale"),)

  called, histories = {}, {}  # by the scale's path
  for path, var in metas.items():
    if var.get_metadata().get("kind") == "amax_history":
      scale = scale_path(path)
      called[scale] = reduce(grads[scale]) > 0
      histories[scale] = jnp.where(called[scale], reduce(grads[path]), var.get_value())

  def new(path, var):
    md = var.get_metadata()
    if md.get("kind") == "amax_history":
      return var.replace(histories[scale_path(path)])
    scale = compute_scale(histories[path], var.get_value(), md["scaled_max"], md["algo"])
    return var.replace(jnp.where(called[path], scale, var.get_value()))

  return jax.tree_util.tree_map_with_path(new, meta, is_leaf=_is_var)
