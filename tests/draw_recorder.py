"""A test compressor whose state keeps the last random number its encode drew, so that a test can
read which draws every (stage, pipeline, leaf, partition, rank, step) encode made."""

import dataclasses

import jax.numpy as jnp

import jlp.compression as jc


@dataclasses.dataclass(frozen=True)
class DrawRecorder(jc.Compressor):
  """Payload and state: one uniform draw from the encode's key; decodes to zeros."""
  layout = (jc.Scalars("draw"),)
  needs_key = True

  def init(self, x):
    return {"draw": jnp.zeros((1,), jnp.float32)}

  def compress(self, x, state, key):
    u = jc.ops.uniform(key, (1,))
    return {"draw": u}, {"draw": u}

  def decompress(self, fields, n):
    return jnp.zeros((n,), jnp.float32)
