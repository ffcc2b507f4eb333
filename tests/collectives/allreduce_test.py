"""jlp.collectives.allreduce on emulated CPU devices, against plain-Python references.

References: the literal cases of cpd.md §3.1 and §4, and `collective_refs`
(Python loops over the ranks written from the spec, numpy float32 arithmetic,
`references.round_to_format` as the per-element cast, never jlp code), the
float64 sum (error bounds) and `lax.psum`.

Error bound used below (sequential fold and ring, no Kahan). Let u = 2^-(man+1)
be the format's unit roundoff, u32 = 2^-24 and eta = 2^(emin-man-1) half its
smallest subnormal. One step computes s_i = q(fl32(s_{i-1} + x_i)); with no
overflow and no float32 underflow, |fl32(z) - z| <= u32|z| and
|q(y) - y| <= u|y| + eta, so the step's error is at most d|s_{i-1} + x_i| + eta
with d = u + u32 + u*u32. The error e_i of the partial sum then obeys
|e_i| <= (1 + d)|e_{i-1}| + d*A + eta (A = sum |x_j|, since
|s_{i-1} + x_i| <= A + |e_{i-1}|), and from e_0 = 0 over n steps (the first one,
q(0 + x_0), included):
    |s_n - sum x| <= ((1 + d)^n - 1) * (A + eta / d).
The ring folds each chunk in a rotated rank order, to which the same bound
applies. With APS each x_i is first replaced by q(x_i 2^s), adding at most
(u|x_i| 2^s + eta) per rank, and the unscale by 2^-s is exact, so the bound
becomes 2^-s [n*eta + u*A*2^s + ((1 + d)^n - 1)((1 + u) A 2^s + n*eta + eta/d)].
fmt=None: d = u32, eta = 0.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))  # collective_refs (--import-mode=importlib)
import collective_refs as cref  # noqa: E402
import device_runs as dev  # noqa: E402
from device_runs import SHAPES, mesh_of, on_ranks  # noqa: E402
import references as ref  # noqa: E402
from jlp import BFPFormat, FloatFormat  # noqa: E402
from jlp.collectives import allreduce, emulated_allreduce  # noqa: E402

# XLA optimisations off: most of these tests' time is compiling (values do not change:
# every operation is an exactly rounded float32 op or an integer op).
pytestmark = pytest.mark.usefixtures("fast_compile")
F32 = np.float32
ALGORITHMS = ("sequential", "ring")


def reduced(leaves_per_rank, **options):
  """The (checked identical) result on every rank, per leaf."""
  outs = on_ranks(leaves_per_rank, **options)
  for o in outs:
    for r in range(1, o.shape[0]):
      ref.assert_same_bits(o[r], o[0], msg=f"rank {r} differs from rank 0")
  return [o[0] for o in outs]


@functools.lru_cache(maxsize=None)
def _compiled_each(w, option_sets):
  def body(*xs):
    xs = [x[0] for x in xs]
    return tuple(o[None] for options in option_sets
                 for o in allreduce(xs, "r", **dict(options)))
  return jax.jit(jax.shard_map(body, mesh=mesh_of(w), in_specs=P("r"), out_specs=P("r")))


def reduced_each(leaves_per_rank, *option_sets):
  """`reduced` for each option set, all in one program (one compile; for the cases of a test
  that no other test compiles): per option set, the result per leaf."""
  fn = _compiled_each(len(leaves_per_rank),
                      tuple(tuple(sorted(options.items())) for options in option_sets))
  outs = [np.asarray(o) for o in fn(*dev.stack(leaves_per_rank))]
  for o in outs:
    for r in range(1, o.shape[0]):
      ref.assert_same_bits(o[r], o[0], msg=f"rank {r} differs from rank 0")
  leaves = len(leaves_per_rank[0])
  return [[o[0] for o in outs[i * leaves:(i + 1) * leaves]] for i in range(len(option_sets))]


def random_ranks(w, shapes, seed=0, scale_exp=(-3, 3)):
  return dev.random_nodes(w, shapes, seed, scale_exp)


@pytest.mark.parametrize("values, fmt, plain, kahan", [
    ([1.0, 0.3, 0.3, 0.3], "e5m2", 1.75, 2.0),
    ([0.3] * 8, "e3m0", 1.0, 2.0),
])
def test_cpd_reference_cases_sequential(values, fmt, plain, kahan):
  ranks = [[np.array([v], F32)] for v in values]
  for use_kahan, want in ((False, plain), (True, kahan)):
    got = reduced(ranks, fmt=fmt, kahan=use_kahan)[0]
    assert float(got[0]) == want
    want_fold = cref.fold([r[0] for r in ranks], FloatFormat.from_name(fmt), use_kahan)
    ref.assert_same_bits(got, want_fold)


def test_cpd_reference_case_sixteen_ranks():
  """16 x 0.1 in e5m2 (cpd.md §3.1) over 8 devices x 2 nodes, node order d*2 + v."""
  mesh = mesh_of(8)
  x = np.full((16, 1), 0.1, F32)
  for kahan, want in ((False, 1.0), (True, 1.5)):
    fn = jax.jit(jax.shard_map(
        lambda g, k=kahan: emulated_allreduce(g, fmt="e5m2", kahan=k, axis_name="r")[None],
        mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    got = np.asarray(fn(x))
    assert (got == want).all()


def test_aps_two_rank_e4m3_case():
  """cpd.md §4: rank0 [0.001, -0.0003], rank1 [0.0007, 0.0002] in e4m3."""
  ranks = [[np.array([0.001, -0.0003], F32)], [np.array([0.0007, 0.0002], F32)]]
  fmt = FloatFormat(4, 3)
  want = np.array([0.001708984375, -0.0001068115234375], F32)
  cases = [dict(aps=aps, algorithm=algorithm) for aps in (True, "cpd") for algorithm in ALGORITHMS]
  *got, plain = reduced_each(ranks, *(dict(fmt=fmt, **c) for c in cases), dict(fmt=fmt))
  for case, g in zip(cases, got, strict=True):
    ref.assert_same_bits(g[0], want, msg=f"{case}")
  ref.assert_same_bits(plain[0], np.array([0.001953125, 0.0], F32))
  ref.assert_same_bits(cref.allreduce(ranks, fmt, aps=True)[0], want)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("fmt, kahan, aps, mean", [
    (None, True, False, True), (FloatFormat(5, 2), True, False, False),
    (FloatFormat(4, 3), False, True, True), (FloatFormat(4, 3), True, "cpd", False)], ids=str)
def test_matches_python_reference(algorithm, fmt, kahan, aps, mean):
  ranks = random_ranks(8, SHAPES, seed=1)
  got = reduced(ranks, fmt=fmt, algorithm=algorithm, kahan=kahan, aps=aps, mean=mean)
  want = cref.allreduce(ranks, fmt, algorithm, kahan, aps, mean=mean)
  for g, w in zip(got, want, strict=True):
    ref.assert_same_bits(g, w, msg=f"{algorithm} kahan={kahan} {fmt} aps={aps}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("fmt, kahan", [(None, False), (FloatFormat(4, 3), False),
                                        (FloatFormat(4, 3), True)], ids=str)
def test_one_rank_is_the_rounded_value(algorithm, fmt, kahan):
  """One device (a run without --cpu_devices): the sum of one rank is its own leaves rounded
  once, as the Python reference folds them; nothing crashes."""
  ranks = random_ranks(1, SHAPES, seed=4)
  got = reduced(ranks, fmt=fmt, algorithm=algorithm, kahan=kahan)
  want = cref.allreduce(ranks, fmt, algorithm, kahan, False, mean=False)
  for g, w in zip(got, want, strict=True):
    ref.assert_same_bits(g, w, msg=f"{algorithm} kahan={kahan} {fmt}")


def test_cpd_compat_format_equals_ieee_format_away_from_quirks():
  """compat='cpd' e5m2 only differs from IEEE e5m2 near overflow, FP32 subnormals and subnormal
  ties with sticky bits; well-scaled data gives the same sum (a smoke test of the plumbing)."""
  ranks = random_ranks(8, [(64,)], seed=2)
  (a,), (b,) = reduced_each(ranks, dict(fmt=FloatFormat(5, 2, compat="cpd"), aps=True),
                            dict(fmt=FloatFormat(5, 2), aps=True))
  ref.assert_same_bits(a, b)


def test_ring_float32_close_to_psum():
  ranks = random_ranks(8, SHAPES, seed=3)
  stacked = [np.stack([r[i] for r in ranks]) for i in range(len(SHAPES))]
  fn = jax.jit(jax.shard_map(lambda *xs: tuple(lax.psum(x[0], "r")[None] for x in xs),
                             mesh=mesh_of(8), in_specs=P("r"), out_specs=P("r")))
  psum = [np.asarray(o)[0] for o in fn(*stacked)]
  got = reduced(ranks, algorithm="ring")
  for g, p, s in zip(got, psum, stacked, strict=True):
    bound = 2 * 7 * 2.0 ** -24 * np.abs(s.astype(np.float64)).sum(0)  # both within (n-1)u32·A
    assert (np.abs(g.astype(np.float64) - p) <= bound).all()
    assert np.allclose(g, s.astype(np.float64).sum(0), rtol=0, atol=1e-5)


def test_psum_is_lax_psum_bit_for_bit_and_the_mean_divides_it():
  """algorithm="psum" is XLA's all-reduce: the bits of `lax.psum` (an independent call of it),
  then / W for the mean, and within float32 rounding of the float64 sum."""
  ranks = random_ranks(8, SHAPES, seed=3)
  stacked = [np.stack([r[i] for r in ranks]) for i in range(len(SHAPES))]
  fn = jax.jit(jax.shard_map(lambda *xs: tuple(lax.psum(x[0], "r")[None] for x in xs),
                             mesh=mesh_of(8), in_specs=P("r"), out_specs=P("r")))
  psum = [np.asarray(o)[0] for o in fn(*stacked)]
  for mean in (False, True):
    got = reduced(ranks, algorithm="psum", mean=mean)
    for g, p, s in zip(got, psum, stacked, strict=True):
      ref.assert_same_bits(g, p / F32(8) if mean else p)
      assert np.allclose(g, s.astype(np.float64).sum(0) / (8 if mean else 1), rtol=0, atol=1e-5)


def test_psum_is_float32_of_real_devices_only():
  for options in (dict(fmt="e5m2"), dict(kahan=True)):
    with pytest.raises(ValueError, match="algorithm='psum'"):
      on_ranks([[np.ones(3, F32)]] * 2, algorithm="psum", **options)
  with pytest.raises(ValueError, match="algorithm='psum'"):
    jax.shard_map(lambda x: emulated_allreduce(x, algorithm="psum", axis_name="r"),
                  mesh=mesh_of(2), in_specs=P("r"), out_specs=P("r"))(np.ones((4, 3), F32))


def fold_bound(x, fmt, factor=1.0):
  """The bound of the module docstring, per element; x [n, ...] float64, factor = 2^s (APS)."""
  n = x.shape[0]
  if fmt is None:
    d, eta, u = 2.0 ** -24, 0.0, 0.0
  else:
    u = 2.0 ** -(fmt.man + 1)
    d = u + 2.0 ** -24 + u * 2.0 ** -24
    eta = 2.0 ** (1 - (2 ** (fmt.exp - 1) - 1) - fmt.man - 1)
  a = np.abs(x).sum(0) * factor
  growth = (1 + d) ** n - 1
  if factor == 1.0:
    return growth * (a + eta / d)
  return (n * eta + u * a + growth * ((1 + u) * a + n * eta + eta / d)) / factor


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("fmt", [None, FloatFormat(4, 3), FloatFormat(8, 7)], ids=str)
def test_error_within_proven_bound(algorithm, fmt):
  ranks = random_ranks(8, [(300,)], seed=4, scale_exp=(-2, 2))
  x = np.stack([r[0] for r in ranks]).astype(np.float64)
  exact = x.sum(0)
  if fmt is None:
    got = reduced(ranks, fmt=fmt, algorithm=algorithm)[0].astype(np.float64)
  else:  # with and without APS in one program
    (got,), (got_aps,) = reduced_each(ranks, dict(fmt=fmt, algorithm=algorithm),
                                      dict(fmt=fmt, algorithm=algorithm, aps=True))
    got, got_aps = got.astype(np.float64), got_aps.astype(np.float64)
  err = np.abs(got - exact)
  assert (err <= fold_bound(x, fmt)).all(), float((err / fold_bound(x, fmt)).max())
  if fmt is not None:
    assert err.max() > 0  # the format does round here
    m = np.max(np.abs(x)) * 8
    shift = min(max(fmt.emax - int(np.ceil(np.log2(m))), -126), 126)
    assert (np.abs(got_aps - exact) <= fold_bound(x, fmt, 2.0 ** shift)).all()


# Default: Kahan in the sequential fold, plain on the ring (each algorithm and each Kahan setting
# once: APS's scale does not depend on the fold); the other two pairs are slow.
@pytest.mark.parametrize("algorithm, kahan", [
    ("sequential", True), ("ring", False),
    pytest.param("sequential", False, marks=pytest.mark.slow),
    pytest.param("ring", True, marks=pytest.mark.slow)])
def test_aps_equivariant_to_power_of_two_scaling(algorithm, kahan):
  fmt = FloatFormat(4, 3)
  ranks = random_ranks(8, [(40,), (3, 3)], seed=5)
  base = reduced(ranks, fmt=fmt, algorithm=algorithm, kahan=kahan, aps=True)
  for k in (40, -40):
    scaled = [[(g * F32(2.0 ** k)).astype(F32) for g in r] for r in ranks]
    got = reduced(scaled, fmt=fmt, algorithm=algorithm, kahan=kahan, aps=True)
    for g, b in zip(got, base, strict=True):
      ref.assert_same_bits(g, (b * F32(2.0 ** k)).astype(F32), msg=f"2^{k}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_aps_huge_and_tiny_gradients_neither_overflow_nor_vanish(algorithm):
  fmt = FloatFormat(5, 2)
  for k in (100, -100):
    ranks = random_ranks(8, [(50,)], seed=6)
    ranks = [[(g * F32(2.0 ** k)).astype(F32) for g in r] for r in ranks]
    x = np.stack([r[0] for r in ranks]).astype(np.float64)
    (got,), (plain,) = reduced_each(ranks, dict(fmt=fmt, algorithm=algorithm, aps=True),
                                    dict(fmt=fmt, algorithm=algorithm))
    assert np.isfinite(got).all()
    rel = np.abs(got - x.sum(0)) / np.abs(x).sum(0)
    assert rel.max() < 0.5 and np.count_nonzero(got) > 40
    # plain: without APS they do
    assert (not np.isfinite(plain).all()) if k > 0 else (plain == 0).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_aps_all_zero_leaves_give_zeros(algorithm):
  # SHAPES and these options: the program of test_identical_on_every_rank_and_run_to_run.
  ranks = random_ranks(8, SHAPES, seed=7)
  for r in ranks:
    r[2] = np.zeros(16, F32)
  got = reduced(ranks, fmt="e4m3", algorithm=algorithm, kahan=True, aps=True)
  assert (got[2] == 0).all() and not np.signbit(got[2]).any()
  alone = reduced([[r[0]] for r in ranks], fmt="e4m3", algorithm=algorithm, aps=True, kahan=True)
  ref.assert_same_bits(got[0], alone[0])  # each leaf has its own exponent


def test_aps_cpd_reproduces_nan_on_all_zero_gradients():
  ranks = [[np.zeros(3, F32)] for _ in range(4)]
  (cpd,), (aps,) = reduced_each(ranks, dict(fmt="e5m2", aps="cpd"), dict(fmt="e5m2", aps=True))
  assert np.isnan(cpd).all()
  assert (aps == 0).all()


def test_aps_with_8_bit_exponent_is_finite_and_cpd_mode_is_not():
  """e8m7: emax = 127, so CPD's shift 127 - e exceeds 127 whenever max|gW| <= 1/2 (cpd.md §4)."""
  ranks = random_ranks(4, [(20,)], seed=8, scale_exp=(-12, -8))
  x = np.stack([r[0] for r in ranks]).astype(np.float64)
  (got,), (cpd,) = reduced_each(ranks, dict(fmt="e8m7", aps=True), dict(fmt="e8m7", aps="cpd"))
  assert np.isfinite(got).all()
  assert (np.abs(got - x.sum(0)) <= fold_bound(x, FloatFormat(8, 7), 2.0 ** 126)).all()
  assert not np.isfinite(cpd).any()


