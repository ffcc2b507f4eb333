"""The notebooks' set-up: install a jlp clone and make `jlp`, `configs` and `experiments` importable.

The first code cell of every notebook does two things:
1. It looks for a jlp checkout: the folder above the notebook (a Jupyter started in `notebooks/`),
   the current folder, `./jlp_src` (an earlier clone), or a folder on `sys.path` (PYTHONPATH). If
   there is none, as on Colab, it clones `JLP_REPO_URL` into `./jlp_src`. That step must run
   before this module exists, so it is in the cell; it checks `git clone`'s exit status itself.
2. It imports this module from the checkout and calls `setup(root, install=...)`.

`setup` puts the checkout first on `sys.path` (so `import configs` and `import experiments` work,
though `pip install` installs only `jlp` and `pallas_kernels`), and, for a clone the cell made
(`install=True`), installs it with `pip install -c constraints.txt -e .` (the `gpu` extra on a
machine with an NVIDIA GPU), unless that clone is installed already. A checkout of your own is
never installed: use its `.venv` (`make venv`) as the kernel.

Every command's exit status is checked: a failing command raises `SetupError`, whose message
names the command, its exit status and the end of its output. If the install replaced a module
that this Python process had already imported, `setup` raises `RestartRequired`: restart the
runtime and run the notebook again from the top (the cell then skips the clone and the install).

This file uses only the standard library, so it runs before anything is installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Sequence

#: Where the cell clones jlp when it finds no checkout (not "jlp": a folder of that name in the
#: current directory would shadow the package).
CLONE_DIR = "jlp_src"


class SetupError(RuntimeError):
  """A set-up step failed; the message says which command, and what to do."""


class RestartRequired(RuntimeError):
  """The install replaced modules this process has imported: restart the runtime."""


def run(cmd: Sequence[str], cwd: str | None = None) -> str:
  """Runs `cmd` (no shell), returns its output; raises SetupError if its exit status is not 0.

  The output is captured (a notebook does not show a child process's output) and the last 20
  lines of it go into the error message."""
  shown = " ".join(cmd)
  try:
    done = subprocess.run(list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, check=False)
  except OSError as e:  # the program is missing
    raise SetupError(f"`{shown}` could not start: {e}") from None
  if done.returncode != 0:
    tail = "\n".join(done.stdout.strip().splitlines()[-20:])
    raise SetupError(f"`{shown}` failed with exit status {done.returncode}"
                     + (f" (in {cwd})" if cwd else "") + (f":\n{tail}" if tail else "."))
  return done.stdout


def has_nvidia_gpu() -> bool:
  """True when `nvidia-smi` exists and lists a GPU (a probe: its failure is not an error)."""
  if shutil.which("nvidia-smi") is None:
    return False
  try:
    out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, check=False, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return out.returncode == 0 and "GPU" in out.stdout


def installed_from() -> str | None:
  """The folder of this Python's editable jlp install (pip's direct_url.json), or None."""
  importlib.invalidate_caches()
  try:
    text = importlib.metadata.distribution("jlp").read_text("direct_url.json")
  except importlib.metadata.PackageNotFoundError:
    return None
  url = json.loads(text).get("url", "") if text else ""
  return os.path.realpath(url[len("file://"):]) if url.startswith("file://") else None


def pip_install_command(root: str, gpu: bool) -> list[str]:
  """`python -m pip install -q -c constraints.txt -e .` (or `-e .[gpu]`), run in `root`."""
  return [sys.executable, "-m", "pip", "install", "-q", "-c", "constraints.txt", "-e",
          ".[gpu]" if gpu else "."]


def stale_modules() -> list[str]:
  """Imported top-level modules whose installed version is no longer the one loaded:
  "numpy 1.26.4 (installed now: 2.5.0)" per module."""
  importlib.invalidate_caches()
  owners = importlib.metadata.packages_distributions()
  stale = []
  for name, module in sorted(sys.modules.items()):
    if "." in name or name not in owners:
      continue
    try:
      with warnings.catch_warnings():  # some modules deprecate __version__
        warnings.simplefilter("ignore")
        loaded = getattr(module, "__version__", None)
    except Exception:  # pylint: disable=broad-except
      continue
    if not isinstance(loaded, str):
      continue
    installed = []
    for dist in owners[name]:
      try:
        installed.append(importlib.metadata.version(dist))
      except importlib.metadata.PackageNotFoundError:
        pass
    if installed and loaded not in installed:
      stale.append(f"{name} {loaded} (installed now: {installed[0]})")
  return stale


def setup(root: str, install: bool, gpu: bool | None = None) -> str:
  """Makes the checkout `root` importable, and installs it if `install`; returns its absolute path.

  install: True for a clone the set-up cell made (Colab): `pip install -c constraints.txt -e .`
    in `root`, skipped when this Python's jlp is already an editable install of `root`. False
    for your own checkout: nothing is installed.
  gpu: install the `gpu` extra (jax[cuda12]); None: when `nvidia-smi` lists a GPU.
  Raises SetupError if a command fails, RestartRequired if the runtime must be restarted."""
  root = os.path.realpath(root)
  if not os.path.isfile(os.path.join(root, "constraints.txt")):
    raise SetupError(f"{root} is not a jlp checkout (it has no constraints.txt).")
  if root in sys.path:
    sys.path.remove(root)
  sys.path.insert(0, root)  # `configs` and `experiments` are not installed by pip: import them from here
  if not install:
    print(f"jlp checkout: {root} (first on sys.path; nothing installed)")
    return root
  if installed_from() == root:
    print(f"jlp: {root} is installed already")
    return root
  gpu = has_nvidia_gpu() if gpu is None else gpu
  cmd = pip_install_command(root, gpu)
  print(f"installing jlp from {root}: {' '.join(cmd[1:])} (a few minutes) ...", flush=True)
  run(cmd, cwd=root)
  stale = stale_modules()
  if stale:
    raise RestartRequired(
        "jlp is installed, but this runtime had already imported older versions of "
        + ", ".join(stale) + ". Restart the runtime (Colab: Runtime > Restart session), then run "
        "the notebook again from the top; this cell will skip the clone and the install.")
  print("jlp installed; no restart needed")
  return root
