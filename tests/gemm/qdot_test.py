"""jlp.gemm.qdot: qdot_general / qconv against independent references.

References (never the code under test):
  * Without accum: the role formulas of GemmQuant's docstring (BFPsim's
    BFPConv2dFunction, bfp.md §2.1-§2.2; Noh et al., FlexBlock, IEEE Trans.
    Computers 2023) composed from `jlp.quantize` and plain lax ops: forward
    y = q_y(q_x(x) · q_w(w)); dx = q_dgrad_out(q_dgrad_dy(g) ·ᵀ q_dgrad_w(w̃)),
    dw = q_wgrad_out(q_wgrad_x(x̃) ·ᵀ q_wgrad_dy(g)), with ·ᵀ written as an
    explicit einsum for dot_general and as the vjp of the plain
    lax.conv_general_dilated for convolutions. Inputs are small integers
    (times powers of two) and formats keep every product and sum exact in
    float32, so bit equality is meaningful whatever the summation order.
  * With accum: plain-Python loops written from cpd.md §2.1 (CPD's quant_gemm,
    Han, Demmel, You, arXiv:1911.08907): p = q(fl32(a·b)), then s = q(s + p) or
    the Kahan step, k in the documented order; conv through an explicit im2col
    with K order (c, kh, kw) (cpd.md §2.3), wgrad over (n, oh, ow), dgrad over o
    followed by a float32 col2im in (kh, kw) order. q = references.round_to_format.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jlp
from jlp.formats import BFPFormat, FloatFormat
from jlp.gemm.config import GemmQuant, ROLES
from jlp.gemm.qdot import qconv, qdot_general
import references as ref

f32 = np.float32
FMT = FloatFormat(5, 2)   # 3 significant bits: 9 -> 8, 11 -> 12, ... (integers < 2^15 stay exact)
HI = lax.Precision.HIGHEST

# which outputs (y, dx, dw) a role changes (bwd_from_fwd=True: x̃ feeds wgrad, w̃ dgrad)
AFFECTS = {"x": "yw", "w": "yx", "y": "y", "wgrad_dy": "w", "wgrad_x": "w", "wgrad_out": "w",
           "dgrad_dy": "x", "dgrad_w": "x", "dgrad_out": "x"}


def ints(rng, shape, lo=-15, hi=16, scale=1.0):
  return jnp.asarray((rng.integers(lo, hi, shape) * scale).astype(f32))


def normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def q(x, fmt, key=None):
  return x if fmt is None else jlp.quantize(x, fmt, key=key)


def reference(cfg, x, w, g, fwd, dlhs, drhs):
  """The role formulas from jlp.quantize and the given plain ops (no jlp.gemm code), jitted."""
  return jax.jit(lambda x, w, g: _reference(cfg, x, w, g, fwd, dlhs, drhs))(x, w, g)


def _reference(cfg, x, w, g, fwd, dlhs, drhs):
  xq, wq = q(x, cfg.x), q(w, cfg.w)
  xt, wt = (xq, wq) if cfg.bwd_from_fwd else (x, w)
  y = q(fwd(xq, wq), cfg.y)
  dx = q(dlhs(q(g, cfg.dgrad_dy), q(wt, cfg.dgrad_w)), cfg.dgrad_out)
  dw = q(drhs(q(xt, cfg.wgrad_x), q(g, cfg.wgrad_dy)), cfg.wgrad_out)
  return y, dx, dw


_RUN = {}


def run(fn, x, w, g):
  """(y, dx, dw) of fn at (x, w) with cotangent g, as one jitted program (one per fn: calls
  with the same fn and shapes share its trace and compile)."""
  if fn not in _RUN:
    def f(x, w, g):
      y, vjp = jax.vjp(fn, x, w)
      return (y,) + vjp(g)
    _RUN[fn] = jax.jit(f)
  return _RUN[fn](x, w, g)


def check(got, want, base=None, affects="yxw", msg=""):
  for name, gt, wt, b in zip("yxw", got, want, base or (None,) * 3, strict=True):
    ref.assert_same_bits(gt, wt, msg=f"{msg} {name}")
    if b is not None:
      changed = not np.array_equal(np.asarray(gt), np.asarray(b))
      assert changed == (name in affects), f"{msg}: output {name} changed={changed}"


# ----------------------------------------------------------------------------- dot_general, role by role

# lhs (K, B, M), rhs (B, N, K): contracting (0 | 2), batch (1 | 0)
GEN_DN = (((0,), (2,)), ((1,), (0,)))
GEN = dict(fwd=lambda x, w: jnp.einsum("kbm,bnk->bmn", x, w, precision=HI),
           dlhs=lambda g, w: jnp.einsum("bmn,bnk->kbm", g, w, precision=HI),
           drhs=lambda x, g: jnp.einsum("kbm,bmn->bnk", x, g, precision=HI))
DENSE = dict(fwd=lambda x, w: jnp.matmul(x, w, precision=HI),
             dlhs=lambda g, w: jnp.matmul(g, w.T, precision=HI),
             drhs=lambda x, g: jnp.matmul(x.T, g, precision=HI))


@pytest.fixture(scope="module")
def gen_operands():
  rng = np.random.default_rng(0)
  return ints(rng, (4, 2, 3)), ints(rng, (2, 5, 4)), ints(rng, (2, 3, 5))


_BASE = {}


def base_run(name, fn, x, w, g):
  """The unquantized (y, dx, dw) of one test case, computed once per module."""
  if name not in _BASE:
    _BASE[name] = run(fn(GemmQuant()), x, w, g)
  return _BASE[name]


@pytest.mark.parametrize("role", ROLES)
def test_dot_general_role_by_role(role, gen_operands):
  x, w, g = gen_operands
  fn = lambda c: (lambda a, b: qdot_general(a, b, GEN_DN, c))
  base = base_run("gen", fn, x, w, g)
  cfg = GemmQuant(**{role: FMT})
  check(run(fn(cfg), x, w, g), reference(cfg, x, w, g, **GEN), base, AFFECTS[role], role)


BFP_BLOCKS = {"x": (2, 2), "w": (2, 3), "y": (1, 4), "wgrad_dy": (4, 1), "wgrad_x": (1, 6),
              "wgrad_out": (3, 2), "dgrad_dy": (2, 4), "dgrad_w": (6, 1), "dgrad_out": (4, 3)}


@pytest.mark.parametrize("role", ROLES)
def test_dense_bfp_role_by_role(role):
  """(B, in)·(in, out) with one BFPFormat role (BFPsim's 4-bit magnitudes, truncation)."""
  rng = np.random.default_rng(1)
  x, w, g = ints(rng, (4, 6), scale=0.25), ints(rng, (6, 4), scale=0.5), ints(rng, (4, 4))
  dn = (((1,), (0,)), ((), ()))
  fn = lambda c: (lambda a, b: qdot_general(a, b, dn, c))
  base = base_run("dense", fn, x, w, g)
  cfg = GemmQuant(**{role: BFPFormat(3, BFP_BLOCKS[role])})
  check(run(fn(cfg), x, w, g), reference(cfg, x, w, g, **DENSE), base, AFFECTS[role], role)


@pytest.mark.parametrize("bwd_from_fwd", [True, False])
def test_bwd_from_fwd(bwd_from_fwd, gen_operands):
  x, w, g = gen_operands
  cfg = GemmQuant(x=FMT, w=FloatFormat(4, 1), bwd_from_fwd=bwd_from_fwd)
  got = run(lambda a, b: qdot_general(a, b, GEN_DN, cfg), x, w, g)
  check(got, reference(cfg, x, w, g, **GEN), msg=f"bwd_from_fwd={bwd_from_fwd}")
  other = reference(cfg.replace(bwd_from_fwd=not bwd_from_fwd), x, w, g, **GEN)
  assert not np.array_equal(got[1], other[1]) and not np.array_equal(got[2], other[2])


def test_all_roles_and_multi_contracting_dims():
  """Two contracting dims given out of axis order, every role set at once."""
  rng = np.random.default_rng(2)
  x, w, g = ints(rng, (3, 2, 4)), ints(rng, (4, 5, 3)), ints(rng, (2, 5))
  dn = (((2, 0), (0, 2)), ((), ()))
  fmts = [FMT, FloatFormat(4, 1), FloatFormat(6, 2), FloatFormat(5, 1)]
  cfg = GemmQuant(**{r: fmts[i % 4] for i, r in enumerate(ROLES)})
  ops = dict(fwd=lambda a, b: jnp.einsum("imk,kni->mn", a, b, precision=HI),
             dlhs=lambda g, b: jnp.einsum("mn,kni->imk", g, b, precision=HI),
             drhs=lambda a, g: jnp.einsum("imk,mn->kni", a, g, precision=HI))
  check(run(lambda a, b: qdot_general(a, b, dn, cfg), x, w, g), reference(cfg, x, w, g, **ops))


def test_identity_cfg_is_lax():
  rng = np.random.default_rng(3)
  x, w = normal(rng, (3, 5)), normal(rng, (5, 2))
  dn = (((1,), (0,)), ((), ()))
  ref.assert_same_bits(qdot_general(x, w, dn, GemmQuant()), lax.dot_general(x, w, dn))
  xc, wc = normal(rng, (1, 5, 5, 2)), normal(rng, (3, 3, 2, 2))
  kw = dict(window_strides=(2, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  ref.assert_same_bits(qconv(xc, wc, cfg=GemmQuant(), **kw), lax.conv_general_dilated(xc, wc, **kw))


# ----------------------------------------------------------------------------- stochastic roles, transforms


SR = FloatFormat(5, 2, rounding="stochastic")


def test_stochastic_streams_per_role():
  """Role r draws from fold_in(key, ROLES.index(r)): reproducible per key, distinct per role."""
  rng = np.random.default_rng(4)
  x, w, g = ints(rng, (3, 4)), ints(rng, (4, 5)), ints(rng, (3, 5))  # SR of ints: products stay exact
  dn = (((1,), (0,)), ((), ()))
  roles = ("x", "w", "dgrad_dy", "wgrad_dy")
  cfg = GemmQuant(**{r: SR for r in roles})
  key = jax.random.key(7)

  @jax.jit
  def reference_sr(x, w, g):
    qr = {r: jlp.quantize(v, SR, key=jax.random.fold_in(key, ROLES.index(r)))
          for r, v in (("x", x), ("w", w), ("dgrad_dy", g), ("wgrad_dy", g))}
    mm = lambda a, b: jnp.matmul(a, b, precision=HI)
    return (mm(qr["x"], qr["w"]), mm(qr["dgrad_dy"], qr["w"].T), mm(qr["x"].T, qr["wgrad_dy"]),
            qr["dgrad_dy"], qr["wgrad_dy"])

  *want, g_dgrad, g_wgrad = reference_sr(x, w, g)
  assert not np.array_equal(g_dgrad, g_wgrad)  # the same tensor, two streams
  f = jax.jit(lambda k: run(lambda a, b: qdot_general(a, b, dn, cfg, key=k), x, w, g))
  got = f(key)
  for name, gt, wt in zip(("y", "dx", "dw"), got, want, strict=True):
    ref.assert_same_bits(gt, wt, msg=name)
  for gt, again in zip(got, f(jax.random.key(7)), strict=True):
    ref.assert_same_bits(again, gt, msg="same key")
  assert not all(np.array_equal(a, b) for a, b in zip(got, f(jax.random.key(8)), strict=True))


def test_jit_vmap_grad(gen_operands):
  x, w, g = gen_operands
  cfg = GemmQuant(x=FMT, dgrad_dy=FloatFormat(4, 1), wgrad_out=FMT)
  f = lambda a, b: qdot_general(a, b, GEN_DN, cfg)
  y, dx, dw = run(f, x, w, g)
  ref.assert_same_bits(f(x, w), y, msg="eager")
  grad = jax.grad(lambda a, b, g: jnp.sum(f(a, b) * g), (0, 1))
  for gt, wt in zip(jax.jit(grad)(x, w, g), (dx, dw), strict=True):
    ref.assert_same_bits(gt, wt, msg="jit(grad)")
  # vmap over a new leading axis of the operands = a loop over examples
  xs, ws = jnp.stack([x, 2 * x]), jnp.stack([w, w + 1])
  ys, dxs, dws = jax.jit(lambda a, b: (jax.vmap(f)(a, b),) + jax.vmap(grad, (0, 0, None))(a, b, g))(xs, ws)
  for i in range(2):
    for gt, wt in zip((ys[i], dxs[i], dws[i]), run(f, xs[i], ws[i], g), strict=True):
      ref.assert_same_bits(gt, wt, msg=f"vmap {i}")


def test_errors(gen_operands):
  x, w, _ = gen_operands
  with pytest.raises(ValueError, match="key=None.*wgrad_dy"):
    qdot_general(x, w, GEN_DN, GemmQuant(wgrad_dy=SR))
  with pytest.raises(ValueError, match="cfg.x=BFPFormat.*ndim=3"):
    qdot_general(x, w, GEN_DN, GemmQuant(x=BFPFormat(4, (1, 4))))
  with pytest.raises(ValueError, match="cfg=.*GemmQuant"):
    qdot_general(x, w, GEN_DN, {"x": FMT})
  xc, kc = jnp.ones((1, 4, 4, 4)), jnp.ones((3, 3, 4, 2))
  with pytest.raises(ValueError, match="cfg.dgrad_w=BFPFormat.*ndim=4"):
    qconv(xc, kc, (1, 1), "SAME", GemmQuant(dgrad_w=BFPFormat(4, (3, 3, 4))),
          dimension_numbers=("NHWC", "HWIO", "NHWC"))
  with pytest.raises(ValueError, match="accum.rounding"):
    qconv(xc, kc, (1, 1), "SAME", GemmQuant(accum=SR), dimension_numbers=("NHWC", "HWIO", "NHWC"))
  with pytest.raises(ValueError, match="padding='SAME' is not allowed with lhs_dilation"):
    qconv(xc, kc, (1, 1), "SAME", GemmQuant(x=FMT), lhs_dilation=(2, 2),
          dimension_numbers=("NHWC", "HWIO", "NHWC"))


# ----------------------------------------------------------------------------- qconv without accum


def conv_ops(**kw):
  conv = lambda a, b: lax.conv_general_dilated(a, b, precision=HI, **kw)
  return dict(fwd=conv, dlhs=lambda g, b: jax.vjp(lambda a: conv(a, b), XSHAPE[0])[1](g)[0],
              drhs=lambda a, g: jax.vjp(lambda b: conv(a, b), XSHAPE[1])[1](g)[0])


XSHAPE = [None, None]  # the (x, w) zeros of the current case, for the reference vjps

CONV_CASES = {
    "nhwc-s2-same": (dict(window_strides=(2, 2), padding="SAME",
                          dimension_numbers=("NHWC", "HWIO", "NHWC")), (2, 6, 5, 3), (3, 3, 3, 4)),
    "nchw-dil-pad": (dict(window_strides=(1, 2), padding=((2, 1), (0, 1)), rhs_dilation=(2, 1),
                          dimension_numbers=("NCHW", "OIHW", "NCHW")), (2, 3, 6, 5), (4, 3, 2, 3)),
    "nhwc-grouped-lhsdil": (dict(window_strides=(1, 1), padding=((1, 1), (1, 0)), lhs_dilation=(2, 1),
                                 feature_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC")),
                            (1, 4, 5, 4), (2, 3, 2, 6)),
}


def conv_operands(case, seed):
  kw, xs, ws = CONV_CASES[case]
  rng = np.random.default_rng(seed)
  x, w = ints(rng, xs), ints(rng, ws, scale=0.5)
  y = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kw), x, w)
  g = ints(rng, y.shape)
  XSHAPE[:] = [jnp.zeros_like(x), jnp.zeros_like(w)]
  return kw, x, w, g


@pytest.mark.parametrize("role", ROLES)
def test_conv_role_by_role(role):
  kw, x, w, g = conv_operands("nhwc-s2-same", 5)
  fn = lambda c: (lambda a, b: qconv(a, b, cfg=c, **kw))
  base = base_run("conv", fn, x, w, g)
  cfg = GemmQuant(**{role: FMT})
  check(run(fn(cfg), x, w, g), reference(cfg, x, w, g, **conv_ops(**kw)), base, AFFECTS[role], role)


@pytest.mark.parametrize("case,bwd_from_fwd", [("nchw-dil-pad", True), ("nhwc-grouped-lhsdil", False)])
def test_conv_all_roles(case, bwd_from_fwd):
  kw, x, w, g = conv_operands(case, 6)
  fmts = [FMT, FloatFormat(4, 1), FloatFormat(6, 2), FloatFormat(5, 1)]
  cfg = GemmQuant(**{r: fmts[i % 4] for i, r in enumerate(ROLES)}, bwd_from_fwd=bwd_from_fwd)
  got = run(lambda a, b: qconv(a, b, cfg=cfg, **kw), x, w, g)
  check(got, reference(cfg, x, w, g, **conv_ops(**kw)), msg=case)


def test_conv_bfp_nhwc():
  """BFPsim's group shapes after from_bfpsim's NCHW->NHWC, OIHW->HWIO permutation."""
  kw, x, w, g = conv_operands("nhwc-s2-same", 7)
  cfg = GemmQuant(x=BFPFormat(3, (1, 3, 3, 3)), w=BFPFormat(3, (3, 3, 3, 2)),
                  dgrad_dy=BFPFormat(3, (1, 2, 2, 4)), wgrad_dy=BFPFormat(2, (2, 1, 1, 4)))
  check(run(lambda a, b: qconv(a, b, cfg=cfg, **kw), x, w, g), reference(cfg, x, w, g, **conv_ops(**kw)))


# ----------------------------------------------------------------------------- accumulator (cpd.md §2.1)


ACC = FloatFormat(4, 3)


def acc_sum(terms, fmt, kahan):
  """One output element from its (a, b) terms in order, exactly cpd.md §2.1."""
  qq = lambda v: ref.round_to_format(np.array([v], f32), fmt)[0]
  s, c = f32(0), f32(0)
  with np.errstate(all="ignore"):
    for a, b in terms:
      p = qq(f32(f32(a) * f32(b)))
      if kahan:
        y = qq(f32(p - c))
        t = qq(f32(s + y))
        c = qq(f32(qq(f32(t - s)) - y))
        s = t
      else:
        s = qq(f32(s + p))
  return s


@pytest.mark.parametrize("kahan", [False, True], ids=["plain", "kahan"])
def test_accum_dense_loop(kahan):
  """(B, in)·(in, out): forward K = in, dgrad K = out, wgrad K = batch rows (cpd.md §2.3)."""
  rng = np.random.default_rng(8)
  x, w, g = normal(rng, (3, 5)), normal(rng, (5, 4)), normal(rng, (3, 4))
  cfg = GemmQuant(accum=ACC, kahan=kahan)
  y, dx, dw = run(lambda a, b: qdot_general(a, b, (((1,), (0,)), ((), ())), cfg), x, w, g)
  X, W, G = map(np.asarray, (x, w, g))
  ry = [[acc_sum([(X[i, k], W[k, j]) for k in range(5)], ACC, kahan) for j in range(4)] for i in range(3)]
  rdx = [[acc_sum([(G[i, o], W[k, o]) for o in range(4)], ACC, kahan) for k in range(5)] for i in range(3)]
  rdw = [[acc_sum([(X[b, k], G[b, j]) for b in range(3)], ACC, kahan) for j in range(4)] for k in range(5)]
  for name, gt, wt in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
    ref.assert_same_bits(gt, np.array(wt, f32), msg=name)


def test_accum_general_dn_loop():
  """Batched, two contracting dims in the given order ((2, 0) | (0, 3)): k2 slow, k0 fast."""
  rng = np.random.default_rng(9)
  x, w, g = normal(rng, (3, 2, 2, 4)), normal(rng, (4, 2, 5, 3)), normal(rng, (2, 2, 5))
  # lhs (k0=3, b=2, m=2, k2=4), rhs (k2=4, b=2, n=5, k0=3); out (b, m, n)
  dn = (((3, 0), (0, 3)), ((1,), (1,)))
  cfg = GemmQuant(accum=ACC, kahan=True, x=FMT)
  y, dx, dw = run(lambda a, b: qdot_general(a, b, dn, cfg), x, w, g)
  X, W, G = np.asarray(jlp.quantize(x, FMT)), np.asarray(w), np.asarray(g)
  ry = np.zeros((2, 2, 5), f32)
  for b, m, n in np.ndindex(2, 2, 5):
    ry[b, m, n] = acc_sum([(X[k0, b, m, k2], W[k2, b, n, k0]) for k2 in range(4) for k0 in range(3)],
                          ACC, True)
  ref.assert_same_bits(y, ry, msg="y")
  # dlhs contracts over rhs's free dim n; drhs over lhs's free dim m
  rdx = np.zeros(x.shape, f32)
  for k0, b, m, k2 in np.ndindex(*x.shape):
    rdx[k0, b, m, k2] = acc_sum([(G[b, m, n], W[k2, b, n, k0]) for n in range(5)], ACC, True)
  rdw = np.zeros(w.shape, f32)
  for k2, b, n, k0 in np.ndindex(*w.shape):
    rdw[k2, b, n, k0] = acc_sum([(X[k0, b, m, k2], G[b, m, n]) for m in range(2)], ACC, True)
  ref.assert_same_bits(dx, rdx, msg="dx")
  ref.assert_same_bits(dw, rdw, msg="dw")


def conv_loops(x, w, g, stride, pad, dil, fmt, kahan):
  """NHWC/HWIO conv by explicit im2col, K (c, kh, kw); wgrad K (n, oh, ow); dgrad K o + col2im."""
  n, h, wd, c = x.shape
  kh, kw, _, o = w.shape
  xp = np.zeros((n, h + pad[0][0] + pad[0][1], wd + pad[1][0] + pad[1][1], c), f32)
  xp[:, pad[0][0]:pad[0][0] + h, pad[1][0]:pad[1][0] + wd] = x
  oh = (xp.shape[1] - (dil[0] * (kh - 1) + 1)) // stride[0] + 1
  ow = (xp.shape[2] - (dil[1] * (kw - 1) + 1)) // stride[1] + 1
  pos = lambda i, j, a, b: (i * stride[0] + a * dil[0], j * stride[1] + b * dil[1])
  y = np.zeros((n, oh, ow, o), f32)
  for b_, i, j, oo in np.ndindex(n, oh, ow, o):
    y[b_, i, j, oo] = acc_sum([(xp[(b_,) + pos(i, j, a, bb) + (cc,)], w[a, bb, cc, oo])
                               for cc in range(c) for a in range(kh) for bb in range(kw)], fmt, kahan)
  dw = np.zeros(w.shape, f32)
  for a, bb, cc, oo in np.ndindex(*w.shape):
    dw[a, bb, cc, oo] = acc_sum([(xp[(b_,) + pos(i, j, a, bb) + (cc,)], g[b_, i, j, oo])
                                 for b_ in range(n) for i in range(oh) for j in range(ow)], fmt, kahan)
  dxp = np.zeros(xp.shape, f32)
  for a, bb in np.ndindex(kh, kw):           # col2im: float32, (kh, kw) order (torch's F.fold)
    for b_, i, j, cc in np.ndindex(n, oh, ow, c):
      dcol = acc_sum([(g[b_, i, j, oo], w[a, bb, cc, oo]) for oo in range(o)], fmt, kahan)
      idx = (b_,) + pos(i, j, a, bb) + (cc,)
      dxp[idx] = f32(dxp[idx] + dcol)
  dx = dxp[:, pad[0][0]:pad[0][0] + h, pad[1][0]:pad[1][0] + wd]
  return y, dx, dw


@pytest.mark.parametrize("kahan,layout", [(False, "NHWC"), (True, "NCHW")])
def test_accum_conv_loop(kahan, layout):
  """Strided, padded, dilated conv; NCHW/OIHW must give the same K order (c, kh, kw) as NHWC/HWIO."""
  rng = np.random.default_rng(10)
  x, w = normal(rng, (2, 5, 4, 2)), normal(rng, (2, 3, 2, 3))   # NHWC, HWIO
  stride, pad, dil = (2, 1), ((1, 1), (2, 0)), (1, 2)
  kw = dict(window_strides=stride, padding=pad, rhs_dilation=dil)
  yshape = jax.eval_shape(lambda a, b: lax.conv_general_dilated(
      a, b, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw), x, w).shape
  g = normal(rng, yshape)
  want = conv_loops(*map(np.asarray, (x, w, g)), stride, pad, dil, ACC, kahan)
  cfg = GemmQuant(accum=ACC, kahan=kahan)
  if layout == "NHWC":
    got = run(lambda a, b: qconv(a, b, cfg=cfg, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw), x, w, g)
  else:
    to_nchw, to_oihw = (0, 3, 1, 2), (3, 2, 0, 1)
    got = run(lambda a, b: qconv(a, b, cfg=cfg, dimension_numbers=("NCHW", "OIHW", "NCHW"), **kw),
              x.transpose(to_nchw), w.transpose(to_oihw), g.transpose(to_nchw))
    got = (got[0].transpose(0, 2, 3, 1), got[1].transpose(0, 2, 3, 1), got[2].transpose(2, 3, 1, 0))
  for name, gt, wt in zip(("y", "dx", "dw"), got, want, strict=True):
    ref.assert_same_bits(gt, wt, msg=name)


@pytest.mark.parametrize("case", ["nchw-negpad-lhsdil", "nwc-1d", "nhwc-grouped"])
def test_accum_conv_geometry(case):
  """A float32-wide accumulator on exact integer data is lax's conv and its vjp, bit for bit.

  Covers the im2col / col2im geometry (lhs dilation, negative padding, 1-D, feature groups)
  independently of the accumulator's rounding.
  """
  kw, xs, ws = {
      "nchw-negpad-lhsdil": (dict(window_strides=(1, 2), padding=((-1, 2), (1, 0)), lhs_dilation=(2, 1),
                                  rhs_dilation=(1, 2), dimension_numbers=("NCHW", "OIHW", "NCHW")),
                             (1, 2, 4, 5), (3, 2, 2, 2)),
      "nwc-1d": (dict(window_strides=(2,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC")),
                 (2, 7, 2), (3, 2, 3)),
      "nhwc-grouped": (dict(window_strides=(2, 1), padding=((1, 1), (0, 1)), feature_group_count=2,
                            dimension_numbers=("NHWC", "HWIO", "NHWC")), (1, 5, 4, 4), (3, 2, 2, 6)),
  }[case]
  rng = np.random.default_rng(12)
  x, w = ints(rng, xs), ints(rng, ws)
  plain = lambda a, b: lax.conv_general_dilated(a, b, precision=HI, **kw)
  g = ints(rng, jax.eval_shape(plain, x, w).shape)
  got = run(lambda a, b: qconv(a, b, cfg=GemmQuant(accum=FloatFormat(8, 23)), **kw), x, w, g)
  for name, gt, wt in zip(("y", "dx", "dw"), got, run(plain, x, w, g), strict=True):
    ref.assert_same_bits(gt, wt, msg=name)


def test_bfloat16_operands():
  """Non-float32 inputs are computed in float32; output and gradients keep the input dtypes."""
  rng = np.random.default_rng(13)
  x, w, g = ints(rng, (3, 4)), ints(rng, (4, 2)), ints(rng, (3, 2))
  dn = (((1,), (0,)), ((), ()))
  cfg = GemmQuant(x=FMT, dgrad_out=FloatFormat(4, 3))
  got = run(lambda a, b: qdot_general(a, b, dn, cfg), x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
            g.astype(jnp.bfloat16))
  assert [t.dtype for t in got] == [jnp.bfloat16] * 3
  want = reference(cfg, x, w, g, **DENSE)
  for gt, wt in zip(got, want, strict=True):
    ref.assert_same_bits(gt.astype(jnp.float32), wt.astype(jnp.bfloat16).astype(jnp.float32))


# ----------------------------------------------------------------------------- matrix_view


def _view_q(x, fmt):
  """`fmt` on TransformerEngine's 2-D view of x: leading axes flattened into rows."""
  return x if fmt is None else jlp.quantize(x.reshape(-1, x.shape[-1]), fmt).reshape(x.shape)


def test_matrix_view_quantizes_the_2d_view_of_every_block_format_role():
  """A conv (NHWC x HWIO) with MX, NVFP4 and block-scaled roles on the (N*H*W, C) and
  (H*W*I, O) views: the wgrad operands are blocked along the flattened rows."""
  kw, x, w, g = conv_operands("nhwc-s2-same", 8)
  cfg = GemmQuant(x=jlp.MXFormat("float8_e4m3fn", block=2, axis=-1),
                  w=jlp.BlockScaledFormat(block=(4, 2), axis=-2),
                  dgrad_dy=jlp.NVFP4Format(axis=-1), dgrad_w=jlp.MXFormat("float6_e2m3fn", 4),
                  wgrad_x=jlp.MXFormat("float8_e5m2", block=8, axis=-2),
                  wgrad_dy=jlp.BlockScaledFormat("float8_e5m2", block=(1, 6), axis=-2),
                  bwd_from_fwd=False, matrix_view=True)
  ops = conv_ops(**kw)
  want = jax.jit(lambda x, w, g: (
      ops["fwd"](_view_q(x, cfg.x), _view_q(w, cfg.w)),
      ops["dlhs"](_view_q(g, cfg.dgrad_dy), _view_q(w, cfg.dgrad_w)),
      ops["drhs"](_view_q(x, cfg.wgrad_x), _view_q(g, cfg.wgrad_dy))))(x, w, g)
  got = run(lambda a, b: qconv(a, b, cfg=cfg, **kw), x, w, g)
  for name, gt, wt in zip("yxw", got, want, strict=True):
    np.testing.assert_allclose(gt, wt, rtol=1e-6, atol=1e-6, err_msg=name)
  # the views matter: dw without them (its program alone: the vjp in w only) differs
  plain_dw = jax.jit(lambda x, w, g: jax.vjp(
      lambda b: qconv(x, b, cfg=cfg.replace(matrix_view=False), **kw), w)[1](g)[0])(x, w, g)
  assert not np.array_equal(np.asarray(plain_dw), np.asarray(got[2]))


def test_matrix_view_leaves_other_formats_and_2d_tensors_alone(gen_operands):
  x, w, g = gen_operands
  cfg = GemmQuant(x=FMT, w=BFPFormat(3, (1, 2, 2)), dgrad_dy=FMT, matrix_view=True)
  check(run(lambda a, b: qdot_general(a, b, GEN_DN, cfg), x, w, g),
        reference(cfg.replace(matrix_view=False), x, w, g, **GEN))
  rng = np.random.default_rng(9)
  xd, wd, gd = normal(rng, (8, 32)), normal(rng, (32, 16)), normal(rng, (8, 16))
  mx = dict(x=jlp.MXFormat("float8_e4m3fn"), wgrad_x=jlp.MXFormat("float8_e4m3fn", axis=-2))
  dn = (((1,), (0,)), ((), ()))
  viewed = run(lambda a, b: qdot_general(a, b, dn, GemmQuant(**mx, matrix_view=True)), xd, wd, gd)
  plain = run(lambda a, b: qdot_general(a, b, dn, GemmQuant(**mx)), xd, wd, gd)
  for a, b in zip(viewed, plain, strict=True):
    ref.assert_same_bits(a, b)


def test_matrix_view_validation_and_shape():
  from jlp.gemm.config import matrix_shape  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r"matrix_view=1 is not allowed; expected True or False"):
    GemmQuant(matrix_view=1)
  assert GemmQuant.from_dict({"matrix_view": True}).matrix_view
  assert matrix_shape((2, 3, 4)) == (6, 4) and matrix_shape((5,)) == (1, 5)
  assert matrix_shape(()) == (1, 1)
  # an axis is checked against the view's rank (2), not the tensor's
  x, w = jnp.ones((2, 3, 8)), jnp.ones((8, 4))
  dn = (((2,), (0,)), ((), ()))
  with pytest.raises(ValueError, match=r"cfg.x=NVFP4Format.* shape \(6, 8\).*axis=-3"):
    qdot_general(x, w, dn, GemmQuant(x=jlp.NVFP4Format(axis=-3), matrix_view=True))
  qdot_general(x, w, dn, GemmQuant(x=jlp.NVFP4Format(axis=-3)))  # fine on the 3-D tensor


def test_block_scaled_and_nvfp4_formats_are_roles():
  cfg = GemmQuant(x=jlp.NVFP4Format(), w=jlp.BlockScaledFormat(block=(16, 16), axis=0))
  assert isinstance(cfg.x, jlp.NVFP4Format) and isinstance(cfg.w, jlp.BlockScaledFormat)
  rng = np.random.default_rng(10)
  x, w, g = normal(rng, (4, 32)), normal(rng, (32, 8)), normal(rng, (4, 8))
  dn = (((1,), (0,)), ((), ()))
  got = run(lambda a, b: qdot_general(a, b, dn, cfg), x, w, g)
  want = reference(cfg, x, w, g, **DENSE)
  for name, gt, wt in zip("yxw", got, want, strict=True):
    np.testing.assert_allclose(gt, wt, rtol=1e-6, atol=1e-6, err_msg=name)
  with pytest.raises(ValueError, match=r"x=\{\} is not allowed; expected None, a FloatFormat, "
                                       r"BFPFormat, MXFormat, NVFP4Format, BlockScaledFormat"):
    GemmQuant(x={})


# ----------------------------------------------------------------------------- dgrad_w = w


def _casts(fn, *args) -> int:
  """How many NVFP4 / block-scaled casts (calls of their jitted XLA path) the lowered program of
  fn(*args) makes."""
  return len(re.findall(r"call @_quantize_xla", jax.jit(fn).lower(*args).as_text()))


def test_which_dgrad_w_casts_are_w_s():
  from jlp.gemm.qdot import dgrad_w_is_w  # pylint: disable=import-outside-toplevel
  from jlp.nn import recipes  # pylint: disable=import-outside-toplevel
  square = lambda fmt, axis, **kw: GemmQuant(w=fmt(axis=-2, **kw), dgrad_w=fmt(axis=axis, **kw),
                                             bwd_from_fwd=False, matrix_view=True)
  nv = lambda **kw: jlp.NVFP4Format((16, 16), **kw)
  bs = lambda **kw: jlp.BlockScaledFormat(block=(128, 128), **kw)
  for cfg, rank, want in [
      (recipes.recipe_gemm("nvfp4"), 4, True),  # TE's 16 x 16 weight tiles, on the 2-D view
      (recipes.recipe_gemm("deepseek_fp8"), 4, True),  # DeepSeek-V3's 128 x 128
      (recipes.recipe_gemm("mxfp8"), 4, False),  # 1 x 32 blocks along different axes
      (recipes.recipe_gemm("mxfp4"), 2, False),  # stochastic rounding in the backward
      (square(nv, -1), 2, True), (square(bs, 0), 2, True), (square(nv, -2), 2, True),
      (square(nv, -1, rounding="stochastic"), 2, False),
      (square(nv, -1).replace(matrix_view=False), 4, False),  # axes of a 4-D kernel
      (GemmQuant(w=jlp.BlockScaledFormat(block=(1, 128), axis=-2),
                 dgrad_w=jlp.BlockScaledFormat(block=(1, 128), axis=-1), bwd_from_fwd=False), 2,
       False),
      (GemmQuant(w=FMT, dgrad_w=FMT, bwd_from_fwd=False), 4, True),
      (GemmQuant(w=FMT, dgrad_w=FMT), 4, False),  # bwd_from_fwd: dgrad_w casts w̃ again
      (GemmQuant(w=FMT, bwd_from_fwd=False), 2, False)]:
    assert dgrad_w_is_w(cfg, rank) is want, cfg
  bfp = BFPFormat(3, (1, 4))
  assert dgrad_w_is_w(GemmQuant(w=bfp, dgrad_w=bfp, bwd_from_fwd=False), 2)
  assert not dgrad_w_is_w(GemmQuant(w=bfp, dgrad_w=bfp, bwd_from_fwd=False), 2,
                          widths={"w": jnp.int32(3)})


# The default shapes have, for both recipes' tiles (NVFP4's 16 x 16, DeepSeek's 128 x 128), whole
# and partial tiles along both axes (DeepSeek: (300, 200); NVFP4: the view (300, 24) already, so
# its (300, 200) is slow: each shape compiles both casts anew) and the view (300, 24) of a conv
# kernel, narrower than one DeepSeek tile; the slow ones add more views of conv kernels and dense
# weights with the same kinds of tiles (blocks are capped at the matrix per axis).
_SQUARE_SHAPES = {"nvfp4": [(5, 3, 20, 24)], "deepseek_fp8": [(5, 3, 20, 24), (300, 200)]}
_SQUARE_SHAPES_SLOW = [(3, 3, 64, 128), (3, 3, 128, 64), (1, 1, 64, 128), (17, 33)]


@pytest.mark.parametrize("recipe,shapes", [
    pytest.param(r, _SQUARE_SHAPES[r], id=r) for r in ("nvfp4", "deepseek_fp8")] + [
    pytest.param(r, ([(300, 200)] if r == "nvfp4" else []) + _SQUARE_SHAPES_SLOW,
                 marks=pytest.mark.slow, id=f"{r}-more-shapes")
    for r in ("nvfp4", "deepseek_fp8")])
def test_square_weight_tiles_are_the_same_cast_along_either_axis(recipe, shapes):
  """The premise of reusing w̃: on the 2-D view of conv kernels and dense weights, whole and
  partial tiles, both recipes' w and dgrad_w casts give the same bits."""
  from jlp.gemm.config import matrix_shape  # pylint: disable=import-outside-toplevel
  from jlp.nn import recipes  # pylint: disable=import-outside-toplevel
  cfg = recipes.recipe_gemm(recipe, accumulator=False)
  rng = np.random.default_rng(11)
  for shape in shapes:
    w = (rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, shape)).astype(np.float32)
    w.flat[::97] = 0.0
    view = jnp.asarray(w.reshape(matrix_shape(w.shape)))
    ref.assert_same_bits(jlp.quantize(view, cfg.dgrad_w), jlp.quantize(view, cfg.w))


def test_the_backward_keeps_the_quantized_weight_instead_of_casting_it_again():
  """TE's NVFP4 weight roles on a conv: the input gradient uses q_w(w) (one weight cast in
  forward and backward, was two), and equals the module docstring's formula with the dgrad_w
  cast of the raw weight."""
  kw, x, w, g = conv_operands("nhwc-s2-same", 8)
  w = jnp.concatenate([w] * 8, axis=-1)  # the (27, 32) view: whole and partial 16 x 16 tiles
  cfg = GemmQuant(w=jlp.NVFP4Format((16, 16), axis=-2), dgrad_w=jlp.NVFP4Format((16, 16), axis=-1),
                  bwd_from_fwd=False, matrix_view=True)
  y = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kw), x, w)
  g = jnp.asarray(np.random.default_rng(12).standard_normal(y.shape), jnp.float32)
  XSHAPE[:] = [jnp.zeros_like(x), jnp.zeros_like(w)]
  fn = lambda a, b: qconv(a, b, cfg=cfg, **kw)
  assert _casts(lambda x, w, g: run(fn, x, w, g), x, w, g) == 1
  ops = conv_ops(**kw)
  want = jax.jit(lambda x, w, g: (ops["fwd"](x, _view_q(w, cfg.w)),
                                  ops["dlhs"](g, _view_q(w, cfg.dgrad_w))))(x, w, g)
  got = run(fn, x, w, g)
  for name, gt, wt in zip("yx", got, want):
    np.testing.assert_allclose(gt, wt, rtol=1e-6, atol=1e-6, err_msg=name)
