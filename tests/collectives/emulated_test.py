"""jlp.collectives.emulated_allreduce: equal bit for bit to allreduce on real devices, and to
plain-Python references of cpd.md §3.2.

References: `allreduce` run on 8 emulated CPU devices (the emulation must reproduce it bit for
bit) and `collective_refs` (Python loops from the spec, numpy float32 arithmetic,
`references.round_to_format` as the per-element cast, never jlp code).
"""

import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))  # collective_refs (--import-mode=importlib)
import collective_refs as cref  # noqa: E402
from device_runs import mesh_of, on_ranks, random_nodes, stack  # noqa: E402
import references as ref  # noqa: E402
from jlp import FloatFormat  # noqa: E402
from jlp.collectives import emulated_allreduce  # noqa: E402

# XLA optimisations off: most of these tests' time is compiling (values do not change:
# every operation is an exactly rounded float32 op or an integer op).
pytestmark = pytest.mark.usefixtures("fast_compile")
F32 = np.float32


def on_devices(nodes, **options):
  """allreduce with one node per device; rank 0's result per leaf."""
  return [o[0] for o in on_ranks(nodes, **options)]


def emulated_one_device(nodes, **options):
  return [np.asarray(o) for o in jax.jit(
      lambda xs: emulated_allreduce(xs, **options))(stack(nodes))]


def emulated_on_mesh(nodes, w, **options):
  """nodes split over w devices (device d holds nodes d*N .. d*N + N-1); device 0's result."""
  return emulated_on_mesh_each(nodes, w, options)[0]


def emulated_on_mesh_each(nodes, w, *option_sets):
  """emulated_on_mesh for each option set, all in one program (one compile; the parts the
  sets share are compiled once): per option set, device 0's result per leaf."""
  def body(*xs):
    return tuple(o[None] for options in option_sets
                 for o in emulated_allreduce(list(xs), axis_name="r", **options))
  fn = jax.jit(jax.shard_map(body, mesh=mesh_of(w), in_specs=P("r"), out_specs=P("r")))
  outs = [np.asarray(o) for o in fn(*stack(nodes))]
  for o in outs:
    for d in range(1, w):
      ref.assert_same_bits(o[d], o[0], msg=f"device {d} differs from device 0")
  leaves = len(nodes[0])
  return [[o[0] for o in outs[i * leaves:(i + 1) * leaves]] for i in range(len(option_sets))]


# The option sets of allreduce_test's reference test (their device runs are compiled once).
CASES = [
    dict(fmt=None, kahan=True, aps=False, mean=True),
    dict(fmt=FloatFormat(5, 2), kahan=True, aps=False, mean=False),
    dict(fmt=FloatFormat(4, 3), kahan=False, aps=True, mean=True),
    dict(fmt=FloatFormat(4, 3), kahan=True, aps="cpd", mean=False),
]


