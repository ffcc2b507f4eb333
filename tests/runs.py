"""Helpers of the tests that compare training runs: a small digits config, metrics rows without
their timing fields, the newest checkpoint of a run directory as flat arrays, and bitwise
equality of two pytrees."""

import os
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp

#: Metrics fields that depend on the wall clock, not on the run's values.
VOLATILE = ("time", "throughput", "compile_seconds", "save_seconds")


def small_digits(**fields):
  """configs/digits.py with an 8-wide CNN and batches of 64, then each top-level `fields` entry
  set."""
  from configs import digits  # pylint: disable=g-import-not-at-top
  c = digits.get_config()
  c.model.kwargs.width = 8
  c.batch_size = 64
  for k, v in fields.items():
    c[k] = v
  return c


def stable(rows):
  """metrics.jsonl rows without the VOLATILE fields."""
  return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def final_checkpoint(workdir):
  """(step, {keystr(path): array}) of the newest checkpoint of `workdir` (restored without a
  target)."""
  directory = os.path.join(workdir, "checkpoints")
  step = max(int(d) for d in os.listdir(directory) if d.isdigit())
  with ocp.CheckpointManager(directory, item_names=("state", "meta")) as mgr:
    restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                         meta=ocp.args.JsonRestore()))
  leaves = jax.tree_util.tree_flatten_with_path(restored.state)[0]
  return step, {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def assert_trees_equal(got, want):
  """The same tree structure and, leaf by leaf, the same values (named by path when not)."""
  flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
  assert tree_got == tree_want
  for (path, g), (_, w) in zip(flat_got, flat_want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


def sigint_before(method):
  """`method` wrapped to send this process SIGINT first: a Ctrl-C during that call."""
  def wrapped(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return method(self, *args, **kwargs)
  return wrapped
