"""What the `experiments/` entry points share: one-line errors for bad flags and configs, and
`--cpu_devices`.

    from jlp.train import cli
    cli.define_cpu_devices()
    ...
    def main(argv):
      cli.apply_cpu_devices()          # before anything touches a JAX device
      ...
    if __name__ == "__main__":
      cli.run(main)

`run` parses the flags itself: a misspelled `--config.FIELD`, a value of the wrong type, a missing
config file or required flag ends the program with at most three lines on stderr (the flag, what
was given, what is allowed or "did you mean") and exit status 2, instead of absl's traceback.
`fail` does the same for errors found later (ValueError from `jlp.train.config.validate`, ...).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import jax
from absl import app, flags

from jlp.train.config import DEVICE_HINT

__all__ = ["DEVICE_HINT", "apply_cpu_devices", "config_value", "define_cpu_devices", "elements",
           "fail", "run"]

USAGE_HINT = "see --helpshort; the config fields are documented in jlp/train/config.py"


def define_cpu_devices(default: int | None = None) -> None:
  """Defines --cpu_devices (emulated CPU devices; None: what XLA shows, usually one)."""
  flags.DEFINE_integer("cpu_devices", default,
                       "Emulate this many CPU devices (set before JAX starts; default: "
                       f"{'what XLA shows' if default is None else default}).", lower_bound=1)


def apply_cpu_devices(count: int | None = None) -> None:
  """Makes the CPU backend show `count` devices (default: the --cpu_devices flag). Must run
  before anything touches a JAX device; a no-op when the count is None."""
  if count is None:
    count = flags.FLAGS["cpu_devices"].value if "cpu_devices" in flags.FLAGS else None
  if count is None:
    return
  try:
    jax.config.update("jax_num_cpu_devices", int(count))
  except RuntimeError:
    if jax.local_device_count() != count:
      fail(f"--cpu_devices={count} came too late: JAX already started with "
           f"{jax.local_device_count()} devices; expected it before any JAX computation.")


def fail(message: str, hint: str | None = None) -> NoReturn:
  """Prints `error: message` (and one hint line) to stderr and exits with status 2."""
  print(f"error: {message}", file=sys.stderr)
  if hint:
    print(hint, file=sys.stderr)
  sys.exit(2)


def elements(text: str, flag: str) -> int:
  """An element count given as --FLAG=TEXT, with an optional K (2^10) or M (2^20) suffix ("64K",
  "1M"); anything else fails with one line naming --FLAG."""
  scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
  number = text[:-1] if scale > 1 else text
  if not number.isdigit() or int(number) < 1:
    fail(f"--{flag}={text!r} is not allowed; expected a positive integer with an optional K or M "
         "suffix.")
  return int(number) * scale


_DID_YOU_MEAN = re.compile(r'Did you mean \\?"([^"\\]+)\\?" instead of \\?"([^"\\]+)\\?"')
_KEY = re.compile(r"'\\*'?([A-Za-z0-9_]+)\\*'?")


def _override(argv: Sequence[str], key: str) -> str:
  """The command-line argument that sets field `key` (or names it), for the message."""
  for arg in argv:
    name = arg.split("=", 1)[0]
    if name.startswith("--") and re.search(rf"[.]{re.escape(key)}$", name):
      return arg
  return f"--...{key}"


def _config_error(error: BaseException, argv: Sequence[str]) -> str:
  text = str(error)
  match = _DID_YOU_MEAN.search(text)
  if match:
    suggestion, key = match.groups()
    return (f"{_override(argv, key)} is not allowed: the config has no field {key!r}; did you "
            f"mean {suggestion!r}?")
  if isinstance(error, (AttributeError, KeyError)):
    key_match = _KEY.search(text)
    key = key_match.group(1) if key_match else text
    return f"{_override(argv, key)} is not allowed: the config has no field {key!r}."
  if isinstance(error, OSError) and "Failed loading config file" in text:
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "?")
    reason = text.strip().splitlines()[-1].strip()
    return (f"--config={path} is not allowed: the file could not be loaded ({reason}); "
            "expected a config file such as configs/digits.py[:ARG].")
  return " ".join(text.split())


def config_value(holder: flags.FlagHolder):
  """The config of a `config_flags.DEFINE_config_file` flag; a file that failed to load ends the
  program with one line (ml_collections raises only when the value is first read)."""
  try:
    value = holder.value
    value.keys()  # a failed load is a proxy that raises on first use
    return value
  except OSError as e:
    fail(_config_error(e, sys.argv), USAGE_HINT)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors (exit 2); returns the remaining arguments."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(" ".join(str(e).split()), USAGE_HINT)
  except (AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    fail(_config_error(e, argv), USAGE_HINT)


def run(main: Callable[[list[str]], None]) -> None:
  """`absl.app.run(main)` with `parse_flags`."""
  app.run(main, flags_parser=parse_flags)
