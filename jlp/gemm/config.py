"""GemmQuant: one quantizer per tensor role of a layer y = x · w, plus the accumulator.

The nine roles follow BFPsim's BFPConv2d (docs/bfp.md#layer-roles) and AQT's fwd / dlhs / drhs
split:

  forward          y = q_y(q_x(x) · q_w(w))
  weight gradient  dw = q_wgrad_out(q_wgrad_x(x̃) ·ᵀ q_wgrad_dy(g))
  input gradient   dx = q_dgrad_out(q_dgrad_dy(g) ·ᵀ q_dgrad_w(w̃))

with g = dL/dy and x̃, w̃ the forward-quantized operands when `bwd_from_fwd`
(BFPsim's behaviour) or the raw ones otherwise.

References:
  Noh et al., FlexBlock, IEEE Trans. Computers 72(9), 2023 (BFPsim roles fw, fi,
    fo, bwo, bwi, bwg, bio, biw, big).
  Han, Demmel, You, arXiv:1911.08907 (CPD's custom-precision accumulator).
  DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv:2412.19437 §3.3.2 (promotion of
    the tensor cores' partial sums to float32 every N_C products).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jlp.formats import (BFPFormat, BlockScaledFormat, Format, FloatFormat, MXFormat, NVFP4Format,
                         as_format)
from jlp.gemm.accum import check_promote_every

ROLES = ("x", "w", "y", "wgrad_dy", "wgrad_x", "wgrad_out", "dgrad_dy", "dgrad_w", "dgrad_out")
FIELDS = ROLES + ("accum", "kahan", "bwd_from_fwd", "promote_every", "matrix_view")
#: Formats that `matrix_view` applies to: those that scale blocks along one `axis`.
MATRIX_VIEW_FORMATS = (MXFormat, NVFP4Format, BlockScaledFormat)

# BFPsim key -> (jlp role, tensor kind). Kinds: "act" (NCHW / (B, F)), "weight" (OIHW / (out, in)).
BFPSIM_ROLES = {
    "fw": ("w", "weight"), "fi": ("x", "act"), "fo": ("y", "act"),
    "bwo": ("wgrad_dy", "act"), "bwi": ("wgrad_x", "act"), "bwg": ("wgrad_out", "weight"),
    "bio": ("dgrad_dy", "act"), "biw": ("dgrad_w", "weight"), "big": ("dgrad_out", "act"),
}

# BFPsim's BFPConf defaults: flag, bits (a key or an int), dims (4-D, OIHW / NCHW).
_BFPSIM_DEFAULTS = {
    "fw": (True, 8, (16, 1, 3, 3)),
    "fi": (True, "fw", (4, 1, 3, 3)),
    "fo": (False, "fw", (1, 1, 1, 1)),
    "bio": (True, "fi", "fi"),
    "biw": (True, "fw", "fw"),
    "big": (False, "fi", (1, 1, 1, 1)),
    "bwo": (True, "fi", "fi"),
    "bwi": (True, "fi", "fi"),
    "bwg": (False, "fw", (4, 1, 3, 3)),
}
_BFPSIM_ORDER = ("fw", "fi", "fo", "bio", "biw", "big", "bwo", "bwi", "bwg")
_BFPSIM_EXTRA_KEYS = {"type"}


def _check_format(role: str, value: Any) -> Format | None:
  if value is None:
    return None
  if isinstance(value, str):
    return as_format(value, role)
  if not isinstance(value, (FloatFormat, BFPFormat, MXFormat, NVFP4Format, BlockScaledFormat)):
    raise ValueError(f"{role}={value!r} is not allowed; expected None, a FloatFormat, "
                     "BFPFormat, MXFormat, NVFP4Format, BlockScaledFormat or a format name.")
  return value


@dataclasses.dataclass(frozen=True)
class GemmQuant:
  """Quantizers of one bilinear layer's nine tensor roles and its accumulator.

  Each role is None (use as is), a FloatFormat, a BFPFormat (its `block` has one
  entry per axis of that tensor, in the layout jlp sees: NHWC activations, HWIO
  kernels, (B, F) / (F_in, F_out) for dense layers), an MXFormat, an NVFP4Format or a
  BlockScaledFormat (their `axis` is an axis of that tensor; `jlp.nn.recipe_rules` puts it on
  the contraction axis of the role's GEMM, as hardware block scaling needs).

  Attributes:
    x, w, y: forward operands and output.
    wgrad_dy, wgrad_x, wgrad_out: weight-gradient GEMM operands (g, x̃) and result.
    dgrad_dy, dgrad_w, dgrad_out: input-gradient GEMM operands (g, w̃) and result.
    accum: FloatFormat of the accumulator of all three GEMMs (None: float32).
    kahan: Kahan-compensated accumulation (with `accum`).
    bwd_from_fwd: the backward GEMMs quantize the forward-quantized x̃ = q_x(x)
      and w̃ = q_w(w) (BFPsim, docs/bfp.md#layer-roles); False: the raw x and w.
    promote_every: None, or n_c >= 1 (with `accum`, kahan=False): accumulation
      with promotion (`jlp.gemm.accum.matmul`): each run of n_c consecutive
      products of every GEMM is accumulated in `accum`, then added to a float32
      accumulator (DeepSeek-V3's N_C = 128).
    matrix_view: quantize every role whose format is an MXFormat, NVFP4Format or
      BlockScaledFormat on TransformerEngine's 2-D view of its tensor: shape (..., n) as the
      (prod(...), n) matrix (all leading axes flattened, row-major, into rows; a 1-D tensor is
      one row), so the format's `axis` is -1 (along the last axis) or -2 (along the flattened
      rows: the weight-gradient GEMM's contraction over batch, tokens and positions, in TE's
      columnwise order). False: the format sees the tensor as it is. Other formats are not
      affected. `matrix_shape` gives the view's shape.
  """

  x: Format | None = None
  w: Format | None = None
  y: Format | None = None
  wgrad_dy: Format | None = None
  wgrad_x: Format | None = None
  wgrad_out: Format | None = None
  dgrad_dy: Format | None = None
  dgrad_w: Format | None = None
  dgrad_out: Format | None = None
  accum: FloatFormat | None = None
  kahan: bool = False
  bwd_from_fwd: bool = True
  promote_every: int | None = None
  matrix_view: bool = False

  def __post_init__(self):
    for role in ROLES:
      object.__setattr__(self, role, _check_format(role, getattr(self, role)))
    if isinstance(self.accum, str):
      object.__setattr__(self, "accum", as_format(self.accum, "accum"))
    if self.accum is not None and not isinstance(self.accum, FloatFormat):
      raise ValueError(f"accum={self.accum!r} is not allowed; expected None or a FloatFormat.")
    for flag in ("kahan", "bwd_from_fwd", "matrix_view"):
      if not isinstance(getattr(self, flag), bool):
        raise ValueError(f"{flag}={getattr(self, flag)!r} is not allowed; expected True or False.")
    if self.kahan and self.accum is None:
      raise ValueError("kahan=True is not allowed with accum=None; expected an accumulator FloatFormat.")
    check_promote_every(self.promote_every, kahan=self.kahan, chunk=1)
    if self.promote_every is not None and self.accum is None:
      raise ValueError(f"promote_every={self.promote_every!r} is not allowed with accum=None; "
                       "expected promote_every=None, or an accumulator FloatFormat in accum.")

  def views(self, role: str) -> bool:
    """Whether role `role` is quantized on the 2-D view of its tensor (`matrix_view`)."""
    return self.matrix_view and isinstance(getattr(self, role), MATRIX_VIEW_FORMATS)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "GemmQuant":
    """From a mapping of field names (e.g. a config dict); unknown names are a ValueError."""
    unknown = sorted(set(d) - set(FIELDS))
    if unknown:
      raise ValueError(f"GemmQuant has no role {unknown[0]!r}; expected one of {', '.join(FIELDS)}.")
    return cls(**dict(d))

  def replace(self, **changes: Any) -> "GemmQuant":
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown:
      raise ValueError(f"GemmQuant has no role {unknown[0]!r}; expected one of {', '.join(FIELDS)}.")
    return dataclasses.replace(self, **changes)

  @property
  def is_identity(self) -> bool:
    """True when the layer computes exactly as the unquantized float32 one."""
    return all(getattr(self, r) is None for r in ROLES) and self.accum is None

  @classmethod
  def from_bfpsim(cls, entry: Mapping[str, Any], *, kind: str = "conv",
                  rounding: str = "truncate") -> "GemmQuant":
    """Translates one BFPsim layer entry (keys fw, fw_bit, fw_dim, ...) to a GemmQuant.

    Missing keys take BFPsim's BFPConf defaults. Group shapes are given
    by BFPsim for OIHW kernels and NCHW activations (conv) or (out, in) weights
    and (B, F) activations (linear) and are permuted to the layouts jlp uses:
    HWIO kernels and NHWC activations, (in, out) dense kernels.

    Args:
      entry: the BFPsim dict for one layer.
      kind: "conv" (4-D dims) or "linear" (2-D dims).
      rounding: BFPFormat rounding ("truncate" is BFPsim's).
    """
    if kind not in ("conv", "linear"):
      raise ValueError(f"kind={kind!r} is not allowed; expected 'conv' or 'linear'.")
    allowed = set(_BFPSIM_EXTRA_KEYS)
    for key in _BFPSIM_ORDER:
      allowed |= {key, f"{key}_bit", f"{key}_dim"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
      raise ValueError(f"BFPsim entry has unknown key {unknown[0]!r}; expected keys among "
                       f"{', '.join(sorted(allowed))}.")
    bits: dict[str, int] = {}
    dims: dict[str, tuple[int, ...]] = {}
    roles: dict[str, Format | None] = {}
    for key in _BFPSIM_ORDER:
      flag_default, bit_default, dim_default = _BFPSIM_DEFAULTS[key]
      bit = entry.get(f"{key}_bit", bits[bit_default] if isinstance(bit_default, str) else bit_default)
      dim = entry.get(f"{key}_dim", dims[dim_default] if isinstance(dim_default, str) else dim_default)
      dim = _parse_dims(f"{key}_dim", dim)
      bits[key], dims[key] = int(bit), dim
      role, tensor = BFPSIM_ROLES[key]
      if bool(entry.get(key, flag_default)):
        roles[role] = BFPFormat(int(bit), _to_jlp_layout(f"{key}_dim", dim, tensor, kind), rounding=rounding)
      else:
        roles[role] = None
    return cls(**roles)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """TransformerEngine's 2-D view of a tensor of `shape` (`GemmQuant.matrix_view`): (the product
  of all axes but the last, the last axis); a scalar is (1, 1)."""
  shape = tuple(int(d) for d in shape)
  if not shape:
    return (1, 1)
  rows = 1
  for d in shape[:-1]:
    rows *= d
  return (rows, shape[-1])


def _parse_dims(field: str, dims: Any) -> tuple[int, ...]:
  if isinstance(dims, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
    return tuple(int(d) for d in dims)
  raise ValueError(f"{field}={dims!r} is not allowed; expected a list of ints (BFPsim's string "
                   "dims are not supported).")


def _to_jlp_layout(field: str, dims: tuple[int, ...], tensor: str, kind: str) -> tuple[int, ...]:
  if kind == "conv":
    if len(dims) != 4:
      raise ValueError(f"{field}={list(dims)!r} has {len(dims)} entries; a conv layer needs 4 (OIHW / NCHW).")
    if tensor == "weight":   # OIHW -> HWIO
      o, i, h, w = dims
      return (h, w, i, o)
    n, c, h, w = dims        # NCHW -> NHWC
    return (n, h, w, c)
  # linear: BFPsim's 2-D kernels use the first two entries of whatever dims they get
  if len(dims) < 2:
    raise ValueError(f"{field}={list(dims)!r} has {len(dims)} entries; a linear layer needs 2.")
  a, b = dims[:2]
  return (b, a) if tensor == "weight" else (a, b)  # (out, in) -> (in, out)