@pytest.mark.parametrize("algorithm", ["sequential", "ring"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_one_device_equals_eight_devices_bit_for_bit(algorithm, case):
  nodes = random_nodes(8, seed=1)
  want = on_devices(nodes, algorithm=algorithm, **case)
  got = emulated_one_device(nodes, algorithm=algorithm, **case)
  for g, w in zip(got, want, strict=True):
    ref.assert_same_bits(g, w, msg=f"{algorithm} {case}")


@pytest.mark.parametrize("algorithm", ["sequential", "ring"])
def test_three_nodes_match_python_reference(algorithm):
  """N = 3 does not divide the leaf sizes 35, 1, 16: the ring pads."""
  nodes = random_nodes(3, seed=2)
  got = emulated_one_device(nodes, fmt="e4m3", algorithm=algorithm, kahan=True, aps=True)
  want = cref.allreduce(nodes, FloatFormat(4, 3), algorithm, True, True)
  for g, w in zip(got, want, strict=True):
    ref.assert_same_bits(g, w)


@pytest.mark.parametrize("algorithm", ["sequential", "ring"])
def test_flat_four_devices_times_two_nodes_equals_eight_devices(algorithm):
  nodes = random_nodes(8, seed=3)
  options = dict(fmt=FloatFormat(4, 3), algorithm=algorithm, kahan=True, aps=True, mean=True)
  got = emulated_on_mesh(nodes, 4, form="flat", **options)
  want = on_devices(nodes, **options)
  for g, w in zip(got, want, strict=True):
    ref.assert_same_bits(g, w)


@pytest.mark.parametrize("fmt, aps, kahan, algorithm", [
    (None, False, False, "sequential"),
    (FloatFormat(4, 3), False, True, "sequential"),
    (FloatFormat(4, 3), True, True, "ring"),
    (FloatFormat(5, 2), "cpd", False, "sequential"),
], ids=str)
def test_cpd_two_level_matches_python_reference(fmt, aps, kahan, algorithm):
  """4 devices x 2 virtual nodes: local APS (multiplier 2), plain fold, then the 4-way allreduce."""
  nodes = random_nodes(8, seed=4)
  options = dict(fmt=fmt, aps=aps, kahan=kahan, algorithm=algorithm, mean=True)
  got, flat = emulated_on_mesh_each(nodes, 4, dict(form="cpd", **options),
                                    dict(form="flat", **options))
  per_device = [nodes[2 * d:2 * d + 2] for d in range(4)]
  want = cref.cpd_two_level(per_device, fmt, aps, kahan, cast_single=False, mean=True,
                            algorithm=algorithm)
  for g, w in zip(got, want, strict=True):
    ref.assert_same_bits(g, w)
  if fmt is not None:  # two levels round differently from one flat reduction
    assert any(not ref.same_bits(a, b).all() for a, b in zip(got, flat, strict=True))


@pytest.mark.parametrize("aps", [False, True])
def test_cpd_single_node_skip_and_always_cast(aps):
  """N == 1: ResNet18 (cast_single=False) hands g over uncast, ResNet50 (True) casts it first."""
  nodes = random_nodes(4, seed=5)
  fmt = FloatFormat(3, 1)
  results = dict(zip((False, True), emulated_on_mesh_each(
      nodes, 4, *(dict(form="cpd", fmt=fmt, aps=aps, cast_single=c) for c in (False, True)))))
  for cast_single, got in results.items():
    want = cref.cpd_two_level([[node] for node in nodes], fmt, aps, False, cast_single)
    for g, w in zip(got, want, strict=True):
      ref.assert_same_bits(g, w, msg=f"cast_single={cast_single}")
  assert any(not ref.same_bits(a, b).all()
             for a, b in zip(results[False], results[True], strict=True))


def test_cpd_local_level_only_and_its_zero_guard():
  """axis_name=None: only the local level. CPD's emulation loop guards all-zero grads (shift 0)."""
  nodes = random_nodes(4, seed=6)
  for node in nodes:
    node[1] = np.zeros(3, F32)
  both = jax.jit(lambda xs: [emulated_allreduce(xs, fmt="e5m2", aps=aps, form="cpd")
                             for aps in ("cpd", True)])(stack(nodes))  # one program for both
  for aps, got in zip(("cpd", True), both, strict=True):
    got = [np.asarray(g) for g in got]
    want = cref.cpd_two_level([nodes], FloatFormat(5, 2), aps, False, False)
    for g, w in zip(got, want, strict=True):
      ref.assert_same_bits(g, w, msg=f"aps={aps}")
    assert (got[1] == 0).all()


@pytest.mark.parametrize("kwargs, tree, field", [
    (dict(), [np.ones((2, 3), F32), np.ones((3, 3), F32)], "leading axes"),
    (dict(), [np.ones((), F32)], "shape"),
    (dict(form="tree"), [np.ones((2, 3), F32)], "form="),
    (dict(cast_single=1), [np.ones((2, 3), F32)], "cast_single="),
    (dict(fmt="e5m2", aps=True, algorithm="butterfly"), [np.ones((2, 3), F32)], "algorithm="),
    (dict(axis_name="r"), [np.ones((2, 3), F32)], "axis_name="),
    (dict(), [np.ones((2, 3), np.float16)], "dtype"),
])
def test_bad_input_raises(kwargs, tree, field):
  with pytest.raises(ValueError, match=field):
    emulated_allreduce(tree, **kwargs)
