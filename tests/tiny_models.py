"""Tiny zoo models for tests: inputs, numpy-filled parameters and a classification loss.

Shared by tests/models/models_test.py and tests/nn/quantized_models_test.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jlp.models as zoo

BATCH = 2


def images(h: int, c: int = 3):
  return lambda key: jax.random.normal(key, (BATCH, h, h, c), jnp.float32)


def token_ids(t: int, vocab: int):
  return lambda key: jax.random.randint(key, (BATCH, t), 0, vocab)


def materialize(abstract, seed: int = 0):
  """Concrete model from an nnx.eval_shape one, filled with numpy random values.

  Real construction compiles every threefry draw of a new shape (about 1 s each on this CPU, so
  ~15 s for a width-4 ResNet18, jitted or not); the structure under test does not depend on the
  initializer, which models_test.test_real_init checks once. The same seed gives the same values.
  """
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)
  flat = []
  for i, (path, var) in enumerate(nnx.to_flat_state(state)):
    sds = var.get_value()
    if isinstance(var, nnx.RngKey):
      value = jax.random.key(i)
    elif isinstance(var, nnx.RngCount):
      value = jnp.zeros(sds.shape, sds.dtype)
    elif path[-1] in ("scale", "var"):
      value = np.ones(sds.shape, sds.dtype)
    elif path[-1] == "mean":
      value = np.zeros(sds.shape, sds.dtype)
    else:  # kernels, embeddings, biases
      fan_in = int(np.prod(sds.shape[:-1])) if len(sds.shape) > 1 else 16
      value = (rng.standard_normal(sds.shape) / np.sqrt(fan_in)).astype(sds.dtype)
    flat.append((path, var.replace(value=jnp.asarray(value))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def build(name: str, kwargs: dict, seed: int = 0):
  """A tiny `name` model with numpy-drawn parameters (see `materialize`)."""
  return materialize(
      nnx.eval_shape(lambda: zoo.get_model(name, rngs=nnx.Rngs(0, dropout=1), **kwargs)), seed)


def classification_loss(name: str, model, x):
  """Cross-entropy with fixed labels; FCN: per-pixel labels on main + 0.4 auxiliary head;
  BERT: the last two tokens padded."""
  ce = optax.softmax_cross_entropy_with_integer_labels
  if name == "fcn":
    out, aux = model(x, return_aux=True)
    labels = jnp.arange(out.shape[1] * out.shape[2]).reshape(1, out.shape[1], out.shape[2]) % 5
    labels = jnp.broadcast_to(labels, out.shape[:3])
    return ce(out, labels).mean() + 0.4 * ce(aux, labels).mean()
  if name == "bert_small":
    out = model(x, attention_mask=jnp.ones(x.shape, bool).at[:, -2:].set(False))
  else:
    out = model(x)
  labels = jnp.arange(out.shape[0]) % out.shape[-1]
  return ce(out, labels).mean()
