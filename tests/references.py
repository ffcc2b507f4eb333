"""Independent references for numerics tests, written from the format rules.

Plain numpy float64 arithmetic on values (never jlp code): every float32 value
and every grid step is exact in float64, so rounding to a FloatFormat grid can be
written directly from its definition.
"""

import numpy as np


def bits(x: np.ndarray) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.uint32)


def same_bits(got, want) -> np.ndarray:
  """Elementwise bit equality of float32 arrays, any two NaNs of one sign being equal."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  both_nan = np.isnan(got) & np.isnan(want) & (np.signbit(got) == np.signbit(want))
  return (bits(got) == bits(want)) | both_nan


def assert_same_bits(got, want, x=None, msg=""):
  ok = same_bits(got, want)
  if not ok.all():
    idx = np.flatnonzero(~ok.ravel())[:8]
    detail = [(None if x is None else hex(bits(np.ravel(x)[i])), float(np.ravel(want)[i]),
               float(np.ravel(got)[i])) for i in idx]
    raise AssertionError(f"{msg}: {(~ok).sum()} of {ok.size} differ; (x, want, got): {detail}")


def grid_params(fmt):
  """(bias, emin, emax, max) from the format's definition (not from jlp properties)."""
  bias = 2 ** (fmt.exp - 1) - 1
  emin = 1 - bias
  if fmt.specials == "ieee":
    emax, maxv = bias, 2.0 ** bias * (2 - 2.0 ** -fmt.man)
  elif fmt.specials == "none":
    emax, maxv = bias + 1, 2.0 ** (bias + 1) * (2 - 2.0 ** -fmt.man)
  elif fmt.man == 0:  # nan_only: the only top-exponent encoding is NaN
    emax, maxv = bias, 2.0 ** bias
  else:
    emax, maxv = bias + 1, 2.0 ** (bias + 1) * (2 - 2.0 ** (1 - fmt.man))
  return bias, emin, emax, maxv


def round_to_format(x, fmt, rbits=None) -> np.ndarray:
  """float32 x rounded to FloatFormat `fmt` (compat=None), as float32, in float64 arithmetic."""
  x = np.asarray(x, np.float32)
  _, emin, _, maxv = grid_params(fmt)
  with np.errstate(all="ignore"):
    v = x.astype(np.float64)
  a = np.abs(v)
  finite = np.isfinite(v)
  with np.errstate(all="ignore"):
    _, e2 = np.frexp(np.where(finite & (a > 0), a, 1.0))
    step = np.ldexp(1.0, np.maximum(e2 - 1, emin) - fmt.man)  # grid step at |x|
    n = a / step                                                  # exact
    lo = np.floor(n)
    frac = n - lo
    if fmt.rounding == "nearest":
      up = (frac > 0.5) | ((frac == 0.5) & (lo % 2 == 1))
    elif fmt.rounding == "truncate":
      up = np.zeros_like(frac, bool)
    else:
      threshold = np.floor(frac * 2.0 ** 32)
      up = np.asarray(rbits, np.uint64).astype(np.float64) < threshold
    r = (lo + up) * step
  over = finite & (r > maxv)
  if fmt.specials == "none" or fmt.overflow == "saturate":
    over_val = maxv
  elif fmt.rounding == "truncate":
    over_val = maxv  # IEEE roundTowardZero never overflows to infinity
  else:
    over_val = np.inf if fmt.specials == "ieee" else np.nan
  r = np.where(over, over_val, r)
  if not fmt.subnormals:
    r = np.where(r < 2.0 ** emin, 0.0, r)
  # non-finite inputs
  inf_in = np.isinf(v)
  if fmt.specials == "ieee" and fmt.overflow == "inf":
    inf_val = np.inf
  elif fmt.specials == "nan_only" and fmt.overflow == "inf":
    inf_val = np.nan
  else:
    inf_val = maxv
  r = np.where(inf_in, inf_val, r)
  out = np.copysign(r, np.where(np.signbit(v), -1.0, 1.0))
  nan_in = np.isnan(v)
  if fmt.specials == "none":  # ml_dtypes: NaN -> zero of the opposite sign
    out = np.where(nan_in, np.where(np.signbit(v), 0.0, -0.0), out)
  else:
    out = np.where(nan_in, np.copysign(np.nan, np.where(np.signbit(v), -1.0, 1.0)), out)
  return out.astype(np.float32)


def special_inputs() -> np.ndarray:
  vals = np.array([0x0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                   0xFFFFFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000,
                   0x7F7FFFFF, 0xFF7FFFFF, 0x00400000], np.uint32)
  return vals.view(np.float32)


