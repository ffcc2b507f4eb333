"""The virtual-time simulator and SD-PIPE's group scheduler (jlp.pipeline.simulator).

References, written here from sdpipe.md and the module docstring, never calling the code under test:
  * `reference_finish`: the cost model of §4/§7.4 evaluated by a dependency-driven sweep over the
    stage orders of §1.1 / GPipe (no event queue), float64, for the barrier-type syncs (none,
    allreduce, adpsgd, hetpipe);
  * `reference_matchings`: the seed's AD-PSGD rule (§3.1) with Python's `random.Random(seed)`;
  * `check_connectivity`: a union-find replay of the §2.2 counting (a connected union graph at the
    window after every crossing of connect_every * N members);
  * hand-computed time tables and group-size sequences (in the tests' comments).
"""

import random

import numpy as np
import pytest

from jlp.pipeline import simulator as sim
from jlp.pipeline.simulator import HetPipe, Hetero, PReduce, preduce_schedule, simulate


# -- references ------------------------------------------------------------------------------------
def reference_matchings(n, rounds, seed):
  rng = random.Random(seed)
  out = []
  for _ in range(rounds):
    workers = list(range(n))  # the rank-sorted list, copied every round
    rng.shuffle(workers)
    partner = [None] * n
    for p in range(n):
      partner[workers[p]] = workers[p + 1] if p % 2 == 0 else workers[p - 1]
    out.append(partner)
  return out


def reference_orders(schedule, S, B, M):
  orders = []
  for s in range(S):
    if schedule == "gpipe":
      order = []
      for b in range(B):
        order += [("F", b, m) for m in range(M)] + [("B", b, m) for m in reversed(range(M))]
    else:
      warm = min(S - s, B)
      order = [("F", b, 0) for b in range(warm)]
      next_forward = warm
      for b in range(B):
        order.append(("B", b, 0))
        if next_forward < B:
          order.append(("F", next_forward, 0))
          next_forward += 1
    orders.append(order)
  return orders


def reference_finish(schedule, sync, N, S, B, M=1, *, seed=0, hetero=Hetero(),
                     hetpipe=HetPipe(), first_batch=0, start=None):
  """finish[b, i, s]: when (pipeline i, stage s) leaves the sync of update b; `first_batch`
  mini-batches were trained before (HetPipe pulls at global batch counts). GPipe: the pipelines
  run in lockstep (F(b, 0), the first op of mini-batch b at a stage, starts once every (pipeline,
  stage) left update b - 1; mini-batch 0 at the latest start), and one stall draw per (mini-batch,
  stage, direction), row 2b or 2b + 1, costs each of its M micro-batch ops delay_s / M."""
  orders = reference_orders(schedule, S, B, M)
  K = len(orders[0])
  gpipe = schedule == "gpipe"
  draws = np.random.default_rng(seed).random((2 * B if gpipe else K, N, S))
  first_start = 0.0 if start is None else float(np.max(start))
  slow = hetero.slowdown or [[1.0] * S for _ in range(N)]
  match = reference_matchings(N, B, seed) if sync == "adpsgd" else None
  alpha, beta = hetero.allreduce_alpha_s, hetero.allreduce_beta_s

  def group_of(i, s, b):
    if sync == "allreduce":
      return [(j, s) for j in range(N)]
    if sync == "adpsgd":
      return sorted([(i, s), (match[b][i], s)])
    if sync == "hetpipe" and hetpipe.barrier and (first_batch + b + 1) % hetpipe.pull_every == 0:
      return [(j, s2) for j in range(N) for s2 in range(S)]
    return [(i, s)]

  def cost(size):
    if sync == "none":
      return 0.0
    if sync == "hetpipe":
      return alpha
    return alpha + beta * (size - 1)

  end, arrivals = {}, {}
  finish = np.full((B, N, S), np.nan)
  free = [[0.0 if start is None else float(start[i][s]) for s in range(S)]
          for i in range(N)]  # None while waiting in a sync
  pos = [[0] * S for _ in range(N)]
  progress = True
  while progress:
    progress = False
    for i in range(N):
      for s in range(S):
        while pos[i][s] < K and free[i][s] is not None:
          k = pos[i][s]
          kind, b, m = orders[s][k]
          source = s - 1 if kind == "F" else s + 1
          start = free[i][s]
          if gpipe and kind == "F" and m == 0:  # the lockstep barrier
            if b > 0 and np.isnan(finish[b - 1]).any():
              break
            start = max(start, first_start if b == 0 else finish[b - 1].max())
          if 0 <= source < S:
            if (i, source, kind, b, m) not in end:
              break
            start = max(start, end[(i, source, kind, b, m)] + hetero.p2p_s)
          base = (hetero.fwd_s if kind == "F" else hetero.bwd_s) / (M if gpipe else 1)
          draw = draws[2 * b + (kind == "B"), i, s] if gpipe else draws[k, i, s]
          stall = hetero.delay_s / (M if gpipe else 1) if draw < hetero.probability else 0.0
          t = start + (base * slow[i][s] + stall)
          end[(i, s, kind, b, m)] = t
          pos[i][s] += 1
          progress = True
          update = kind == "B" and (schedule == "1f1b" or m == 0)
          if not update:
            free[i][s] = t
            continue
          group = group_of(i, s, b)
          arrived = arrivals.setdefault((b, tuple(group)), {})
          arrived[(i, s)] = t
          free[i][s] = None
          if len(arrived) == len(group):
            leave = max(arrived.values()) + cost(len(group))
            for j, s2 in group:
              finish[b, j, s2] = leave
              free[j][s2] = leave
  assert all(p == K for row in pos for p in row)
  return finish


