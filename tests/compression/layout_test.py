"""jlp.compression.layout and the registry of jlp.compression.base: declared layouts, wire
sizes, from_bytes checks, registration rules. References: byte strings and sizes worked out by
hand from the layout definitions (layout.py docstring, hipress.md §1)."""

from __future__ import annotations

import dataclasses
import struct
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest

from jlp import compression
from jlp.compression import layout
from jlp.compression.base import Compressor, register
from jlp.compression.layout import Header, Packed, Scalars, Sparse


@dataclasses.dataclass(frozen=True)
class Toy(Compressor):
  """A layout with every field kind: uint8 header n mod 7, two float32 scalars, 4-bit codes
  (pad 9), and nothing sparse (Sparse is covered by TinySparse)."""
  layout = (Header("n_mod_7", "uint8", lambda c, n: n % 7), Scalars("lohi", 2),
            Packed("codes", bits=4, pad=9))

  def compress(self, x, state, key):
    codes = jnp.clip(jnp.round(x), 0, 15).astype(jnp.uint8)
    return {"lohi": jnp.stack([x.min(), x.max()]), "codes": codes}, state

  def decompress(self, fields, n):
    return fields["codes"].astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class TinySparse(Compressor):
  """Keeps the entries > 0, at most 3."""
  layout = (Sparse(capacity=lambda c, n: min(n, 3)),)

  def compress(self, x, state, key):
    from jlp.compression import ops  # pylint: disable=g-import-not-at-top
    idx, count = ops.capacity_filter(x > 0, min(x.shape[0], 3))
    return {"count": count, "indices": idx,
            "values": jnp.take(x, idx, mode="fill", fill_value=0)}, state


def test_toy_layout_bytes_sizes_and_round_trip():
  c = Toy()
  x = jnp.asarray([1, 2, 3, 15, 0, 7, 4, 5, 6.0], jnp.float32)  # n = 9: header 2, 5 bytes
  payload, _ = c.encode(x)
  want = bytes([2]) + struct.pack("<ff", 0.0, 15.0) + bytes([0x21, 0xF3, 0x70, 0x54, 0x96])
  assert c.to_bytes(payload).tobytes() == want
  assert c.wire_bytes(9) == len(want) == 1 + 8 + 5
  assert {k: v.shape for k, v in c.payload_spec(9).items()} == {
      "n_mod_7": (1,), "lohi": (2,), "codes": (5,)}
  back = c.from_bytes(want, 9)
  np.testing.assert_array_equal(c.decode(back, 9), x)
  with pytest.raises(ValueError, match=r"Toy.from_bytes: header n_mod_7=2 is not allowed for "
                                       r"n=10; expected 3"):
    c.from_bytes(want[:-1] + bytes([0x96, 0x99]), 10)
  with pytest.raises(ValueError, match="Toy.from_bytes: 13 bytes is too short for n=9"):
    c.from_bytes(want[:-1], 9)
  with pytest.raises(ValueError, match="Toy.from_bytes: 15 bytes is not allowed for n=9; "
                                       "expected 14"):
    c.from_bytes(want + b"\0", 9)


def test_sparse_layout_wire_and_checks():
  c = TinySparse()
  payload, _ = c.encode(jnp.asarray([0, -1, 2.5, 0, 4, 1, 3], jnp.float32))
  assert int(payload["count"]) == 3
  data = c.to_bytes(payload).tobytes()
  assert data == struct.pack("<i3i3f", 28, 2, 4, 5, 2.5, 4.0, 1.0)
  assert c.wire_bytes(7) == 28 and c.wire_bytes(2) == 4 + 16
  payload, _ = c.encode(jnp.asarray([0, -1.0, 5.0], jnp.float32))
  assert c.to_bytes(payload).tobytes() == struct.pack("<iif", 12, 2, 5.0)
  back = c.from_bytes(struct.pack("<iif", 12, 2, 5.0), 3)
  np.testing.assert_array_equal(back["indices"], [2, 3, 3])  # unused slots hold n
  np.testing.assert_array_equal(back["values"], [5, 0, 0])
  np.testing.assert_array_equal(c.decode(back, 3), [0, 0, 5])
  np.testing.assert_array_equal(c.decode_add(back, jnp.ones(3)), [1, 1, 6])
  for data, match in ((struct.pack("<i", 13), "sparse header M=13"),
                      (struct.pack("<i4i4f", 36, 0, 1, 2, 3, 1, 1, 1, 1), "sparse header M=36"),
                      (struct.pack("<iif", 12, -1, 5.0), "sparse index -1"),
                      (struct.pack("<iif", 12, 3, 5.0), "sparse index 3"),
                      (struct.pack("<iif", 12, 0, 5.0) + b"\0", "expected 12")):
    with pytest.raises(ValueError, match=match):
      c.from_bytes(data, 3)


def test_layout_fields_are_validated():
  with pytest.raises(ValueError, match="Header.dtype='float64' is not allowed"):
    Header("h", "float64", lambda c, n: 0)
  with pytest.raises(ValueError, match="Scalars.count=0 is not allowed"):
    Scalars("s", 0)
  with pytest.raises(ValueError, match="Packed.bits=3 is not allowed"):
    Packed("p", 3)
  with pytest.raises(ValueError, match="Packed.pad=4 is not allowed"):
    Packed("p", 2, pad=4)
  with pytest.raises(ValueError, match="names \\['a'\\] twice"):
    layout.check_layout((Scalars("a"), Packed("a", 1)), "X")
  with pytest.raises(ValueError, match="names \\['count'\\] twice"):
    layout.check_layout((Scalars("count"), Sparse(lambda c, n: 1)), "X")
  with pytest.raises(ValueError, match="X.layout=\\(\\) is not allowed"):
    layout.check_layout((), "X")


def test_register_rules():
  with pytest.raises(ValueError, match="'tbq' is already registered to TBQ"):
    register("tbq")(Toy)
  with pytest.raises(TypeError, match="needs a Compressor subclass"):
    register("not_a_compressor")(int)

  class NotADataclass(Compressor):  # inherits the base's dataclass machinery, not its own
    layout = (Scalars("s"),)

  with pytest.raises(TypeError, match="must be a frozen dataclass"):
    register("mutable_test")(NotADataclass)

  @dataclasses.dataclass(frozen=True)
  class BadProperty(Compressor):
    bits: int = 3

    @property
    def layout(self):
      return (Packed("p", self.bits),)

  with pytest.raises(ValueError, match="Packed.bits=3"):  # checked on the default instance
    register("bad_property_test")(BadProperty)
  assert "mutable_test" not in compression.COMPRESSORS
  assert "bad_property_test" not in compression.COMPRESSORS


def test_sizes_on_decimal_values():
  assert [layout.packed_size(n, b) for n, b in ((0, 1), (1, 1), (9, 1), (5, 2), (3, 4), (3, 8))] == [
      0, 1, 2, 2, 2, 3]
  assert layout.decimal(0.999) == Fraction(999, 1000)
  assert layout.fraction_count(1000, 1 - layout.decimal(0.999)) == 1
  assert layout.fraction_count(1000, 0.001) == 1 and layout.fraction_count(1001, 0.001) == 2
  assert layout.fraction_count(10, 1e-9) == 1  # at least one
