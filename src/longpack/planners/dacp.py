"""Skrull's DACP (Algorithm 1, App. B.1) for one micro-batch, its round-robin ablation (Table 3), and the
per-sequence compute loads both place by.

DACP: in ascending order, each sequence goes whole on the least-loaded CP rank if it fits, else on the rank with
the most room, else is sharded over all N ranks if the tightest rank can hold ceil(s/N); if not even that, one
local sequence of the tightest rank becomes sharded (rollback) and the scan retries. The placement rules and
their guarantees are in planners/skrull.py's docstring. Cost: O(K·N) per call for K sequences.

>>> dacp([100, 200, 300, 2000], cap=1000, cp=4, t_local=[1.0, 2.0, 3.0, 30.0], t_shard=[0.5, 0.7, 1.0, 8.0])
[0, 1, 2, None]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .base import PlanContext

__all__ = ["dacp", "round_robin", "sequence_costs"]


class _Ranks:
    """Budgets, loads and local sequences of the N CP ranks while one micro-batch is being placed."""

    def __init__(self, cap: int, cp: int) -> None:
        self.room = [cap] * cp
        self.load = [0.0] * cp
        self.local: list[list[int]] = [[] for _ in range(cp)]

    def put_local(self, i: int, r: int, s: int, t: float) -> None:
        self.room[r] -= s
        self.load[r] += t
        self.local[r].append(i)

    def put_sharded(self, shard: int, t: float) -> None:
        for r in range(len(self.room)):
            self.room[r] -= shard
            self.load[r] += t


def _rollback(ranks: _Ranks, r: int, place: list, lengths: Sequence[int], t_local: Sequence[float],
              t_shard: Sequence[float], cp: int, longest: bool) -> bool:
    """Turn a local sequence of rank r into a sharded one (corrected errata); cascade while a rank is negative."""
    pending = [r]
    while pending:
        r = pending.pop()
        if not ranks.local[r]:
            return False
        pick = max(ranks.local[r], key=lambda i: (lengths[i], i)) if longest else ranks.local[r][0]
        ranks.local[r].remove(pick)
        s, shard = lengths[pick], math.ceil(lengths[pick] / cp)
        ranks.room[r] += s
        ranks.load[r] -= t_local[pick]
        ranks.put_sharded(shard, t_shard[pick])
        place[pick] = None
        pending.extend(q for q in range(cp) if ranks.room[q] < 0 and q not in pending)
    return True


def _place(lengths: Sequence[int], cap: int, cp: int, t_local: Sequence[float], t_shard: Sequence[float],
           rollback: str, balance: bool) -> list[int | None] | None:
    """Shared loop of DACP (balance=True) and round-robin (balance=False); see the module docstring."""
    ranks = _Ranks(cap, cp)
    place: list[int | None] = [None] * len(lengths)
    i = 0
    while i < len(lengths):
        s = int(lengths[i])
        shard = math.ceil(s / cp)
        t = min(range(cp), key=lambda r: (ranks.load[r], r))
        if not (balance and ranks.room[t] >= s):
            t = max(range(cp), key=lambda r: (ranks.room[r], -r))
        if ranks.room[t] >= s:
            ranks.put_local(i, t, s, t_local[i])
            place[i] = t
            i += 1
            continue
        tight = min(range(cp), key=lambda r: (ranks.room[r], r))
        if ranks.room[tight] >= shard or rollback == "none":
            ranks.put_sharded(shard, t_shard[i])  # with rollback "none" this may overflow: an OOM
            place[i] = None
            i += 1
            continue
        if not _rollback(ranks, tight, place, lengths, t_local, t_shard, cp, rollback == "longest"):
            return None
    return place


def dacp(lengths: Sequence[int], *, cap: int, cp: int, t_local: Sequence[float], t_shard: Sequence[float],
         rollback: str = "shortest") -> list[int | None] | None:
    """Skrull DACP for one micro-batch given in ascending length order: the CP rank of each local sequence, None
    for sharded ones; None overall when even rollback cannot fit it (GDS then uses more micro-batches)."""
    return _place(lengths, cap, cp, t_local, t_shard, rollback, balance=True)


def round_robin(lengths: Sequence[int], *, cap: int, cp: int, t_local: Sequence[float], t_shard: Sequence[float],
                rollback: str = "shortest") -> list[int | None] | None:
    """Table 3's round-robin: most room first, shard if nothing fits, no compute balancing."""
    return _place(lengths, cap, cp, t_local, t_shard, rollback, balance=False)


def sequence_costs(lengths: np.ndarray, ctx: PlanContext) -> tuple[np.ndarray, np.ndarray]:
    """(whole on one rank, one rank's share when sharded) compute per sequence: seconds from the cost model, or
    with option ``loads=flops`` the paper's FLOPs(S) and FLOPs(S)/N (Skrull App. C.2)."""
    cost, cp = ctx.cost, ctx.cp
    s = lengths.astype(np.float64)
    if ctx.option("loads", "time") == "flops":
        f = cost.model.skrull_layer_flops(s)
        return f, f / cp
    pairs = cost.cfg.causal_factor * s * s
    local = np.asarray(cost.linear_s(s, ideal=True)) + np.asarray(cost.attn_s(pairs, s))
    q = s / (2 * cp) if cp > 1 else s
    shard = np.asarray(cost.linear_s(s / cp, ideal=True)) + np.asarray(cost.attn_s(pairs / cp, q))
    return local, shard