def sampled_inputs(n: int, seed: int = 0) -> np.ndarray:
  """Random float32 bit patterns, N(0,1) and wide-range normals, plus specials."""
  rng = np.random.default_rng(seed)
  patterns = rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
  normal = rng.standard_normal(n // 4).astype(np.float32)
  wide = (rng.standard_normal(n // 4) * 2.0 ** rng.integers(-40, 40, n // 4)).astype(np.float32)
  return np.concatenate([patterns, normal, wide, special_inputs()])


def format_values(fmt) -> np.ndarray:
  """Every finite value of `fmt` (both signs), from the definition."""
  _, emin, emax, maxv = grid_params(fmt)
  mags = [0.0]
  for k in range(1, 2 ** fmt.man):
    mags.append(k * 2.0 ** (emin - fmt.man))
  for e in range(emin, emax + 1):
    for k in range(2 ** fmt.man):
      mags.append((1 + k / 2 ** fmt.man) * 2.0 ** e)
  mags = np.array([m for m in mags if m <= maxv])
  return np.concatenate([mags, -mags]).astype(np.float32)


def midpoints_and_neighbours(fmt) -> np.ndarray:
  """Every midpoint between adjacent values, its float32 ±1-ulp neighbours, and overflow edges."""
  vals = np.unique(np.abs(format_values(fmt)).astype(np.float64))
  _, _, emax, maxv = grid_params(fmt)
  top_step = 2.0 ** (emax - fmt.man)
  vals = np.append(vals, maxv + top_step)  # the first value past max
  vals = vals[vals <= np.finfo(np.float32).max]
  mids = ((vals[1:] + vals[:-1]) / 2).astype(np.float32)
  near = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)),
                         vals.astype(np.float32), np.nextafter(vals.astype(np.float32), np.float32(np.inf))])
  return np.concatenate([near, -near])


def imagenet_normalized(hwc):
  """torchvision ToTensor + Normalize(IMAGENET_MEAN, IMAGENET_STD), one float32 operation at a
  time per element (the loaders' reference)."""
  from jlp.data.imagenet import IMAGENET_MEAN, IMAGENET_STD  # pylint: disable=g-import-not-at-top
  out = np.zeros(hwc.shape, np.float32)
  for idx in np.ndindex(hwc.shape):
    c = idx[-1]
    out[idx] = ((np.float32(hwc[idx]) / np.float32(255) - np.float32(IMAGENET_MEAN[c]))
                / np.float32(IMAGENET_STD[c]))
  return out


# -- counter-based random bits ---------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def threefry2x32_20(key, counter):
  """Random123's Threefry-2x32 with 20 rounds (Salmon et al., SC'11, §3.2), in numpy uint64
  arithmetic masked to 32 bits. key: two ints; counter: two uint arrays. Returns two uint32
  arrays."""
  rot = ((13, 15, 26, 6), (17, 29, 16, 24))
  k = [int(key[0]), int(key[1])]
  k.append(k[0] ^ k[1] ^ 0x1BD11BDA)
  x0 = (np.asarray(counter[0], np.uint64) + k[0]) & _MASK32
  x1 = (np.asarray(counter[1], np.uint64) + k[1]) & _MASK32
  for r in range(20):
    x0 = (x0 + x1) & _MASK32
    d = rot[(r // 4) % 2][r % 4]
    x1 = (((x1 << np.uint64(d)) | (x1 >> np.uint64(32 - d))) & _MASK32) ^ x0
    if r % 4 == 3:
      s = r // 4 + 1
      x0 = (x0 + k[s % 3]) & _MASK32
      x1 = (x1 + k[(s + 1) % 3] + s) & _MASK32
  return x0.astype(np.uint32), x1.astype(np.uint32)


def stochastic_draws(key, n: int, offset: int = 0, rng: str = "pairs") -> np.ndarray:
  """The uint32 draws of elements offset .. offset + n - 1 (jlp.quantize's documented streams):
  "pairs": element g takes word g % 2 of Threefry-2x32-20(key, (hi | 2^31, lo)), (hi, lo) the
  halves of g // 2; "jax": word 0 xor word 1 of Threefry-2x32-20(key, halves of g)."""
  g = np.arange(n, dtype=np.uint64) + np.uint64(offset)
  if rng == "jax":
    y0, y1 = threefry2x32_20(key, (g >> np.uint64(32), g & _MASK32))
    return y0 ^ y1
  c = g >> np.uint64(1)
  y0, y1 = threefry2x32_20(key, ((c >> np.uint64(32)) | np.uint64(0x80000000), c & _MASK32))
  return np.where(g % 2 == 0, y0, y1)