def blocks(matrix):
  """The support sets of the rows of a block-uniform matrix, checked exactly: every row i has
  entries 1/|S_i| on S_i (which holds i) and 0 elsewhere, and S_j = S_i for j in S_i."""
  n = matrix.shape[0]
  supports = [frozenset(np.flatnonzero(matrix[i]).tolist()) for i in range(n)]
  for i, support in enumerate(supports):
    assert i in support
    assert np.all(matrix[i, sorted(support)] == np.float32(1.0 / len(support)))
    assert all(supports[j] == support for j in support)
  return sorted(set(supports), key=min)


def windows_from_plan(plan):
  """The groups of a one-stage plan, collected into windows (same open and close time), up to the
  first pipeline's last arrival (the end of the run may close a forced window early)."""
  windows = []
  end = plan.finish[-2, :, 0].min()
  for g in range(plan.group_sizes.size):
    if plan.group_close[g] >= end:
      break
    members = tuple(np.flatnonzero(plan.group_members[g]).tolist())
    key = (plan.group_open[g], plan.group_close[g])
    if windows and windows[-1][0] == key:
      windows[-1][1].append(members)
    else:
      windows.append((key, [members]))
  return [groups for _, groups in windows]


def check_connectivity(windows, n, connect_every):
  """Replays §2.2's counting: after the accumulated members cross a multiple of
  connect_every * n, the next window opened while every pipeline has arrived before must leave the
  union graph of every group since the last period end (itself included) connected, and the union
  starts afresh. A window is a list of member tuples ((None,): one member not known). Before every
  pipeline has been seen, a window after a crossing may or may not end the period (the scheduler
  skips the check while one has never arrived), so both continuations are kept; at least one must
  explain every window. Returns the fewest periods checked over the surviving explanations and the
  most members between two period ends (periods that began after the warm-up)."""
  everyone = set(range(n))

  def union(parent, groups):
    parent = list(parent)

    def find(x):
      while parent[x] != x:
        x = parent[x]
      return x

    for g in groups:
      if len(g) > 1:
        for i in g:
          parent[find(i)] = find(g[0])
    return tuple(find(i) for i in range(n))

  # (union-find roots, need, members since the period began, it began after the warm-up,
  #  longest period, periods checked)
  states = {(tuple(range(n)), False, 0, False, 0, 0)}
  accumulated, seen = 0, set()
  for w, groups in enumerate(windows):
    members = [i for g in groups for i in g]
    after = seen | (set(members) - {None})
    new_states = set()
    for roots, need, since, warm, longest, checked in states:
      roots = union(roots, groups)
      if need and len(set(roots)) == 1:  # the period ends here
        new_states.add((tuple(range(n)), False, 0, after == everyone,
                        max(longest, since) if warm else longest, checked + 1))
      if not need or seen != everyone:  # the period goes on
        new_states.add((roots, need, since + len(members), warm, longest, checked))
    assert new_states, f"window {w}: the union graph is not connected at a period end"
    period = connect_every * n
    if (accumulated + len(members)) // period > accumulated // period:
      new_states = {(r, True, since, warm, longest, checked)
                    for r, _, since, warm, longest, checked in new_states}
    states, accumulated, seen = new_states, accumulated + len(members), after
  return min(s[5] for s in states), max(s[4] for s in states)


