"""One greedy placement of a global batch for one :class:`~.knobs.Candidate` (loads are cost-model seconds, so
both Σ s and Σ s² balance).

1. Classify: samples longer than a group holds become chains (planners/unified/tail.py); of the rest, those
   longer than a rank's budget B are sharded (for memory, as in Skrull's DACP), and those the candidate's
   threshold α says are heavy are sharded too (for compute, which DACP never does); everything else stays whole
   on one rank.
2. Chains to replicas (LPT), then sharded samples to the replica whose load grows least, counting how much each
   lengthens that replica's K/V exchange.
3. Whole samples, heaviest first, to the replica whose Eq. 2 time max(exchange, own work) + shared work is least
   after adding it to that replica's least-loaded rank (own work under the exchange is free).
4. Each replica packed into micro-batches (:func:`~.layout.pack`), chains after.

Returns the :class:`~.layout.Layout`, or None when the candidate is infeasible or places exactly as one already
seen. Guarantees: every sample placed once, each within its rank's budget or split into a chain. Cost:
O(n log n + n · replicas) for the deals (one numpy pricing of the replicas a sample from 32 of them on),
O(n · m) for packing into m micro-batches a replica.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np

from ..base import Batch, PlanContext
from .knobs import UNIT, Candidate
from .layout import Layout, Rates, pack
from .tail import chain_cost, tail

__all__ = ["build", "deal_shared", "deal_own"]

FEW = 32  # below this many replicas the whole-sample deal scans them in Python, faster than numpy there


def build(batch: Batch, ctx: PlanContext, rates: Callable[[int, int], Rates], c: Candidate, seen: set[tuple],
          full: dict[int, int]) -> Layout | None:
    """The candidate's layout (module docstring); ``rates(d, k)``: the batch's :class:`Rates`, memoised; ``full``:
    the batch's lengths by sample id."""
    d, r, lengths = c.degree, rates(c.degree, ctx.ckpt_layers), batch.lengths
    cost, cap = r.cost, r.cost.token_cap(r.k)
    budget = cap // c.split
    whole_len = min(budget * d, batch.split_len or np.iinfo(np.int64).max)
    is_chain = lengths > whole_len
    if budget < 1 or (d > 1 and is_chain.any() and not ctx.flag("shard_chains", True)):
        return None
    fits = (lengths <= budget) & ~is_chain
    sharded = _shard(c, r, fits, is_chain, ctx.world)
    local = fits & ~sharded
    if d == 1:
        local, sharded = local | sharded, np.zeros_like(sharded)
    key = (d, c.tail and bool(is_chain.any()), budget, tuple(np.flatnonzero(sharded).tolist()))
    if key in seen:
        return None
    seen.add(key)
    if (built := tail(batch, r, c.split, c.tail, budget, is_chain)) is None:
        return None
    chains, start = built
    load = start.tolist()
    shared, comm = deal_shared(heaviest_first(r.share_a, np.flatnonzero(sharded)), r, load)
    own = deal_own(heaviest_first(r.own_a, np.flatnonzero(local)), r.own, comm, load, d)
    samples = batch.samples.tolist()
    return Layout([pack(r, shared[g], own[g], budget) for g in range(len(own))], chains,
                  *chain_cost(chains, r, full), cost, cap, r.bound - cost.grad_allreduce_s(),
                  frozenset(np.flatnonzero(sharded).tolist()), samples, full)


def _shard(c: Candidate, r: Rates, fits: np.ndarray, apart: np.ndarray, world: int) -> np.ndarray:
    """Which samples to shard (step 1): those that fit no rank, and at threshold α those that fit but whose whole-rank
    time exceeds α·τ, or (``unit``) the step's longest unit, the largest over samples of the shorter of whole on a
    rank, where it fits, and its share plus its own exchange."""
    sharded, t_loc = ~fits & ~apart, r.own_a
    if c.degree > 1 and c.alpha == UNIT:
        sharded |= fits & (t_loc > float(np.max(np.where(fits, np.minimum(t_loc, r.alone), r.alone))))
    elif c.degree > 1 and math.isfinite(c.alpha):
        sharded |= fits & (t_loc > c.alpha * float(t_loc[fits].sum() + r.share_a[~fits].sum() * c.degree) / world)
    return sharded


def deal_shared(order: list[int], r: Rates, load: list[float]) -> tuple[list[list[int]], list[float]]:
    """Sharded samples (heaviest first) each to the replica whose load grows least, its share plus how much it
    lengthens the replica's K/V exchange (ties: the first); ``load`` ends as each replica's shared compute.
    Returns (samples per replica, exchange seconds per replica). O(n · replicas), in numpy."""
    shared: list[list[int]] = [[] for _ in load]
    tokens, comm, at = np.zeros(len(load), dtype=np.int64), np.zeros(len(load)), np.asarray(load, dtype=np.float64)
    for i in order:
        g = int(np.argmin(at + r.share[i] + r.x_a(tokens + r.n[i]) - comm))
        shared[g].append(i)
        tokens[g] += r.n[i]
        grown = r.x(int(tokens[g]))
        at[g] += r.share[i] + grown - comm[g]
        comm[g] = grown
    load[:] = (at - comm).tolist()
    return shared, comm.tolist()


def deal_own(items: list[int], own: list[float], comm: list[float], base: list[float], d: int
             ) -> list[list[list[int]]]:
    """Whole samples (heaviest first) to the ranks of len(comm) replicas of d ranks (step 3: the replica whose
    max(exchange, least rank's load + the sample) + shared work is least, its least-loaded rank; ties within
    1e-12: the replica whose least-loaded rank is emptiest, then the first). O(items · (replicas + log d)), in
    numpy from ``FEW`` replicas on."""
    n_rep = len(comm)
    out: list[list[list[int]]] = [[[] for _ in range(d)] for _ in range(n_rep)]
    ranks = [[(0.0, j) for j in range(d)] for _ in range(n_rep)]  # per replica, a heap of (own load, rank)
    least, reps = [0.0] * n_rep, range(n_rep)
    comm_a, base_a, least_a = np.asarray(comm), np.asarray(base), np.zeros(n_rep)
    for i in items:
        t = own[i]
        if n_rep < FEW:
            after = [max(c, x + t) + b for c, x, b in zip(comm, least, base, strict=True)]
            tie, g = min(after) * (1 + 1e-12), -1
            for r in reps:
                if after[r] <= tie and (g < 0 or least[r] < least[g]):
                    g = r
        else:
            after_a = np.maximum(comm_a, least_a + t) + base_a
            tied = np.flatnonzero(after_a <= after_a.min() * (1 + 1e-12))
            g = int(tied[np.argmin(least_a[tied])])
        load, j = ranks[g][0]
        out[g][j].append(i)
        heapq.heapreplace(ranks[g], (load + t, j))
        least[g] = least_a[g] = ranks[g][0][0]
    return out


def heaviest_first(t: np.ndarray, pos: np.ndarray) -> list[int]:
    return pos[np.lexsort((pos, -t[pos]))].tolist()
