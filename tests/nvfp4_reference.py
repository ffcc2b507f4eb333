"""numpy transcriptions of the NVFP4 peers, written from their sources (never from jlp code).

Every step is the peer's float32 operation in the peer's order, in numpy float32 arithmetic
(IEEE, gradual underflow: numpy does not flush subnormals), with ml_dtypes for the E4M3 cast.

* `te_quantize`: TransformerEngine's `NVFP4QuantizerRef` (transformer_engine/pytorch/
  custom_recipes/quantization_nvfp4.py): `_quantize` (rowwise usage: amax of the tensor,
  `_pad_tensor`), `_quantize_blockwise_reference` (non-pow2 path) and `cast_to_fp4x2`'s
  comparison table. `te_decode` is the decode jlp documents (e2m1 * scale * (amax / 2688)).
* `torchao_quantize` / `torchao_dequantize`: torchao 0.18's `nvfp4_quantize`,
  `per_tensor_amax_to_scale` and `NVFP4Tensor.dequantize`, with `f32_to_f4_unpacked`
  (custom_fp_utils._f32_to_floatx_unpacked) transcribed bit operation by bit operation. A tensor
  divided by a Python float is a true division (PyTorch on CPU).
* `rht` / `inverse_rht`: the transform T = D H16 / 4 with TE's `get_wgrad_sign_vector()` signs, in
  the order jlp documents: z = (x * s) * 0.25, then in-place butterflies with strides 8, 4, 2, 1.
"""

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
TE_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)
# TE's `cast_from_fp4x2` table: the value of each 4-bit code.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _pad(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
  m, n = x.shape
  return np.pad(x, ((0, -m % rows), (0, -n % cols)))


def te_cast_to_fp4(x: np.ndarray) -> np.ndarray:
  """`cast_to_fp4x2` before packing: codes from TE's comparison table (0 where none matches)."""
  r = np.zeros(x.shape, np.uint8)
  table = [((x >= 0.0) & (x <= 0.25), 0), ((x > 0.25) & (x < 0.75), 1),
           ((x >= 0.75) & (x <= 1.25), 2), ((x > 1.25) & (x < 1.75), 3),
           ((x >= 1.75) & (x <= 2.5), 4), ((x > 2.5) & (x < 3.5), 5),
           ((x >= 3.5) & (x <= 5.0), 6), (x > 5.0, 7),
           ((x >= -0.25) & (x < -0.0), 8), ((x < -0.25) & (x > -0.75), 9),
           ((x <= -0.75) & (x >= -1.25), 10), ((x < -1.25) & (x > -1.75), 11),
           ((x <= -1.75) & (x >= -2.5), 12), ((x < -2.5) & (x > -3.5), 13),
           ((x <= -3.5) & (x >= -5.0), 14), (x < -5.0, 15)]
  for mask, code in table:
    r[mask] = code
  return r


