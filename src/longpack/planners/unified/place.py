"""One greedy placement of a global batch for one :class:`~.knobs.Candidate` (loads are cost-model seconds, so
both Σ s and Σ s² balance).

1. Classify: samples longer than a group holds become chains, those that fit only with more checkpointing big
   (planners/unified/tail.py); of the rest, those longer than a rank's budget B are sharded (for memory, as in
   Skrull's DACP), and those the candidate's threshold α says are heavy are sharded too (for compute, which DACP
   never does); everything else stays whole on one rank.
2. Big samples and chains to replicas (LPT), then sharded samples to the replica whose load grows least,
   counting how much each lengthens that replica's K/V exchange.
3. Whole samples, heaviest first, to the replica whose Eq. 2 time max(exchange, own work) + shared work is least
   after adding it to that replica's least-loaded rank (own work under the exchange is free).

Returns the :class:`~.layout.Layout` (the micro-batches of each replica are packed from it on demand), or None
when the candidate is infeasible or places exactly as one already seen. Guarantees: every sample placed once,
each within its rank's budget or split into a chain. Cost: O(n log n + n · replicas).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from ...cost import CostModel
from ..base import Batch, PlanContext
from .knobs import LIGHT, UNIT, Candidate, flag
from .layout import Layout, Timer
from .tail import tail, times

__all__ = ["build", "ARRAY_REPLICAS"]

ARRAY_REPLICAS = 12  # from this many replicas the deals price all in one numpy call; below, a plain loop is faster


def build(batch: Batch, ctx: PlanContext, timer: Timer, c: Candidate, seen: set[tuple]) -> Layout | None:
    cost = timer.cost
    d, k0, kb = c.degree, ctx.ckpt_layers, c.ckpt
    cap = cost.token_cap(k0)
    budget = cap // c.split
    if budget < 1:
        return None
    limit = batch.split_len or np.iinfo(np.int64).max
    whole_len = min(budget * d, limit)
    big_len = min(cost.token_cap(kb) * d, limit) if kb > k0 else whole_len
    lengths, s = batch.lengths, batch.lengths.astype(np.float64)
    is_big = (lengths > whole_len) & (lengths <= big_len)
    is_chain = lengths > max(whole_len, big_len)
    if d > 1 and is_chain.any() and not flag(ctx.option("shard_chains", True)):
        return None
    t_loc, t_sh = times(s, cost, d, k0)
    fits = (lengths <= budget) & ~is_chain & ~is_big
    sharded, unit = _shard(c, cost, s, fits, is_chain | is_big, t_loc, t_sh, ctx.world, k0)
    local = fits & ~sharded
    if d == 1:
        local, sharded = local | sharded, np.zeros_like(sharded)
    key = (d, kb if is_big.any() else k0, c.tail and bool(is_big.any() or is_chain.any()), budget,
           tuple(np.flatnonzero(sharded).tolist()), whole_len, c.alpha == LIGHT)
    if key in seen:
        return None
    seen.add(key)
    built = tail(batch, cost, d, kb, c.split, c.tail, k0, budget, is_big, is_chain, ctx.world // d)
    if built is None:
        return None
    after, rep_load, ckpt_big = built
    start = rep_load.copy()
    shared, comm = deal_shared(heaviest_first(t_sh, np.flatnonzero(sharded)), t_sh, s, rep_load, cost, k0)
    if d > 1 and c.alpha == LIGHT:  # also shard what outlasts the unit on top of the lightest replica's shares
        more = local & (t_loc > unit - float(rep_load.min()))
        if more.any():
            sharded, local, rep_load = sharded | more, local & ~more, start
            shared, comm = deal_shared(heaviest_first(t_sh, np.flatnonzero(sharded)), t_sh, s, rep_load, cost, k0)
    own = deal_own(heaviest_first(t_loc, np.flatnonzero(local)), t_loc, comm, rep_load, d)
    return Layout(timer, k0, budget, cost.token_cap(kb) if ckpt_big else cap, batch, t_loc, t_sh, shared, own,
                  after)


def _shard(c: Candidate, cost: CostModel, s: np.ndarray, fits: np.ndarray, apart: np.ndarray, t_loc: np.ndarray,
           t_sh: np.ndarray, world: int, k0: int) -> tuple[np.ndarray, float]:
    """Which samples to shard (step 1), and the step's longest unit (the largest over samples of the shorter of
    whole on a rank, where it fits, and its share plus its own exchange)."""
    sharded = ~fits & ~apart
    t_unit = t_sh + cost.cp_comm_s(s, k0)
    unit = float(np.max(np.where(fits, np.minimum(t_loc, t_unit), t_unit)))
    if c.degree > 1 and c.alpha in (UNIT, LIGHT):
        sharded |= fits & (t_loc > unit)
    elif c.degree > 1 and math.isfinite(c.alpha) and c.alpha > 0:
        tau = float(t_loc[fits].sum() + t_sh[~fits].sum() * c.degree) / world
        sharded |= fits & (t_loc > c.alpha * tau)
    return sharded, unit


def deal_shared(order: list[int], t_sh: np.ndarray, s: np.ndarray, rep_load: np.ndarray, cost: CostModel, k: int
                ) -> tuple[list[list[int]], np.ndarray]:
    """Sharded samples (heaviest first) each to the replica whose load grows least, its share plus how much it
    lengthens the replica's K/V exchange; ``rep_load`` ends as the shared compute alone. Returns (samples per
    replica, exchange seconds per replica). O(n · replicas)."""
    n_rep = rep_load.size
    shared: list[list[int]] = [[] for _ in range(n_rep)]
    sh_tokens, comm = np.zeros(n_rep), np.zeros(n_rep)
    for i in order:
        if n_rep >= ARRAY_REPLICAS:  # np.argmin keeps the first of equal values: the same choice as the loop
            g = int(np.argmin(rep_load + t_sh[i] + cost.cp_comm_s(sh_tokens + s[i], k) - comm))
        else:
            g = min(range(n_rep), key=lambda r: (rep_load[r] + t_sh[i] + cost.cp_comm_s(sh_tokens[r] + s[i], k)
                                                 - comm[r], r))
        shared[g].append(i)
        sh_tokens[g] += s[i]
        grown = cost.cp_comm_s(sh_tokens[g], k)
        rep_load[g] += float(t_sh[i]) + grown - comm[g]
        comm[g] = grown
    rep_load -= comm
    return shared, comm


def deal_own(items: list[int], t_loc: np.ndarray, comm: np.ndarray, base: np.ndarray, d: int
             ) -> list[list[list[int]]]:
    """Whole samples (heaviest first) to the ranks of len(comm) replicas of d ranks (step 3; ties: the replica
    whose least-loaded rank is emptiest, then the first). O(items · replicas + items · log d)."""
    n_rep = len(comm)
    own: list[list[list[int]]] = [[[] for _ in range(d)] for _ in range(n_rep)]
    heaps = [[(0.0, j) for j in range(d)] for _ in range(n_rep)]  # per replica: (own load, rank)
    least = np.zeros(n_rep)
    comm_l, base_l, least_l, reps = comm.tolist(), base.tolist(), [0.0] * n_rep, range(n_rep)
    for i, t in zip(items, t_loc[np.asarray(items, dtype=np.int64)].tolist(), strict=True):
        if n_rep < ARRAY_REPLICAS:
            after_l = [max(c, x + t) + b for c, x, b in zip(comm_l, least_l, base_l, strict=True)]
            top, g = min(after_l) * (1 + 1e-12), -1
            for r in reps:
                if after_l[r] <= top and (g < 0 or least_l[r] < least_l[g]):
                    g = r
        else:
            after = np.maximum(comm, least + t) + base
            tied = np.flatnonzero(after <= after.min() * (1 + 1e-12))
            g = int(tied[np.argmin(least[tied])]) if tied.size > 1 else int(tied[0])
        load, j = heaps[g][0]
        own[g][j].append(i)
        heapq.heapreplace(heaps[g], (load + t, j))
        least_l[g] = heaps[g][0][0]
        if n_rep >= ARRAY_REPLICAS:
            least[g] = least_l[g]
    return own


def heaviest_first(t: np.ndarray, pos: np.ndarray) -> list[int]:
    return pos[np.lexsort((pos, -t[pos]))].tolist()