# -- AD-PSGD ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,seed", [(2, 0), (4, 0), (8, 3), (16, 7)])
def test_adpsgd_matchings_reproduce_the_seed_rule(n, seed):
  got = sim.adpsgd_matchings(n, 50, seed=seed)
  assert got.dtype == np.int32 and got.shape == (50, n)
  assert got.tolist() == reference_matchings(n, 50, seed)
  for partner in got:  # perfect matchings
    assert all(partner[partner[i]] == i and partner[i] != i for i in range(n))


def test_adpsgd_matchings_odd_pipelines_raise():
  with pytest.raises(ValueError, match="num_pipelines=3"):
    sim.adpsgd_matchings(3, 5)
  with pytest.raises(ValueError, match="num_pipelines=5"):
    simulate("1f1b", "adpsgd", 5, 2, 4)


def test_adpsgd_mix_is_the_pairing_of_each_round_at_every_stage():
  plan = simulate("1f1b", "adpsgd", 4, 3, 20, seed=5, hetero=Hetero(delay_s=0.05))
  for b, partner in enumerate(reference_matchings(4, 20, 5)):
    expected = np.zeros((4, 4))
    for i, j in enumerate(partner):
      expected[i, i] = expected[i, j] = 0.5
    for s in range(3):
      np.testing.assert_array_equal(plan.mix[b, s], expected)
  assert plan.group_sizes.tolist() == [2] * (20 * 3 * 2)


# -- PReduce schedule structure --------------------------------------------------------------------
@pytest.mark.parametrize("n,hetero,max_group", [(2, 0.1, None), (4, 0.3, None), (6, 0.1, 4),
                                                (8, 0.3, None), (10, 0.3, None), (12, 0.1, None)])
def test_preduce_schedule_matrices_are_uniform_groups(n, hetero, max_group):
  mats = preduce_schedule(n, 300, seed=1, hetero=hetero, max_group=max_group, connect_every=3)
  assert mats.dtype == np.float32 and mats.shape == (300, n, n)
  for m in mats:
    np.testing.assert_array_equal(m, m.T)
    np.testing.assert_allclose(m.sum(axis=0), 1.0, atol=1e-6)
    np.testing.assert_allclose(m.sum(axis=1), 1.0, atol=1e-6)
    sizes = sorted(len(block) for block in blocks(m))
    if n <= 8:  # one group, everyone else untouched
      assert sizes[:-1] == [1] * (n - sizes[-1])
    else:  # adjacent pairs, or one forced (unsplit) group
      assert sizes[-1] <= 2 or sizes[:-1] == [1] * (n - sizes[-1])


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_preduce_schedule_homogeneous_groups_are_everyone(n):
  mats = preduce_schedule(n, 120, seed=0, hetero=0.0)
  np.testing.assert_array_equal(mats, np.full((120, n, n), np.float32(1.0 / n)))


def test_preduce_schedule_stragglers_give_smaller_groups_and_depend_on_the_seed():
  a = preduce_schedule(4, 200, seed=0, hetero=0.3)
  sizes = [max(len(block) for block in blocks(m)) for m in a]
  assert min(sizes) < 4 and max(sizes) == 4
  np.testing.assert_array_equal(a, preduce_schedule(4, 200, seed=0, hetero=0.3))
  assert not np.array_equal(a, preduce_schedule(4, 200, seed=1, hetero=0.3))


