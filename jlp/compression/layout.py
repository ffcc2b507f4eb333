"""Payload layouts: how a compressor's fields are packed in jit and laid out on HiPress's wire.

A compressor declares its payload as a tuple of fields (`Compressor.layout`); everything that
follows from the layout comes with it: bit packing of sub-byte codes (LSB-first, ragged tails),
the fixed-shape in-jit payload (a dict of arrays that jit, shard_map and collectives carry as
they are), the wire bytes (`to_bytes` / `from_bytes`, little-endian, fields in layout order) and
the wire size.

  Header(name, dtype, value)   a constant of the wire format that follows from the compressor and
                               n (e.g. TernGrad's bit width and tail count), value(compressor, n):
                               filled in by encode, carried as dtype[1], checked by from_bytes.
  Scalars(name, count, dtype)  `count` values (float32 or int32) carried as dtype[count].
  Packed(name, bits, pad)      one b-bit code per element (b in 1, 2, 4, 8), carried packed as
                               uint8[ceil(n*b/8)]: element i at bit offset b*(i mod 8/b) of byte
                               i // (8/b); unused slots of the last byte hold code `pad`.
  Sparse(capacity)             at most k = capacity(compressor, n) (index, value) pairs, carried as
                               count int32[], indices int32[k] (unused: n), values float32[k]
                               (unused: 0); on the wire (HiPress's DGC / GradDrop format) int32 M =
                               4 + 8*count, int32 indices[count], float32 values[count].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jlp.numerics.packing import BITS, packed_size

__all__ = ["BITS", "Header", "Packed", "Scalars", "Sparse", "decimal", "fraction_count",
           "packed_size"]

_DTYPES = ("float32", "int32", "uint8")


@dataclasses.dataclass(frozen=True)
class Header:
  """A wire constant value(compressor, n), carried in the payload as dtype[1]."""
  name: str
  dtype: str
  value: Callable[[Any, int], int | float]

  def __post_init__(self):
    if self.dtype not in _DTYPES:
      raise ValueError(f"Header.dtype={self.dtype!r} is not allowed; expected one of {_DTYPES}.")


@dataclasses.dataclass(frozen=True)
class Scalars:
  """`count` values of `dtype` carried in the payload as dtype[count]."""
  name: str
  count: int = 1
  dtype: str = "float32"

  def __post_init__(self):
    if self.dtype not in _DTYPES:
      raise ValueError(f"Scalars.dtype={self.dtype!r} is not allowed; expected one of {_DTYPES}.")
    if not isinstance(self.count, int) or self.count < 1:
      raise ValueError(f"Scalars.count={self.count!r} is not allowed; expected an int >= 1.")


@dataclasses.dataclass(frozen=True)
class Packed:
  """One `bits`-bit code per element, packed LSB-first; tail slots hold `pad`."""
  name: str
  bits: int
  pad: int = 0

  def __post_init__(self):
    if self.bits not in BITS:
      raise ValueError(f"Packed.bits={self.bits!r} is not allowed; expected one of {BITS}.")
    if not 0 <= self.pad < (1 << self.bits):
      raise ValueError(f"Packed.pad={self.pad!r} is not allowed; expected a {self.bits}-bit code.")


@dataclasses.dataclass(frozen=True)
class Sparse:
  """Up to capacity(compressor, n) (index, value) pairs plus their count (see module docstring)."""
  capacity: Callable[[Any, int], int]
  name: str = "sparse"


Field = Header | Scalars | Packed | Sparse


def check_layout(layout: tuple[Field, ...], owner: str) -> None:
  if not isinstance(layout, tuple) or not layout:
    raise ValueError(f"{owner}.layout={layout!r} is not allowed; expected a non-empty tuple of "
                     "Header / Scalars / Packed / Sparse fields.")
  names = set()
  for f in layout:
    if not isinstance(f, (Header, Scalars, Packed, Sparse)):
      raise ValueError(f"{owner}.layout field {f!r} is not allowed; expected Header, Scalars, "
                       "Packed or Sparse.")
    if isinstance(f, Sparse):
      new = {"count", "indices", "values"}
    else:
      new = {f.name}
    if names & new:
      raise ValueError(f"{owner}.layout names {sorted(names & new)} twice.")
    names |= new


def payload_spec(layout: tuple[Field, ...], compressor: Any, n: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes and dtypes of the in-jit payload of n elements."""
  out = {}
  for f in layout:
    if isinstance(f, Header):
      out[f.name] = jax.ShapeDtypeStruct((1,), jnp.dtype(f.dtype))
    elif isinstance(f, Scalars):
      out[f.name] = jax.ShapeDtypeStruct((f.count,), jnp.dtype(f.dtype))
    elif isinstance(f, Packed):
      out[f.name] = jax.ShapeDtypeStruct((packed_size(n, f.bits),), jnp.uint8)
    elif isinstance(f, Sparse):
      k = int(f.capacity(compressor, n))
      out["count"] = jax.ShapeDtypeStruct((), jnp.int32)
      out["indices"] = jax.ShapeDtypeStruct((k,), jnp.int32)
      out["values"] = jax.ShapeDtypeStruct((k,), jnp.float32)
  return out


