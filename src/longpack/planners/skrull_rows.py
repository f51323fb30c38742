"""Skrull's GDS + DACP (planners/skrull.py) for many global batches at once, into columns (planners/columnar.py).

Step for step equal to :meth:`Skrull.plan_batch <longpack.planners.skrull.Skrull.plan_batch>` (tested): the same
split, micro-batches and placements, every float load summed in the same order. What runs in lockstep, one
vectorized step per item index over a block of batches:

1. LPT: item k of every batch (heaviest first) to its batch's least-loaded replica (ties: the lowest).
2. Per replica, its samples ascending by (length, sample) and m = ceil(Σ ceil(s/cp) / cap) strided slices.
3. DACP on every slice of every replica at once: each sample whole on its slice's least-loaded rank if it fits,
   else on the rank with the most room, else sharded when the tightest rank holds ceil(s/cp). A slice that would
   need a rollback is placed by :func:`~longpack.planners.dacp.dacp` itself, from its start.
4. A replica with a slice over cap·cp tokens or one DACP cannot place tries m + 1, until all fit.

Cost: O(width) vectorized steps for LPT and O(longest slice) per try of m for DACP, each over the block's
batches; O(samples) memory. Rollbacks cost what :func:`~longpack.planners.dacp.dacp` costs, for their slices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..columns import StepColumns
from .base import Batch, PlanContext
from .columnar import Placed, Rows, plan_rows
from .dacp import dacp, sequence_costs

__all__ = ["skrull_steps"]

_BIG = np.iinfo(np.int64).max


def skrull_steps(batches: Sequence[Batch], ctx: PlanContext, rollback: str) -> StepColumns:
    """Skrull's steps (DACP placement, LPT partition) for ``batches``."""
    return plan_rows(batches, ctx, lambda rows: _gds(rows, ctx, rollback), 0, block=1 << 18)