def test_kahan_beats_plain_fold_on_adversarial_inputs():
  """One large value and many small ones per element: the plain e5m2 fold drops the small ones."""
  rng = np.random.default_rng(9)
  big = rng.uniform(1, 2, 200).astype(F32)
  ranks = [[big]] + [[rng.uniform(0.05, 0.15, 200).astype(F32)] for _ in range(7)]
  exact = np.stack([r[0] for r in ranks]).astype(np.float64).sum(0)
  runs = reduced_each(ranks, *(dict(fmt="e5m2", algorithm=algorithm, kahan=kahan)
                               for algorithm in ALGORITHMS for kahan in (False, True)))
  for i, algorithm in enumerate(ALGORITHMS):
    (plain,), (kahan,) = runs[2 * i:2 * i + 2]
    e_plain, e_kahan = np.abs(plain - exact).sum(), np.abs(kahan - exact).sum()
    assert e_kahan < 0.5 * e_plain, (algorithm, e_kahan, e_plain)


@pytest.mark.parametrize("kahan", [False, True])
def test_ring_sends_every_leaf_in_the_same_hops(kahan):
  """The ring's hops carry all leaves at once: one ppermute in the hop loop for the whole tree
  (two with Kahan: the sum and the compensation), one all_gather per leaf (the bits are checked
  by the reference tests)."""
  shapes = [jax.ShapeDtypeStruct((8,) + s, jnp.float32) for s in SHAPES]

  def body(*xs):
    return tuple(o[None] for o in allreduce([x[0] for x in xs], "r", fmt="e4m3", aps=True,
                                            kahan=kahan, algorithm="ring"))
  hlo = jax.jit(jax.shard_map(body, mesh=mesh_of(8), in_specs=P("r"), out_specs=P("r"))
                ).lower(*shapes).as_text()
  assert hlo.count("stablehlo.collective_permute") == (2 if kahan else 1)
  assert hlo.count("stablehlo.all_gather") == len(SHAPES)


