"""Helpers shared by the kernels: tile sizes (Triton needs power-of-two block shapes) and
argument checks."""


def is_power_of_two(n: int) -> bool:
  return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def num_warps(tile_elements: int) -> int:
  """1 warp per 256 elements of a tile, 1 to 8."""
  return max(1, min(8, tile_elements // 256))


def checked_rbits(x, rbits, rounding: str):
  """The stochastic-rounding draws as a uint32 array of x's shape (None unless stochastic).

  Raises:
    ValueError: stochastic rounding without rbits, or rbits of another shape or dtype.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if rounding != "stochastic":
    return None
  if rbits is None:
    raise ValueError("stochastic rounding needs rbits (uint32, x.shape)")
  rbits = jnp.asarray(rbits)
  if rbits.shape != x.shape or rbits.dtype != jnp.uint32:
    raise ValueError(f"rbits has shape {rbits.shape} and dtype {rbits.dtype}; "
                     f"expected {x.shape} and uint32.")
  return rbits
