"""jlp.pipeline.stages: zoo models cut into pipeline stages (sdpipe.md §0, §1).

Reference: the unsplit model itself (jlp.models, independent of the stage rules), run in train
mode: `model(x)` for the logits, the model's own variables after that call for the new BatchNorm
running stats and RNG counters (read with nnx.to_flat_state, not with StageSplit.merge), and
`jax.grad` of a cross-entropy of `model(x)` for the gradients. The stages are composed by hand
(stage_s(params_s, y_{s-1}, state_s) in order; the gradients by chaining jax.vjp of each stage
backwards). Run eagerly, composition and model execute the same ops on the same values, so the
logits and states must agree bit for bit; gradients (the chained vjps and the model's jax.grad
computed in one jitted program) are checked to float32 rounding. Jitted stages are checked to
float32 rounding (XLA fuses across the stage boundaries differently).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jlp.models as zoo
from jlp.formats import BFPFormat, FloatFormat
from jlp.gemm.config import GemmQuant
from jlp.nn import QuantRule, quantize_model
from jlp.pipeline.stages import STAGE_RULES, split_model
from tiny_models import build

pytestmark = pytest.mark.usefixtures("fast_compile")

SMALL_CNN = dict(width=4)
MLP = dict(hidden=(8, 6, 4))
RESNET18 = dict(num_classes=10, width=4)
RESNET50 = dict(num_classes=10, width=2)
VGG19 = dict(num_classes=10, width=2)
BERT = dict(vocab=20, max_len=8, hidden=8, num_layers=4, heads=2, mlp_dim=16, num_classes=3,
            pad_id=0)


# Inputs drawn with numpy: an eager jax.random draw compiles its threefry program for every new
# shape, and no property here depends on how the inputs were drawn.
def _images(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _token_ids(seed=0):
  ids = np.random.default_rng(seed).integers(1, BERT["vocab"], (2, 8), np.int32)
  ids[:, -2:] = BERT["pad_id"]  # two padded tokens, masked through pad_id
  return jnp.asarray(ids)


def _plain(value):
  value = value.get_value() if isinstance(value, nnx.Variable) else value
  if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(value))
  return np.asarray(value)


def _variables(model, wanted):
  """{"<path>/<variable>": numpy array} of the model's variables of type `wanted`."""
  state = nnx.state(model, wanted)
  return {"/".join(map(str, p)): _plain(v) for p, v in nnx.to_flat_state(state)}


def _compose(split, x):
  """Logits and the union of the stages' new states, stage by stage."""
  new_state = {}
  for stage, params, state in zip(split.stages, split.params, split.state, strict=True):
    x, state = stage(params, x, state)
    new_state.update(state)
  return x, new_state


def _assert_same(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(_plain(got[k]), want[k], err_msg=k)


CASES = {
    "small_cnn-S2": ("small_cnn", SMALL_CNN, lambda: _images((4, 8, 8, 1)), 2, (2, 3)),
    "small_cnn-S4": ("small_cnn", SMALL_CNN, lambda: _images((4, 8, 8, 1)), 4, (2, 1, 1, 1)),
    # 2 images: test_chained_stage_vjps_are_the_model_gradient's ResNet input (eager ops compiled
    # once for both)
    "resnet18-S4": ("resnet18", RESNET18, lambda: _images((2, 8, 8, 3)), 4, (3, 2, 2, 3)),
    "resnet50-S4": ("resnet50", RESNET50, lambda: _images((2, 16, 16, 3)), 4, (5, 4, 4, 5)),
    "vgg19-S4": ("vgg19", VGG19, lambda: _images((2, 32, 32, 3)), 4, (4, 4, 4, 5)),
    "bert_small-S2": ("bert_small", BERT, _token_ids, 2, (3, 3)),
    "bert_small-S4": ("bert_small", BERT, _token_ids, 4, (2, 1, 1, 2)),
    "mlp-S2": ("mlp", MLP, lambda: _images((4, 8, 8, 1)), 2, (2, 2)),
    "mlp-S4": ("mlp", MLP, lambda: _images((4, 8, 8, 1)), 4, (1, 1, 1, 1)),
}


# resnet50-S4 in the slow tier: resnet18-S4 takes the same ResNet rule (units, default split,
# BatchNorm stats); the bottleneck blocks are jlp.models' (tests/models).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "resnet50-S4"
                                  else c for c in CASES])
