"""Validation helpers shared by the configuration dataclasses: the one-line error of a bad field
("field=given is not allowed; expected allowed.") and the integer test that rejects bools."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["invalid", "is_int"]


def invalid(field: str, given: Any, allowed: str) -> ValueError:
  """The ValueError of a bad field: which field, what was given, what is allowed."""
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def is_int(value: Any) -> bool:
  """Whether value is a Python or numpy integer (bools are not)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
