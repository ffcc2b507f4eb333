"""Traced BFP widths (qdot_general / qconv `widths=`), BFPWidths in quantized models, ZSE metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlp.formats import BFPFormat, FloatFormat
from jlp.gemm.config import GemmQuant
from jlp.gemm.qdot import biw_zse_block, bwo_zse_block, qconv, qdot_general
from jlp.nn.rules import (BFPWidths, QuantRule, ZSEProbe, bfp_zse_metrics, get_widths,
                          quantize_model, set_widths)
from jlp.nn.controller import SimpleController
from jlp.nn.zse import zero_setting_error

DN = (((1,), (0,)), ((), ()))


def _dot_cfg(m):
  return GemmQuant(x=BFPFormat(m, (1, 8)), w=BFPFormat(m, (8, 1)),
                   dgrad_dy=BFPFormat(8, (1, 4)), dgrad_w=BFPFormat(8, (4, 1)),
                   wgrad_dy=BFPFormat(8, (4, 1)), wgrad_x=BFPFormat(8, (4, 1)))


def _conv_cfg(m, rounding="truncate"):
  return GemmQuant(x=BFPFormat(m, (1, 3, 3, 2), rounding), w=BFPFormat(m, (3, 3, 2, 1), rounding),
                   dgrad_dy=BFPFormat(8, (1, 3, 3, 2)), dgrad_w=BFPFormat(8, (3, 3, 2, 1)),
                   wgrad_dy=BFPFormat(8, (1, 3, 3, 2)), wgrad_x=BFPFormat(8, (1, 3, 3, 2)))


def _vjp_all(f, a, b, g):
  y, vjp = jax.vjp(f, a, b)
  return (y,) + vjp(g)


def _conv(cfg, **kw):
  return lambda a, b: qconv(a, b, (1, 1), "SAME", cfg, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                            **kw)


@pytest.mark.parametrize("op", ["dot", "conv"])
def test_traced_widths_match_static_bit_for_bit_and_compile_once(op):
  k = jax.random.split(jax.random.key(0), 4)
  if op == "dot":
    a, b = jax.random.normal(k[0], (8, 16)), jax.random.normal(k[1], (16, 4))
    g = jax.random.normal(k[2], (8, 4))
    make = lambda cfg, **kw: (lambda u, v: qdot_general(u, v, DN, cfg, **kw))
    cfg_of = _dot_cfg
  else:
    a, b = jax.random.normal(k[0], (2, 5, 5, 4)), jax.random.normal(k[1], (3, 3, 4, 3))
    g = jax.random.normal(k[2], (2, 5, 5, 3))
    make = _conv
    cfg_of = _conv_cfg
  traces = [0]

  @jax.jit
  def dynamic(a, b, g, m):
    traces[0] += 1
    return _vjp_all(make(cfg_of(8), widths={"x": m, "w": m}), a, b, g)

  widths = (4, 8, 16)
  # the static references of all widths in one jitted program: one compile instead of three
  wants = jax.jit(lambda a, b, g: [_vjp_all(make(cfg_of(m)), a, b, g) for m in widths])(a, b, g)
  for m, want in zip(widths, wants, strict=True):
    got = dynamic(a, b, g, jnp.int32(m))
    for name, u, v in zip(("y", "dlhs", "drhs"), got, want, strict=True):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=f"{op} m={m} {name}")
  assert traces[0] == 1
  # different widths really give different results
  y4, y16 = dynamic(a, b, g, jnp.int32(4))[0], dynamic(a, b, g, jnp.int32(16))[0]
  assert not np.array_equal(y4, y16)


def test_traced_widths_stochastic_role_matches_static():
  a = jax.random.normal(jax.random.key(1), (4, 8))
  b = jax.random.normal(jax.random.key(2), (8, 4))
  key = jax.random.key(7)
  cfg = GemmQuant(x=BFPFormat(8, (1, 8), "stochastic"), w=BFPFormat(8, (8, 1)))
  f = jax.jit(lambda a, b, m: qdot_general(a, b, DN, cfg, key=key, widths={"x": m}))
  want = jax.jit(lambda a, b: qdot_general(
      a, b, DN, cfg.replace(x=BFPFormat(4, (1, 8), "stochastic")), key=key))(a, b)
  np.testing.assert_array_equal(np.asarray(f(a, b, jnp.int32(4))), np.asarray(want))


def test_widths_errors():
  a, b = jnp.ones((4, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match="not a BFPFormat"):
    qdot_general(a, b, DN, _dot_cfg(8).replace(y=FloatFormat(4, 3)), widths={"y": jnp.int32(4)})
  with pytest.raises(ValueError, match="not a BFPFormat"):
    qdot_general(a, b, DN, _dot_cfg(8), widths={"y": jnp.int32(4)})
  with pytest.raises(ValueError, match="role 'bogus'"):
    qdot_general(a, b, DN, _dot_cfg(8), widths={"bogus": jnp.int32(4)})
  with pytest.raises(ValueError, match="int32 scalar"):
    qdot_general(a, b, DN, _dot_cfg(8), widths={"x": jnp.float32(4)})
  with pytest.raises(ValueError, match="zse_probe"):
    qdot_general(a, b, DN, GemmQuant(x=BFPFormat(8, (1, 8))), zse_probe=jnp.float32(0))


def test_zse_blocks_follow_bfpsim_layouts():
  cfg = _conv_cfg(8).replace(dgrad_w=BFPFormat(8, (3, 3, 1, 16)),
                             wgrad_dy=BFPFormat(8, (4, 3, 3, 1)))
  # BFPsim applies OIHW dims (16,1,3,3) to dx (N,C,H,W): NHWC (16,3,3,1)
  assert biw_zse_block(cfg, 4) == (16, 3, 3, 1)
  # BFPsim applies NCHW dims (4,1,3,3) to dW (O,I,H,W): HWIO (3,3,1,4)
  assert bwo_zse_block(cfg, 4) == (3, 3, 1, 4)
  assert biw_zse_block(cfg, 3) is None and bwo_zse_block(GemmQuant(), 4) is None


# ----------------------------------------------------------------------------- models


class Net(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 3, (3, 3), rngs=rngs)
    self.lin = nnx.Linear(3, 4, rngs=rngs)

  def __call__(self, x):
    return self.lin(jax.nn.relu(self.conv(x)).mean((1, 2)))


def _lin_cfg(m):
  return GemmQuant(x=BFPFormat(m, (1, 2)), w=BFPFormat(m, (2, 1)), dgrad_dy=BFPFormat(8, (1, 2)),
                   dgrad_w=BFPFormat(8, (2, 1)), wgrad_dy=BFPFormat(8, (2, 1)))


def _model(m):
  model = Net(nnx.Rngs(0))
  report = quantize_model(model, [QuantRule("conv", _conv_cfg(m)), QuantRule("lin", _lin_cfg(m))])
  return model, report


X = jax.random.normal(jax.random.key(5), (2, 5, 5, 2))
WRT = nnx.Any(nnx.Param, ZSEProbe)


def _loss(model, x):
  return jnp.sum(model(x) ** 2)


def _make_step(report, counter):

  @nnx.jit
  def step(model, x):
    counter[0] += 1
    loss, grads = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, WRT))(model, x)
    return loss, grads, bfp_zse_metrics(model, grads, report)

  return step


def test_set_widths_changes_the_model_without_recompiling():
  model, report = _model(8)
  assert isinstance(model.conv.conv_general_dilated.bfp_widths, BFPWidths)
  assert get_widths(model, report)["conv"] == {"x": 8, "w": 8, "dgrad_dy": 8, "dgrad_w": 8,
                                               "wgrad_dy": 8, "wgrad_x": 8}
  counter = [0]
  step = _make_step(report, counter)
  for m in (4, 16, 8):
    set_widths(model, report, {"conv": {"x": m, "w": m}, "lin": {"x": jnp.int32(m), "w": m}})
    assert get_widths(model, report)["lin"]["w"] == m
    loss, grads, _ = step(model, X)
    ref_model, ref_report = _model(m)
    ref_loss, ref_grads, _ = _make_step(ref_report, [0])(ref_model, X)
    assert np.array_equal(loss, ref_loss), m
    for p in ("conv", "lin"):
      np.testing.assert_array_equal(grads[p]["kernel"][...], ref_grads[p]["kernel"][...])
  assert counter[0] == 1


def test_set_widths_errors():
  model, report = _model(8)
  with pytest.raises(ValueError, match="not a quantized layer"):
    set_widths(model, report, {"nope": {"x": 4}})
  with pytest.raises(ValueError, match="BFPFormat"):
    set_widths(model, report, {"conv": {"y": 4}})
  with pytest.raises(ValueError):
    set_widths(model, report, {"conv": {"x": 30}})
  assert get_widths(model, report)["conv"]["x"] == 8


def test_bfp_zse_metrics_fw_bwo_biw():
  model, report = _model(8)
  step = _make_step(report, [0])
  # one jitted dL/dx for both widths (the widths are traced model state)
  input_grad = nnx.jit(lambda model, x: jax.grad(lambda x: _loss(model, x))(x))
  for m in (4, 8):
    set_widths(model, report, {"conv": {"w": m, "dgrad_w": m, "wgrad_dy": m},
                               "lin": {"w": m, "dgrad_w": m, "wgrad_dy": m}})
    _, grads, metrics = step(model, X)
    assert set(metrics) == {"conv", "lin"}
    assert set(metrics["conv"]) == {"fw", "bwo", "biw"}
    cfg = report["conv"]
    kernel = model.conv.kernel[...]
    assert metrics["conv"]["fw"] == zero_setting_error(kernel, BFPFormat(m, cfg.w.block))
    kgrad = grads["conv"]["kernel"][...]
    assert metrics["conv"]["bwo"] == zero_setting_error(kgrad, BFPFormat(m, (3, 3, 2, 1)))
    # biw of the first layer: ZSE of dL/dx, x the model input
    dx = input_grad(model, X)
    assert metrics["conv"]["biw"] == zero_setting_error(dx, BFPFormat(m, (1, 3, 3, 2)))
    assert 0.0 <= float(metrics["lin"]["biw"]) <= 1.0
  # fw only without grads; ZSE grows as the width shrinks
  set_widths(model, report, {"conv": {"w": 2}})
  small = bfp_zse_metrics(model, None, report)
  assert set(small["conv"]) == {"fw"}
  set_widths(model, report, {"conv": {"w": 16}})
  assert bfp_zse_metrics(model, None, report)["conv"]["fw"] <= small["conv"]["fw"]


def test_probe_is_not_a_param():
  model, _ = _model(8)
  params = nnx.state(model, nnx.Param)
  flat = [p for p, _ in nnx.to_flat_state(params)]
  assert all("zse_probe" not in p and "bfp_widths" not in p for p in flat)
  plain = Net(nnx.Rngs(0))
  assert len(flat) == len(list(nnx.to_flat_state(nnx.state(plain, nnx.Param))))


def test_controller_closes_the_loop_without_recompiling():
  """ZSE metrics of a jitted step -> SimpleController -> set_widths -> the same compiled step."""
  model, report = _model(8)
  counter = [0]
  step = _make_step(report, counter)
  # lo = hi = 2.0: every window's ZSE (<= 1) is below lo, so each window steps 8 -> 4, then stays.
  controller = SimpleController(2.0, 2.0, window=1, bits=get_widths(model, report))
  seen = []
  for _ in range(3):
    _, _, metrics = step(model, X)
    controller.update({p: {k: float(v) for k, v in m.items()} for p, m in metrics.items()})
    set_widths(model, report, controller.bits)
    seen.append(get_widths(model, report)["conv"])
  assert seen[0]["w"] == seen[0]["x"] == 4 and seen[0]["dgrad_w"] == seen[0]["dgrad_dy"] == 4
  assert seen[2] == seen[0]
  assert counter[0] == 1