def test_composed_stages_are_the_train_mode_forward(case):
  """Default boundaries; logits and new state (BatchNorm stats, dropout RNG counters) equal the
  unsplit model's, bit for bit (eager)."""
  name, kwargs, make_x, num_stages, boundaries = CASES[case]
  model = build(name, kwargs)
  model.train()
  split = split_model(model, num_stages)
  assert split.boundaries == boundaries
  assert sum(split.param_counts) == sum(
      int(np.prod(v.shape)) for v in _variables(model, nnx.Param).values())
  x = make_x()
  logits, new_state = _compose(split, x)
  reference = model(x)  # advances the model's own BatchNorm stats and RNG counters
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(reference))
  _assert_same(new_state, _variables(model, nnx.Not(nnx.Param)))
  if name in ("small_cnn", "resnet18"):
    before, after = _variables(build(name, kwargs), nnx.BatchStat), _variables(model, nnx.BatchStat)
    assert any(not np.array_equal(before[k], after[k]) for k in after)  # the stats did move
  if name == "bert_small":
    assert any(k.endswith("rngs/count") and v == 1 for k, v in new_state.items())


def test_bert_stage0_takes_a_dict_with_an_attention_mask():
  """{"input_ids", "token_type_ids", "attention_mask"} as stage 0's input = the model called with
  those keyword arguments."""
  kwargs = dict(BERT, pad_id=None)
  model = build("bert_small", kwargs, seed=1)
  split = split_model(model, 2)
  ids = _token_ids(3)
  batch = {"input_ids": ids, "token_type_ids": (jnp.arange(8)[None] >= 4).astype(jnp.int32)
           * jnp.ones_like(ids), "attention_mask": jnp.ones(ids.shape, bool).at[:, -3:].set(False)}
  logits, new_state = _compose(split, batch)
  reference = model(ids, batch["token_type_ids"], batch["attention_mask"])
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(reference))
  _assert_same(new_state, _variables(model, nnx.Not(nnx.Param)))
  with pytest.raises(ValueError, match="input keys"):
    split.stages[0](split.params[0], {"tokens": ids}, split.state[0])


def test_bert_base_default_is_the_seed_partition():
  """12 layers at S=4 -> layers [2, 4, 4, 2] (train_bert.py), embeddings and head at the ends."""
  model = build("bert_small", dict(BERT, num_layers=12))
  split = split_model(model, 4)
  assert split.boundaries == (3, 4, 4, 3)
  assert split.stage_units[0] == ("embeddings", "layers/0", "layers/1")
  assert split.stage_units[3] == ("layers/10", "layers/11", "head")
  assert split.stage_modules[3] == ("layers/10", "layers/11", "pooler", "dropout", "classifier")


@pytest.mark.parametrize("name,kwargs,make_x,num_stages", [
    ("small_cnn", SMALL_CNN, lambda: _images((4, 8, 8, 1)), 4),
    ("bert_small", BERT, _token_ids, 2),
])
def test_merge_round_trips_the_model(name, kwargs, make_x, num_stages):
  """merge(initial params, state) and merge(params, new state) give the model's eval forward;
  the split copies the model (an eval-mode model stays in eval mode, the stages train)."""
  model = build(name, kwargs)
  model.eval()
  split = split_model(model, num_stages)
  x = make_x()
  assert all(m.use_running_average for _, m in nnx.iter_modules(model)
             if isinstance(m, nnx.BatchNorm))
  assert all(m.deterministic for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Dropout))
  merged = split.merge(split.params, split.state)
  merged.eval()
  np.testing.assert_array_equal(np.asarray(merged(x)), np.asarray(model(x)))
  _, new_state = _compose(split, x)
  model.train()
  model(x)  # the reference's own train-mode step
  model.eval()
  merged = split.merge(split.params, [{k: new_state[k] for k in s} for s in split.state])
  merged.eval()
  np.testing.assert_array_equal(np.asarray(merged(x)), np.asarray(model(x)))
  _assert_same(_variables(merged, ...), _variables(model, ...))
  with pytest.raises(ValueError, match="params with 1 stages"):
    split.merge(split.params[:1], split.state)


