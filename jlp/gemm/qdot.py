"""Quantized dot_general and convolution: nine tensor roles and a custom accumulator.

`qdot_general` and `qconv` are drop-in replacements for `lax.dot_general` and
`lax.conv_general_dilated`, each a `jax.custom_vjp` driven by a static
`GemmQuant` (jlp/gemm/config.py). With q_r the quantizer of role r (identity
when the role is None) and g = dL/dy:

  forward          y    = q_y(q_x(lhs) · q_w(rhs))
  input gradient   dlhs = q_dgrad_out(q_dgrad_dy(g) ·ᵀ q_dgrad_w(w̃))
  weight gradient  drhs = q_wgrad_out(q_wgrad_x(x̃) ·ᵀ q_wgrad_dy(g))

where x̃ = q_x(lhs), w̃ = q_w(rhs) when `cfg.bwd_from_fwd` (BFPsim's
BFPConv2dFunction, docs/bfp.md#layer-roles: the backward GEMMs re-quantize the saved
forward operands) or the raw lhs, rhs otherwise. Where q_dgrad_w(rhs) is q_w(rhs) bit for bit
(`dgrad_w_is_w`: the same deterministic format, or TransformerEngine's and DeepSeek-V3's square
weight tiles taken along either axis of the 2-D weight), the forward's w̃ is what the backward
keeps and uses, as TE keeps one quantized weight for both GEMMs: one cast fewer per layer to
compile and run, the same bits. Without an accumulator the
two backward GEMMs are the vjp (`jax.linear_transpose`: the same transpose
rule, without re-running the forward) of the underlying lax op at the
substituted operands, so every dimension_numbers, stride,
padding, dilation and feature grouping works. The GEMMs run in float32 with precision=HIGHEST.

Quantization uses `jlp.numerics.quantize_core.quantize_f32` (no second custom_vjp; impl
"auto"). A stochastic role r draws its bits from `fold_in(key, ROLES.index(r))`
(ROLES = x, w, y, wgrad_dy, wgrad_x, wgrad_out, dgrad_dy, dgrad_w, dgrad_out),
so every role has its own stream.

Traced BFP widths (`widths=`, docs/bfp.md#simple-controller): a dict role -> int32 scalar array
overrides the mantissa width of those BFP roles; they are quantized by the XLA
path `jlp.numerics.bfp.bfp_quantize(x, fmt, rbits, man=width)`, bit-identical to
the static BFPFormat of that width, and a jitted caller compiles once for all
widths (the dynamic precision controller, `jlp.nn.controller`). The widths ride
through the custom_vjp as non-differentiable int arrays (cotangent None). A
`zse_probe=` float32 scalar (value ignored) gets as its gradient the
zero-setting error of the returned input gradient dL/dlhs (BFPsim's "biw",
docs/bfp.md#zero-setting-error; group shape `biw_zse_block`), so the statistic computed inside
the backward pass comes out through ordinary gradients. widths=None and
zse_probe=None are the static path, unchanged.

Custom-precision accumulation (`cfg.accum`, CPD's quant_gemm; Han, Demmel,
You, "Auto-Precision Scaling for Distributed Deep Learning", arXiv:1911.08907;
docs/cpd.md#accumulating-gemm): all three GEMMs go through `jlp.gemm.accum.matmul`, whose every
output element accumulates sequentially over k with each float32 operation
rounded to `accum` (plain or Kahan). The k order is part of the result:

  dot_general: lhs is transposed to (batch..., free..., contracting...) and rhs
    to (batch..., contracting..., free...); the contracting dimensions are
    flattened in the order given by `dimension_numbers` (k runs over the last
    listed one fastest) and the batch dimensions are vmapped. The backward
    GEMMs are the transposed contractions written as dot_generals: dlhs
    contracts over rhs's free dimensions (in increasing axis order), drhs over
    lhs's free dimensions (in increasing axis order). For a dense layer
    (B, in)·(in, out) this is CPD's Quant_LinearFunction:
    forward K = in, dgrad K = out, wgrad K = the batch rows in sample order.
  conv: im2col (CPD's Quant_Conv via F.unfold). The patches have
    one row per (n, output position) in row-major order and K order
    (c, kh, kw, ...) row-major, zero padding and lhs-dilation holes included
    (they enter the accumulator as zero products, which matters for Kahan).
      forward: y    = matmul(cols(x̃), W(C·KH·KW, O))          K = (c, kh, kw)
      wgrad:   dW   = matmul(gᵀ(O, N·L), cols(x̃))              K = (n, oh, ow)
      dgrad:   dcol = matmul(g(N·L, O), W(O, C·KH·KW))          K = o
               dx   = col2im(dcol)
    col2im (torch's F.fold, the backward of F.unfold) is NOT accumulated in
    `accum`: each input element sums its overlapping window contributions in
    float32, sequentially in (kh, kw) order starting from +0.0, exactly as
    CPD's autograd does. It is exact (no rounding at all) when windows do not
    overlap (stride >= dilated kernel extent, e.g. 1x1 convs) or when the
    float32 partial sums are representable; otherwise it is still
    deterministic, with that fixed order.
  Feature groups (feature_group_count = G) run one such GEMM per group (K
  order (c', kh, kw) with c' the channel within the group). Supported with
  accum: any number of spatial dimensions, any dimension_numbers, strides,
  explicit or string padding, lhs and rhs dilation, feature groups.
  `cfg.promote_every` (accumulation with promotion, DeepSeek-V3,
  arXiv:2412.19437 §3.3.2) applies to all three GEMMs alike: runs of that many
  consecutive k (in the K orders above) are accumulated in `accum` and each
  run's sum is added to a float32 accumulator (`jlp.gemm.accum.matmul`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.formats import BFPFormat, BlockScaledFormat, FloatFormat, Format, NVFP4Format
from jlp.gemm import accum as accum_lib
from jlp.gemm import fp8_delayed
from jlp.gemm.config import GemmQuant, ROLES, matrix_shape
from jlp.numerics import bfp as bfp_numerics
from jlp.numerics.quantize_core import is_stochastic, quantize_f32, random_bits

_HIGHEST = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- validation


def _role_shapes(lhs_shape, rhs_shape, out_shape) -> dict[str, tuple[int, ...]]:
  return {"x": lhs_shape, "w": rhs_shape, "y": out_shape,
          "wgrad_dy": out_shape, "wgrad_x": lhs_shape, "wgrad_out": rhs_shape,
          "dgrad_dy": out_shape, "dgrad_w": rhs_shape, "dgrad_out": lhs_shape}


def _validate(cfg: Any, key: Any, lhs_shape, rhs_shape, out_shape, op: str) -> None:
  if not isinstance(cfg, GemmQuant):
    raise ValueError(f"cfg={cfg!r} is not allowed; expected a jlp GemmQuant.")
  shapes = _role_shapes(tuple(lhs_shape), tuple(rhs_shape), tuple(out_shape))
  for role in ROLES:
    fmt = getattr(cfg, role)
    if fmt is None:
      continue
    if cfg.views(role):
      shapes[role] = matrix_shape(shapes[role])
    if not isinstance(fmt, FloatFormat):  # block formats: a block / axis per tensor axis
      try:
        fmt.check_rank(len(shapes[role]))
      except ValueError as e:
        raise ValueError(f"{op}: cfg.{role}={fmt!r} does not fit that role's tensor of shape "
                         f"{shapes[role]}: {e}") from None
    if is_stochastic(fmt) and key is None:
      raise ValueError(f"key=None is not allowed with cfg.{role}={fmt!r}: stochastic rounding "
                       "needs a PRNG key (e.g. jax.random.key(0)).")
  if cfg.accum is not None:
    accum_lib.check_accum(cfg.accum)


def _check_float(x: jax.Array, name: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}.dtype={x.dtype} is not allowed with a quantizing cfg; "
                     "expected a floating dtype (float32, bfloat16, float16).")


# ----------------------------------------------------------------------------- quantizers


def _q(cfg: GemmQuant, role: str, x: jax.Array, key: jax.Array | None,
       widths: dict[str, jax.Array] | None = None) -> jax.Array:
  """Role `role`'s quantizer applied to float32 x (identity when the role is None).

  A role present in `widths` (a BFP role) is quantized by the XLA path
  `bfp_quantize(x, fmt, rbits, man=widths[role])` (traced width, same bits as
  the static BFPFormat of that width). With `cfg.matrix_view`, an MX / NVFP4 / block-scaled
  role is quantized on the (prod(leading axes), last axis) view of x and reshaped back.
  """
  fmt: Format | None = getattr(cfg, role)
  if fmt is None:
    return x
  rkey = jax.random.fold_in(key, ROLES.index(role)) if is_stochastic(fmt) else None
  if widths is not None and role in widths:
    rbits = random_bits(rkey, x.shape) if rkey is not None else None
    return bfp_numerics.bfp_quantize(x, fmt, rbits, man=widths[role])
  if cfg.views(role) and x.ndim != 2:
    return quantize_f32(x.reshape(matrix_shape(x.shape)), fmt, rkey, "auto").reshape(x.shape)
  return quantize_f32(x, fmt, rkey, "auto")


def _check_widths(cfg: GemmQuant, widths: Any, op: str) -> dict[str, jax.Array] | None:
  """`widths` as {role: int32 scalar array} (roles validated), or None."""
  if widths is None:
    return None
  if not isinstance(widths, dict):
    raise ValueError(f"{op}: widths={widths!r} is not allowed; expected None or a dict "
                     "role -> int32 scalar array.")
  out = {}
  for role, m in widths.items():
    if role not in ROLES:
      raise ValueError(f"{op}: widths has role {role!r}; expected roles among {', '.join(ROLES)}.")
    if not isinstance(getattr(cfg, role), BFPFormat):
      raise ValueError(f"{op}: widths[{role!r}] is not allowed: cfg.{role}={getattr(cfg, role)!r} "
                       "is not a BFPFormat (only BFP mantissa widths can be traced).")
    m = jnp.asarray(m)
    if m.shape != () or not jnp.issubdtype(m.dtype, jnp.integer):
      raise ValueError(f"{op}: widths[{role!r}] has shape {m.shape} and dtype {m.dtype}; expected an "
                       "int32 scalar.")
    out[role] = m.astype(jnp.int32)
  return out


# ----------------------------------------------------------------------------- ZSE blocks


def biw_zse_block(cfg: GemmQuant, lhs_ndim: int) -> tuple[int, ...] | None:
  """The group shape used for the ZSE of the returned input gradient dL/dx ("biw").

  BFPsim measures biw on the layer's dx (NCHW) with biw_dim, an OIHW-ordered
  weight group shape applied as is: N gets O's entry, C gets I's, H and W
  theirs. jlp's dgrad_w block is that shape translated to the kernel layout
  (HWIO for convs, (in, out) for dense kernels), so the BFPsim-faithful group
  shape of dx (NHWC / (B, in)) is dgrad_w's block with its last entry moved to
  the front: (h, w, i, o) -> (o, h, w, i); (i, o) -> (o, i). None when
  cfg.dgrad_w is not a BFPFormat or the rank differs from dx's (e.g. a dense
  layer on (B, T, F) inputs).
  """
  fmt = cfg.dgrad_w
  if not isinstance(fmt, BFPFormat) or len(fmt.block) != lhs_ndim:
    return None
  return tuple(fmt.block[-1:]) + tuple(fmt.block[:-1])


def bwo_zse_block(cfg: GemmQuant, rhs_ndim: int) -> tuple[int, ...] | None:
  """The group shape used for the ZSE of the weight gradient ("bwo").

  BFPsim applies bwo_dim (an NCHW-ordered activation group shape) as is to the
  OIHW weight gradient: O gets N's entry, I gets C's, H and W theirs. jlp's
  wgrad_dy block is that shape translated to NHWC / (B, F), so the
  BFPsim-faithful group shape of the HWIO / (in, out) kernel gradient is
  wgrad_dy's block with its first entry moved to the end: (n, h, w, c) ->
  (h, w, c, n); (b, f) -> (f, b). None when cfg.wgrad_dy is not a BFPFormat or
  the rank differs from the kernel's.
  """
  fmt = cfg.wgrad_dy
  if not isinstance(fmt, BFPFormat) or len(fmt.block) != rhs_ndim:
    return None
  return tuple(fmt.block[1:]) + tuple(fmt.block[:1])


def _width(cfg: GemmQuant, role: str, widths: dict[str, jax.Array] | None):
  if widths is not None and role in widths:
    return widths[role]
  return getattr(cfg, role).man


# ----------------------------------------------------------------------------- dot_general


def _dot_dims(dn, lhs_ndim: int, rhs_ndim: int):
  (lc, rc), (lb, rb) = dn
  lc, rc, lb, rb = map(lambda t: tuple(int(i) for i in t), (lc, rc, lb, rb))
  lf = tuple(i for i in range(lhs_ndim) if i not in lc and i not in lb)
  rf = tuple(i for i in range(rhs_ndim) if i not in rc and i not in rb)
  return lc, rc, lb, rb, lf, rf


def accum_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, accum, *,
                      kahan: bool = False, promote_every: int | None = None) -> jax.Array:
  """lax.dot_general of float32 operands with every output accumulated in `accum`.

  Canonicalises to batched (M, K)·(K, N) (module docstring: contracting dims
  flattened in the order given, batch dims vmapped) and calls
  `jlp.gemm.accum.matmul` (CPD's quant_gemm, docs/cpd.md#accumulating-gemm; with promote_every,
  runs of that many products promoted to float32, DeepSeek-V3 arXiv:2412.19437
  §3.3.2). The output has dot_general's layout (batch..., lhs free..., rhs free...).
  """
  lc, rc, lb, rb, lf, rf = _dot_dims(dimension_numbers, lhs.ndim, rhs.ndim)
  bshape = tuple(lhs.shape[i] for i in lb)
  lfshape = tuple(lhs.shape[i] for i in lf)
  rfshape = tuple(rhs.shape[i] for i in rf)
  k = math.prod(lhs.shape[i] for i in lc)
  a = jnp.transpose(lhs, lb + lf + lc).reshape((math.prod(bshape), math.prod(lfshape), k))
  b = jnp.transpose(rhs, rb + rc + rf).reshape((math.prod(bshape), k, math.prod(rfshape)))
  mm = functools.partial(accum_lib.matmul, accum=accum, kahan=kahan, promote_every=promote_every)
  c = mm(a[0], b[0])[None] if not lb else jax.vmap(mm)(a, b)
  return c.reshape(bshape + lfshape + rfshape)


def _accum_dot_dlhs(g, rhs, dn, lhs_ndim, accum, kahan, promote_every):
  """dlhs = g ·ᵀ rhs as an accumulating dot_general (K = rhs free dims, ascending)."""
  lc, rc, lb, rb, lf, rf = _dot_dims(dn, lhs_ndim, rhs.ndim)
  nb, nlf = len(lb), len(lf)
  g_contract = tuple(range(nb + nlf, g.ndim))
  res = accum_dot_general(g, rhs, ((g_contract, rf), (tuple(range(nb)), rb)), accum, kahan=kahan,
                          promote_every=promote_every)
  # res axes: batch (lb), g free (lf), rhs remaining = rc ascending -> their lhs partners
  src = list(lb) + list(lf) + [lc[rc.index(r)] for r in sorted(rc)]
  return jnp.transpose(res, tuple(int(np.argsort(src)[i]) for i in range(lhs_ndim)))


def _accum_dot_drhs(x, g, dn, rhs_ndim, accum, kahan, promote_every):
  """drhs = x ·ᵀ g as an accumulating dot_general (K = lhs free dims, ascending)."""
  lc, rc, lb, rb, lf, rf = _dot_dims(dn, x.ndim, rhs_ndim)
  nb, nlf = len(lb), len(lf)
  g_contract = tuple(range(nb, nb + nlf))
  res = accum_dot_general(x, g, ((lf, g_contract), (lb, tuple(range(nb)))), accum, kahan=kahan,
                          promote_every=promote_every)
  # res axes: batch (rb), x remaining = lc ascending -> their rhs partners, g remaining (rf)
  src = list(rb) + [rc[lc.index(l)] for l in sorted(lc)] + list(rf)
  return jnp.transpose(res, tuple(int(np.argsort(src)[i]) for i in range(rhs_ndim)))


# ----------------------------------------------------------------------------- convolution (im2col)


def _dilate_dim(d: int, r: int) -> int:
  return 0 if d == 0 else 1 + r * (d - 1)


class _ConvGeom:
  """Canonical (N, C, *S) / (O, I, *K) geometry of one convolution (static ints only)."""

  def __init__(self, lhs_shape, rhs_shape, params):
    strides, padding, lhs_dil, rhs_dil, dn, _ = params
    self.dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dn)
    lhs_spec, rhs_spec, _ = self.dn
    self.lhs_c = tuple(lhs_shape[i] for i in lhs_spec)          # (N, C, *S)
    self.rhs_c = tuple(rhs_shape[i] for i in rhs_spec)          # (O, I, *K)
    self.strides, self.padding, self.lhs_dil, self.rhs_dil = strides, padding, lhs_dil, rhs_dil
    self.ksize = self.rhs_c[2:]
    self.padded = tuple(_dilate_dim(s, d) + lo + hi for s, d, (lo, hi)
                        in zip(self.lhs_c[2:], lhs_dil, padding))
    self.out_sp = tuple(max(0, (p - _dilate_dim(k, r)) // s + 1) for p, k, r, s
                        in zip(self.padded, self.ksize, rhs_dil, strides))

  def pad_config(self):
    return [(0, 0, 0), (0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(self.padding, self.lhs_dil)]

  def window_slices(self):
    """(kernel offset tuple, slice tuple into the padded (N, C, *P) array), row-major."""
    out = []
    for pos in np.ndindex(*self.ksize):
      sl = [slice(None), slice(None)]
      for kk, r, s, o in zip(pos, self.rhs_dil, self.strides, self.out_sp):
        start = kk * r
        sl.append(slice(start, start + (o - 1) * s + 1, s) if o > 0 else slice(0, 0))
      out.append(tuple(sl))
    return out


def _im2col(x_c: jax.Array, geom: _ConvGeom) -> jax.Array:
  """(N, C, *S) -> (N·L, C·KK) patches; rows (n, out pos) row-major, K order (c, kh, kw...)."""
  n, c = geom.lhs_c[:2]
  xp = lax.pad(x_c, jnp.zeros((), x_c.dtype), geom.pad_config())
  cols = jnp.stack([xp[sl] for sl in geom.window_slices()], axis=-1)  # (N, C, *O, KK)
  nsp = len(geom.out_sp)
  cols = jnp.moveaxis(cols, 1, 1 + nsp)                                 # (N, *O, C, KK)
  return cols.reshape(n * math.prod(geom.out_sp), c * math.prod(geom.ksize))


def _col2im(dcols: jax.Array, geom: _ConvGeom) -> jax.Array:
  """Transpose of `_im2col`: float32 sums in (kh, kw, ...) order from +0.0 (torch's F.fold)."""
  n, c = geom.lhs_c[:2]
  nsp = len(geom.out_sp)
  kk = math.prod(geom.ksize)
  d = dcols.reshape((n,) + geom.out_sp + (c, kk))
  d = jnp.moveaxis(d, 1 + nsp, 1)                                       # (N, C, *O, KK)
  xp = jnp.zeros((n, c) + geom.padded, jnp.float32)
  for j, sl in enumerate(geom.window_slices()):
    xp = xp.at[sl].add(d[..., j])
  pad_fn = lambda x: lax.pad(x, jnp.zeros((), jnp.float32), geom.pad_config())
  (dx,) = jax.linear_transpose(pad_fn, jax.ShapeDtypeStruct(geom.lhs_c, jnp.float32))(xp)
  return dx


def _to_layout(canon: jax.Array, spec: Sequence[int]) -> jax.Array:
  """Canonical (N|O, C|I, *spatial) array -> the layout whose axes are `spec`."""
  return jnp.transpose(canon, tuple(int(i) for i in np.argsort(spec)))


def _grouped_matmul(a: jax.Array, b: jax.Array, accum, kahan, promote_every) -> jax.Array:
  """(G, M, K)·(G, K, N) -> (G, M, N), one accumulating matmul per feature group."""
  mm = functools.partial(accum_lib.matmul, accum=accum, kahan=kahan, promote_every=promote_every)
  return mm(a[0], b[0])[None] if a.shape[0] == 1 else jax.vmap(mm)(a, b)


def _wmat(w, geom, groups):
  """The kernel as (G, O/G, C/G·KK), K order (c, kh, kw, ...) within the group."""
  o = geom.rhs_c[0]
  return jnp.transpose(w, geom.dn[1]).reshape(groups, o // groups, -1)


def _cols(x, geom, groups):
  """Patches as (G, N·L, C/G·KK): channel c = group·C/G + c' (lax's feature grouping)."""
  cols = _im2col(jnp.transpose(x, geom.dn[0]), geom)
  return cols.reshape(cols.shape[0], groups, -1).transpose(1, 0, 2)


def _g2(g, geom, groups):
  """The cotangent as (G, N·L, O/G)."""
  gc = jnp.moveaxis(jnp.transpose(g, geom.dn[2]), 1, -1)                # (N, *O_sp, O)
  return gc.reshape(-1, groups, geom.rhs_c[0] // groups).transpose(1, 0, 2)


def _accum_conv_fwd(x, w, params, accum, kahan, promote_every):
  geom, groups = _ConvGeom(x.shape, w.shape, params), params[5]
  y = _grouped_matmul(_cols(x, geom, groups), _wmat(w, geom, groups).transpose(0, 2, 1), accum, kahan,
                      promote_every)
  y = y.transpose(1, 0, 2).reshape((geom.lhs_c[0],) + geom.out_sp + (geom.rhs_c[0],))
  return _to_layout(jnp.moveaxis(y, -1, 1), geom.dn[2])                # (N, O, *O_sp) -> out


def _accum_conv_dlhs(g, w, x_shape, params, accum, kahan, promote_every):
  geom, groups = _ConvGeom(x_shape, w.shape, params), params[5]
  dcols = _grouped_matmul(_g2(g, geom, groups), _wmat(w, geom, groups), accum, kahan, promote_every)
  dcols = dcols.transpose(1, 0, 2).reshape(dcols.shape[1], -1)          # (N·L, C·KK)
  return _to_layout(_col2im(dcols, geom), geom.dn[0])


def _accum_conv_drhs(x, g, w_shape, params, accum, kahan, promote_every):
  geom, groups = _ConvGeom(x.shape, w_shape, params), params[5]
  dw = _grouped_matmul(_g2(g, geom, groups).transpose(0, 2, 1), _cols(x, geom, groups), accum, kahan,
                       promote_every)
  return _to_layout(dw.reshape(geom.rhs_c), geom.dn[1])                # (G, O/G, C/G·KK) -> rhs


# ----------------------------------------------------------------------------- the custom_vjp


def _plain_op(kind: str, params):
  if kind == "dot":
    dn, precision = params
    return lambda a, b: lax.dot_general(a, b, dn, precision=precision,
                                        preferred_element_type=jnp.float32)
  strides, padding, lhs_dil, rhs_dil, dn, fgc = params
  return lambda a, b: lax.conv_general_dilated(
      a, b, strides, padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil,
      dimension_numbers=dn, feature_group_count=fgc, precision=_HIGHEST,
      preferred_element_type=jnp.float32)


def _forward_gemm(kind, params, cfg, a, b):
  if cfg.accum is None:
    return _plain_op(kind, params)(a, b)
  if kind == "dot":
    return accum_dot_general(a, b, params[0], cfg.accum, kahan=cfg.kahan,
                             promote_every=cfg.promote_every)
  return _accum_conv_fwd(a, b, params, cfg.accum, cfg.kahan, cfg.promote_every)


def _dlhs_gemm(kind, params, cfg, g, w, x_like):
  if cfg.accum is None:
    op = _plain_op(kind, params)
    return jax.linear_transpose(lambda l: op(l, w), x_like)(g)[0]
  if kind == "dot":
    return _accum_dot_dlhs(g, w, params[0], x_like.ndim, cfg.accum, cfg.kahan, cfg.promote_every)
  return _accum_conv_dlhs(g, w, x_like.shape, params, cfg.accum, cfg.kahan, cfg.promote_every)


def _drhs_gemm(kind, params, cfg, x, g, w_like):
  if cfg.accum is None:
    op = _plain_op(kind, params)
    return jax.linear_transpose(lambda r: op(x, r), w_like)(g)[0]
  if kind == "dot":
    return _accum_dot_drhs(x, g, params[0], w_like.ndim, cfg.accum, cfg.kahan, cfg.promote_every)
  return _accum_conv_drhs(x, g, w_like.shape, params, cfg.accum, cfg.kahan, cfg.promote_every)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _qbilinear(lhs, rhs, key, widths, probe, kind, params, cfg):
  return _qbilinear_fwd(lhs, rhs, key, widths, probe, kind, params, cfg)[0]


def dgrad_w_is_w(cfg: GemmQuant, w_ndim: int, widths: Any = None) -> bool:
  """Whether role dgrad_w's cast of a weight of rank `w_ndim` gives role w's values bit for bit,
  so that the forward's quantized weight serves the input gradient (with cfg.bwd_from_fwd the
  backward re-quantizes w̃ instead, BFPsim's order). True when both roles are deterministic
  (no stochastic rounding, no traced width) and either equal, or NVFP4 / block-scaled formats
  with a square 2-D block that differ only in which axis of the 2-D weight (or its matrix view)
  the block's second entry runs along: a square block tiles a matrix and its transpose alike,
  and a value depends only on its block (and, for NVFP4, on the tensor's amax), so the two
  casts are the same function (TE's NVFP4 and DeepSeek-V3's 128 x 128 weight tiles)."""
  w, d = cfg.w, cfg.dgrad_w
  if w is None or d is None or cfg.bwd_from_fwd or is_stochastic(w) or is_stochastic(d):
    return False
  if widths is not None and ("w" in widths or "dgrad_w" in widths):
    return False
  if cfg.views("w") != cfg.views("dgrad_w"):
    return False
  if d == w:
    return True
  return (isinstance(w, (NVFP4Format, BlockScaledFormat)) and type(d) is type(w)
          and (w_ndim == 2 or cfg.views("w")) and w.block[0] == w.block[1]
          and not getattr(w, "rht", False) and dataclasses.replace(d, axis=w.axis) == w
          and w.axis in (-2, -1, 0, 1) and d.axis in (-2, -1, 0, 1))


def _qbilinear_fwd(lhs, rhs, key, widths, probe, kind, params, cfg):
  xq = _q(cfg, "x", lhs, key, widths)
  wq = _q(cfg, "w", rhs, key, widths)
  y = _q(cfg, "y", _forward_gemm(kind, params, cfg, xq, wq), key, widths)
  if cfg.bwd_from_fwd:
    res = (xq, wq, key)
  else:
    res = (lhs, wq if dgrad_w_is_w(cfg, rhs.ndim, widths) else rhs, key)
  return y, res + (widths, probe)


def _qbilinear_bwd(kind, params, cfg, res, g):
  x_t, w_t, key, widths, probe = res
  g = g.astype(jnp.float32)
  w_d = w_t if dgrad_w_is_w(cfg, w_t.ndim, widths) else _q(cfg, "dgrad_w", w_t, key, widths)
  dlhs = _dlhs_gemm(kind, params, cfg, _q(cfg, "dgrad_dy", g, key, widths), w_d, x_t)
  dlhs = _q(cfg, "dgrad_out", dlhs, key, widths)
  drhs = _drhs_gemm(kind, params, cfg, _q(cfg, "wgrad_x", x_t, key, widths),
                    _q(cfg, "wgrad_dy", g, key, widths), w_t)
  drhs = _q(cfg, "wgrad_out", drhs, key, widths)
  dprobe = None
  if probe is not None:
    from jlp.nn.zse import zero_setting_error  # pylint: disable=g-import-not-at-top (cycle)
    fmt = BFPFormat(cfg.dgrad_w.man, biw_zse_block(cfg, dlhs.ndim))
    dprobe = zero_setting_error(dlhs, fmt, _width(cfg, "dgrad_w", widths)).astype(probe.dtype)
  dwidths = None if widths is None else {r: None for r in widths}
  return dlhs, drhs, None, dwidths, dprobe


_qbilinear.defvjp(_qbilinear_fwd, _qbilinear_bwd)


def _run(lhs, rhs, key, kind, params, cfg, out_dtype, widths=None, probe=None):
  _check_float(lhs, "lhs")
  _check_float(rhs, "rhs")
  y = _qbilinear(lhs.astype(jnp.float32), rhs.astype(jnp.float32), key, widths, probe, kind,
                 params, cfg)
  return y.astype(out_dtype)


def _check_probe(cfg: GemmQuant, probe: Any, lhs_ndim: int, op: str):
  if probe is None:
    return None
  if biw_zse_block(cfg, lhs_ndim) is None:
    raise ValueError(f"{op}: zse_probe is not allowed with cfg.dgrad_w={cfg.dgrad_w!r} and an lhs of "
                     f"rank {lhs_ndim}; expected a BFPFormat dgrad_w whose block has lhs's rank.")
  probe = jnp.asarray(probe)
  if probe.shape != () or not jnp.issubdtype(probe.dtype, jnp.floating):
    raise ValueError(f"{op}: zse_probe has shape {probe.shape} and dtype {probe.dtype}; expected a "
                     "float scalar.")
  return probe


# ----------------------------------------------------------------------------- public API


def _check_not_delayed(cfg: Any, op: str) -> None:
  if isinstance(cfg, fp8_delayed.DelayedScaling):
    raise ValueError(f"{op}: cfg={cfg!r} is not allowed: DelayedScaling keeps per-layer amax "
                     "histories and scales; expected a stateless GemmQuant (quantize a model with "
                     "jlp.nn.quantize_model to use DelayedScaling).")


def _static_dn(dimension_numbers):
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
          (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))


def qdot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, cfg: GemmQuant, *,
                 key: jax.Array | None = None, precision=None,
                 preferred_element_type=None, widths: dict[str, jax.Array] | None = None,
                 zse_probe: jax.Array | None = None) -> jax.Array:
  """Quantized `lax.dot_general`: y = q_y(q_x(lhs) · q_w(rhs)), with quantized gradients.

  The roles of `cfg` (BFPsim's nine, docs/bfp.md#layer-roles; Noh et al., FlexBlock, IEEE
  Trans. Computers 2023) and the accumulator (CPD's quant_gemm, docs/cpd.md#accumulating-gemm;
  Han, Demmel, You, arXiv:1911.08907) are applied as in the module docstring.
  An identity cfg (no role, no accum) is exactly `lax.dot_general`.

  Args:
    lhs, rhs: floating arrays (computed in float32).
    dimension_numbers: as `lax.dot_general`: ((lhs_contract, rhs_contract),
      (lhs_batch, rhs_batch)).
    cfg: the GemmQuant (static; hashable).
    key: PRNG key, required when any role rounds stochastically (role r draws
      from `fold_in(key, ROLES.index(r))`).
    precision: precision of the float32 GEMMs without accum (default HIGHEST).
    preferred_element_type: the output dtype (default: result_type(lhs, rhs)).
    widths: optional {role: int32 scalar array} overriding the mantissa width
      of those BFP roles (may be traced: one compiled function serves every
      width; bit-identical to cfg with BFPFormat(width, block)). Roles absent
      keep their static width; widths=None is the static path. The widths get
      no gradient.
    zse_probe: optional float32 scalar (its value is ignored) whose gradient is
      the zero-setting error (docs/bfp.md#zero-setting-error) of the returned input gradient
      dL/dlhs with dgrad_w's width and `biw_zse_block` (BFPsim's "biw",
      docs/bfp.md#zero-setting-error); needs a BFP dgrad_w. Calls sharing a probe add up.

  Returns:
    The dot_general output, in dot_general's layout.

  Raises:
    ValueError: a stochastic role without key, a BFP block / MX axis that does
      not fit its role's tensor, a non-float input, an invalid accumulator.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  dn = _static_dn(dimension_numbers)
  _check_not_delayed(cfg, "qdot_general")
  if isinstance(cfg, GemmQuant):
    widths = _check_widths(cfg, widths, "qdot_general")
    zse_probe = _check_probe(cfg, zse_probe, lhs.ndim, "qdot_general")
  if isinstance(cfg, GemmQuant) and cfg.is_identity:
    return lax.dot_general(lhs, rhs, dn, precision=precision,
                           preferred_element_type=preferred_element_type)
  out_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs).shape
  _validate(cfg, key, lhs.shape, rhs.shape, out_shape, "qdot_general")
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  params = (dn, _HIGHEST if precision is None else precision)
  return _run(lhs, rhs, key, "dot", params, cfg, out_dtype, widths, zse_probe)


def _canonical_padding(padding, lhs_shape, rhs_shape, strides, lhs_dil, rhs_dil, dn):
  if isinstance(padding, str):
    if any(d != 1 for d in lhs_dil):
      raise ValueError(f"padding={padding!r} is not allowed with lhs_dilation={lhs_dil}; "
                       "expected explicit (low, high) pairs (as lax.conv_general_dilated).")
    cdn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dn)
    k = [_dilate_dim(rhs_shape[i], r) for i, r in zip(cdn.rhs_spec[2:], rhs_dil)]
    s = [lhs_shape[i] for i in cdn.lhs_spec[2:]]
    return tuple((int(lo), int(hi)) for lo, hi in lax.padtype_to_pads(s, k, strides, padding))
  return tuple((int(lo), int(hi)) for lo, hi in padding)


def _static_conv_dn(dn):
  if dn is None or isinstance(dn, lax.ConvDimensionNumbers):
    return dn
  return tuple(dn)


def qconv(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int], padding, cfg: GemmQuant,
          *, lhs_dilation: Sequence[int] | None = None, rhs_dilation: Sequence[int] | None = None,
          dimension_numbers=None, feature_group_count: int = 1,
          key: jax.Array | None = None, precision=None, preferred_element_type=None,
          widths: dict[str, jax.Array] | None = None,
          zse_probe: jax.Array | None = None) -> jax.Array:
  """Quantized `lax.conv_general_dilated` with the roles of `cfg` (docs/bfp.md#layer-roles).

  Without accum the backward GEMMs are the vjp of conv_general_dilated at
  the substituted operands (any strides, padding, dilation, grouping and
  dimension_numbers). With `cfg.accum` the three GEMMs use im2col with K order
  (c, kh, kw) (CPD's Quant_Conv; see the module docstring for dgrad's col2im),
  one GEMM per feature group.
  An identity cfg is exactly `lax.conv_general_dilated`.

  Args:
    lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
      dimension_numbers, feature_group_count: as `lax.conv_general_dilated`.
    cfg: the GemmQuant (static).
    key: PRNG key, required when any role rounds stochastically.
    precision: passed to lax with an identity cfg; quantized convolutions
      always run at HIGHEST (accepted so that Flax Linen's `nn.Conv(...,
      conv_general_dilated=partial(qconv, cfg=cfg))` can call it).
    preferred_element_type: the output dtype (default: result_type(lhs, rhs)).
    widths, zse_probe: traced BFP widths and the "biw" ZSE probe, as
      `qdot_general`.

  Returns:
    The convolution output.

  Raises:
    ValueError: as `qdot_general`, and string padding with lhs_dilation.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  nsp = lhs.ndim - 2
  strides = tuple(int(s) for s in window_strides)
  lhs_dil = (1,) * nsp if lhs_dilation is None else tuple(int(d) for d in lhs_dilation)
  rhs_dil = (1,) * nsp if rhs_dilation is None else tuple(int(d) for d in rhs_dilation)
  dn = _static_conv_dn(dimension_numbers)
  _check_not_delayed(cfg, "qconv")
  if isinstance(cfg, GemmQuant):
    widths = _check_widths(cfg, widths, "qconv")
    zse_probe = _check_probe(cfg, zse_probe, lhs.ndim, "qconv")
  if isinstance(cfg, GemmQuant) and cfg.is_identity:
    return lax.conv_general_dilated(lhs, rhs, strides, padding, lhs_dilation=lhs_dil,
                                    rhs_dilation=rhs_dil, dimension_numbers=dn,
                                    feature_group_count=feature_group_count, precision=precision,
                                    preferred_element_type=preferred_element_type)
  pads = _canonical_padding(padding, lhs.shape, rhs.shape, strides, lhs_dil, rhs_dil, dn)
  params = (strides, pads, lhs_dil, rhs_dil, dn, int(feature_group_count))
  out_shape = jax.eval_shape(_plain_op("conv", params), lhs.astype(jnp.float32),
                             rhs.astype(jnp.float32)).shape
  _validate(cfg, key, lhs.shape, rhs.shape, out_shape, "qconv")
  out_dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else preferred_element_type
  return _run(lhs, rhs, key, "conv", params, cfg, out_dtype, widths, zse_probe)
