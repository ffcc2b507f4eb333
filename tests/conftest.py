"""Test set-up: 8 emulated CPU devices (set before jax is imported)."""
import gc
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache per test process (models built in several tests compile their
# eager initialisers and steps once), fresh each session so suite timings do not depend on earlier
# runs. One directory per xdist worker: jax writes a cache entry in place, without a lock, so a
# worker reading an entry another one is writing can load a truncated executable and abort.
# The process that makes the directory (xdist's controller, or the only process) removes it at
# exit: a suite run leaves about 120 MB there.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  os.environ["JLP_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jlp-tests-xla-cache-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  atexit.register(shutil.rmtree, os.environ["JLP_TEST_XLA_CACHE"], ignore_errors=True)
if "JLP_TEST_XLA_CACHE" in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
      os.environ["JLP_TEST_XLA_CACHE"], os.environ.get("PYTEST_XDIST_WORKER", "main"))
# Set by whoever runs the suite (the default tier then compiles as it says; see below).
_OPTIMIZATIONS_CHOSEN = "JAX_DISABLE_MOST_OPTIMIZATIONS" in os.environ
sys.path.insert(0, os.path.dirname(__file__))  # tests/references.py


import pytest  # noqa: E402  (after XLA_FLAGS)


@pytest.fixture
def fast_compile():
  """Turns XLA's optimisation passes off for one test (the tiny-model tests spend most of their
  time compiling: e.g. 14 s for the tiny FCN's gradient, ~4x less without them). The default tier
  runs so throughout (`pytest_configure`); this keeps it for such tests in the slow tier."""
  import jax  # pylint: disable=g-import-not-at-top
  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
# Seconds per event of _COMPILE_EVENTS since the last test phase's report, in this process.
_compile_seconds = [0.0] * len(_COMPILE_EVENTS)
# nodeid: (seconds per event of _COMPILE_EVENTS, total seconds)
_compile_by_test: dict[str, tuple[list[float], float]] = {}


def _freeze_the_survivors_of_a_full_collection(phase: str, info: dict) -> None:
  """CPython's full (generation 2) collection scans every object the collector tracks, and it
  runs each time their number has grown by a quarter. A test process accumulates millions of
  long-lived objects (jax's caches of traced, lowered and compiled programs), so in a suite run
  the two workers' full collections took 52 s, about 0.7 s each. Moving the survivors of each full
  collection out of the collector's sight (gc.freeze) makes the next one scan only what was made
  since: 6 s. What is frozen is still freed by reference counting; a reference cycle among
  frozen objects is not. That costs little memory: the workers' peaks were 3.9–4.1 GB and
  2.2–2.4 GB, against 4.0 GB and 1.9 GB without. BENCHMARKS.md, "The default test tier, fourth
  pass"."""
  if phase == "stop" and info["generation"] == 2:
    gc.freeze()


def pytest_addoption(parser):
  parser.addoption(
      "--compile-times", type=int, default=0, metavar="N",
      help="list the N tests that spent the most seconds tracing, lowering and compiling JAX "
           "programs, each of the three apart, beside their durations (this process's "
           "compiles: a test's subprocesses are not counted; hits of the persistent "
           "compilation cache cost no backend compile)")


def pytest_configure(config):
  # The default tier ("not slow") compiles with XLA's LLVM optimisation level 0 (jax's
  # disable_most_optimizations), here and in the processes its tests start: the same HLO passes,
  # so the same fusions and the same order of every sum, hence the same numbers, compiled faster
  # and run slower. Most of this tier's time is XLA compiling small programs; its backend compile
  # took 882 s instead of 1015 s (docs/setup.md, "Faster CPU runs"). The slow tier, where programs
  # run long and some tests time them, compiles fully optimised, as does a run with
  # JAX_DISABLE_MOST_OPTIMIZATIONS set (`JAX_DISABLE_MOST_OPTIMIZATIONS=0 make test`).
  import jax  # pylint: disable=g-import-not-at-top
  default_tier = config.option.markexpr.replace(" ", "") == "notslow"
  if default_tier:  # measured there; the slow tier's tests hold large arrays, and it has time
    gc.callbacks.append(_freeze_the_survivors_of_a_full_collection)
  if not _OPTIMIZATIONS_CHOSEN and default_tier:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)
  if config.getoption("compile_times"):

    def listen(event: str, seconds: float, **_) -> None:
      if event in _COMPILE_EVENTS:
        _compile_seconds[_COMPILE_EVENTS.index(event)] += seconds
    jax.monitoring.register_event_duration_secs_listener(listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  if item.config.getoption("compile_times"):
    outcome.get_result().user_properties.append(("compile_s", tuple(_compile_seconds)))
    _compile_seconds[:] = [0.0] * len(_COMPILE_EVENTS)


def pytest_runtest_logreport(report):
  compile_s = [v for k, v in report.user_properties if k == "compile_s"]
  if compile_s:  # --compile-times is on
    c, t = _compile_by_test.get(report.nodeid, ([0.0] * len(_COMPILE_EVENTS), 0.0))
    _compile_by_test[report.nodeid] = ([a + sum(b) for a, b in zip(c, zip(*compile_s))],
                                       t + report.duration)


def pytest_terminal_summary(terminalreporter, config):
  n = config.getoption("compile_times")
  if not n or not _compile_by_test:
    return
  trace_s, lower_s, backend_s = (sum(c[i] for c, _ in _compile_by_test.values())
                                 for i in range(len(_COMPILE_EVENTS)))
  compile_s = trace_s + lower_s + backend_s
  total_s = sum(t for _, t in _compile_by_test.values())
  terminalreporter.section(f"{n} tests with the most compile seconds")
  terminalreporter.write_line(
      f"all tests: {compile_s:.1f} s compiling of {total_s:.1f} s "
      f"({compile_s / max(total_s, 1e-9):.0%}): tracing {trace_s:.1f} s, lowering to StableHLO "
      f"{lower_s:.1f} s, XLA's backend compile {backend_s:.1f} s")
  terminalreporter.write_line("compile   trace   lower backend   total")
  for nodeid, (c, t) in sorted(_compile_by_test.items(), key=lambda kv: -sum(kv[1][0]))[:n]:
    terminalreporter.write_line(
        f"{sum(c):7.2f} {c[0]:7.2f} {c[1]:7.2f} {c[2]:7.2f} {t:7.2f}  {nodeid}")