# Round to nearest in the slow tier: the stochastic case carries the same quantized layers into the
# stages (plus their RNG streams in the stage state); nearest rounding itself is jlp.formats'.
# Quantized weights in split stages (against the unsplit model, where a wrong rounding is whole
# e4m3 steps off): executor_test's test_quantized_zoo_model_trains_in_a_pipeline (default cases).
@pytest.mark.parametrize("stochastic", [pytest.param(False, marks=pytest.mark.slow), True])
def test_quantized_small_cnn_keeps_its_quantization(stochastic):
  """e4m3 on every layer: x and w rounded to nearest; x with stochastic rounding (the per-layer
  RNG streams live in the stage state and advance as in the model)."""
  fmt = FloatFormat.from_name("e4m3", rounding="stochastic" if stochastic else "nearest")
  model = build("small_cnn", SMALL_CNN)
  # Stochastic: x alone (a draw per layer input; stochastic weights under split_model are
  # executor_test's test_quantized_zoo_model_trains_in_a_pipeline[gpipe-e4m3_stochastic]'s).
  cfg = GemmQuant(x=fmt) if stochastic else GemmQuant(x=fmt, w=fmt)
  quantize_model(model, [QuantRule(".*", cfg)], rngs=nnx.Rngs(quant=7))
  split = split_model(model, 4)
  x = _images((4, 8, 8, 1), seed=2)
  logits, new_state = _compose(split, x)
  reference = model(x)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(reference))
  _assert_same(new_state, _variables(model, nnx.Not(nnx.Param)))
  float_model = build("small_cnn", SMALL_CNN)
  assert not np.array_equal(np.asarray(logits), np.asarray(float_model(x)))  # it did quantize
  if stochastic:
    counts = {k: v for k, v in new_state.items() if k.endswith("rng/count")}
    assert len(counts) == 3 and all(v == 1 for v in counts.values())


def _loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _stage_gradients(split, x, labels):
  """jax.vjp through every stage, chained backwards from d loss / d logits."""
  pullbacks = []
  for s, (stage, params, state) in enumerate(zip(split.stages, split.params, split.state, strict=True)):
    if s == 0:  # stage 0's input is data (int token ids for BERT): no cotangent for it
      x, pullback, _ = jax.vjp(lambda p, x=x, st=stage, v=state: st(p, x, v), params, has_aux=True)
      pullbacks.append(lambda ct, f=pullback: (f(ct)[0], None))
    else:
      x, pullback, _ = jax.vjp(lambda p, y, st=stage, v=state: st(p, y, v), params, x,
                               has_aux=True)
      pullbacks.append(pullback)
  ct = jax.grad(_loss)(x, labels)
  grads = {}
  for pullback in reversed(pullbacks):
    stage_grads, ct = pullback(ct)
    grads.update(stage_grads)
  return grads


def _model_gradients(model, x, labels):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    return _loss(nnx.merge(graphdef, p, rest, copy=True)(x), labels)

  grads = jax.grad(loss)(params)
  return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(grads)}


FI = BFPFormat(2, (1, 2, 2, 4))  # a BFP x role on NHWC boxes of 2x2 pixels x 4 channels


# small_cnn-S4 in the slow tier: resnet18-inplace-fi chains the vjps of 4 conv / BatchNorm stages
# (and bert_small-S2 of a transformer's); SmallCNN's stage forwards are
# test_composed_stages_are_the_train_mode_forward's, bit for bit.
@pytest.mark.parametrize("case", [pytest.param("small_cnn-S4", marks=pytest.mark.slow),
                                  "bert_small-S2", "resnet18-inplace-fi"])
