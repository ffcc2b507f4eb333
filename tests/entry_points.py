"""The entry points as tests run them: `entry_point` starts `python -m module` as a real process
(what a user's shell runs); `run_main` runs it in the test's own process, for what it prints and
the status it exits with (no start-up and imports: about 2 s less per call)."""

import contextlib
import importlib
import io
import os
import subprocess
import sys
import warnings

from absl import flags, logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def entry_point(module, *args, timeout=180, env=None):
  env = dict(os.environ if env is None else env, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # what a user's shell has: one CPU device
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _own_flags():
  """absl's global flag registry as a fresh process has it (absl's own flags only) for the
  duration: the flags of modules imported before (other tests import entry points whose flags
  share names) are set aside, and the registry is put back as it was afterwards."""
  registry = flags.FLAGS
  saved = {k: {kk: list(vv) if isinstance(vv, list) else vv for kk, vv in v.items()}
           if isinstance(v, dict) else v for k, v in registry.__dict__.items()}
  for module, defined in registry.flags_by_module_dict().items():
    if not module.startswith("absl."):
      for flag in defined:
        for name in (flag.name, flag.short_name):
          if name and name in registry:
            delattr(registry, name)
  try:
    yield
  finally:
    registry.__dict__.update(saved)


def run_main(module, *args):
  """`python -m module *args` in this process: the module imported afresh, its flags parsed as
  `jlp.train.cli.run` parses them (sys.argv set: ml_collections reads --config.* overrides
  there), its main called in the repository root. Returns (exit status, stdout, stderr). For
  what an entry point prints and the status it exits with; the tests that check a real process
  (its devices, exit status and streams) start one with `entry_point`."""
  from jlp.train import cli  # pylint: disable=g-import-not-at-top
  out, err = io.StringIO(), io.StringIO()
  argv, cwd, verbosity = sys.argv, os.getcwd(), logging.get_verbosity()
  status = 0
  with _own_flags():
    sys.modules.pop(module, None)
    try:
      sys.argv = [module, *args]
      os.chdir(ROOT)
      with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
          warnings.catch_warnings():
        # config_flags' loader (a DeprecationWarning, which a program's own modules do not show)
        warnings.filterwarnings("ignore", "the load_module", DeprecationWarning)
        try:
          importlib.import_module(module).main(cli.parse_flags(sys.argv))
        except SystemExit as e:
          status = 0 if e.code is None else e.code
    finally:
      sys.argv = argv
      os.chdir(cwd)
      sys.modules.pop(module, None)
      logging.set_verbosity(verbosity)
  return status, out.getvalue(), err.getvalue()
