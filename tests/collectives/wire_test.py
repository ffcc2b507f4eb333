"""jlp.collectives.wire and allreduce(wire="packed"): a format's codes on the wire.

References: ml_dtypes (the float32 value of every code of its float8 / float6 / float4 / bfloat16
/ float16 types), and allreduce(wire="float32") for the packed reduction's bits (each value that
crosses devices is a value of the format, so its code carries it exactly)."""

import functools
import os
import sys

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
import device_runs as dev  # noqa: E402
import references as ref  # noqa: E402
from jlp import FloatFormat  # noqa: E402
from jlp.collectives import allreduce  # noqa: E402
from jlp.collectives import wire  # noqa: E402
from jlp.numerics.float_cast import float_cast  # noqa: E402
from jlp.sync import GradSync  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")

TYPES = [("float8_e4m3fn", ml_dtypes.float8_e4m3fn), ("float8_e5m2", ml_dtypes.float8_e5m2),
         ("float8_e4m3", ml_dtypes.float8_e4m3), ("float8_e3m4", ml_dtypes.float8_e3m4),
         ("float6_e2m3fn", ml_dtypes.float6_e2m3fn), ("float4_e2m1fn", ml_dtypes.float4_e2m1fn),
         ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)]


# The codec as one program per format (called eagerly, each of ~30 operations compiles on its
# own, again for each new combination of code width and constants); the values are the same.
_decode = jax.jit(wire.decode, static_argnums=1)
_encode = jax.jit(wire.encode, static_argnums=1)
_pack_nibbles = jax.jit(wire.pack_nibbles)
_unpack_nibbles = jax.jit(wire.unpack_nibbles, static_argnums=1)


@functools.partial(jax.jit, static_argnums=1)
def _cast_and_round_trip(x, fmt):
  """(float_cast(x, fmt), its codes decoded) as one program per format."""
  q = float_cast(x, fmt)
  return q, wire.decode(wire.encode(q, fmt), fmt)


def _values_of_every_code(dtype, bits):
  codes = np.arange(2 ** bits, dtype=np.uint32)
  if bits == 16:
    return codes, codes.astype(np.uint16).view(dtype).astype(np.float32)
  return codes, np.array([np.frombuffer(np.uint8(c).tobytes(), dtype=dtype)[0]
                          for c in codes]).astype(np.float32)


@pytest.mark.parametrize("name, dtype", TYPES)
def test_every_code_decodes_to_ml_dtypes_value_and_back(name, dtype):
  fmt = FloatFormat.from_name(name)
  assert wire.packable(fmt) and wire.wire_dtype(fmt) == (jnp.uint8 if fmt.bits <= 8 else
                                                         jnp.uint16)
  codes, values = _values_of_every_code(dtype, fmt.bits)
  got = np.asarray(_decode(jnp.asarray(codes), fmt))
  nan = np.isnan(values)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(got.view(np.uint32)[~nan], values.view(np.uint32)[~nan])
  back = np.asarray(_encode(jnp.asarray(got), fmt)).astype(np.uint32)
  np.testing.assert_array_equal(back[~nan], codes[~nan])


@pytest.mark.parametrize("fmt", [FloatFormat(3, 2), FloatFormat(5, 10, subnormals=False),
                                 FloatFormat(6, 9), FloatFormat(8, 7, overflow="saturate"),
                                 FloatFormat(4, 3, specials="none")])