def _lpt(c: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """(rows, width): the group of each entry, LPT per row (heaviest first to the lightest of k groups; a row's
    padding adds 0.0 to a group, which leaves its load exact)."""
    rows, width = c.shape
    order = np.argsort(np.where(np.arange(width)[None, :] < counts[:, None], -c, np.inf), axis=1, kind="stable")
    heavy = np.where(np.arange(width)[None, :] < counts[:, None], np.take_along_axis(c, order, axis=1), 0.0)
    loads = np.zeros((rows, k))
    chosen = np.zeros((rows, width), dtype=np.int64)
    r = np.arange(rows)
    for j in range(width):
        g = np.argmin(loads, axis=1)
        loads[r, g] += heavy[:, j]
        chosen[:, j] = g
    group = np.empty_like(chosen)
    np.put_along_axis(group, order, chosen, axis=1)
    return group


def _gds(rows: Rows, ctx: PlanContext, rollback: str) -> Placed:
    cap, cp, dp = ctx.token_cap, ctx.cp, ctx.dp
    n_rows, width = rows.lengths.shape
    if width == 0:  # every batch of the block runs its samples as chains, placed apart: nothing here
        none = np.zeros((n_rows, 0), dtype=np.int64)
        return Placed(none, none, np.zeros(n_rows, dtype=np.int64), rank=none, within=none)
    t_local, t_shard = (a.reshape(n_rows, width) for a in sequence_costs(rows.lengths.ravel(), ctx))
    group = _lpt(t_local, rows.counts, dp)
    # replica (row, g) = row * dp + g: its entries ascending by (length, sample)
    ascending = np.argsort(np.where(rows.mask, rows.lengths * (1 << 31) + rows.samples, _BIG), axis=1)
    by_group = np.where(rows.mask, group, dp).astype(np.int16)  # padding after every group
    order = np.take_along_axis(ascending, np.argsort(np.take_along_axis(by_group, ascending, axis=1), axis=1,
                                                     kind="stable"), axis=1)
    per = np.stack([(by_group == g).sum(axis=1) for g in range(dp)], axis=1)  # (rows, dp)
    n = per.ravel()
    wr = max(int(n.max(initial=0)), 1)
    at = (np.cumsum(per, axis=1) - per)[:, :, None] + np.arange(wr)[None, None, :]
    pos = np.take_along_axis(order[:, None, :], np.minimum(at, max(width - 1, 0)), axis=2).reshape(n_rows * dp, wr)
    row = np.repeat(np.arange(n_rows), dp)[:, None]
    real = np.arange(wr)[None, :] < n[:, None]
    lengths = np.where(real, rows.lengths[row, pos], 0)
    local, shard = t_local[row, pos], t_shard[row, pos]  # per replica slot, as ``lengths``
    m = np.maximum(1, -(-(-(-lengths // cp)).sum(axis=1) // cap))
    where = np.full(lengths.shape, -1, dtype=np.int64)
    pending = np.flatnonzero(n > 0)
    while pending.size:
        ok = _try(pending, m[pending], n[pending], lengths, local, shard, where, cap, cp, rollback)
        m[pending[~ok]] += 1
        pending = pending[~ok]
    slot = np.empty((n_rows * dp, width), dtype=np.int64)  # entry -> its slot in its replica's ascending order
    r_idx = np.broadcast_to(np.arange(n_rows * dp)[:, None], pos.shape)
    slot[r_idx[real], pos[real]] = np.broadcast_to(np.arange(wr), pos.shape)[real]
    rep = np.arange(n_rows)[:, None] * dp + group
    k = np.take_along_axis(slot.reshape(n_rows, dp, width), group[:, None, :], axis=1)[:, 0, :]
    k = np.where(rows.mask, k, 0)
    rank = where[rep, k]
    depth = np.where(n > 0, m, 0).reshape(n_rows, dp).max(axis=1, initial=0)
    return Placed(group, k % m[rep], depth, rank=rank, within=k)


def _try(reps: np.ndarray, m: np.ndarray, n: np.ndarray, lengths: np.ndarray, t_local: np.ndarray,
         t_shard: np.ndarray, where: np.ndarray, cap: int, cp: int, rollback: str) -> np.ndarray:
    """Place replicas ``reps`` in ``m`` strided slices each; write the ranks of those that fit into ``where``
    and return which fit."""
    mb_rep = np.repeat(np.arange(reps.size), m)
    j = np.arange(mb_rep.size) - np.repeat(np.cumsum(m) - m, m)
    size = -(-(n[mb_rep] - j) // m[mb_rep])
    slots = j[:, None] + np.arange(int(size.max(initial=1)))[None, :] * m[mb_rep, None]
    inside = slots < n[mb_rep, None]
    slots = np.where(inside, slots, 0)
    g = reps[mb_rep, None]
    s, tl, ts = lengths[g, slots], t_local[g, slots], t_shard[g, slots]
    fits = np.where(inside, -(-s // cp), 0).sum(axis=1) <= cap * cp
    placed, stuck = _dacp_lockstep(s, tl, ts, size, cap, cp, rollback == "none")
    for b in np.flatnonzero(stuck & fits).tolist():
        got = dacp(s[b, :size[b]].tolist(), cap=cap, cp=cp, t_local=tl[b, :size[b]].tolist(),
                   t_shard=ts[b, :size[b]].tolist(), rollback=rollback)
        if got is None:
            fits[b] = False
        else:
            placed[b, :size[b]] = [-1 if r is None else r for r in got]
    bad = np.bincount(mb_rep[~fits], minlength=reps.size) > 0
    keep = inside & ~bad[mb_rep, None]
    where[np.broadcast_to(g, slots.shape)[keep], slots[keep]] = placed[keep]
    return ~bad


def _dacp_lockstep(s: np.ndarray, tl: np.ndarray, ts: np.ndarray, size: np.ndarray, cap: int, cp: int,
                   overflow: bool) -> tuple[np.ndarray, np.ndarray]:
    """DACP without rollback on every row (slice) at once: each item's rank (−1 sharded), and which rows needed a
    rollback (left for :func:`dacp`); ``overflow``: shard anyway instead (rollback ``none``)."""
    rows = s.shape[0]
    room = np.full((rows, cp), cap, dtype=np.int64)
    load = np.zeros((rows, cp))
    placed = np.full(s.shape, -1, dtype=np.int64)
    stuck = np.zeros(rows, dtype=bool)
    for i in range(s.shape[1]):
        a = np.flatnonzero((size > i) & ~stuck)
        if not a.size:
            break
        si, rm, ar = s[a, i], room[a], np.arange(a.size)
        t = np.argmin(load[a], axis=1)
        t = np.where(rm[ar, t] >= si, t, np.argmax(rm, axis=1))
        local = rm[ar, t] >= si
        la, lt = a[local], t[local]
        room[la, lt] -= si[local]
        load[la, lt] += tl[la, i]
        placed[la, i] = lt
        other = ~local
        shard = other & ((rm.min(axis=1) >= -(-si // cp)) | overflow)
        sa = a[shard]
        room[sa] -= (-(-si[shard] // cp))[:, None]
        load[sa] += ts[sa, i][:, None]
        stuck[a[other & ~shard]] = True
    return placed, stuck
