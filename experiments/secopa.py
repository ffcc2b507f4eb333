r"""SeCoPa's plan for a list of gradients (HiPress's `SeCoPa.py`, docs/hipress.md).

  python -m experiments.secopa --input=input.txt --output=plan.txt --topology=PS --nnodes=16

reads HiPress's input.txt (`name,num_float32_elements` per line) and writes its SeCoPaPlan.txt
(`name,size,y|n,K` per line: compress or not, K partitions), byte for byte what HiPress's script
writes for the same flags. --topology is PS or RING (any case); --nnodes is 4, 8 or 16 with
HiPress's coefficients (its local cluster).

Coefficients measured on this machine instead (jlp.compression.profile.fit_cost_model):

  python -m experiments.secopa --fit --nnodes=8 --profile=coeffs.json ...   fit on the first
      --nnodes devices (on CPU, that many emulated devices), save the fit to coeffs.json, plan
      with it (--compressor: the codec to time, default tbq; --fit_sizes: element counts)
  python -m experiments.secopa --compressor=onebit ...   plan each gradient with onebit's own
      payload size (wire_bytes(ceil(S/K)) / 4 float32s) instead of HiPress's 1/16 for every codec
  python -m experiments.secopa --profile=coeffs.json --nnodes=8 ...          plan with a saved
      fit (a JSON cost model: CostModel.save / fit_cost_model)

Errors (unreadable input, a malformed line, a node count the model lacks, a bad flag) print one
line and exit with status 2.
"""

import os

from absl import flags, logging

from jlp.train import cli

_INPUT = flags.DEFINE_string("input", "input.txt", "Gradients: one 'name,num_elements' per line.")
_OUTPUT = flags.DEFINE_string("output", "SeCoPaPlan.txt", "Plan: one 'name,size,y|n,K' per line.")
_TOPOLOGY = flags.DEFINE_string("topology", "PS", "PS (CaSync-PS) or RING (CaSync-Ring).")
_NNODES = flags.DEFINE_integer("nnodes", 16, "Cluster size N.")
_FIT = flags.DEFINE_bool("fit", False, "Fit the cost model on this machine's devices first.")
_PROFILE = flags.DEFINE_string("profile", None, "Cost model JSON: written by --fit, else read.")
_COMPRESSOR = flags.DEFINE_string(
    "compressor", "tbq", "With --fit: the compressor to time. Given explicitly: also plan with "
    "its own payload size per partition instead of HiPress's 1/16 for every codec.")
_FIT_SIZES = flags.DEFINE_list("fit_sizes", None, "With --fit: element counts to time "
                               "(default 2^10..2^20).")


def cost_model(nnodes: int):
  """The cost model the flags ask for: None (HiPress's), a saved one, or a fresh fit."""
  from jlp.compression import secopa  # pylint: disable=g-import-not-at-top
  if not _FIT.value:
    return None if _PROFILE.value is None else secopa.CostModel.load(_PROFILE.value)
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={max(nnodes, 1)}").strip()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jlp.compression import profile  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  if not 2 <= nnodes <= len(devices):
    cli.fail(f"--nnodes={nnodes} is not allowed with --fit; expected 2..{len(devices)} "
         f"(the {devices[0].platform} devices here).")
  kwargs = {}
  if _FIT_SIZES.value:
    try:
      kwargs["sizes"] = [int(s) for s in _FIT_SIZES.value]
    except ValueError:
      cli.fail(f"--fit_sizes={','.join(_FIT_SIZES.value)!r} is not allowed; expected ints.")
  mesh = jax.sharding.Mesh(np.array(devices[:nnodes]), ("d",))
  model = profile.fit_cost_model(mesh, "d", compressor=_COMPRESSOR.value, **kwargs)
  if _PROFILE.value is not None:
    model.save(_PROFILE.value)
    print(f"wrote {_PROFILE.value} ({model.source})")
  return model


def main(argv):
  if len(argv) > 1:
    cli.fail(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from jlp.compression import secopa  # pylint: disable=g-import-not-at-top
  try:
    model = cost_model(_NNODES.value)
    grads = secopa.read_grads(_INPUT.value)
    # HiPress plans every codec at 1/16; a named --compressor is planned at its own size.
    compressor = _COMPRESSOR.value if flags.FLAGS["compressor"].present else None
    plan = secopa.secopa_plan(grads, num_nodes=_NNODES.value, topology=_TOPOLOGY.value,
                              cost_model=model, compressor=compressor)
    secopa.write_plan(_OUTPUT.value, plan)
  except (ValueError, OSError) as e:
    cli.fail(str(e))
  compressed = sum(e.compress for e in plan)
  source = (model or secopa.CostModel.seed()).source
  print(f"wrote {_OUTPUT.value}: {compressed} of {len(plan)} gradients compressed "
        f"({_TOPOLOGY.value.lower()}, N={_NNODES.value}, {source})")


if __name__ == "__main__":
  cli.run(main)
