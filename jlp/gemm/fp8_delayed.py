"""FP8 with delayed per-tensor scaling: TransformerEngine's DelayedScaling recipe.

A layer y = x · w quantized with `DelayedScaling` keeps, for each of its three FP8 tensors t in
("x", "w", "dy": the input, the kernel, the gradient of the output), an amax history h_t
(float32 [amax_history_len]) and a scale s_t (float32 scalar): state of the model
(`jlp.nn.fp8_delayed`), initialised as TE does, h_t = 0 and s_t = 1.

Quantization of tensor t in a step (forward for x and w, backward for dy), with the state before
the step (delayed: this step's own amax is not used for its own scale):

  q_t   = fp8(clip(t · s_t, -fp8_max, fp8_max))        saturating cast, round to nearest even
  t̃     = float32(q_t) · (1 / s_t)                       TE's scale_inv = 1 / scale (float32)

with fp8 = float8_e4m3fn (fp8_max 448) for x and w and float8_e5m2 (fp8_max 57344) for dy under
fp8_format "HYBRID" (TE's default; "E4M3": e4m3 for all three). The three GEMMs are float32 GEMMs
(precision HIGHEST) of the dequantized operands: y = x̃ · w̃, dx = dỹ ·ᵀ w̃, dw = x̃ ·ᵀ dỹ (TE's
per-tensor FP8 transposes hold the same values as the forward copies). The quantization of x and
w passes the gradient straight through.

History and scale update with the tensor's amax a = max|t| of the step (`amax_update`):

  h'  = roll(h, -1) with h'[0] = a          (jnp.roll by -1, then the newest amax at index 0)
  A   = max(h')                              amax_compute_algo "max" (TE's default);
                                             "most_recent": A = h'[0] = a
  s'  = (fp8_max / 2^margin) / A             if A is finite and A > 0, else s' = s
  s'  = float32 max                          where s' is inf (A too small; TE's rule)

h' is, entry for entry, the buffer TE's `amax_and_scale_update` reads (TE writes the step's amax
at index 0 of its stored history, then computes the scale from it, then stores it rolled by -1 with
index 0 zeroed, ready for the next amax): jlp stores it before TE's final roll, as Flax's
`compute_amax_history` does, so both keep the same window of the amax_history_len most recent
amaxes and give the same scales. TE computes fp8_max · 2^-margin first, then divides.

Since dy's amax is only known in the backward pass, the update is delivered as Flax's fp8_ops do
(OVERWRITE_WITH_GRADIENT): `fp8_qdq` and `fp8_grad_qdq` are custom_vjps whose "gradient" with
respect to h_t is the updated h'_t of the call, and with respect to s_t is 1, a count of the
calls; the caller overwrites the state instead of applying an optimizer, recomputing s'_t from
h'_t (`jlp.nn.fp8_delayed.overwrite_fp8_meta`; the data-parallel step first takes the max of h'
over its devices, `jlp.train.step`). A tensor whose count is 0 (its layer was not called) keeps
its state, as in TE. Gradients of several calls add up, which is not TE's max over the calls, so
a layer called twice in one differentiated function is refused (`jlp.nn.fp8_delayed`).

References:
  NVIDIA TransformerEngine, transformer_engine/common/recipe/__init__.py (DelayedScaling,
    Format.HYBRID) and common/recipe/delayed_scaling.cu (amax_and_scale_update).
  Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433, 2022.
  Flax, flax/nnx/nn/fp8_ops.py (Fp8DotGeneralOp, in_qdq / out_qdq, compute_amax_history,
    compute_scale, OVERWRITE_WITH_GRADIENT).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jlp.formats import FloatFormat
from jlp.formats.float_format import _check_choice, _invalid
from jlp.gemm.config import ROLES, GemmQuant

__all__ = ["AMAX_ALGOS", "FP8_FORMATS", "TENSORS", "DelayedScaling", "amax_update", "fp8_grad_qdq",
           "fp8_qdq", "quantize_dequantize"]

#: fp8_format values: TE's Format.HYBRID (E4M3 forward, E5M2 backward) and Format.E4M3.
FP8_FORMATS = ("HYBRID", "E4M3")
#: amax_compute_algo values (TE's).
AMAX_ALGOS = ("max", "most_recent")
#: The FP8 tensors of a layer: input, kernel, output gradient.
TENSORS = ("x", "w", "dy")
_E4M3, _E5M2 = "float8_e4m3fn", "float8_e5m2"


@dataclasses.dataclass(frozen=True)
class DelayedScaling(GemmQuant):
  """A layer's GemmQuant for TE's DelayedScaling (module docstring); needs per-layer state, so it
  is used through `jlp.nn.quantize_model` (the layer's adapter keeps the state), not
  `qdot_general`.

  The roles are set from fp8_format (x, w: E4M3; dgrad_dy, wgrad_dy: E5M2 under "HYBRID"), for
  reports; bwd_from_fwd=True (the backward GEMMs use the forward's FP8 x and w); no other role
  and no accumulator.

  Attributes:
    fp8_format: "HYBRID" (TE's default) or "E4M3".
    amax_history_len: the history length (TE's default 1024), >= 1.
    amax_compute_algo: "max" (TE's default) or "most_recent".
    margin: the scale is divided by 2^margin (TE's default 0), an int >= 0.
  """

  fp8_format: str = "HYBRID"
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  margin: int = 0

  def __post_init__(self):
    _check_choice("fp8_format", self.fp8_format, FP8_FORMATS)
    n = self.amax_history_len
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise _invalid("amax_history_len", n, "an int >= 1")
    _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)
    m = self.margin
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
      raise _invalid("margin", m, "an int >= 0")
    expected = {r: None for r in ROLES}
    expected.update(x=FloatFormat.from_name(_E4M3), w=FloatFormat.from_name(_E4M3),
                    dgrad_dy=FloatFormat.from_name(self.dtype_name("dy")),
                    wgrad_dy=FloatFormat.from_name(self.dtype_name("dy")))
    for role, fmt in expected.items():
      given = getattr(self, role)
      if given is not None and given != fmt:
        raise ValueError(f"{role}={given!r} is not allowed with DelayedScaling(fp8_format="
                         f"{self.fp8_format!r}); expected {fmt!r} (set by fp8_format).")
      object.__setattr__(self, role, fmt)
    if not self.bwd_from_fwd:
      raise ValueError("bwd_from_fwd=False is not allowed with DelayedScaling; expected True.")
    if self.accum is not None or self.kahan or self.promote_every is not None:
      raise ValueError(f"accum={self.accum!r} is not allowed with DelayedScaling; expected None "
                       "(float32 accumulation).")
    super().__post_init__()

  def dtype_name(self, tensor: str) -> str:
    """The ml_dtypes name of tensor `tensor`'s FP8 type ("x", "w", "dy")."""
    if tensor not in TENSORS:
      raise ValueError(f"tensor={tensor!r} is not allowed; expected one of {', '.join(TENSORS)}.")
    return _E5M2 if tensor == "dy" and self.fp8_format == "HYBRID" else _E4M3

  def scaled_max(self, tensor: str) -> float:
    """fp8_max · 2^-margin of tensor `tensor` (float32), TE's `scaled_max`."""
    return float(np.float32(fp8_max(self.dtype_name(tensor))) * np.float32(2.0 ** -self.margin))


def fp8_max(dtype_name: str) -> float:
  """The largest finite value of an ml_dtypes float8 type (448 for e4m3fn, 57344 for e5m2)."""
  return float(ml_dtypes.finfo(getattr(ml_dtypes, dtype_name)).max)


def quantize_dequantize(x: jax.Array, scale: jax.Array, dtype_name: str) -> jax.Array:
  """float32(fp8(clip(x · scale, ±fp8_max))) · (1 / scale): TE's per-tensor FP8 cast (saturating,
  round to nearest even) and its dequantization by scale_inv = 1 / scale (float32)."""
  dtype = getattr(ml_dtypes, dtype_name)
  top = jnp.float32(fp8_max(dtype_name))
  scale = jnp.asarray(scale, jnp.float32)
  q = jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype)
  return q.astype(jnp.float32) * (jnp.float32(1.0) / scale)


def amax_update(history: jax.Array, scale: jax.Array, amax: jax.Array, scaled_max: float,
                algo: str = "max") -> tuple[jax.Array, jax.Array]:
  """(h', s') after a step whose tensor amax is `amax` (module docstring).

  h' = roll(history, -1) with h'[0] = amax; A = max(h') ("max") or amax ("most_recent");
  s' = scaled_max / A where A is finite and > 0, else `scale`; an infinite s' becomes the float32
  max. Everything in float32.
  """
  amax = jnp.asarray(amax, jnp.float32)
  new_history = jnp.roll(history, -1, axis=0).at[0].set(amax)
  return new_history, compute_scale(new_history, scale, scaled_max, algo)


def compute_scale(new_history: jax.Array, scale: jax.Array, scaled_max: float,
                  algo: str = "max") -> jax.Array:
  """s' of an updated history h' (h'[0] the newest amax) and the previous scale (`amax_update`)."""
  a = jnp.max(new_history) if algo == "max" else new_history[0]
  scale = jnp.asarray(scale, jnp.float32)
  sf = jnp.float32(scaled_max) / a
  sf = jnp.where(jnp.isfinite(a) & (a > 0), sf, scale)
  return jnp.where(jnp.isinf(sf), jnp.float32(np.finfo(np.float32).max), sf)


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x.astype(jnp.float32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fp8_qdq(x: jax.Array, scale: jax.Array, history: jax.Array, dtype_name: str,
            scaled_max: float, algo: str) -> jax.Array:
  """`quantize_dequantize(x, scale, dtype_name)`; the gradient passes straight through to x, the
  "gradient" of history is the updated h' of `amax_update` with amax = max|x| and that of scale
  is 1, the call count (OVERWRITE_WITH_GRADIENT, module docstring)."""
  return quantize_dequantize(x, scale, dtype_name)


def _fp8_qdq_fwd(x, scale, history, dtype_name, scaled_max, algo):
  new_history, _ = amax_update(history, scale, _amax(x), scaled_max, algo)
  return quantize_dequantize(x, scale, dtype_name), new_history


def _fp8_qdq_bwd(dtype_name, scaled_max, algo, new_history, g):
  del dtype_name, scaled_max, algo
  return g, jnp.ones((), jnp.float32), new_history


fp8_qdq.defvjp(_fp8_qdq_fwd, _fp8_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fp8_grad_qdq(y: jax.Array, scale: jax.Array, history: jax.Array, dtype_name: str,
                 scaled_max: float, algo: str) -> jax.Array:
  """The identity on y; its backward quantizes the incoming gradient g (`quantize_dequantize(g,
  scale, dtype_name)`) and gives history the "gradient" h' of `amax_update` with amax = max|g|
  and scale the call count 1 (OVERWRITE_WITH_GRADIENT, module docstring)."""
  del scale, history, dtype_name, scaled_max, algo
  return y


def _fp8_grad_qdq_fwd(y, scale, history, dtype_name, scaled_max, algo):
  del dtype_name, scaled_max, algo
  return y, (scale, history)


def _fp8_grad_qdq_bwd(dtype_name, scaled_max, algo, res, g):
  scale, history = res
  g32 = g.astype(jnp.float32)
  new_history, _ = amax_update(history, scale, _amax(g32), scaled_max, algo)
  return (quantize_dequantize(g32, scale, dtype_name).astype(g.dtype), jnp.ones((), jnp.float32),
          new_history)


fp8_grad_qdq.defvjp(_fp8_grad_qdq_fwd, _fp8_grad_qdq_bwd)