def te_scaled(x: np.ndarray, tile=(1, 16)):
  """TE's reference up to the clamp: (scaled x before the clamp, E4M3 scales (M_pad, N_pad/16)
  with a 16 x 16 tile's scale repeated over its rows, as TE returns them, global amax)."""
  x = np.asarray(x, F32)
  m, n = x.shape
  with np.errstate(all="ignore"):
    global_amax = F32(np.max(np.abs(x)))
    xp = _pad(x, tile[0], tile[1])
    mp, np_ = xp.shape
    blocks = xp.reshape(mp, np_ // 16, 16)
    if tile == (16, 16):
      tiles = xp.reshape(mp // 16, 16, np_ // 16, 16)
      block_amax = np.max(np.abs(tiles), axis=(1, 3))
      vec_max = np.repeat(block_amax, 16, axis=0)[..., None]
    else:
      vec_max = np.max(np.abs(blocks), axis=-1, keepdims=True)
    fp4_max, fp8_max = F32(6.0), F32(448.0)
    ges = (fp8_max * fp4_max) / global_amax
    ges = np.minimum(ges, FLT_MAX)
    if ges == F32(0.0):
      ges = F32(1.0)
    gds = F32(1.0) / ges
    multiplier = ges * (F32(1.0) / fp4_max)
    decode_scale = vec_max * multiplier
    decode_scale = np.minimum(decode_scale, FLT_MAX)
    decode_scale = np.clip(decode_scale, -fp8_max, fp8_max).astype(ml_dtypes.float8_e4m3fn)
    encode_scale = np.minimum(F32(1.0) / (decode_scale.astype(F32) * gds), FLT_MAX)
    scaled = (blocks * encode_scale).reshape(mp, np_)[:m, :n]
  return scaled, decode_scale[..., 0], global_amax


def te_quantize(x: np.ndarray, tile=(1, 16)):
  """(codes (M, N) uint8, scales, global amax): the scales one per tile, (M_pad/16, N_pad/16)
  for 16 x 16 tiles (TE's rows of repeats taken once)."""
  scaled, scales, amax = te_scaled(x, tile)
  with np.errstate(all="ignore"):
    codes = te_cast_to_fp4(np.clip(scaled, F32(-6.0), F32(6.0)))
  return codes, (scales[::16] if tile == (16, 16) else scales), amax


def _expand_scales(scales: np.ndarray, shape, tile) -> np.ndarray:
  s = np.repeat(np.repeat(scales.astype(F32), tile[0], axis=0), 16, axis=1)
  return s[:shape[0], :shape[1]]


def te_decode(codes: np.ndarray, scales: np.ndarray, amax, tile=(1, 16)) -> np.ndarray:
  """jlp's documented TE decode: (e2m1 * float32(scale)) * (amax / 2688), float32."""
  with np.errstate(all="ignore"):
    g = F32(amax) / F32(2688.0)
    return (FP4_VALUES[codes] * _expand_scales(scales, codes.shape, tile)) * g


# -- torchao ------------------------------------------------------------------------------------

def f32_to_f4_unpacked(x: np.ndarray) -> np.ndarray:
  """torchao's `_f32_to_floatx_unpacked(x, ebits=2, mbits=1)`, bit operation by bit operation."""
  ebits, mbits, f32_bias = 2, 1, 127
  exp_bias = 1
  max_int = 7
  magic_adder = (1 << (23 - mbits - 1)) - 1
  max_normal = 2.0 ** (3 - exp_bias) * (3 / 2)
  min_normal = 2.0 ** (1 - exp_bias)
  denorm_exp = (f32_bias - exp_bias) + (23 - mbits) + 1
  denorm_mask_int = denorm_exp << 23
  denorm_mask_float = np.array(denorm_mask_int, np.int32).view(np.float32)
  u = np.asarray(x, F32).view(np.uint32)
  sign = u & np.uint32(0x80000000)
  xf = (u ^ sign).view(np.float32)
  saturate = xf >= max_normal
  denormal = ~saturate & (xf < min_normal)
  normal = ~(saturate | denormal)
  with np.errstate(all="ignore"):
    denormal_x = ((xf + denorm_mask_float).view(np.int32) - denorm_mask_int).astype(np.uint8)
  normal_i = xf.view(np.int32).astype(np.int64)
  mant_odd = (normal_i >> (23 - mbits)) & 1
  normal_i = normal_i + (((exp_bias - f32_bias) << 23) + magic_adder) + mant_odd
  normal_x = ((normal_i >> (23 - mbits)) & 0xFF).astype(np.uint8)
  out = np.full(xf.shape, max_int, np.uint8)
  out = np.where(denormal, denormal_x, out)
  out = np.where(normal, normal_x, out)
  sign_lp = ((sign >> np.uint32(28)) & np.uint32(8)).astype(np.uint8)
  return out | sign_lp


def per_tensor_amax_to_scale(amax) -> np.float32:
  return F32(amax) / F32(448.0 * 6.0)


def torchao_scaled(x: np.ndarray, per_tensor_scale=None):
  """torchao's `nvfp4_quantize` up to the clamped scaled data: (scales float8_e4m3fn
  (..., K/16), clamped x * reciprocal scale of x's shape)."""
  x = np.asarray(x, F32)
  data = x.reshape(x.shape[0], -1, 16)
  with np.errstate(all="ignore"):
    max_abs = np.max(np.abs(data), axis=-1)
    block_scale = max_abs / F32(6.0)
    eps, fp8_max = F32(2.0 ** -6), F32(448.0)
    if per_tensor_scale is None:
      scale8 = np.clip(block_scale, eps, fp8_max).astype(ml_dtypes.float8_e4m3fn)
      data_scaled = data * (F32(1.0) / scale8.astype(F32))[..., None]
    else:
      pts = F32(per_tensor_scale)
      scale8 = np.clip(block_scale / pts, eps, fp8_max).astype(ml_dtypes.float8_e4m3fn)
      reciprocal = (F32(1.0) / pts) / scale8.astype(F32)
      data_scaled = data * reciprocal[..., None]
    data_scaled = np.clip(data_scaled, F32(-6.0), F32(6.0)).reshape(x.shape)
  return scale8.reshape(x.shape[:-1] + (x.shape[-1] // 16,)), data_scaled


def torchao_quantize(x: np.ndarray, per_tensor_scale=None):
  """torchao's `nvfp4_quantize(x, 16, per_tensor_scale)`: (scales float8_e4m3fn (..., K/16),
  unpacked codes of x's shape)."""
  scale8, data_scaled = torchao_scaled(x, per_tensor_scale)
  return scale8, f32_to_f4_unpacked(data_scaled)


def torchao_dequantize(codes: np.ndarray, scale8: np.ndarray, per_tensor_scale=None) -> np.ndarray:
  """`NVFP4Tensor.dequantize(torch.float32)`: e2m1 * hp scale, the hp scale being
  float32(scale) or per_tensor_scale * float32(scale)."""
  data = FP4_VALUES[codes]
  with np.errstate(all="ignore"):
    hp = scale8.astype(F32)
    if per_tensor_scale is not None:
      hp = F32(per_tensor_scale) * hp
    blocks = data.reshape(codes.shape[:-1] + (codes.shape[-1] // 16, 16))
    return (blocks * hp[..., None]).reshape(codes.shape)


# -- the Hadamard transform ---------------------------------------------------------------------

def _butterflies(y: np.ndarray) -> np.ndarray:
  y = y.copy()
  with np.errstate(all="ignore"):
    for h in (8, 4, 2, 1):
      for j in range(16):
        if j & h == 0:
          a, b = y[..., j].copy(), y[..., j + h].copy()
          y[..., j], y[..., j + h] = a + b, a - b
  return y


def rht(x: np.ndarray) -> np.ndarray:
  """x (..., 16k) with every 16 consecutive elements of the last axis times D H16 / 4."""
  x = np.asarray(x, F32)
  blocks = x.reshape(x.shape[:-1] + (-1, 16))
  with np.errstate(all="ignore"):
    z = (blocks * TE_SIGNS) * F32(0.25)
  return _butterflies(z).reshape(x.shape)


def inverse_rht(y: np.ndarray) -> np.ndarray:
  """y times (D H16 / 4)^T per 16 elements: w = y * 0.25, butterflies, times the signs."""
  y = np.asarray(y, F32)
  blocks = y.reshape(y.shape[:-1] + (-1, 16))
  with np.errstate(all="ignore"):
    return (_butterflies(blocks * F32(0.25)) * TE_SIGNS).reshape(y.shape)
