"""The compressor protocol, the registry, and what every compressor gets from its layout.

A compressor is a frozen dataclass (hashable: a static argument of jitted code) validated on
construction. It declares its payload `layout` (jlp.compression.layout) and writes two functions
over unpacked fields:

  compress(x, state, key) -> (fields, state)   x: float32[n]; fields: {name: array} with one
                                               uint8 code per element for each Packed field,
                                               dtype[count] for Scalars, and count / indices /
                                               values for a Sparse field
  decompress(fields, n) -> float32[n]

and, when it has state, `init`. With `error_feedback = True` the base class keeps the residual
r (state {"residual"}): compress sees v = x + r, and the new residual is v - decode(payload),
computed after the payload is packed (a second pass over x and r, so that a donated residual is
updated in place: XLA would otherwise copy it). A compressor may instead keep its own state and
apply its feedback lazily in one pass (onebit keeps v and its scales, TBQ v; each derives r at
the next encode, `check_state` validating the state it is given). The base class turns these into the protocol the
synchronisation (`jlp.compression.sync`), the train step and the wire use:

  init(x) -> state                      error-feedback residual (onebit: its last v and scales;
                                        tbq: its last v),
                                        DGC's U and V; {} if none
  encode(x, state, key=None) -> (payload, state)
                                        x of any shape, taken flat in C order; payload: fixed-
                                        shape arrays holding the packed codes
  decode(payload, n) -> float32[n];  decode_add(payload, acc) -> acc + decode(payload, n)
  to_bytes(payload) -> numpy uint8;  from_bytes(data, n) -> payload   (HiPress's wire bytes)
  wire_bytes(n) -> int                  the bytes one payload puts on the wire (sparse: capacity)
  server(num_ranks) -> Compressor       what an aggregator of num_ranks payloads re-encodes with
                                        (CaSync-PS); `self` unless the algorithm says
                                        otherwise (DGC: the union of the non-zeros)
  is_sparse(compressor) -> bool         (a function of this module) whether the payload is a
                                        Sparse field: count, indices, values

A layout that depends on the compressor's fields (TernGrad's bit width, onebit's scale count) is
a `layout` property instead of a class attribute. A compressor whose layout is one Sparse field
gets decompress (zero-fill, then scatter) and decompress_add (scatter-add) from the base class;
unused slots (index n, or past `count`) are skipped. `needs_key` may also be a property. A field
`impl` ("auto" | "xla" | "pallas", default "auto": Pallas on GPU, XLA elsewhere, the same bits)
chooses the ops' path; a compressor without one runs "auto".
encode, decode and decode_add each run as one jitted program (inlined under an outer jit, vmap
or shard_map), so eager calls give jit's bits.

Writing a new one (replacing CompLL's DSL): see docs/hipress.md#writing-a-compressor and the
tour's "Writing a compressor" (docs/tour.md).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlp.compression import layout as layout_lib
from jlp.compression import ops

__all__ = ["COMPRESSORS", "Compressor", "get", "is_sparse", "register"]

COMPRESSORS: dict[str, type["Compressor"]] = {}


def invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def register(name: str):
  """Class decorator: makes the compressor class available as `jlp.compression.get(name)` (and
  as config.compression.name in the runner); checks its layout."""
  def wrap(cls):
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
      raise TypeError(f"register({name!r}) needs a Compressor subclass, got {cls!r}.")
    if name in COMPRESSORS and COMPRESSORS[name] is not cls:
      raise ValueError(f"compressor name {name!r} is already registered to "
                       f"{COMPRESSORS[name].__name__}.")
    if "__dataclass_params__" not in vars(cls) or not cls.__dataclass_params__.frozen:
      raise TypeError(f"{cls.__name__} must be a frozen dataclass (hashable, static under jit).")
    layout_lib.check_layout(_default_layout(cls), cls.__name__)
    cls.name = name
    COMPRESSORS[name] = cls
    return cls
  return wrap


def _default_layout(cls: type["Compressor"]) -> tuple:
  """cls.layout, or the layout of its default instance where `layout` is a property."""
  if isinstance(inspect.getattr_static(cls, "layout"), property):
    return cls().layout
  return cls.layout


def get(name: str, **kwargs: Any) -> "Compressor":
  """The registered compressor `name` built with `kwargs` (its dataclass fields)."""
  if name not in COMPRESSORS:
    raise invalid("name", name, f"one of {sorted(COMPRESSORS)}")
  cls = COMPRESSORS[name]
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise invalid(f"{name} argument {unknown[0]}", kwargs[unknown[0]],
                  f"one of the fields of {cls.__name__}: {sorted(fields)}")
  return cls(**kwargs)


def check_impl(owner: str, impl: Any) -> None:
  if not isinstance(impl, str) or impl not in ops.IMPLS:
    raise invalid(f"{owner}.impl", impl, f"one of {ops.IMPLS}")


def check_num_ranks(field: str, num_ranks: Any) -> None:
  """ValueError naming `field` unless num_ranks is an int >= 1 (a server's number of ranks)."""
  if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
    raise invalid(field, num_ranks, "an int >= 1")


def check_state(owner: str, state: Any, keys: set[str]) -> None:
  """ValueError unless state is a dict with exactly `keys` (a compressor's own state)."""
  if not isinstance(state, dict) or set(state) != keys:
    given = sorted(state) if isinstance(state, dict) else type(state).__name__
    raise invalid(f"{owner} state", given, f"a dict with keys {sorted(keys)} ({owner}.init)")


def is_sparse(compressor: "Compressor") -> bool:
  """Whether the compressor's payload is a Sparse field (count, indices, values)."""
  return any(isinstance(f, layout_lib.Sparse) for f in compressor.layout)


def _scatter(fields: dict[str, jax.Array], out: jax.Array, add: bool) -> jax.Array:
  """out with the sparse fields' first `count` (index, value) pairs set or added; other slots
  (and indices outside [0, n)) are dropped."""
  indices, values = fields["indices"], fields["values"].astype(jnp.float32)
  used = (jnp.arange(indices.shape[0]) < fields["count"]) & (indices >= 0)
  indices = jnp.where(used, indices, out.shape[0])
  at = out.at[indices]
  return at.add(values, mode="drop") if add else at.set(values, mode="drop")


@dataclasses.dataclass(frozen=True)
class Compressor:
  """Base class (see the module docstring). Subclasses are frozen dataclasses with a `layout`,
  `compress` and `decompress`, registered with `@register(name)`."""

  name: ClassVar[str] = ""
  layout: ClassVar[tuple] = ()
  #: whether encode draws random numbers (then a key is required).
  needs_key: ClassVar[bool] = False
  #: whether the base class keeps an error-feedback residual (see the module docstring).
  error_feedback: ClassVar[bool] = False
  #: the `jlp.compression.sync` topologies it runs with ("allreduce": payloads that can be
  #: summed, e.g. PowerSGD's P and Q).
  topologies: ClassVar[tuple[str, ...]] = ("ps", "ring")

  # -- what a compressor writes ----------------------------------------------------------------
  def init(self, x: jax.Array) -> Any:
    """The state for tensors like x (flat float32[n] arrays): {"residual": zeros} with error
    feedback, else {}."""
    return self.residual_state(x) if self.error_feedback else {}

  def compress(self, x: jax.Array, state: Any, key: jax.Array | None) -> tuple[dict, Any]:
    raise NotImplementedError

  def decompress(self, fields: dict[str, jax.Array], n: int) -> jax.Array:
    """float32[n] from unpacked fields. Sparse layouts: zeros with the kept values scattered."""
    if is_sparse(self):
      return _scatter(fields, jnp.zeros((n,), jnp.float32), add=False)
    raise NotImplementedError(f"{type(self).__name__}.decompress")

  def decompress_add(self, fields: dict[str, jax.Array], acc: jax.Array) -> jax.Array:
    """acc + decompress(fields, n); sparse layouts scatter-add the kept values instead."""
    if is_sparse(self):
      return _scatter(fields, acc, add=True)
    return acc + self.decompress(fields, acc.shape[0])

  def server(self, num_ranks: int) -> "Compressor":
    """The compressor an aggregator re-encodes the sum of `num_ranks` payloads with (CaSync-PS,
    and the ring's reduce hops); `self` unless the algorithm says otherwise."""
    check_num_ranks(f"{type(self).__name__}.server num_ranks", num_ranks)
    return self

  # -- what comes with it ----------------------------------------------------------------------
  @property
  def impl_(self) -> str:
    return getattr(self, "impl", "auto")

  def residual_state(self, x: jax.Array) -> dict[str, jax.Array]:
    """{"residual": zeros like flat x}: the state of an error-feedback compressor."""
    return {"residual": jnp.zeros((jnp.size(x),), jnp.float32)}

  def init_flat(self, n: int) -> Any:
    return self.init(jnp.zeros((n,), jnp.float32))

  def encode(self, x: jax.Array, state: Any = None, key: jax.Array | None = None
             ) -> tuple[dict[str, jax.Array], Any]:
    """(payload, new state) of float32 x (any shape, flat in C order); state None: fresh."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
      raise invalid(f"{type(self).__name__}.encode x.dtype", str(x.dtype), "float32")
    x = x.reshape(-1)
    n = x.shape[0]
    if n == 0:
      raise invalid(f"{type(self).__name__}.encode x.size", 0, "at least one element")
    if state is None:
      state = self.init(x)
    if self.needs_key and key is None:
      raise invalid(f"{type(self).__name__}.encode key", None,
                    "a jax.random key (this compressor draws random numbers)")
    return _encode(self, x, state, key)

  def _pack(self, fields: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    payload = {}
    for f in self.layout:
      if isinstance(f, layout_lib.Header):
        payload[f.name] = jnp.full((1,), f.value(self, n), f.dtype)
      elif isinstance(f, layout_lib.Packed):
        payload[f.name] = ops.pack_bits(fields[f.name], f.bits, f.pad, impl=self.impl_)
      elif isinstance(f, layout_lib.Scalars):
        payload[f.name] = jnp.asarray(fields[f.name], f.dtype).reshape(f.count)
      elif isinstance(f, layout_lib.Sparse):
        payload["count"] = jnp.asarray(fields["count"], jnp.int32).reshape(())
        payload["indices"] = jnp.asarray(fields["indices"], jnp.int32)
        payload["values"] = jnp.asarray(fields["values"], jnp.float32)
    return payload

  def _unpack(self, payload: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    fields = dict(payload)
    for f in self.layout:
      if isinstance(f, layout_lib.Packed):
        fields[f.name] = ops.unpack_bits(payload[f.name], f.bits, n, impl=self.impl_)
    return fields

  def decode(self, payload: dict[str, jax.Array], n: int) -> jax.Array:
    """float32[n]: the tensor the payload stands for."""
    return _decode(self, jax.tree.map(jnp.asarray, payload), n)

  def decode_add(self, payload: dict[str, jax.Array], acc: jax.Array) -> jax.Array:
    """acc + decode(payload, acc.size) (CaSync's merge), acc float32[n]."""
    acc = jnp.asarray(acc, jnp.float32).reshape(-1)
    return _decode_add(self, jax.tree.map(jnp.asarray, payload), acc)

  def payload_spec(self, n: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the payload of n elements."""
    return layout_lib.payload_spec(self.layout, self, n)

  def wire_bytes(self, n: int) -> int:
    """Bytes one payload of n elements puts on the wire (sparse ones at capacity)."""
    return layout_lib.wire_size(self.layout, self, n)

  def to_bytes(self, payload: dict[str, Any]) -> np.ndarray:
    """HiPress's wire bytes of a payload (numpy uint8, little-endian)."""
    return layout_lib.to_bytes(self.layout, jax.tree.map(np.asarray, payload))

  def from_bytes(self, data: Any, n: int) -> dict[str, np.ndarray]:
    """The payload of n elements that `to_bytes` wrote as `data`."""
    return layout_lib.from_bytes(self.layout, self, data, n)


# encode, decode and decode_add run as one compiled program even when called outside jit (inside
# jit, vmap or shard_map these calls are inlined): XLA fuses a float32 multiply and add into one
# fused multiply-add where op-by-op execution rounds twice, so eager calls give jit's bits.
@functools.partial(jax.jit, static_argnums=0)
def _encode(compressor: Compressor, x: jax.Array, state: Any, key: jax.Array | None):
  # pylint: disable=protected-access
  n = x.shape[0]
  if not compressor.error_feedback:
    fields, state = compressor.compress(x, state, key)
    return compressor._pack(fields, n), state
  fields, state = compressor.compress(x + state["residual"], state, key)
  payload = compressor._pack(fields, n)
  # The residual update reads x and r only once the payload exists: one pass computes the
  # payload, the next the residual, written over a donated r with no copy of it.
  payload, x, residual = lax.optimization_barrier((payload, x, state["residual"]))
  v = x + residual
  new_residual = v - compressor.decompress(compressor._unpack(payload, n), n)
  return payload, {**state, "residual": new_residual}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _decode(compressor: Compressor, payload: dict[str, jax.Array], n: int) -> jax.Array:
  return compressor.decompress(compressor._unpack(payload, n), n)  # pylint: disable=protected-access


@functools.partial(jax.jit, static_argnums=0)
def _decode_add(compressor: Compressor, payload: dict[str, jax.Array], acc: jax.Array) -> jax.Array:
  fields = compressor._unpack(payload, acc.shape[0])  # pylint: disable=protected-access
  return compressor.decompress_add(fields, acc)
