"""Mixing matrices from the groups the simulator formed: `round_mix`, the mixing matrices of the
lockstep executor's rounds (`SyncPlan.mix`), and `window_mix`, one window's matrix
(`preduce_schedule`).

Mapping groups onto the lockstep executor (an approximation for 1F1B): a group formed at stage s
holds arrivals (i, b_i) that may belong to different mini-batches (1F1B's fast pipelines run ahead;
GPipe's run in lockstep, so its groups hold one mini-batch and the mapping is exact). It is
assigned to round r = max_i b_i, and mix[r, s] = G_k @ ... @ G_1 over the groups assigned to (r, s)
in formation order (G = 1/|g| inside group g, identity elsewhere), so the executor averages the
members' models as they are after update r instead of after their own update b_i. Updates without a
group keep identity rows. "adpsgd": mix[b, s] = the pairing matrix of round b
(`adpsgd_matchings(N, B, seed=seed)`) at every stage. "allreduce" (the executor averages
gradients), "none" and "hetpipe" (the executor keeps the parameter-server copy): identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jlp.pipeline.preduce import Group

__all__ = ["round_mix", "window_mix"]


def round_mix(sync: str, groups: Sequence[Group], matchings: np.ndarray | None,
              num_pipelines: int, num_stages: int, num_batches: int) -> np.ndarray:
  """float32 [B, S, N, N]: mix[b, s] for `sync` (module docstring) from the preduce `groups` in
  formation order, or the int [B, N] AD-PSGD partners `matchings` (sync "adpsgd" only)."""
  N, S, B = num_pipelines, num_stages, num_batches
  if sync == "adpsgd":
    pairing = np.zeros((B, N, N))
    rounds, rows = np.arange(B)[:, None], np.arange(N)[None, :]
    pairing[rounds, rows, rows] = 0.5
    pairing[rounds, rows, matchings] = 0.5
    return np.broadcast_to(pairing[:, None], (B, S, N, N)).astype(np.float32)
  if sync == "preduce":
    mix = np.broadcast_to(np.eye(N), (B, S, N, N)).copy()
    for group in groups:
      if len(group.members) > 1:
        rows = mix[group.round, group.stage]
        rows[list(group.members)] = rows[list(group.members)].mean(axis=0)
    return mix.astype(np.float32)
  return np.broadcast_to(np.eye(N, dtype=np.float32), (B, S, N, N)).copy()


def window_mix(window: Sequence[Group], num_pipelines: int) -> np.ndarray:
  """float64 [N, N]: 1/|g| inside each group g of the window, identity elsewhere."""
  matrix = np.eye(num_pipelines)
  for group in window:
    if len(group.members) > 1:
      matrix[np.ix_(group.members, group.members)] = 1.0 / len(group.members)
  return matrix
