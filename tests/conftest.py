"""Test set-up: 8 emulated CPU devices (set before jax is imported)."""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache per test process (models built in several tests compile their
# eager initialisers and steps once), fresh each session so suite timings do not depend on earlier
# runs. One directory per xdist worker: jax writes a cache entry in place, without a lock, so a
# worker reading an entry another one is writing can load a truncated executable and abort.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile  # pylint: disable=g-import-not-at-top
  os.environ["JLP_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jlp-tests-xla-cache-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
if "JLP_TEST_XLA_CACHE" in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
      os.environ["JLP_TEST_XLA_CACHE"], os.environ.get("PYTEST_XDIST_WORKER", "main"))
sys.path.insert(0, os.path.dirname(__file__))  # tests/references.py


import pytest  # noqa: E402  (after XLA_FLAGS)


@pytest.fixture
def fast_compile():
  """Turns XLA's optimisation passes off for one test (the tiny-model tests spend most of their
  time compiling: e.g. 14 s for the tiny FCN's gradient, ~4x less without them)."""
  import jax  # pylint: disable=g-import-not-at-top
  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)