def test_chained_stage_vjps_are_the_model_gradient(case):
  """Gradients w.r.t. every parameter; BERT with dropout active and padding masked; a ResNet18
  with BFPsim's in-place fi on the first conv after two stage boundaries (stem | layer1/0 and
  layer2/0 | layer2/1, boundaries (1, 3, 3, 3)), whose input quantization and ReLU-mask gradient
  then run in the consuming stage."""
  boundaries = None
  if case == "small_cnn-S4":
    model, x, num_stages = build("small_cnn", SMALL_CNN), _images((4, 8, 8, 1)), 4
  elif case == "bert_small-S2":
    model, x, num_stages = build("bert_small", BERT), _token_ids(), 2
  else:
    model, x, num_stages = build("resnet18", RESNET18), _images((2, 8, 8, 3)), 4
    quantize_model(model, [QuantRule("layer1/0/conv1|layer2/1/conv1", GemmQuant(x=FI))],
                   bfpsim_inplace_fi=True)
    boundaries = (1, 3, 3, 3)
  model.train()
  split = split_model(model, num_stages, boundaries=boundaries)
  labels = jnp.arange(x.shape[0]) % 3
  float_model = build("resnet18", RESNET18) if case == "resnet18-inplace-fi" else None

  # The chained stage vjps and the model's jax.grad (its own variables, independent of the stage
  # rules) in one jitted program: one compile instead of one per eager op. Both are checked to
  # float32 rounding anyway.
  @jax.jit
  def both(x, labels):
    got = _stage_gradients(split, x, labels)
    want = _model_gradients(model, x, labels)
    if float_model is None:
      return got, want, None, None
    logits, _ = _compose(split, x)
    return got, want, logits, nnx.merge(*nnx.split(float_model), copy=True)(x)

  got, want, logits, float_logits = both(x, labels)
  want = {k: np.asarray(v) for k, v in want.items()}
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-7, err_msg=k)
  if float_model is not None:  # the split model's forward is the in-place fi one
    assert not np.array_equal(np.asarray(logits), np.asarray(float_logits))


def test_jitted_stages_match_to_float32_rounding():
  """jax.jit of each stage, composed, against nnx.jit of the model (fusions differ)."""
  model = build("small_cnn", SMALL_CNN)
  split = split_model(model, 4)
  x = _images((4, 8, 8, 1))
  y, new_state = x, {}
  for stage, params, state in zip(split.stages, split.params, split.state, strict=True):
    y, state = jax.jit(stage)(params, y, state)
    new_state.update(state)
  reference = nnx.jit(lambda m, v: m(v))(model, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=1e-5, atol=1e-6)
  want = _variables(model, nnx.Not(nnx.Param))
  for k in want:
    np.testing.assert_allclose(np.asarray(new_state[k]), want[k], rtol=1e-5, atol=1e-6)


def test_stage_values_are_plain_arrays():
  """params float32; state: plain arrays (uint32 key data for the dropout streams)."""
  split = split_model(build("bert_small", BERT), 2)
  for params, state in zip(split.params, split.state):
    assert all(v.dtype == jnp.float32 for v in params.values())
    assert all(isinstance(v, jax.Array) and not jnp.issubdtype(v.dtype, jax.dtypes.prng_key)
               for v in state.values())
  assert split.state[0]["embeddings/dropout/rngs/key"].dtype == jnp.uint32


@pytest.mark.parametrize("boundaries,match", [
    ((2, 2), r"boundaries=\(2, 2\) is not allowed; expected 2 integers >= 1 summing to the 5"),
    ((5, 0), r"boundaries=\(5, 0\) is not allowed"),
    ((1, 1, 3), r"boundaries=\(1, 1, 3\) is not allowed"),
    ((2.0, 3), r"boundaries=\(2.0, 3\) is not allowed"),
    ("23", r"boundaries='23' is not allowed"),
])
def test_bad_boundaries(boundaries, match):
  with pytest.raises(ValueError, match=match):
    split_model(build("small_cnn", SMALL_CNN), 2, boundaries=boundaries)


@pytest.mark.parametrize("num_stages", [0, 6, True, 2.0])
def test_bad_num_stages(num_stages):
  with pytest.raises(ValueError, match=r"num_stages=.* is not allowed; expected an integer from "
                     r"1 to 5 \(the units of SmallCNN: conv1, bn1, conv2, bn2, head\)"):
    split_model(build("small_cnn", SMALL_CNN), num_stages)


def test_unsupported_model():
  model = nnx.eval_shape(lambda: zoo.davidnet(width=4, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"model=DavidNet is not allowed; expected one of the "
                     r"supported models: ResNet \(resnet18, resnet50\), Bert"):
    split_model(model, 2)
  assert sorted(STAGE_RULES) == ["Bert", "MLP", "ResNet", "SmallCNN", "VGG"]
