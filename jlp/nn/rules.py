"""Per-layer quantization rules for Flax NNX models (qwix-style, first match wins).

`quantize_model(model, rules)` walks an existing NNX model and, for every
`nnx.Linear`, `nnx.LinearGeneral`, `nnx.Conv` and `nnx.Einsum`, takes the first
`QuantRule` whose regex `re.fullmatch`es the layer's path; the layer's injection
hook is then set to a small adapter module that calls `jlp.gemm.qdot`:

  nnx.Linear, nnx.LinearGeneral   `dot_general`           -> `QDotGeneral` (qdot_general)
  nnx.Conv                        `conv_general_dilated`  -> `QConv` (qconv)
  nnx.Einsum                      `einsum_op`             -> `QEinsum` (the two-operand
                                   spec is parsed into one qdot_general + a transpose)

The model is modified in place and nothing else in it changes: layers with no
matching rule, or whose first matching rule has cfg None, keep their original
op object, so a model without matching rules computes exactly as before.

Paths are the NNX graph paths joined with "/" (`nnx.iter_modules`; list indices
as decimal strings): "conv1", "layer1/0/conv1", "layer2/0/shortcut/0", "linear"
(the format of `jlp.models.module_path`). Layer kinds, used by per-kind rules:
"linear" (Linear, LinearGeneral), "conv" (Conv), "einsum" (Einsum).

Stochastic rounding keys. A layer whose GemmQuant rounds any role (or its
accumulator) stochastically gets its own `nnx.RngStream` (tag "quant") stored in
the adapter, i.e. inside the model's state (`nnx.RngKey` / `nnx.RngCount`
variables under "<layer path>/<hook>/rng"):

  layer key   = fold_in(rngs.quant(), crc32(path) & 0x7fffffff)   (once, in quantize_model)
  call n key  = fold_in(layer key, n)                              (RngStream semantics)
  role r key  = fold_in(call n key, ROLES.index(r))                (inside qdot_general / qconv)

`rngs.quant()` falls back to the "default" stream, as every NNX stream does. So
draws are independent across layers, across calls and across roles, and
reproducible from the seed. The call counter is model state: under `nnx.jit` /
`nnx.value_and_grad` it advances by itself. With `nnx.split` / `nnx.merge` and
plain `jax.jit` / `jax.grad`, merge with `nnx.merge(..., copy=True)` inside the
differentiated function (NNX's rule for any RNG-carrying module, e.g. Dropout)
and return `nnx.state(model, nnx.RngState)` if the next step must draw new
bits (otherwise the same bits are reused). A stochastic rule with `rngs=None`
is a ValueError at quantize time.

BFP training controls (docs/bfp.md#simple-controller). An adapter whose GemmQuant has BFP roles
holds their mantissa widths as a `BFPWidths` variable (int32, model state) and passes
them as traced `widths=` to qdot_general / qconv; `set_widths(model, report,
{path: {role: int}})` changes them in place (a jitted step taking the model does
not recompile; `SimpleController.bits` fits directly) and `get_widths` reads
them. An adapter with a BFP dgrad_w also holds a `ZSEProbe` (a float32 scalar
variable, not an nnx.Param) whose gradient is the layer's "biw" zero-setting
error. `bfp_zse_metrics(model, grads, report)` returns {path: {"fw", "bwo",
"biw"}} (grads taken with `wrt=nnx.Any(nnx.Param, ZSEProbe)` for "biw").

FP8 delayed scaling (TE's DelayedScaling, `jlp.gemm.fp8_delayed`). An adapter whose GemmQuant is a
`DelayedScaling` holds an `Fp8DelayedState` under "fp8": the amax histories and scales of x, w and
the output gradient as `Fp8Meta` variables (model state), and computes its GEMMs with them
(`jlp.nn.fp8_delayed`; their gradients are their new values, written back by
`overwrite_fp8_meta` or by `jlp.train.TrainStep`).

References:
  qwix (google/qwix): `QuantizationRule.module_path`, first match wins,
    `get_unused_rules`.
  AQT (google/aqt): injection through the layers' dot_general / conv hooks.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import re
import string
import zlib
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jlp.formats import BFPFormat, FloatFormat
from jlp.gemm.config import GemmQuant, ROLES
from jlp.gemm.fp8_delayed import DelayedScaling
from jlp.gemm.qdot import biw_zse_block, bwo_zse_block, qconv, qdot_general
from jlp.nn.fp8_delayed import Fp8DelayedState, Fp8Meta
from jlp.quantize import is_stochastic

__all__ = [
    "BFPWidths",
    "Fp8Meta",
    "KINDS",
    "ZSEProbe",
    "bfp_zse_metrics",
    "get_widths",
    "set_widths",
    "QConv",
    "QDotGeneral",
    "QEinsum",
    "QuantReport",
    "QuantRule",
    "layer_kind",
    "quantize_model",
    "unquantize_model",
]

logger = logging.getLogger("jlp.nn")

KINDS = ("linear", "conv", "einsum")

# Layer type -> (kind, hook attribute, original ops the hook may hold).
_LAYERS: tuple[tuple[type, str, str, tuple[Any, ...]], ...] = (
    (nnx.Conv, "conv", "conv_general_dilated", (lax.conv_general_dilated,)),
    (nnx.Linear, "linear", "dot_general", (lax.dot_general,)),
    (nnx.LinearGeneral, "linear", "dot_general", (None, lax.dot_general)),
    (nnx.Einsum, "einsum", "einsum_op", (jnp.einsum,)),
)
_WEIGHT_ROLES = ("w", "dgrad_w", "wgrad_out")


def layer_kind(module: Any) -> str | None:
  """"linear", "conv", "einsum" for the layers quantize_model handles, else None."""
  for cls, kind, _, _ in _LAYERS:
    if isinstance(module, cls):
      return kind
  return None


def _hook(module: Any) -> tuple[str, str, tuple[Any, ...]]:
  for cls, kind, attr, originals in _LAYERS:
    if isinstance(module, cls):
      return kind, attr, originals
  raise TypeError(type(module))


# ----------------------------------------------------------------------------- rules


@dataclasses.dataclass(frozen=True)
class QuantRule:
  """One rule: layers whose "/"-joined path fullmatches `path` get `cfg`.

  Attributes:
    path: a regular expression, matched with `re.fullmatch` against the layer
      path ("layer1/0/conv1"); compiled at construction.
    cfg: the layer's GemmQuant; None keeps the layer in float32 (and still
      counts as a match, so later rules do not apply). A mapping from layer kind
      ("linear", "conv", "einsum") to GemmQuant / None makes the rule apply only
      to the kinds it names (a layer of another kind falls through to the next
      rule); `load_bfpsim_preset` uses this, since a BFPsim entry translates
      differently for Conv2d and Linear layers.
    name: optional label shown in reports and error messages.
  """

  path: str
  cfg: GemmQuant | None | Mapping[str, GemmQuant | None] = None
  name: str | None = None

  def __post_init__(self):
    if not isinstance(self.path, str):
      raise ValueError(f"{self._label()}: path={self.path!r} is not allowed; expected a regex string.")
    try:
      object.__setattr__(self, "_regex", re.compile(self.path))
    except re.error as e:
      raise ValueError(f"{self._label()}: path regex {self.path!r} does not compile: {e}") from None
    cfg = self.cfg
    if isinstance(cfg, Mapping):
      bad = sorted(str(k) for k in cfg if k not in KINDS)
      if bad:
        raise ValueError(f"{self._label()}: cfg has layer kind {bad[0]!r}; expected kinds among "
                         f"{', '.join(KINDS)}.")
      for k, v in cfg.items():
        if v is not None and not isinstance(v, GemmQuant):
          raise ValueError(f"{self._label()}: cfg[{k!r}]={v!r} is not allowed; expected a "
                           "GemmQuant or None.")
      # frozen and hashable: a sorted tuple of items behind a read-only mapping view
      object.__setattr__(self, "cfg", _KindMap(cfg))
    elif cfg is not None and not isinstance(cfg, GemmQuant):
      raise ValueError(f"{self._label()}: cfg={cfg!r} is not allowed; expected a GemmQuant, None "
                       "or a mapping from layer kind to GemmQuant.")

  def _label(self) -> str:
    return f"QuantRule({self.name!r})" if self.name else f"QuantRule(path={self.path!r})"

  def matches(self, path: str, kind: str | None = None) -> bool:
    """Whether the rule applies to a layer at `path` of `kind` (any kind when None)."""
    if self._regex.fullmatch(path) is None:  # pytype: disable=attribute-error
      return False
    return kind is None or not isinstance(self.cfg, Mapping) or kind in self.cfg

  def cfg_for(self, kind: str) -> GemmQuant | None:
    return self.cfg.get(kind) if isinstance(self.cfg, Mapping) else self.cfg


class _KindMap(collections.abc.Mapping):
  """An immutable, hashable {kind: GemmQuant | None}."""

  def __init__(self, d: Mapping[str, GemmQuant | None]):
    self._items = tuple(sorted(d.items()))

  def __getitem__(self, k):
    for kk, v in self._items:
      if kk == k:
        return v
    raise KeyError(k)

  def __iter__(self):
    return (k for k, _ in self._items)

  def __len__(self):
    return len(self._items)

  def __hash__(self):
    return hash(self._items)

  def __eq__(self, other):
    return isinstance(other, Mapping) and dict(self._items) == dict(other)

  def __repr__(self):
    return repr(dict(self._items))


def _as_rules(rules: Iterable[Any]) -> list[QuantRule]:
  out = []
  for i, r in enumerate(rules):
    if isinstance(r, QuantRule):
      out.append(r)
    elif isinstance(r, (tuple, list)) and len(r) == 2:
      out.append(QuantRule(r[0], r[1]))
    else:
      raise ValueError(f"rules[{i}]={r!r} is not allowed; expected a QuantRule or a (regex, cfg) pair.")
  return out


# ----------------------------------------------------------------------------- adapters


class BFPWidths(nnx.Variable):
  """The mantissa widths of a quantized layer's BFP roles: an int32 array of shape
  (len(ROLES),) in ROLES order (0 for roles that are not BFP). Model state, so a
  jitted step taking the model sees new widths without recompiling
  (`set_widths`)."""


class ZSEProbe(nnx.Variable):
  """A float32 scalar whose gradient is the layer's "biw" zero-setting error.

  Its value is ignored by the forward pass; `qdot_general(..., zse_probe=)`
  defines its cotangent as the ZSE of the layer's returned input gradient
  dL/dx (docs/bfp.md#zero-setting-error; the fp8 "overwrite with gradient" trick of Flax's
  fp8_ops). Not an nnx.Param, so optimizers and the usual `nnx.grad` (wrt
  nnx.Param) ignore it: differentiate with
  `wrt=nnx.Any(nnx.Param, ZSEProbe)` to get it (`bfp_zse_metrics`).
  """


def _bfp_roles(cfg: GemmQuant) -> tuple[str, ...]:
  return tuple(r for r in ROLES if isinstance(getattr(cfg, r), BFPFormat))


class _QuantOp(nnx.Module):
  """Common state of the injected ops: the static GemmQuant, the path, an optional RngStream,
  the traced BFP widths (`BFPWidths`, when any role is BFP), the biw ZSE probe
  (`ZSEProbe`, when dgrad_w is BFP) and the FP8 delayed-scaling state (`Fp8DelayedState`, when
  the GemmQuant is a `DelayedScaling`)."""

  def __init__(self, cfg: GemmQuant, path: str, original: Any, rng: nnx.RngStream | None):
    self.cfg = cfg
    self.path = path
    self.original = original  # the op the layer held before; restored by `unquantize_model`
    self.rng = rng
    roles = _bfp_roles(cfg)
    self.bfp_widths = None if not roles else BFPWidths(jnp.asarray(
        [getattr(cfg, r).man if r in roles else 0 for r in ROLES], jnp.int32))
    self.zse_probe = (ZSEProbe(jnp.zeros((), jnp.float32)) if isinstance(cfg.dgrad_w, BFPFormat)
                      else None)
    self.fp8 = Fp8DelayedState(cfg) if isinstance(cfg, DelayedScaling) else None

  def _key(self) -> jax.Array | None:
    return None if self.rng is None else self.rng()

  def _widths(self) -> dict[str, jax.Array] | None:
    if self.bfp_widths is None:
      return None
    arr = self.bfp_widths[...]
    return {r: arr[ROLES.index(r)] for r in _bfp_roles(self.cfg)}

  def _probe(self, lhs_ndim: int) -> jax.Array | None:
    if self.zse_probe is None or biw_zse_block(self.cfg, lhs_ndim) is None:
      return None
    return self.zse_probe[...]

  def _check_sharding(self, out_sharding):
    if out_sharding is not None:
      raise ValueError(f"out_sharding={out_sharding!r} is not allowed for the quantized layer "
                       f"{self.path!r}; expected None.")


class QDotGeneral(_QuantOp):
  """`lax.dot_general`-compatible op calling `jlp.gemm.qdot.qdot_general` with the layer's cfg."""

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               out_sharding=None):
    self._check_sharding(out_sharding)
    if self.fp8 is not None:
      return self.fp8.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    return qdot_general(lhs, rhs, dimension_numbers, self.cfg, key=self._key(), precision=precision,
                        preferred_element_type=preferred_element_type, widths=self._widths(),
                        zse_probe=self._probe(jnp.ndim(lhs)))