def test_preduce_schedule_compat_reference_quirk_homogeneous():
  # The reference checks connectivity when the forced window opens: after 10 groups of 4 the
  # union graph is already connected, so pipeline 0 (first on ties) closes it alone; 1, 2, 3 form
  # the next window, which times out without 0. Then 40 + 4 members, and 9 more groups of 4 reach
  # the next multiple of 40: sizes 4 x 10, then (1, 3, 4 x 9) repeating.
  mats = preduce_schedule(4, 10 + 3 * 11, seed=0, hetero=0.0, compat="sdpipe")
  sizes = [max(len(block) for block in blocks(m)) for m in mats]
  assert sizes == [4] * 10 + ([1, 3] + [4] * 9) * 3
  alone_then_three = [blocks(m) for m in mats[10:12]]
  assert alone_then_three == [[{0}, {1}, {2}, {3}], [{0}, {1, 2, 3}]]


@pytest.mark.parametrize("n,hetero,connect_every,compat,seed", [
    (4, 0.3, 2, None, 0), (4, 0.1, 1, None, 1), (6, 0.3, 3, None, 2), (8, 0.1, 2, None, 0),
    (4, 0.3, 2, "sdpipe", 0), (6, 0.3, 1, "sdpipe", 3)])
def test_preduce_schedule_union_graph_is_connected_every_period(n, hetero, connect_every, compat,
                                                               seed):
  mats = preduce_schedule(n, 400, seed=seed, hetero=hetero, connect_every=connect_every,
                          compat=compat)
  # N <= 8: a window is its one group; an identity matrix is a group of one unknown pipeline
  # (no edge, one member).
  windows = []
  for m in mats:
    group = max(blocks(m), key=len)
    windows.append([tuple(sorted(group)) if len(group) > 1 else (None,)])
  checked, longest = check_connectivity(windows, n, connect_every)
  assert checked >= 5
  # Members between two period ends: at most connect_every * n up to the crossing, plus the
  # crossing window's overshoot (< n).
  assert longest <= connect_every * n + n - 1
  # The one-stage simulate runs the same scheduler: its first 400 windows are these matrices.
  plan = simulate("1f1b", "preduce", n, 1, 401, seed=seed, hetero=Hetero(delay_s=hetero),
                  preduce=PReduce(connect_every=connect_every, compat=compat))
  exact = windows_from_plan(plan)
  assert len(exact) >= 400
  for w, m in zip(exact[:400], mats, strict=True):
    expected = np.eye(n)
    for g in w:
      expected[np.ix_(g, g)] = 1.0 / len(g)
    np.testing.assert_array_equal(m, expected.astype(np.float32))


@pytest.mark.parametrize("n,compat", [(10, None), (12, "sdpipe")])
def test_pairwise_union_graph_is_connected_every_period(n, compat):
  plan = simulate("1f1b", "preduce", n, 1, 300, seed=4, hetero=Hetero(delay_s=0.1),
                  preduce=PReduce(connect_every=2, compat=compat))
  windows = windows_from_plan(plan)
  for w in windows:
    sizes = [len(g) for g in w]
    assert max(sizes) <= 2 or len(w) == 1  # adjacent pairs, or one forced group
  checked, longest = check_connectivity(windows, n, 2)
  assert checked >= 5 and longest <= 2 * n + n - 1
  if compat:  # the reference never merges pairs: every forced window waits for all N
    forced = (plan.group_kind == sim.FORCED) & (plan.group_close < plan.finish[-2, :, 0].min())
    assert forced.any() and np.all(plan.group_sizes[forced] == n)


def test_max_group_caps_ordinary_windows():
  plan = simulate("1f1b", "preduce", 6, 2, 200, seed=0, hetero=Hetero(delay_s=0.02),
                  preduce=PReduce(max_group=3, connect_every=2))
  ordinary = plan.group_kind != sim.FORCED
  assert np.all(plan.group_sizes[ordinary] <= 3) and np.any(plan.group_sizes[ordinary] == 3)