def wire_size(layout: tuple[Field, ...], compressor: Any, n: int) -> int:
  """Bytes on the wire for n elements (sparse fields at capacity)."""
  size = 0
  for f in layout:
    if isinstance(f, Header):
      size += np.dtype(f.dtype).itemsize
    elif isinstance(f, Scalars):
      size += np.dtype(f.dtype).itemsize * f.count
    elif isinstance(f, Packed):
      size += packed_size(n, f.bits)
    else:
      size += 4 + 8 * int(f.capacity(compressor, n))
  return size


def to_bytes(layout: tuple[Field, ...], payload: dict[str, Any]) -> np.ndarray:
  """The wire bytes (uint8, little-endian, fields in layout order) of one payload."""
  parts = []
  for f in layout:
    if isinstance(f, Header):
      parts.append(np.asarray(payload[f.name], np.dtype(f.dtype).newbyteorder("<")).reshape(-1))
    elif isinstance(f, Scalars):
      parts.append(np.asarray(payload[f.name], np.dtype(f.dtype).newbyteorder("<")).reshape(-1))
    elif isinstance(f, Packed):
      parts.append(np.asarray(payload[f.name], np.uint8).reshape(-1))
    else:
      count = int(np.asarray(payload["count"]))
      parts.append(np.asarray([4 + 8 * count], "<i4"))
      parts.append(np.asarray(payload["indices"], "<i4")[:count])
      parts.append(np.asarray(payload["values"], "<f4")[:count])
  return np.concatenate([p.view(np.uint8).reshape(-1) for p in parts])


def from_bytes(layout: tuple[Field, ...], compressor: Any, data: Any, n: int) -> dict[str, Any]:
  """The payload (numpy arrays of the in-jit shapes) of wire bytes (bytes or a uint8 array);
  ValueError on a mismatch."""
  if isinstance(data, (bytes, bytearray, memoryview)):
    data = np.frombuffer(data, np.uint8)
  data = np.asarray(data, np.uint8).reshape(-1)
  name = type(compressor).__name__
  out: dict[str, Any] = {}
  pos = 0

  def take(count: int, dtype: str) -> np.ndarray:
    nonlocal pos
    size = count * np.dtype(dtype).itemsize
    if pos + size > data.size:
      raise ValueError(f"{name}.from_bytes: {data.size} bytes is too short for n={n}; "
                       f"expected at least {pos + size}.")
    chunk = data[pos:pos + size].view(np.dtype(dtype).newbyteorder("<")).astype(dtype)
    pos += size
    return chunk

  for f in layout:
    if isinstance(f, Header):
      got = take(1, f.dtype)[0].item()
      want = f.value(compressor, n)
      if got != want:
        raise ValueError(f"{name}.from_bytes: header {f.name}={got!r} is not allowed for n={n}; "
                         f"expected {want!r}.")
      out[f.name] = np.asarray([got], f.dtype)
    elif isinstance(f, Scalars):
      out[f.name] = take(f.count, f.dtype)
    elif isinstance(f, Packed):
      out[f.name] = take(packed_size(n, f.bits), "uint8")
    else:
      k = int(f.capacity(compressor, n))
      total = int(take(1, "int32")[0])
      count, rest = divmod(total - 4, 8)
      if rest or not 0 <= count <= k:
        raise ValueError(f"{name}.from_bytes: sparse header M={total} is not allowed for n={n}; "
                         f"expected 4 + 8*count with 0 <= count <= {k}.")
      indices = np.full(k, n, np.int32)
      values = np.zeros(k, np.float32)
      indices[:count] = take(count, "int32")
      values[:count] = take(count, "float32")
      bad = (indices[:count] < 0) | (indices[:count] >= n)
      if bad.any():
        raise ValueError(f"{name}.from_bytes: sparse index {int(indices[:count][bad][0])} is not "
                         f"allowed for n={n}; expected 0 <= index < {n}.")
      out.update(count=np.int32(count), indices=indices, values=values)
  if pos != data.size:
    raise ValueError(f"{name}.from_bytes: {data.size} bytes is not allowed for n={n}; "
                     f"expected {pos}.")
  return out


def decimal(x: float) -> Fraction:
  """The decimal value a user wrote for a float (Fraction('0.999') for 0.999), so that counts
  such as ceil(1000 * (1 - 0.999)) are 1, not the 2 binary floating point gives."""
  return x if isinstance(x, Fraction) else Fraction(repr(float(x)))


def fraction_count(n: int, fraction: float | Fraction) -> int:
  """max(1, ceil(n * fraction)) on decimal values (see `decimal`)."""
  return max(1, math.ceil(n * decimal(fraction)))
