"""HiPress's five compressors (docs/hipress.md), written with jlp.compression.base's authoring API.

References:
  Strom, "Scalable distributed DNN training using commodity GPU cloud computing", Interspeech
    2015 (TBQ).
  Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
    Learning", NeurIPS 2017 (HiPress's TernGrad is a min/max b-bit quantiser).
  Lin et al., "Deep Gradient Compression", ICLR 2018 (DGC).
  Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017 (GradDrop).
  Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
    Distributed Training of Speech DNNs", Interspeech 2014 (onebit).
  Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN Training",
    SOSP 2021 (HiPress).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jlp.compression import ops
from jlp.compression.base import (Compressor, check_impl, check_num_ranks, check_state, invalid,
                                  register)
from jlp.compression.layout import Header, Packed, Scalars, Sparse, decimal, fraction_count

__all__ = ["DGC", "DGCServer", "GradDrop", "OneBit", "TBQ", "TernGrad"]


SCALE_MODES = ("two_means", "l1_mean")


def _positive_finite(owner: str, field: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value > 0):
    raise invalid(f"{owner}.{field}", value, "a positive finite float")


def _divide(a: jax.Array, b: int) -> jax.Array:
  """a / b in float32, correctly rounded, for finite a. XLA rewrites a division by a constant,
  or (under vmap) by a broadcast scalar, into a multiplication by the rounded reciprocal, which
  is not correctly rounded; a divisor computed from a (0*a + b: XLA keeps float 0*a) is
  neither."""
  return a / (0 * a + jnp.float32(b))


def _fraction(owner: str, field: str, value: Any, closed_at: int) -> None:
  """value a float in (0, 1] (closed_at=1) or in [0, 1) (closed_at=0)."""
  interval = "(0, 1]" if closed_at else "[0, 1)"
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      (0 < value <= 1) if closed_at else (0 <= value < 1)):
    raise invalid(f"{owner}.{field}", value, f"a float in {interval}")


@register("tbq")
@dataclasses.dataclass(frozen=True)
class TBQ(Compressor):
  """Threshold binary quantisation with fused error feedback (HiPress's zgc kernel).

  Per element, on the residual r in place:  r += x;  r >= τ: send +τ (code 2), r -= τ;
  r <= -τ: send -τ (code 0), r += τ;  else send 0 (code 1). Decode: (code - 1) * τ.
  State {"v": float32[n]}: the last encoded v = x + r (fresh: zeros). r' = v - decode is
  applied lazily, as onebit's: the next encode computes r = v -+ τ or v elementwise
  (`residual(state)`; +0 for a fresh state) and the new v = x + r in one pass that reads x and
  the old v and writes the new v (in place when donated); the packed codes read the new v
  (XLA:CPU runs them as a second loop: its outputs have another shape). Keeping r instead took
  a second pass over x and r once the payload existed (20n bytes against 16n). The codes and r
  are those of HiPress's in-place loop, bit for bit.
  Wire: ceil(n/4) bytes, no header, element 4i+k at bits 2k..2k+1 of byte i; unused tail slots
  hold code 1 (HiPress starts every byte at 0x55). τ is known to both sides.
  """

  threshold: float = 1.0
  impl: str = "auto"

  layout = (Packed("codes", bits=2, pad=1),)

  def __post_init__(self):
    _positive_finite("TBQ", "threshold", self.threshold)
    check_impl("TBQ", self.impl)

  def init(self, x):
    """{"v": zeros like flat x}: the state of r = +0."""
    return {"v": jnp.zeros((jnp.size(x),), jnp.float32)}

  def residual(self, state: dict[str, jax.Array]) -> jax.Array:
    """The error-feedback residual r = v - decode(v's codes) the state stands for: what the
    next encode adds to its x (x + r_before = decode(payload) + r_after). Exactly: the decoded
    value is +τ, -τ or +0 (v - +0 = v, also for v = -0)."""
    check_state("TBQ", state, {"v"})
    v = jnp.asarray(state["v"], jnp.float32)
    tau = jnp.float32(self.threshold)
    return jnp.where(v >= tau, v - tau, jnp.where(v <= -tau, v + tau, v))

  def compress(self, x, state, key):
    del key
    v = x + self.residual(state)
    tau = jnp.float32(self.threshold)
    codes = jnp.where(v >= tau, 2, jnp.where(v <= -tau, 0, 1)).astype(jnp.uint8)
    return {"codes": codes}, {"v": v}

  def decompress(self, fields, n):
    del n
    return (fields["codes"].astype(jnp.float32) - 1.0) * jnp.float32(self.threshold)


@register("onebit")
@dataclasses.dataclass(frozen=True)
class OneBit(Compressor):
  """One sign bit per element with error feedback (Seide et al. 2014; docs/hipress.md#compressors).

  v = x + r (r: the residual). bit = 1 iff v < 0. scale_mode="two_means" (Seide, and GRACE's
  onebit): set bits decode to the mean of the negative entries of v, clear bits to the mean of
  the non-negative ones (a mean over no entries is 0). scale_mode="l1_mean" (BytePS's onebit with
  scaling): decode -s / +s with s = mean|v|. r' = v - decode(payload).
  State {"v": float32[n], "scales": float32[2 or 1]}: the last encoded v and its scales (fresh:
  zeros). r' is applied lazily: the next encode computes r = v - decode(v's signs, scales)
  elementwise (`residual(state)`; +0 for a fresh state) and the new v = x + r, then the signs
  and the scales' sums of the new v. Keeping r instead would take a second pass over x and r
  once the scales are known; this way the elementwise work is one pass that reads x and the old
  v and writes the new v (in place when donated), and the signs and the sums read v (XLA:CPU
  runs them as two more loops over v). The bits are those of the two-pass v = x + r, payload,
  r' = v - decode. The sums are `ops.block_sums` (blocks of 1024, then the block sums).
  Wire: ceil(n/8) bytes, element i at bit i mod 8 of byte i // 8 (unused tail bits 0), then the
  float32 scales, little-endian: two_means the negatives' mean, then the non-negatives'; l1_mean
  the one mean|v|. HiPress's onebit kernel is not public; BytePS packs 32 bits per uint32
  MSB-first, a different bit order.
  """

  scale_mode: str = "two_means"
  impl: str = "auto"

  def __post_init__(self):
    if self.scale_mode not in SCALE_MODES:
      raise invalid("OneBit.scale_mode", self.scale_mode, f"one of {SCALE_MODES}")
    check_impl("OneBit", self.impl)

  @property
  def scale_count(self) -> int:
    return 2 if self.scale_mode == "two_means" else 1

  @property
  def layout(self):
    return (Packed("signs", bits=1), Scalars("scales", self.scale_count))

  def init(self, x):
    """{"v": zeros like flat x, "scales": zeros}: the state of r = +0."""
    return {"v": jnp.zeros((jnp.size(x),), jnp.float32),
            "scales": jnp.zeros((self.scale_count,), jnp.float32)}

  def residual(self, state: dict[str, jax.Array]) -> jax.Array:
    """The error-feedback residual r = v - decode(v's signs, scales) the state stands for: what
    the next encode adds to its x (x + r_before = decode(payload) + r_after)."""
    check_state("OneBit", state, {"v", "scales"})
    v = jnp.asarray(state["v"], jnp.float32)
    return v - self._levels(v < 0, jnp.asarray(state["scales"], jnp.float32))

  def _levels(self, negative: jax.Array, scales: jax.Array) -> jax.Array:
    if self.scale_mode == "two_means":
      return jnp.where(negative, scales[0], scales[1])
    return jnp.where(negative, -scales[0], scales[0])

  def compress(self, x, state, key):
    del key
    v = x + self.residual(state)
    negative = v < 0
    if self.scale_mode == "two_means":
      # One pass for the three sums (XLA:CPU materialises the masked values of separate sums).
      sum_neg, sum_pos, count = ops.block_sums(
          (jnp.where(negative, v, 0.0), jnp.where(negative, 0.0, v), negative.astype(jnp.int32)))
      mean_neg = sum_neg / jnp.maximum(count, 1).astype(jnp.float32)
      mean_pos = sum_pos / jnp.maximum(v.shape[0] - count, 1).astype(jnp.float32)
      scales = jnp.stack([mean_neg, mean_pos])
    else:
      scales = _divide(ops.block_sums((jnp.abs(v),))[0], v.shape[0])[None]
    return {"signs": negative.astype(jnp.uint8), "scales": scales}, {"v": v, "scales": scales}

  def decompress(self, fields, n):
    del n
    return self._levels(fields["signs"] == 1, fields["scales"])


def _terngrad_bitwidth(compressor: "TernGrad", n: int) -> int:
  del n
  return compressor.bitwidth


def _terngrad_tail(compressor: "TernGrad", n: int) -> int:
  return compressor.tail(n)


@register("terngrad")
@dataclasses.dataclass(frozen=True)
class TernGrad(Compressor):
  """HiPress's TernGrad: a b-bit uniform quantiser between the tensor's min and max
  (docs/hipress.md#compressors; not Wen et al.'s ternary {-s, 0, s}). No error feedback, no state.

  All in float32: mn, mx = min(x), max(x); gap = (mx - mn) / (2^b - 1); inv = 1 / gap where gap
  is a normal float32 (>= 2^-126), else 0 (every code 0, decoding to min: exact for a constant
  tensor);
  code = round-half-even((x - mn) * inv) (stochastic=False, HiPress's `random=0` default, biased)
  or floor((x - mn) * inv + u) (stochastic=True, unbiased), clamped to [0, 2^b - 1]. The error
  is then at most gap/2 (deterministic) or below gap (stochastic), plus a few float32 ulps of
  max|x|, at any scale. compat="hipress" takes HiPress's inv = 1 / (gap + 1e-8) instead, bit for
  bit: its absolute epsilon scales every code by gap / (gap + 1e-8), so that where gap is not
  far above 1e-8 the codes collapse towards 0 (N(0, 1e-9) values: errors of 6x gap/2 at b = 2,
  500x at b = 8).
  Decode: code * gap + mn (two float32 roundings), except that the top code decodes to mx
  itself (HiPress computes (2^b - 1) * gap + mn, which misses mx by an ulp for about one tensor
  in five; jlp keeps every decode within [min, max]).
  u is uniform in [0, 1), drawn with jax.random from the key (one draw per element; HiPress uses
  a timestamp-seeded LCG and rounds the tail byte deterministically: not reproducible, so not
  reproduced).
  Wire (10-byte header, little-endian): uint8 b, uint8 tail (unused slots of the last byte: 0 or
  8/b - n mod (8/b)), float32 min, float32 max, then ceil(n*b/8) bytes of codes, element
  i*(8/b) + j at bit offset b*j of byte i (unused slots 0).
  """

  bitwidth: int = 2
  stochastic: bool = False
  impl: str = "auto"
  compat: str | None = None

  def __post_init__(self):
    if isinstance(self.bitwidth, bool) or self.bitwidth not in (1, 2, 4, 8):
      raise invalid("TernGrad.bitwidth", self.bitwidth, "one of (1, 2, 4, 8)")
    if not isinstance(self.stochastic, bool):
      raise invalid("TernGrad.stochastic", self.stochastic, "a bool")
    check_impl("TernGrad", self.impl)
    if not (self.compat is None or (isinstance(self.compat, str) and self.compat == "hipress")):
      raise invalid("TernGrad.compat", self.compat, "None or 'hipress'")

  @property
  def layout(self):
    return (Header("bitwidth", "uint8", _terngrad_bitwidth), Header("tail", "uint8", _terngrad_tail),
            Scalars("min"), Scalars("max"), Packed("codes", bits=self.bitwidth))

  @property
  def needs_key(self) -> bool:
    return self.stochastic

  @property
  def top_code(self) -> int:
    return (1 << self.bitwidth) - 1

  def tail(self, n: int) -> int:
    """Unused code slots in the last byte of n codes."""
    per_byte = 8 // self.bitwidth
    return (-n) % per_byte

  def compress(self, x, state, key):
    mn, mx = _min_max(x)
    gap = _divide(mx - mn, self.top_code)
    if self.compat == "hipress":
      inv = jnp.float32(1.0) / (gap + jnp.float32(1e-8))
    else:
      normal = gap >= jnp.finfo(jnp.float32).tiny
      inv = jnp.where(normal, jnp.float32(1.0) / jnp.where(normal, gap, 1.0), 0.0)
    scaled = (x - mn) * inv
    if self.stochastic:
      codes = jnp.floor(scaled + ops.uniform(key, x.shape))
    else:
      codes = jnp.round(scaled)  # half to even
    codes = jnp.clip(codes, 0, self.top_code).astype(jnp.uint8)
    return {"min": mn, "max": mx, "codes": codes}, state

  def decompress(self, fields, n):
    del n
    mn, mx = fields["min"][0], fields["max"][0]
    gap = _divide(mx - mn, self.top_code)
    # The 2^b levels as a table (the barrier keeps code*gap and + mn two roundings in every
    # program: XLA fuses them into one FMA in some and not in others), looked up per code.
    steps = lax.optimization_barrier(jnp.arange(self.top_code + 1, dtype=jnp.float32) * gap)
    levels = (steps + mn).at[self.top_code].set(mx)
    return _lookup(levels, fields["codes"], self.bitwidth)


def _min_max(x: jax.Array, row: int = 1024) -> tuple[jax.Array, jax.Array]:
  """(min(x), max(x)) of flat float32 x in one pass: a variadic reduce over rows of `row` (the
  rows split between threads; XLA:CPU runs jnp.min and jnp.max as two passes, and one 1-D
  reduce on one thread), then over the row results and the ragged tail. min and max are exact
  in any order; a zero extreme present with both signs comes out with the sign XLA's order
  gives (as jnp.min's does), and a NaN makes both NaN (XLA:CPU's one-thread jnp.min skipped it
  above a few thousand elements)."""
  def both(a, b):
    return jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])

  init = (jnp.float32(jnp.inf), jnp.float32(-jnp.inf))
  whole = x.shape[0] // row * row
  rows = x[:whole].reshape(-1, row)
  lo, hi = lax.reduce((rows, rows), init, both, (1,))
  tail = x[whole:]
  lo, hi = jnp.concatenate([lo, tail]), jnp.concatenate([hi, tail])
  return lax.reduce((lo, hi), init, both, (0,))


def _lookup(levels: jax.Array, codes: jax.Array, bits: int) -> jax.Array:
  """levels[codes]: for b <= 2 a tree of selects on the code's bits (XLA:CPU's gather is half as
  fast), else a gather."""
  if bits > 2:
    return jnp.take(levels, codes.astype(jnp.int32), mode="clip")
  values = [levels[i] for i in range(1 << bits)]
  for j in range(bits):
    bit = ((codes >> j) & 1) == 1
    values = [jnp.where(bit, values[2 * i + 1], values[2 * i]) for i in range(len(values) // 2)]
  return values[0]


def _sparsify(acc: jax.Array, key: jax.Array, sample_rate: float, density: float | Fraction,
              capacity: int, impl: str) -> dict[str, jax.Array]:
  """HiPress's selection (DGC and GradDrop): the sampled threshold thr of |acc|, every i with
  |acc_i| > thr, capped at `capacity` by |acc|; where n*density < 1 (on decimal values), thr = 0
  instead, so that the largest |acc| is sent (capacity 1; ties: the lower index). HiPress's
  sample of one element would make itself the threshold: a 1-element partition would never
  send, nor any partition whose magnitudes tie. Sparse fields (indices: unused slots n)."""
  if acc.shape[0] * decimal(density) < 1:
    threshold = jnp.float32(0.0)
  else:
    threshold = ops.sampled_threshold(jnp.abs(acc), key, sample_rate, density)
  indices, count = ops.capped_threshold_select(acc, threshold, capacity, impl=impl)
  return _sparse_fields(acc, indices, count)


def _sparse_fields(acc: jax.Array, indices: jax.Array, count: jax.Array) -> dict[str, jax.Array]:
  return {"count": count, "indices": indices,
          "values": jnp.take(acc, indices, mode="fill", fill_value=0)}


def _zero_at(fields: dict[str, jax.Array], *arrays: jax.Array) -> tuple[jax.Array, ...]:
  """The arrays with zeros at the payload's indices, once the payload has been read from them
  (the barrier: XLA then zeroes a donated state in place instead of copying it first)."""
  fields, arrays = lax.optimization_barrier((fields, arrays))
  return tuple(a.at[fields["indices"]].set(0.0, mode="drop") for a in arrays)


def _capacity(compressor: "DGC | GradDrop", n: int) -> int:
  """DGC's and GradDrop's k = max(1, ceil(n * density)), on decimal values."""
  return fraction_count(n, compressor.density)


@register("dgc")
@dataclasses.dataclass(frozen=True)
class DGC(Compressor):
  """Deep Gradient Compression as HiPress's dgc_new (docs/hipress.md#compressors), with momentum
  correction and momentum-factor masking; no gradient clipping or warm-up (HiPress has neither).

  State u (momentum) and v (velocity). u = m*u + x; v = v + u. S = ceil(n*sample_rate) indices
  drawn uniformly with replacement (jax.random, from the key); thr = the element at position
  floor(S*density) of the sampled |v| in descending order; selected: every i with |v_i| > thr,
  capped at k = ceil(n*density) by the largest |v| (HiPress's truncation compares the already
  zeroed gradient instead, keeping an arbitrary subset: not reproduced). No partition starves:
  where n*density < 1 (less than one element expected, e.g. a 1-element partition) thr = 0, so
  that the largest non-zero |v| is sent (k = 1; ties: the lower index); HiPress's one-element
  sample would be its own threshold, and nothing would be sent while magnitudes tie. Payload: v
  at the selected indices; then v[idx] = u[idx] = 0. Invariant: v_before + u_new = decode +
  v_after.
  Sparse payload (layout.Sparse, capacity k); wire int32 M = 4 + 8*count, int32 idx[count],
  float32 val[count]. The aggregator re-encodes with `server(num_ranks)` (DGCServer).
  """

  density: float = 0.001
  sample_rate: float = 0.001
  momentum: float = 0.9
  impl: str = "auto"

  layout = (Sparse(capacity=_capacity),)
  needs_key = True

  def __post_init__(self):
    _fraction("DGC", "density", self.density, closed_at=1)
    _fraction("DGC", "sample_rate", self.sample_rate, closed_at=1)
    _fraction("DGC", "momentum", self.momentum, closed_at=0)
    check_impl("DGC", self.impl)

  def init(self, x):
    n = jnp.size(x)
    return {"u": jnp.zeros((n,), jnp.float32), "v": jnp.zeros((n,), jnp.float32)}

  def compress(self, x, state, key):
    u = jnp.float32(self.momentum) * state["u"] + x
    v = state["v"] + u
    fields = _sparsify(v, key, self.sample_rate, self.density, _capacity(self, x.shape[0]),
                       self.impl)
    u, v = _zero_at(fields, u, v)
    return fields, {"u": u, "v": v}

  def server(self, num_ranks: int) -> "DGCServer":
    """HiPress's dgc_new_server: every non-zero of the aggregate of num_ranks payloads."""
    check_num_ranks("DGC.server num_ranks", num_ranks)
    return DGCServer(density=self.density, num_ranks=num_ranks, impl=self.impl)


def _dgc_server_capacity(compressor: "DGCServer", n: int) -> int:
  return min(n, compressor.num_ranks * fraction_count(n, compressor.density))


@dataclasses.dataclass(frozen=True)
class DGCServer(Compressor):
  """DGC's aggregator re-encode (HiPress's dgc_new_server): every non-zero of
  the merged partition, with no threshold, no re-sparsification and no state. Capacity
  min(n, num_ranks * ceil(n*density)), which the union of num_ranks DGC payloads fits; past it
  (e.g. when the aggregator's own dense contribution entered) the largest |x| are kept. Not
  registered: it is what `DGC.server(num_ranks)` returns. Same wire format as DGC.
  """

  name: ClassVar[str] = "dgc_server"

  density: float = 0.001
  num_ranks: int = 1
  impl: str = "auto"

  layout = (Sparse(capacity=_dgc_server_capacity),)

  def __post_init__(self):
    _fraction("DGCServer", "density", self.density, closed_at=1)
    check_num_ranks("DGCServer.num_ranks", self.num_ranks)
    check_impl("DGCServer", self.impl)

  def compress(self, x, state, key):
    del key
    indices, count = ops.capped_threshold_select(x, 0.0, _dgc_server_capacity(self, x.shape[0]),
                                                 impl=self.impl)
    return _sparse_fields(x, indices, count), state


@register("graddrop")
@dataclasses.dataclass(frozen=True)
class GradDrop(Compressor):
  """Gradient dropping (Aji & Heafield 2017) as HiPress's gd kernel (docs/hipress.md#compressors).

  r = r + x (r: the residual, state); the sampled threshold exactly as DGC's with density
  d = 1 - drop_ratio (on decimal values: drop_ratio=0.999 gives d = 0.001 and k = ceil(1000*d)
  = 1 for n = 1000); selected: |r_i| > thr, capped at k = ceil(n*d) by the largest |r|; where
  n*d < 1, thr = 0 as for DGC (no partition starves: the largest non-zero |r| is sent); payload:
  r at the selected indices; then r[idx] = 0. Invariant: x + r_before = decode + r_after.
  Same wire format as DGC. At a CaSync-PS root the aggregate is re-encoded with the same encoder
  and the root's own residual (`server(num_ranks)` is self).
  """

  drop_ratio: float = 0.999
  sample_rate: float = 0.001
  impl: str = "auto"

  layout = (Sparse(capacity=_capacity),)
  needs_key = True

  def __post_init__(self):
    _fraction("GradDrop", "drop_ratio", self.drop_ratio, closed_at=0)
    _fraction("GradDrop", "sample_rate", self.sample_rate, closed_at=1)
    check_impl("GradDrop", self.impl)

  @property
  def density(self) -> Fraction:
    """1 - drop_ratio, exactly, on the decimal values written."""
    return 1 - decimal(self.drop_ratio)

  def init(self, x):
    return self.residual_state(x)

  def compress(self, x, state, key):
    r = state["residual"] + x
    fields = _sparsify(r, key, self.sample_rate, self.density, _capacity(self, x.shape[0]),
                       self.impl)
    (r,) = _zero_at(fields, r)
    return fields, {"residual": r}