def test_identical_on_every_rank_and_run_to_run():
  ranks = random_ranks(8, SHAPES, seed=10)
  for algorithm in ALGORITHMS:
    first = on_ranks(ranks, fmt="e4m3", algorithm=algorithm, kahan=True, aps=True)
    second = on_ranks(ranks, fmt="e4m3", algorithm=algorithm, kahan=True, aps=True)
    for a, b in zip(first, second, strict=True):
      ref.assert_same_bits(a, b)
      for r in range(8):
        ref.assert_same_bits(a[r], a[0])


@pytest.mark.parametrize("options, field", [
    (dict(algorithm="tree"), "algorithm="),
    (dict(aps=True), "aps="),
    (dict(fmt=BFPFormat(4, (4,))), "fmt="),
    (dict(fmt="e9m2"), "fmt="),
    (dict(fmt=FloatFormat(5, 2, rounding="stochastic")), "fmt.rounding="),
    (dict(fmt="e5m2", aps="yes"), "aps="),
    (dict(kahan=1), "kahan="),
])
def test_bad_options_raise(options, field):
  with pytest.raises(ValueError, match=field):
    on_ranks([[np.ones(3, F32)]] * 2, **options)


def test_bad_axis_and_dtype_raise():
  with pytest.raises(ValueError, match="axis_name='nope'"):
    jax.shard_map(lambda x: allreduce(x, "nope"), mesh=mesh_of(2), in_specs=P("r"),
                  out_specs=P("r"))(np.ones(2, F32))
  with pytest.raises(ValueError, match="axis_name='r'"):
    allreduce(jnp.ones(3), "r")  # outside shard_map
  with pytest.raises(ValueError, match=r"tree\['g'\].dtype"):
    jax.shard_map(lambda x: allreduce({"g": x}, "r")["g"], mesh=mesh_of(2), in_specs=P("r"),
                  out_specs=P("r"))(np.ones(2, np.int32))


@pytest.mark.parametrize("fmt", [None, FloatFormat(5, 2), FloatFormat(3, 0)], ids=str)
def test_fold_is_jlp_sums_bit_for_bit(fmt):
  """The collectives' own fold (a scan with a varying-typed carry) is jlp.sequential_sum /
  jlp.kahan_sum (a consistency check against jlp code; the references above are independent)."""
  import jlp  # pylint: disable=g-import-not-at-top
  from jlp.collectives.allreduce import fold_stacked  # pylint: disable=g-import-not-at-top
  x = np.stack([r[0] for r in random_ranks(8, [(64,)], seed=11)])
  for kahan, sums_fn in ((False, jlp.sequential_sum), (True, jlp.kahan_sum)):
    ref.assert_same_bits(fold_stacked(jnp.asarray(x), fmt, kahan), sums_fn(x, fmt=fmt))
