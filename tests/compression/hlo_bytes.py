"""The bytes a compiled SPMD program's collectives move per device, averaged over the devices, read
from its HLO text (`jax.jit(f).lower(...).compile().as_text()`), independently of jlp: only the
collectives' result shapes, their source-target pairs and the while loops' trip counts are read.

Conventions (the ring algorithms of NCCL and gloo):
  all-to-all of B bytes in total        (W-1)/W * B   (the row a device keeps does not travel)
  all-gather with a result of B bytes   (W-1)/W * B   (each device's block to the W-1 others)
  all-reduce of B bytes                 2(W-1)/W * B  (reduce-scatter + all-gather)
  collective-permute of B bytes         B * (pairs with source != target) / W
A collective inside a while loop counts once per iteration (its known_trip_count); a collective
inside any other called computation (a conditional's branch) is an error.
"""

import re

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (" + "|".join(_COLLECTIVES) +
                          r"|while|conditional)(?:-start)?\(")


def _type_bytes(text: str) -> int:
  """Bytes of the array shapes in a result type such as `(f32[1,2]{1,0}, s32[3]{0})`."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%(\S+) .*\{\s*$", line)
    if header:
      name = header.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        comps["__entry__"] = comps[name]
    elif name is not None:
      comps[name].append(line)
  return comps


def collective_bytes(hlo: str, num_devices: int) -> tuple[float, list[tuple[str, float]]]:
  """(bytes per device averaged over the devices, [(collective kind, bytes), ...])."""
  comps = _computations(hlo)
  w = num_devices
  found: list[tuple[str, float]] = []

  def visit(name: str, times: int) -> None:
    for line in comps[name]:
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      result, op = m.groups()
      if op == "while":
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        assert trip, f"a while loop without a known trip count: {line[:200]}"
        visit(re.search(r"body=%(\S+?)[,\s]", line).group(1), times * int(trip.group(1)))
        continue
      if op == "conditional":
        for branch in re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[-1]):
          if branch in comps:
            assert not any(_INSTRUCTION.match(l) for l in comps[branch]
                           if re.search("|".join(_COLLECTIVES), l)), "a collective in a branch"
        continue
      size = _type_bytes(result)
      if op == "all-reduce":
        moved = 2 * (w - 1) / w * size
      elif op in ("all-to-all", "all-gather"):
        moved = (w - 1) / w * size
      else:
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line).group(1)
        pairs = re.findall(r"\{(\d+),(\d+)\}", pairs)
        moved = size * sum(1 for s, t in pairs if s != t) / w
      found.extend([(op, moved)] * times)

  visit("__entry__", 1)
  return sum(b for _, b in found), found