class QConv(_QuantOp):
  """`lax.conv_general_dilated`-compatible op calling `jlp.gemm.qdot.qconv`.

  qconv computes in float32 at precision HIGHEST, so `precision` is ignored;
  `preferred_element_type` casts the result.
  """

  def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
               dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
               preferred_element_type=None, out_sharding=None):
    del precision
    self._check_sharding(out_sharding)
    if batch_group_count != 1:
      raise ValueError(f"batch_group_count={batch_group_count} is not allowed for the quantized "
                       f"layer {self.path!r}; expected 1.")
    if self.fp8 is not None:
      return self.fp8.conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                           dimension_numbers, feature_group_count, preferred_element_type)
    y = qconv(lhs, rhs, window_strides, padding, self.cfg, lhs_dilation=lhs_dilation,
              rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
              feature_group_count=feature_group_count, key=self._key(), widths=self._widths(),
              zse_probe=self._probe(jnp.ndim(lhs)))
    return y if preferred_element_type is None else y.astype(preferred_element_type)


class QEinsum(_QuantOp):
  """`jnp.einsum`-compatible op for nnx.Einsum's "<input>,<kernel>-><out>" specs.

  The spec is turned into one `qdot_general(input, kernel)` (labels in both
  operands and the output: batch; in both operands only: contracted; the rest:
  free) and a transpose to the output order, so the input is always role x and
  the kernel role w. An ellipsis is allowed in the input and the output.
  Labels repeated within an operand, or appearing in one operand only and not
  in the output, are not supported (ValueError).
  """

  def __call__(self, spec, lhs, rhs, precision=None, preferred_element_type=None,
               out_sharding=None, **kwargs):
    self._check_sharding(out_sharding)
    if kwargs:
      raise ValueError(f"einsum arguments {sorted(kwargs)} are not allowed for the quantized layer "
                       f"{self.path!r}; expected only precision and preferred_element_type.")
    dn, perm = _einsum_to_dot_general(spec, jnp.ndim(lhs), jnp.ndim(rhs), self.path)
    if self.fp8 is not None:
      y = self.fp8.dot_general(lhs, rhs, dn, precision, preferred_element_type)
      return y if perm == tuple(range(y.ndim)) else jnp.transpose(y, perm)
    y = qdot_general(lhs, rhs, dn, self.cfg, key=self._key(), precision=precision,
                     preferred_element_type=preferred_element_type, widths=self._widths(),
                     zse_probe=self._probe(jnp.ndim(lhs)))
    return y if perm == tuple(range(y.ndim)) else jnp.transpose(y, perm)


