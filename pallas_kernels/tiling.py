"""Tile-size helpers shared by the kernels (Triton needs power-of-two block shapes)."""


def is_power_of_two(n: int) -> bool:
  return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def num_warps(tile_elements: int) -> int:
  """1 warp per 256 elements of a tile, 1 to 8."""
  return max(1, min(8, tile_elements // 256))
