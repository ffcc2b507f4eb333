"""The programs XLA compiles while a block of test code runs (jax's compile events)."""

import contextlib
from collections.abc import Iterator

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[str]]:
  """Yields a list that collects the name of every program compiled inside the block (e.g.
  "jit(_matmul_xla)"); a hit of the persistent compilation cache is no compile."""
  names: list[str] = []

  def listen(event: str, _: float, **kwargs) -> None:
    if event == BACKEND_COMPILE:
      names.append(kwargs.get("fun_name"))
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