def _einsum_to_dot_general(spec: str, lhs_ndim: int, rhs_ndim: int, path: str):
  """'bi,io->bo' -> (dot_general dimension numbers, permutation of its output to the spec's)."""

  def bad(why):
    return ValueError(f"einsum spec {spec!r} of the quantized layer {path!r} is not supported: {why}.")

  s = spec.replace(" ", "")
  if "->" not in s or s.count(",") != 1:
    raise bad("expected '<input>,<kernel>-><output>'")
  ins, out = s.split("->")
  a, b = ins.split(",")
  if "..." in b:
    raise bad("an ellipsis is only allowed in the input and the output")
  if "..." in a:
    n = lhs_ndim - (len(a) - 3)
    free = [c for c in string.ascii_uppercase if c not in s][:max(n, 0)]
    if n < 0 or len(free) < n:
      raise bad(f"the ellipsis does not fit an input of rank {lhs_ndim}")
    a = a.replace("...", "".join(free))
    out = out.replace("...", "".join(free))
  if len(a) != lhs_ndim or len(b) != rhs_ndim:
    raise bad(f"operand ranks ({lhs_ndim}, {rhs_ndim}) do not match the spec")
  for name, labels in (("input", a), ("kernel", b), ("output", out)):
    if len(set(labels)) != len(labels):
      raise bad(f"a label is repeated in the {name}")
  for c in a + b:
    if c not in out and (c not in a or c not in b):
      raise bad(f"label {c!r} is summed over in one operand only")
  if set(out) - set(a) - set(b):
    raise bad("an output label is in neither operand")
  batch = [c for c in a if c in b and c in out]
  contract = [c for c in a if c in b and c not in out]
  lfree = [c for c in a if c not in b]
  rfree = [c for c in b if c not in a]
  dn = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
  produced = batch + lfree + rfree
  perm = tuple(produced.index(c) for c in out)
  return dn, perm