def test_casts_round_trip_through_their_codes(fmt):
  """Every float32 value a cast to fmt gives (normals, subnormals, zeros of both signs, inf)
  survives encode / decode bit for bit."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(20000) * 2.0 ** rng.integers(-40, 40, 20000)).astype(np.float32)
  x = np.concatenate([x, np.array([0.0, -0.0, np.inf, -np.inf], np.float32)])
  q, back = _cast_and_round_trip(jnp.asarray(x), fmt)
  ref.assert_same_bits(np.asarray(back), np.asarray(q))


# Slow tier: APS with mean on the ring (the default keeps APS on the ring with aps="cpd", and
# mean in the sequential case) and float16 (bfloat16 keeps a 16-bit code on the ring; float16's
# codes are test_every_code_decodes_to_ml_dtypes_value_and_back's).
@pytest.mark.parametrize("options", [
    dict(fmt="e4m3", algorithm="ring"),
    dict(fmt="e5m2", algorithm="ring", kahan=True),
    pytest.param(dict(fmt="e4m3", algorithm="ring", aps=True, mean=True),
                 marks=pytest.mark.slow),
    dict(fmt="bfloat16", algorithm="ring", kahan=True),
    pytest.param(dict(fmt="float16", algorithm="ring", mean=True), marks=pytest.mark.slow),
    dict(fmt="float8_e4m3fn", algorithm="ring", aps="cpd"),
    dict(fmt="e5m2", algorithm="sequential", aps=True),
    dict(fmt="e4m3", algorithm="sequential", aps=True, kahan=True, mean=True),
])
def test_packed_wire_gives_the_float32_wires_bits(options):
  nodes = dev.random_nodes(8, ((37,), (5, 3), (1,)), seed=3, scale_exp=(-12, 6))

  def body(*xs):  # both wires in one program (one compile instead of two)
    xs = [x[0] for x in xs]
    return tuple(o[None] for wire_ in ("packed", "float32")
                 for o in allreduce(xs, "r", wire=wire_, **options))
  outs = jax.jit(jax.shard_map(body, mesh=dev.mesh_of(8), in_specs=P("r"), out_specs=P("r")))(
      *dev.stack(nodes))
  packed, plain = outs[:3], outs[3:]
  for a, b in zip(packed, plain, strict=True):
    ref.assert_same_bits(np.asarray(a), np.asarray(b))


def _collective_dtypes(**options):
  mesh = dev.mesh_of(8)
  f = jax.shard_map(lambda x: allreduce(x, "r", **options), mesh=mesh, in_specs=P("r"),
                    out_specs=P("r"))
  jaxpr = jax.make_jaxpr(f)(jnp.zeros((8, 64), jnp.float32))
  found = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("ppermute", "all_gather"):
        found.update(str(v.aval.dtype) for v in eqn.invars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  return found


def test_the_wire_carries_one_byte_per_e4m3_value():
  assert _collective_dtypes(fmt="e4m3", algorithm="ring") == {"uint8"}
  assert _collective_dtypes(fmt="bfloat16", algorithm="ring") == {"uint16"}
  assert _collective_dtypes(fmt="e4m3", algorithm="ring", wire="float32") == {"float32"}
  # The sequential gather of raw gradients (no APS) carries float32.
  assert _collective_dtypes(fmt="e4m3", algorithm="sequential") == {"float32"}


def test_wire_bytes_count_the_codes():
  sizes, w = [1000, 37], 8
  chunks = sum(-(-n // w) for n in sizes)
  assert GradSync(fmt="e4m3", algorithm="ring").allreduce_wire_bytes(sizes, w) == \
      1 * (w - 1) * chunks * 2
  assert GradSync(fmt="bfloat16", algorithm="ring", kahan=True).allreduce_wire_bytes(sizes, w) \
      == 2 * (w - 1) * chunks * 3
  assert GradSync(fmt="e4m3", algorithm="ring", wire="float32").allreduce_wire_bytes(sizes, w) \
      == 4 * (w - 1) * chunks * 2
  assert GradSync(fmt="e5m2", aps=True).allreduce_wire_bytes(sizes, w) == (w - 1) * sum(sizes)
  assert GradSync(fmt="e5m2").allreduce_wire_bytes(sizes, w) == 4 * (w - 1) * sum(sizes)


@pytest.mark.parametrize("options, message", [
    (dict(fmt="e4m3", wire="packed"), r"wire='packed' is not allowed"),
    (dict(fmt=None, algorithm="ring", wire="packed"), r"wire='packed' is not allowed"),
    (dict(fmt="e4m3", algorithm="ring", wire="f8"), r"wire='f8' is not allowed; expected None"),
    (dict(fmt=FloatFormat(5, 2, compat="cpd"), algorithm="ring", wire="packed"),
     r"wire='packed' is not allowed"),
])
def test_impossible_wires_are_rejected(options, message):
  with pytest.raises(ValueError, match=message):
    GradSync(**options)


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
def test_nibbles_carry_two_codes_to_a_byte(n):
  codes = np.random.default_rng(n).integers(0, 16, size=n).astype(np.uint8)
  packed = np.asarray(_pack_nibbles(jnp.asarray(codes)))
  assert packed.shape == (-(-n // 2),) and packed.dtype == np.uint8
  # Written out: code 2i in the low half of byte i, code 2i + 1 in the high half.
  want = [int(codes[2 * i]) | (int(codes[2 * i + 1]) << 4 if 2 * i + 1 < n else 0)
          for i in range(-(-n // 2))]
  np.testing.assert_array_equal(packed, want)
  np.testing.assert_array_equal(np.asarray(_unpack_nibbles(jnp.asarray(packed), n)), codes)
  two = np.stack([packed, packed[::-1]])  # leading axes kept (an all_gather's)
  np.testing.assert_array_equal(np.asarray(_unpack_nibbles(jnp.asarray(two), n))[0], codes)
  assert wire.vector_bytes(FloatFormat.from_name("e2m1"), n) == -(-n // 2)
  assert wire.vector_bytes(FloatFormat.from_name("e4m3"), n) == n
