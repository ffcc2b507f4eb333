"""Format exploration helpers used by the demo and notebooks: properties and errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jlp.formats import BFPFormat, Format, FloatFormat, MXFormat
from jlp.quantize import quantize


@dataclasses.dataclass(frozen=True)
class QuantizationError:
  """Error statistics of quantizing one tensor."""
  rel_rms: float        # ||q(x) - x|| / ||x||
  max_rel: float        # max |q(x) - x| / |x| over nonzero finite x with finite q(x)
  flushed: float        # fraction of nonzero x that became zero
  overflowed: float     # fraction of finite x that became inf/NaN


def quantization_error(x: jax.Array, fmt: Format, key: jax.Array | None = None) -> QuantizationError:
  """Error of `quantize(x, fmt)` for float32 x, computed in float64 on the host."""
  q = np.asarray(quantize(x, fmt, key=key), np.float64)
  x = np.asarray(x, np.float64)
  nonzero = x != 0
  finite_q = np.isfinite(q)
  diff = np.where(finite_q, q - x, 0.0)
  rel = np.abs(diff[nonzero & finite_q]) / np.abs(x[nonzero & finite_q])
  return QuantizationError(
      rel_rms=float(np.linalg.norm(diff) / np.linalg.norm(x)),
      max_rel=float(rel.max()) if rel.size else 0.0,
      flushed=float(np.mean((q == 0)[nonzero])) if nonzero.any() else 0.0,
      overflowed=float(np.mean(~finite_q)))


def describe(fmt: Format) -> dict[str, str]:
  """The properties a researcher wants at hand, as strings for a table."""
  if isinstance(fmt, FloatFormat):
    name = fmt.name if fmt.compat is None else f"{fmt.name} ({fmt.compat})"
    return dict(format=name, bits=str(fmt.bits), max=f"{fmt.max:.6g}",
                min_normal=f"{fmt.smallest_normal:.4g}", min_subnormal=f"{fmt.smallest_subnormal:.4g}",
                eps=f"{fmt.eps:.4g}")
  if isinstance(fmt, BFPFormat):
    group = int(np.prod(fmt.block))
    return dict(format=f"BFP m{fmt.man} {fmt.block}", bits=f"{1 + fmt.man}+8/{group}", max="fp32",
                min_normal="-", min_subnormal="-", eps=f"{2.0 ** (1 - fmt.man):.4g}*")
  elem = fmt.elem if isinstance(fmt.elem, str) else fmt.elem.name
  elem_bits = 8 if fmt.elem == "int8" else fmt.elem.bits
  return dict(format=f"MX {elem} /{fmt.block}", bits=f"{elem_bits}+8/{fmt.block}", max="2^127*elem",
              min_normal="-", min_subnormal="-", eps="elem")


def format_table(formats: list[Format], x: jax.Array) -> list[dict[str, str]]:
  """One row per format: its properties and its error on `x`."""
  rows = []
  for fmt in formats:
    err = quantization_error(x, fmt)
    rows.append({**describe(fmt), "rel_rms_err": f"{err.rel_rms:.3e}", "max_rel_err": f"{err.max_rel:.3e}",
                 "flushed": f"{err.flushed:.2%}", "overflow": f"{err.overflowed:.2%}"})
  return rows


def render_table(rows: list[dict[str, str]]) -> str:
  cols = list(rows[0])
  width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
  line = lambda r: "  ".join(r[c].rjust(width[c]) if i else r[c].ljust(width[c]) for i, c in enumerate(cols))
  return "\n".join([line({c: c for c in cols}), line({c: "-" * width[c] for c in cols})] + [line(r) for r in rows])


def demo_formats() -> list[Format]:
  names = ["float16", "bfloat16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e3m4",
           "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "e3m0"]
  fmts: list[Format] = [FloatFormat.from_name(n) for n in names]
  fmts += [FloatFormat(4, 3, compat="cpd"), FloatFormat(4, 3, compat="qtorch")]
  fmts += [BFPFormat(4, (1, 24)), BFPFormat(8, (1, 12)), BFPFormat(16, (1, 6))]
  fmts += [MXFormat("float8_e4m3fn"), MXFormat("float6_e2m3fn"), MXFormat("float4_e2m1fn"), MXFormat("int8")]
  return fmts


def demo_tensor(seed: int = 0, n: int = 48 * 1024) -> jax.Array:
  """A tensor with a wide dynamic range: N(0,1) scaled by 2^U(-4, 4), shaped (n/48, 48)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  scale = 2.0 ** jax.random.uniform(k2, (n,), minval=-4, maxval=4)
  return (jax.random.normal(k1, (n,)) * scale).reshape(-1, 48).astype(jnp.float32)