# -- simulate: mixing matrices ---------------------------------------------------------------------
@pytest.mark.parametrize("schedule,sync,n,s,m,hetero", [
    ("1f1b", "preduce", 4, 4, 1, 0.1), ("1f1b", "preduce", 6, 3, 1, 0.3),
    ("1f1b", "preduce", 10, 2, 1, 0.1), ("gpipe", "preduce", 4, 3, 3, 0.1),
    ("1f1b", "adpsgd", 4, 4, 1, 0.1), ("gpipe", "adpsgd", 6, 2, 2, 0.3),
    ("1f1b", "allreduce", 4, 2, 1, 0.1), ("1f1b", "none", 3, 2, 1, 0.1),
    ("gpipe", "hetpipe", 2, 2, 2, 0.1)])
def test_every_mix_is_doubly_stochastic(schedule, sync, n, s, m, hetero):
  plan = simulate(schedule, sync, n, s, 60, m, seed=2, hetero=Hetero(delay_s=hetero))
  assert plan.mix.dtype == np.float32 and plan.mix.shape == (60, s, n, n)
  assert np.all(plan.mix >= 0)
  np.testing.assert_allclose(plan.mix.sum(axis=-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(plan.mix.sum(axis=-2), 1.0, atol=1e-5)
  if sync in ("allreduce", "none", "hetpipe"):
    np.testing.assert_array_equal(plan.mix, np.broadcast_to(np.eye(n), plan.mix.shape))
    assert plan.group_sizes.size == 0


@pytest.mark.parametrize("n,s,seed", [(4, 4, 0), (6, 2, 1), (10, 3, 2)])
def test_preduce_mix_is_the_product_of_its_groups_in_formation_order(n, s, seed):
  plan = simulate("1f1b", "preduce", n, s, 80, seed=seed, hetero=Hetero(delay_s=0.1),
                  preduce=PReduce(connect_every=2))
  expected = np.broadcast_to(np.eye(n), plan.mix.shape).copy()
  for g in range(plan.group_sizes.size):
    members = np.flatnonzero(plan.group_members[g])
    assert members.size == plan.group_sizes[g]
    group = np.eye(n)
    group[np.ix_(members, members)] = 1.0 / members.size
    r, stage = plan.group_round[g], plan.group_stage[g]
    expected[r, stage] = group @ expected[r, stage]  # later groups applied after earlier ones
  np.testing.assert_allclose(plan.mix, expected, atol=1e-6)
  # Every update of every (pipeline, stage) is in exactly one group (no epoch stop here).
  for stage in range(s):
    counts = plan.group_members[plan.group_stage == stage].sum(axis=0)
    np.testing.assert_array_equal(counts, np.full(n, 80))
  assert np.all(np.diff(plan.group_close[plan.group_stage == 0]) >= 0)  # formation order


def test_homogeneous_preduce_mix_is_the_average_everywhere():
  for schedule, m in (("1f1b", 1), ("gpipe", 2)):
    plan = simulate(schedule, "preduce", 4, 3, 40, m, hetero=Hetero(delay_s=0.0))
    np.testing.assert_array_equal(plan.mix, np.full((40, 3, 4, 4), np.float32(0.25)))
    assert np.all(plan.group_sizes == 4)


def test_forced_windows_of_different_stages_never_overlap():
  for compat in (None, "sdpipe"):
    plan = simulate("1f1b", "preduce", 4, 4, 300, seed=3, hetero=Hetero(delay_s=0.3),
                    preduce=PReduce(connect_every=1, compat=compat))
    forced = np.flatnonzero(plan.group_kind == sim.FORCED)
    assert len(set(plan.group_stage[forced].tolist())) > 1
    for a in forced:
      for b in forced:
        if plan.group_stage[a] != plan.group_stage[b]:
          assert (plan.group_close[a] <= plan.group_open[b] or
                  plan.group_close[b] <= plan.group_open[a])


@pytest.mark.parametrize("compat,alone", [
    # N=4, S=2, E=5, homogeneous: the last stage's 20th member (b=4) starts the stop; all four are
    # stopped at b=5 (still averaged), then average alone for S-1 = 1 update (b=6); 4 members per
    # round reach 40 at b=10, so b=12 is alone, and so on: b = 6, 12, 18, ...
    (None, [6, 12, 18, 24]),
    # The reference also skips the next epoch's first update: b = 6, 7, then 40 members at b=11,
    # stop at b=12, alone 13, 14; 60 at b=18, alone 20, 21.
    ("sdpipe", [6, 7, 13, 14, 20, 21])])
def test_epoch_stop_drains_alone(compat, alone):
  plan = simulate("1f1b", "preduce", 4, 2, 26, preduce=PReduce(
      epoch_updates=5, connect_every=1000, compat=compat))
  identity = [b for b in range(26) if all(np.array_equal(plan.mix[b, s], np.eye(4))
                                          for s in range(2))]
  assert identity == alone
  others = [b for b in range(26) if b not in alone]
  np.testing.assert_array_equal(plan.mix[others], np.float32(0.25))


# -- simulate: virtual time ------------------------------------------------------------------------
def test_tiny_1f1b_times_by_hand():
  # N=1, S=2, B=2, fwd 0.01, bwd 0.02, p2p 0.001, no stalls. Stage 0: F0 F1 B0 B1; stage 1: F0 B0
  # F1 B1. Stage 0: F0 [0, .01], F1 [.01, .02]; stage 1: F0 [.011, .021], B0 [.021, .041],
  # F1 [.041, .051], B1 [.051, .071]; stage 0: B0 [.042, .062], B1 [.072, .092].
  # "allreduce" (one pipeline) adds alpha = .001 after every update: stage 1: B0 ends .041,
  # leaves .042, F1 [.042, .052], B1 [.052, .072] leaves .073; stage 0: B0 [.042, .062] leaves
  # .063, B1 [.073, .093] leaves .094.
  hetero = Hetero(delay_s=0.0)
  none = simulate("1f1b", "none", 1, 2, 2, hetero=hetero)
  np.testing.assert_allclose(none.finish[:, 0, :], [[0.062, 0.041], [0.092, 0.071]], atol=1e-12)
  np.testing.assert_allclose(none.times, [0.062, 0.092], atol=1e-12)
  allreduce = simulate("1f1b", "allreduce", 1, 2, 2, hetero=hetero)
  np.testing.assert_allclose(allreduce.finish[:, 0, :], [[0.063, 0.042], [0.094, 0.073]],
                             atol=1e-12)


def test_tiny_gpipe_times_by_hand():
  # N=1, S=2, M=2, B=2: every stage runs F(b,0) F(b,1) B(b,1) B(b,0) per mini-batch; a micro-batch
  # op takes 1/M of fwd_s, bwd_s (.005, .01). Stage 0: F [0,.005] [.005,.010]; stage 1: F
  # [.006,.011] [.011,.016], B [.016,.026] [.026,.036]; stage 0: B [.027,.037] [.037,.047].
  # Mini-batch 1: stage 0 F [.047,.052] [.052,.057]; stage 1: F [.053,.058] [.058,.063], B
  # [.063,.073] [.073,.083]; stage 0: B [.074,.084] [.084,.094].
  plan = simulate("gpipe", "none", 1, 2, 2, 2, hetero=Hetero(delay_s=0.0))
  np.testing.assert_allclose(plan.finish[:, 0, :], [[0.047, 0.036], [0.094, 0.083]], atol=1e-12)


def test_start_clocks_carry_a_lead_into_the_next_plan():
  """`start` shifts each (pipeline, stage) as the sweep reference does; pipeline 1 starting late
  finishes late, and the next plan from `finish[-1]` continues the clock."""
  hetero = Hetero(delay_s=0.05, probability=0.3)
  start = [[0.0, 0.0, 0.0], [0.5, 0.5, 0.5]]
  plan = simulate("1f1b", "preduce", 2, 3, 6, seed=4, hetero=hetero, start=start)
  for sync in ("none", "allreduce", "hetpipe"):
    got = simulate("1f1b", sync, 2, 3, 6, seed=4, hetero=hetero, start=start)
    np.testing.assert_allclose(got.finish, reference_finish("1f1b", sync, 2, 3, 6, seed=4,
                                                            hetero=hetero, start=start),
                               rtol=0, atol=1e-12)
  assert plan.finish[0, 1].min() > 0.5
  after = simulate("1f1b", "preduce", 2, 3, 6, seed=5, hetero=hetero, start=plan.finish[-1])
  assert after.times[0] > plan.times[-1]
  with pytest.raises(ValueError, match="start="):
    simulate("1f1b", "none", 2, 3, 6, start=[[0.0, 0.0, 0.0]])


@pytest.mark.parametrize("schedule,sync,n,s,m,barrier", [
    ("1f1b", "none", 3, 4, 1, False), ("1f1b", "allreduce", 4, 4, 1, False),
    ("gpipe", "allreduce", 3, 3, 3, False), ("1f1b", "adpsgd", 4, 3, 1, False),
    ("gpipe", "adpsgd", 2, 2, 2, False), ("1f1b", "hetpipe", 3, 3, 1, False),
    ("1f1b", "hetpipe", 3, 3, 1, True), ("gpipe", "hetpipe", 2, 4, 2, True)])
def test_times_match_the_sweep_reference(schedule, sync, n, s, m, barrier):
  slowdown = tuple(tuple(1.0 + 0.25 * ((i + 2 * j) % 3) for j in range(s)) for i in range(n))
  hetero = Hetero(delay_s=0.07, probability=0.2, slowdown=slowdown, allreduce_beta_s=0.0005)
  hetpipe = HetPipe(pull_every=4, barrier=barrier)
  plan = simulate(schedule, sync, n, s, 23, m, seed=11, hetero=hetero, hetpipe=hetpipe,
                  first_batch=2)
  expected = reference_finish(schedule, sync, n, s, 23, m, seed=11, hetero=hetero,
                              hetpipe=hetpipe, first_batch=2)
  np.testing.assert_allclose(plan.finish, expected, rtol=0, atol=1e-12)
  np.testing.assert_allclose(plan.times, expected.max(axis=(1, 2)), rtol=0, atol=1e-12)


def test_without_stalls_none_allreduce_and_preduce_agree():
  hetero = Hetero(delay_s=0.0, allreduce_alpha_s=0.0)
  none = simulate("1f1b", "none", 4, 3, 30, hetero=hetero)
  allreduce = simulate("1f1b", "allreduce", 4, 3, 30, hetero=hetero)
  np.testing.assert_array_equal(none.times, allreduce.times)
  # Equal speeds: every preduce group closes with its N-th (simultaneous) arrival, like the
  # all-reduce barrier, and costs the same alpha + beta (N - 1).
  hetero = Hetero(delay_s=0.0, allreduce_beta_s=0.0003)
  allreduce = simulate("1f1b", "allreduce", 4, 3, 30, hetero=hetero)
  preduce = simulate("1f1b", "preduce", 4, 3, 30, hetero=hetero)
  np.testing.assert_array_equal(preduce.finish, allreduce.finish)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_stragglers_cost_allreduce_more_than_preduce(seed):
  hetero = Hetero(delay_s=0.1)
  allreduce = simulate("1f1b", "allreduce", 4, 4, 50, seed=seed, hetero=hetero)
  preduce = simulate("1f1b", "preduce", 4, 4, 50, seed=seed, hetero=hetero)
  none = simulate("1f1b", "none", 4, 4, 50, seed=seed, hetero=hetero)
  assert allreduce.times[-1] >= preduce.times[-1] >= none.times[-1]
  assert np.all(np.diff(preduce.times) >= 0)


def test_simulate_is_deterministic_per_seed():
  kwargs = dict(hetero=Hetero(delay_s=0.1))
  a = simulate("1f1b", "preduce", 4, 3, 40, seed=7, **kwargs)
  b = simulate("1f1b", "preduce", 4, 3, 40, seed=7, **kwargs)
  c = simulate("1f1b", "preduce", 4, 3, 40, seed=8, **kwargs)
  np.testing.assert_array_equal(a.mix, b.mix)
  np.testing.assert_array_equal(a.finish, b.finish)
  np.testing.assert_array_equal(a.group_sizes, b.group_sizes)
  assert not np.array_equal(a.finish, c.finish)


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,field", [
    (lambda: simulate("1f1b", "gossip", 2, 2, 2), "sync="),
    (lambda: simulate("pipedream", "none", 2, 2, 2), "schedule="),
    (lambda: simulate("1f1b", "none", 0, 2, 2), "num_pipelines="),
    (lambda: simulate("1f1b", "none", 2, 0, 2), "num_stages="),
    (lambda: simulate("1f1b", "none", 2, 2, 0), "num_batches="),
    (lambda: simulate("1f1b", "adpsgd", 3, 2, 2), "num_pipelines="),
    (lambda: Hetero(delay_s=-0.1), "Hetero.delay_s="),
    (lambda: Hetero(probability=1.5), "Hetero.probability="),
    (lambda: Hetero(probability=-0.1), "Hetero.probability="),
    (lambda: Hetero(fwd_s=float("nan")), "Hetero.fwd_s="),
    (lambda: Hetero(slowdown=((1.0, 0.0),)), "Hetero.slowdown="),
    (lambda: Hetero(slowdown=((1.0, 2.0), (1.0,))), "Hetero.slowdown="),
    (lambda: simulate("1f1b", "none", 2, 3, 2, hetero=Hetero(slowdown=((1.0, 1.0),) * 2)),
     "Hetero.slowdown="),
    (lambda: PReduce(max_group=0), "PReduce.max_group="),
    (lambda: simulate("1f1b", "preduce", 4, 2, 2, preduce=PReduce(max_group=5)),
     "PReduce.max_group="),
    (lambda: preduce_schedule(4, 10, seed=0, max_group=5), "max_group="),
    (lambda: PReduce(connect_every=0), "PReduce.connect_every="),
    (lambda: preduce_schedule(4, 10, seed=0, connect_every=0), "connect_every="),
    (lambda: PReduce(wait_ms_shrink=1.5), "PReduce.wait_ms_shrink="),
    (lambda: PReduce(epoch_updates=0), "PReduce.epoch_updates="),
    (lambda: PReduce(compat="hetu"), "PReduce.compat="),
    (lambda: HetPipe(pull_every=0), "HetPipe.pull_every="),
    (lambda: simulate("1f1b", "none", 2, 2, 2, hetero=0.1), "hetero="),
    (lambda: preduce_schedule(4, 10, seed=0, hetero=-1.0), "hetero="),
])
def test_bad_input_names_the_field(call, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    call()


def test_configs_are_hashable_and_slowdown_is_normalised():
  a = Hetero(slowdown=[[1, 2], [3, 4]])
  assert a.slowdown == ((1.0, 2.0), (3.0, 4.0))
  assert hash(a) == hash(Hetero(slowdown=((1.0, 2.0), (3.0, 4.0))))
  assert len({PReduce(), PReduce(), HetPipe(), Hetero()}) == 3


def test_window_and_adaptive_wait_by_hand():
  # N=2, S=1, pipeline 1 three times slower, no stalls: a forward + backward takes 0.03 s (0.09 s),
  # a group costs alpha = 0.001 s. Pipeline 0 arrives at .030 and opens a 1 ms window alone (closes
  # .031, leaves .032, wait 2 ms); .062 -> .064 (wait 4); pipeline 1 at .090 -> .091 (its wait 2);
  # pipeline 0 at .095 -> .099 (wait 8); .130 -> .138 (wait 10, the cap); .169 -> .179; pipeline 1
  # at .182 -> .184 (its wait 4).
  plan = simulate("1f1b", "preduce", 2, 1, 8, hetero=Hetero(slowdown=((1.0,), (3.0,))))
  got = [(np.flatnonzero(plan.group_members[g]).tolist(), plan.group_open[g], plan.group_close[g])
         for g in range(7)]
  expected = [([0], .030, .031), ([0], .062, .064), ([1], .090, .091), ([0], .095, .099),
              ([0], .130, .138), ([0], .169, .179), ([1], .182, .184)]
  assert [m for m, _, _ in got] == [m for m, _, _ in expected]
  np.testing.assert_allclose([o for _, o, _ in got], [o for _, o, _ in expected], atol=1e-12)
  np.testing.assert_allclose([c for _, _, c in got], [c for _, _, c in expected], atol=1e-12)