_ADAPTERS = {"linear": QDotGeneral, "conv": QConv, "einsum": QEinsum}


# ----------------------------------------------------------------------------- report


@dataclasses.dataclass
class QuantReport(collections.abc.Mapping):
  """What `quantize_model` did. A mapping: layer path -> GemmQuant of every quantized layer.

  Attributes:
    layers: path -> GemmQuant of the quantized layers (in model order).
    kinds: path -> layer kind of every Linear / Conv / Einsum seen.
    matched: path -> index of the rule that decided the layer (quantized or
      kept in float32 by a cfg-None rule); layers no rule matched are absent.
    unused_rules: the rules that matched no layer (likely typos).
    rules: the rules as given.
    bfpsim_inplace_fi: whether BFPsim's in-place fi side effect is emulated
      (`jlp.nn.inplace_fi`).
  """

  layers: dict[str, GemmQuant]
  kinds: dict[str, str]
  matched: dict[str, int]
  unused_rules: list[QuantRule]
  rules: list[QuantRule]
  bfpsim_inplace_fi: bool = False

  def __getitem__(self, path: str) -> GemmQuant:
    return self.layers[path]

  def __iter__(self):
    return iter(self.layers)

  def __len__(self) -> int:
    return len(self.layers)

  @property
  def unchanged(self) -> list[str]:
    """Paths of the layers left as they were (no rule, or a cfg-None rule)."""
    return [p for p in self.kinds if p not in self.layers]

  def __str__(self) -> str:
    rows = [("layer", "kind", "rule", "quantization")]
    for p, kind in self.kinds.items():
      i = self.matched.get(p)
      rule = "-" if i is None else f"#{i} {self.rules[i].name or self.rules[i].path}"
      rows.append((p or "<root>", kind, rule, _summary(self.layers.get(p))))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = ["  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3] for r in rows]
    lines.insert(1, "-" * (sum(widths) + 6 + len(rows[0][3])))
    lines.append(f"{len(self.layers)} of {len(self.kinds)} layers quantized, "
                 f"{len(self.unused_rules)} unused rule(s)")
    if self.bfpsim_inplace_fi:
      lines.append("BFPsim in-place fi side effect emulated (bfpsim_inplace_fi=True)")
    for r in self.unused_rules:
      lines.append(f"  unused: {r.name or r.path!r}")
    return "\n".join(lines)


def _fmt_short(fmt: Any) -> str:
  if isinstance(fmt, BFPFormat):
    r = "" if fmt.rounding == "truncate" else f",{fmt.rounding}"
    return f"bfp{fmt.man}[{'x'.join(map(str, fmt.block))}{r}]"
  if isinstance(fmt, FloatFormat):
    r = "" if fmt.rounding == "nearest" else f"[{fmt.rounding}]"
    return f"e{fmt.exp}m{fmt.man}{r}"
  return repr(fmt)


def _summary(cfg: GemmQuant | None) -> str:
  if cfg is None:
    return "float32"
  if isinstance(cfg, DelayedScaling):
    return (f"fp8_delayed({cfg.fp8_format}, history={cfg.amax_history_len}, "
            f"{cfg.amax_compute_algo}, margin={cfg.margin})")
  parts = [f"{r}={_fmt_short(getattr(cfg, r))}" for r in ROLES if getattr(cfg, r) is not None]
  if cfg.accum is not None:
    parts.append(f"accum={_fmt_short(cfg.accum)}" + ("+kahan" if cfg.kahan else "")
                 + (f"+promote{cfg.promote_every}" if cfg.promote_every is not None else ""))
  if not cfg.bwd_from_fwd:
    parts.append("bwd_from_fwd=False")
  if cfg.matrix_view:
    parts.append("matrix_view")
  return " ".join(parts) or "identity"


# ----------------------------------------------------------------------------- quantize_model


def _path_str(path: Sequence[Any]) -> str:
  return "/".join(str(p) for p in path)


def _stochastic(cfg: GemmQuant) -> bool:
  return any(is_stochastic(getattr(cfg, r)) for r in ROLES) or is_stochastic(cfg.accum)


def _check_weight_roles(cfg: GemmQuant, module: Any, path: str, rule: QuantRule) -> None:
  kernel = getattr(module, "kernel", None)
  if kernel is None:
    return
  for role in _WEIGHT_ROLES:
    fmt = getattr(cfg, role)
    if fmt is not None and not isinstance(fmt, FloatFormat):  # block formats
      ndim = 2 if cfg.views(role) else len(kernel.shape)
      try:
        fmt.check_rank(ndim)
      except ValueError as e:
        raise ValueError(f"{rule._label()} gives layer {path!r} (kernel shape {tuple(kernel.shape)}) "
                         f"cfg.{role}={fmt!r}: {e}") from None


def quantize_model(model: nnx.Module, rules: Iterable[QuantRule | tuple[str, Any]], *,
                   rngs: nnx.Rngs | None = None, bfpsim_inplace_fi: bool = False) -> QuantReport:
  """Quantizes the Linear / LinearGeneral / Conv / Einsum layers of `model` in place.

  Args:
    model: an NNX module (modified in place: the matched layers' op hooks are
      replaced by `QDotGeneral` / `QConv` / `QEinsum` adapter modules).
    rules: `QuantRule`s (or `(regex, cfg)` pairs), in priority order: each
      layer takes the first rule whose regex fullmatches its "/"-joined path
      (and, for per-kind rules, names its kind). cfg None keeps the layer.
    rngs: needed when a matched cfg rounds stochastically; each such layer's
      stream is derived from `rngs.quant()` (module docstring).
    bfpsim_inplace_fi: reproduce the side effect of BFPsim's in-place input
      quantization (`jlp.nn.inplace_fi`, docs/bfp.md#compat-switches): an
      activation feeding a conv with a BFP x role is quantized where it is produced and feeds all
      its consumers quantized (shortcut, projection conv, the producing ReLU's
      backward mask). Supported by the model zoo's ResNets (and FCN's ResNet
      backbone): the value is set on every module with a `bfpsim_inplace_fi`
      attribute. False (default) keeps jlp's functional semantics.

  Returns:
    A `QuantReport`; rules that matched nothing are also logged as a warning
    on the "jlp.nn" logger.

  Raises:
    ValueError: a bad rule, a stochastic cfg without `rngs` (or without a
      "quant"/"default" stream), a BFP/MX block on a weight role that does not
      fit the layer's kernel rank, a layer whose op hook already holds a custom
      (non-jlp) op, an einsum layer without a static einsum_str,
      bfpsim_inplace_fi=True on a model that does not support it.
  """
  rules = _as_rules(rules)
  if not isinstance(model, nnx.Module):
    raise ValueError(f"model={type(model).__name__} is not allowed; expected an nnx.Module.")
  if not isinstance(bfpsim_inplace_fi, bool):
    raise ValueError(f"bfpsim_inplace_fi={bfpsim_inplace_fi!r} is not allowed; expected True or False.")
  inplace_modules = [m for _, m in nnx.iter_modules(model) if hasattr(m, "bfpsim_inplace_fi")]
  if bfpsim_inplace_fi and not inplace_modules:
    raise ValueError(f"bfpsim_inplace_fi=True is not allowed for {type(model).__name__}; expected a "
                     "model with `bfpsim_inplace_fi` support (the ResNets of jlp.models, FCN).")
  used = [False] * len(rules)
  layers: dict[str, GemmQuant] = {}
  kinds: dict[str, str] = {}
  matched: dict[str, int] = {}
  base_key = None
  todo = [(_path_str(p), m) for p, m in nnx.iter_modules(model) if layer_kind(m) is not None]
  for path, module in todo:
    kind, attr, originals = _hook(module)
    kinds[path] = kind
    idx = next((i for i, r in enumerate(rules) if r.matches(path, kind)), None)
    if idx is None:
      continue
    used[idx] = True
    matched[path] = idx
    rule = rules[idx]
    cfg = rule.cfg_for(kind)
    if cfg is None:
      continue
    current = getattr(module, attr)
    if isinstance(module, nnx.LinearGeneral) and getattr(module, "dot_general_cls", None) is not None:
      raise ValueError(f"layer {path!r} has dot_general_cls={module.dot_general_cls!r}; quantize_model "
                       "would replace it (expected the default lax.dot_general).")
    if isinstance(current, _QuantOp):
      original = current.original
    elif any(current is o for o in originals):
      original = current
    else:
      raise ValueError(f"layer {path!r} has {attr}={current!r}, a custom op; quantize_model would "
                       f"replace it (expected the default {originals[-1]!r}).")
    _check_weight_roles(cfg, module, path, rule)
    rng = None
    if _stochastic(cfg):
      if rngs is None:
        raise ValueError(f"{rule._label()} gives layer {path!r} a stochastic GemmQuant but rngs=None; "
                         "expected an nnx.Rngs with a 'quant' (or 'default') stream.")
      if base_key is None:
        try:
          base_key = rngs.quant()
        except AttributeError as e:
          raise ValueError(f"rngs={rngs!r} has no 'quant' or 'default' stream; a stochastic "
                           f"GemmQuant needs one ({e}).") from None
      layer_key = jax.random.fold_in(base_key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
      rng = nnx.RngStream(layer_key, tag="quant")
    setattr(module, attr, nnx.data(_ADAPTERS[kind](cfg, path, original, rng)))
    layers[path] = cfg
  for m in inplace_modules:
    m.bfpsim_inplace_fi = bfpsim_inplace_fi
  unused = [r for r, u in zip(rules, used) if not u]
  if unused:
    logger.warning("jlp quantize_model: %d rule(s) matched no layer: %s", len(unused),
                   ", ".join(r._label() for r in unused))
  return QuantReport(layers=layers, kinds=kinds, matched=matched, unused_rules=unused, rules=rules,
                     bfpsim_inplace_fi=bfpsim_inplace_fi)


def unquantize_model(model: nnx.Module) -> list[str]:
  """Restores the original ops of every layer `quantize_model` changed; returns their paths.

  Also turns the BFPsim in-place fi emulation off (`bfpsim_inplace_fi`).
  """
  restored = []
  for p, m in list(nnx.iter_modules(model)):
    if hasattr(m, "bfpsim_inplace_fi"):
      m.bfpsim_inplace_fi = False
    if layer_kind(m) is None:
      continue
    _, attr, _ = _hook(m)
    op = getattr(m, attr)
    if isinstance(op, _QuantOp):
      setattr(m, attr, nnx.static(op.original))
      restored.append(_path_str(p))
  return restored


# ----------------------------------------------------------------------------- BFP training controls


def _quantized_layers(model: nnx.Module, report: QuantReport) -> dict[str, tuple[tuple, Any, str, _QuantOp]]:
  """path -> (graph path tuple, layer, hook attribute, adapter) of report's quantized layers."""
  out = {}
  for p, m in nnx.iter_modules(model):
    path = _path_str(p)
    if path not in report.layers or layer_kind(m) is None:
      continue
    _, attr, _ = _hook(m)
    op = getattr(m, attr)
    if isinstance(op, _QuantOp):
      out[path] = (tuple(p), m, attr, op)
  return out


def _layer(layers, path: str, what: str):
  if path not in layers:
    raise ValueError(f"{what}: layer {path!r} is not a quantized layer of the model; expected one of "
                     f"{', '.join(repr(p) for p in layers) or '(none)'}.")
  return layers[path]


def get_widths(model: nnx.Module, report: QuantReport) -> dict[str, dict[str, int]]:
  """Current mantissa widths of every quantized layer's BFP roles: {path: {role: int}}.

  Host-side (reads concrete values; not for use inside jit). Layers without a
  BFP role are absent.
  """
  out = {}
  for path, (_, _, _, op) in _quantized_layers(model, report).items():
    if op.bfp_widths is not None:
      arr = np.asarray(op.bfp_widths[...])
      out[path] = {r: int(arr[ROLES.index(r)]) for r in _bfp_roles(op.cfg)}
  return out


def set_widths(model: nnx.Module, report: QuantReport,
               widths: Mapping[str, Mapping[str, Any]]) -> None:
  """Sets BFP mantissa widths in place: widths = {path: {role: int or int32 scalar}}.

  The widths are model state (`BFPWidths` variables), so an `nnx.jit` step
  taking the model uses the new values without recompiling. Accepts
  `SimpleController.bits` / `.as_arrays()` directly. Roles not named keep their
  width.

  Raises:
    ValueError: a path that is not a quantized layer, a role whose format is
      not a BFPFormat, a width outside 1..24 or not an integer.
  """
  layers = _quantized_layers(model, report)
  for path, roles in widths.items():
    _, _, _, op = _layer(layers, path, "set_widths")
    arr = op.bfp_widths[...] if op.bfp_widths is not None else None
    for role, m in roles.items():
      fmt = getattr(op.cfg, role, None) if role in ROLES else None
      if not isinstance(fmt, BFPFormat):
        raise ValueError(f"set_widths: layer {path!r} role {role!r} is not allowed: its format is "
                         f"{fmt!r}; expected a role with a BFPFormat.")
      if isinstance(m, (bool, np.bool_)):
        raise ValueError(f"set_widths: widths[{path!r}][{role!r}]={m!r}; expected an int.")
      if isinstance(m, (int, np.integer)):
        BFPFormat(int(m), fmt.block)  # validates 1..24
      else:
        m = jnp.asarray(m)
        if m.shape != () or not jnp.issubdtype(m.dtype, jnp.integer):
          raise ValueError(f"set_widths: widths[{path!r}][{role!r}] has shape {m.shape} and dtype "
                           f"{m.dtype}; expected an int32 scalar.")
      arr = arr.at[ROLES.index(role)].set(jnp.asarray(m, jnp.int32))
    if arr is not None:
      op.bfp_widths[...] = arr


def _lookup(state: Any, keys: Sequence[Any]) -> Any:
  for k in keys:
    state = state[k]
  return state.get_value() if isinstance(state, nnx.Variable) else state


def bfp_zse_metrics(model: nnx.Module, grads: Any, report: QuantReport) -> dict[str, dict[str, jax.Array]]:
  """Per-layer zero-setting errors as float32 scalars, jit-friendly (docs/bfp.md#zero-setting-error).

  For every quantized layer with a kernel:
    "fw":  ZSE of the FP32 master kernel with role w's BFPFormat and its current
           width (present when cfg.w is a BFPFormat);
    "bwo": ZSE of the kernel's gradient (taken from `grads`) with role
           wgrad_dy's current width (BFPsim's bwo_bit) and the group shape
           `jlp.gemm.qdot.bwo_zse_block`: BFPsim applies bwo_dim, an
           activation-ordered (NCHW) shape, as is to the OIHW weight gradient;
           wgrad_dy's NHWC block with its first entry moved last is that same
           grouping on jlp's HWIO / (in, out) kernel (present when wgrad_dy is
           BFP with the kernel's rank and `grads` holds the kernel gradient;
           BFPsim skips layers without weight.grad);
    "biw": ZSE of the layer's returned input gradient dL/dx with dgrad_w's
           width (BFPsim's biw_bit) and `biw_zse_block` (dgrad_w's kernel-ordered
           block with its last entry moved first), read from the gradient of
           the adapter's `ZSEProbe` in `grads` (present when dgrad_w is BFP and
           `grads` holds the probe; 0.0 when the layer's input rank differs from
           the block's and the probe was not used; a layer called k times sums
           k ZSEs).

  Args:
    model: the quantized model (inside or outside a jitted step).
    grads: the gradients of the model's nnx.Params (e.g. from `nnx.grad`; an
      nnx.State of the model's structure), or None for "fw" only.
    report: the QuantReport of `quantize_model`.

  Returns:
    {path: {"fw": ..., "bwo": ..., "biw": ...}} with the keys that apply.
  """
  from jlp.nn.zse import zero_setting_error  # pylint: disable=g-import-not-at-top

  out: dict[str, dict[str, jax.Array]] = {}
  for path, (keys, layer, attr, op) in _quantized_layers(model, report).items():
    cfg = op.cfg
    widths = op._widths() or {}  # pylint: disable=protected-access
    kernel = getattr(layer, "kernel", None)
    d: dict[str, jax.Array] = {}
    if kernel is not None and isinstance(cfg.w, BFPFormat):
      d["fw"] = zero_setting_error(jnp.asarray(kernel[...], jnp.float32), cfg.w, widths["w"])
    if grads is not None and kernel is not None:
      block = bwo_zse_block(cfg, len(kernel.shape))
      if block is not None:
        try:
          kgrad = _lookup(grads, keys + ("kernel",))
        except (KeyError, TypeError, AttributeError):
          kgrad = None
        if kgrad is not None:
          d["bwo"] = zero_setting_error(jnp.asarray(kgrad, jnp.float32),
                                        BFPFormat(cfg.wgrad_dy.man, block), widths["wgrad_dy"])
    if grads is not None and op.zse_probe is not None:
      try:
        d["biw"] = jnp.asarray(_lookup(grads, keys + (attr, "zse_probe")), jnp.float32)
      except (KeyError, TypeError, AttributeError):
        pass
    if d:
      out[path] = d
  return out
