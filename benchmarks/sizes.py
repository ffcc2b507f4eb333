"""Element counts on the benchmarks' command lines: 16M, 64K, 1000."""

from absl import app


def parse_size(text: str, field: str = "--sizes entry") -> int:
  """A size such as 16M, 64K or 1000 (UsageError naming `field` otherwise)."""
  mult = {"K": 2 ** 10, "M": 2 ** 20}.get(text[-1:].upper(), 1)
  try:
    n = int(text[:-1] if mult > 1 else text) * mult
  except ValueError:
    n = 0
  if n <= 0:
    raise app.UsageError(f"{field} {text!r} is not allowed; expected a positive int, "
                         "optionally with a K or M suffix.")
  return n


def size_label(n: int) -> str:
  for suffix, unit in (("M", 2 ** 20), ("K", 2 ** 10)):
    if n % unit == 0:
      return f"{n // unit}{suffix}"
  return str(n)
