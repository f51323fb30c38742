"""Local search on one pipeline stage's simulated times: three moves, each exact in the simulator's terms.

With one stage a replica's time is the sum of its micro-batches' and a micro-batch's time does not depend on its
replica, so every move below is priced by :class:`~.layout.Timer` exactly. A round runs, in order:

* :func:`repack` (per replica): move one piece to another micro-batch of its replica, or trade it for a smaller
  piece of its kind there, where the two micro-batches then take less time in sum. It pays where the packing left
  a share whose exchange nothing hides, or a half-empty micro-batch whose pieces fit elsewhere.
* :func:`trade` (between replicas): swap a piece of the slowest replica for a slightly smaller one of its kind in
  another, where the slowest then ends sooner and the other stays below it. It balances finer than whole
  micro-batches and puts the longer of two near-equal samples onto a rank that waits anyway.
* :func:`balance` (after each): the slowest replica gives a whole micro-batch to another, for one of that
  replica's or for nothing, while that lowers the slowest.

Rounds repeat while the slowest replica gets faster (at most ``ROUNDS``). Only micro-batches before a replica's
first chain piece move or change (a chain holds memory from its first chunk on, so the cap and each micro-batch's
own memory are all a change must respect), none recomputed or padded. Guarantees: every move keeps coverage and
the cap, and lowers either the slowest replica or a replica's sum, so the search only improves and ends.
:class:`Budget` bounds it by a count of simulated layouts (``--opt budget=N``): deterministic, unlike wall time.
Cost: O(budget) micro-batch timings, plus O(pieces · log pieces) per trade to index pieces by size.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ...plan import MicroBatch, Piece
from .layout import Timer, holds_chunk

__all__ = ["Budget", "search", "balance", "repack", "trade", "BUDGET"]

BUDGET = 16  # default layouts the local search simulates, per sample of the global batch
ROUNDS = 3  # most rounds of repacking and trading
NEAREST = 8  # the smaller pieces of its kind, nearest in size, a piece may trade with
TRADES = 2  # most trades between replicas per replica and round
SWAPS = 4  # most micro-batch moves between replicas per micro-batch of the step


class Budget:
    """What is left of the local search's allowance of simulated layouts."""

    def __init__(self, n: int) -> None:
        self.left = n

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def search(reps: list[list[MicroBatch]], timer: Timer, cap: int, full: dict[int, int], budget: Budget,
           trades: int | None = None) -> list[list[MicroBatch]]:
    """The rounds of the module docstring, from ``reps`` balanced; ``trades``: most trades per replica and
    round (default ``TRADES``, 0: none)."""
    trades = TRADES if trades is None else trades
    reps = balance(reps, timer, full)
    slowest = max(timer.total(r) for r in reps)
    for _ in range(ROUNDS):
        reps = balance([repack(r, timer, cap, full, budget) for r in reps], timer, full)
        if trades:
            reps = balance(trade(reps, timer, cap, full, budget, trades), timer, full)
        before, slowest = slowest, max(timer.total(r) for r in reps)
        if not slowest < before * (1 - 1e-9) or budget.left <= 0:
            break
    return reps


def balance(reps: list[list[MicroBatch]], timer: Timer, full: dict[int, int]) -> list[list[MicroBatch]]:
    """Whole micro-batches between replicas: each move takes the pair (given, taken back or nothing) whose larger
    new time is least; a chain's micro-batches stay, and a moved one goes first in its new replica, where no chain
    holds memory yet. Each move lowers the slowest replica and the sum of squared times; at most ``SWAPS`` per
    micro-batch. O(m · M) per move (m: the slowest replica's micro-batches, M: all)."""
    reps = [list(r) for r in reps]
    sec = [[timer.seconds(mb) for mb in r] for r in reps]
    movable = [[bool(mb.pieces) and not holds_chunk(mb, full) for mb in r] for r in reps]
    total = np.array([sum(t) for t in sec])
    for _ in range(SWAPS * sum(len(r) for r in reps)):
        slow = int(np.argmax(total))
        give = [x for x, ok in enumerate(movable[slow]) if ok]
        back = [(g, x) for g in range(len(reps)) if g != slow
                for x in [*(x for x, ok in enumerate(movable[g]) if ok), -1]]  # -1: nothing back
        if not give or not back:
            break
        delta = np.array([sec[slow][x] for x in give])[:, None] - np.array(
            [sec[g][x] if x >= 0 else 0.0 for g, x in back])[None, :]
        dest = total[np.array([g for g, _ in back])]
        after = np.where((delta > 0) & (delta < (total[slow] - dest)[None, :]),
                         np.maximum(total[slow] - delta, dest[None, :] + delta), np.inf)
        a, b = np.unravel_index(int(np.argmin(after)), after.shape)
        if not after[a, b] < total[slow] * (1 - 1e-9):
            break
        (g, x), y = back[b], give[a]
        table: tuple[list[list[Any]], ...] = (reps, sec, movable)
        for lists in table:
            item = lists[slow].pop(y)
            if x >= 0:
                lists[slow].insert(0, lists[g].pop(x))
            lists[g].insert(0, item)
        total[slow] -= float(delta[a, b])
        total[g] += float(delta[a, b])
    return reps


def _free(mbs: list[MicroBatch], full: dict[int, int]) -> int:
    """How many of a replica's first micro-batches precede its first chain piece."""
    return next((x for x, mb in enumerate(mbs) if holds_chunk(mb, full)), len(mbs))


def _width(p: Piece, d: int) -> int:
    """Tokens a piece puts on a rank: its share, ceil(tokens / d), when sharded; all of it otherwise."""
    return -(-p.tokens // d) if p.cp_rank is None else p.tokens


def _without(timer: Timer, mb: MicroBatch, x: int, budget: Budget) -> tuple[MicroBatch, float, float] | None:
    """Micro-batch ``mb`` without its piece x, its time, and what the piece adds (own work on its rank, or every
    rank's share); None when taking it out cannot shorten ``mb`` (its rank waits for another, or no gain) or the
    budget is spent."""
    before, p = timer(mb), mb.pieces[x]
    if p.cp_rank is not None and before[0][p.cp_rank] < timer.seconds(mb) or not budget.spend():
        return None
    rest = replace(mb, pieces=mb.pieces[:x] + mb.pieces[x + 1:])
    t_rest = timer.seconds(rest)
    if t_rest >= timer.seconds(mb):
        return None
    after = timer(rest)
    added = float(before[1][p.cp_rank] - after[1][p.cp_rank]) if p.cp_rank is not None else \
        float(before[2][0] - after[2][0])
    return rest, t_rest, added


def _estimate(dst: MicroBatch, p: Piece, q: Piece | None, added: float, timer: Timer, cap: int) -> float | None:
    """Eq. 2 estimate of ``dst``'s time with piece p added (on its least-loaded rank with room, or sharded), or in
    place of q (p on q's rank; q gives back its part of ``added`` in proportion to its tokens); None when p does
    not fit the cap. O(d)."""
    d, cost = timer.d, timer.cost
    _, local, dist, comm, tokens, _ = timer(dst)
    room, w_q = cap - tokens, _width(q, d) if q is not None else 0
    more = added * (1 - w_q / _width(p, d))
    if p.cp_rank is None:
        if np.any(room + w_q < _width(p, d)):
            return None
        sharded = sum(y.tokens for y in dst.pieces if y.cp_rank is None) + p.tokens - (q.tokens if q else 0)
        grown = cost.cp_comm_s(sharded, dst.ckpt_layers, dst.recompute)
        return float(np.max(np.maximum(grown, local - cost.fixed_s) + dist + more)) + cost.fixed_s
    j = _rank_for(p, q, dst, timer, cap)
    if j < 0:
        return None
    return max(timer.seconds(dst), float(max(comm[0], local[j] - cost.fixed_s + more) + dist[j]) + cost.fixed_s)


def _rank_for(p: Piece, q: Piece | None, dst: MicroBatch, timer: Timer, cap: int) -> int:
    """The rank an own piece p takes in ``dst``: q's when it replaces q, else the least-loaded with room (-1)."""
    _, local, _, _, tokens, _ = timer(dst)
    room = cap - tokens
    if q is not None:
        return int(q.cp_rank or 0) if room[int(q.cp_rank or 0)] + q.tokens >= p.tokens else -1
    ok = np.flatnonzero(room >= p.tokens)
    return int(ok[np.argmin(local[ok])]) if ok.size else -1


def _swap_in(mb: MicroBatch, p: Piece, q: Piece | None, rank: int | None) -> MicroBatch:
    """``mb`` with p added on ``rank`` (sharded when p is), in place of q when given."""
    kept = tuple(y for y in mb.pieces if y != q) if q is not None else mb.pieces
    return replace(mb, pieces=kept + (Piece(p.sample, p.start, p.stop, None if p.cp_rank is None else rank),))


def repack(mbs: list[MicroBatch], timer: Timer, cap: int, full: dict[int, int], budget: Budget
           ) -> list[MicroBatch]:
    """One replica's pieces between its micro-batches (module docstring), first improvement, while one helps
    (a pass over every piece that can shorten its micro-batch); an emptied micro-batch is dropped. A change whose
    estimate says it cannot pay is not simulated. O(P · M) estimates a pass, for P pieces and M micro-batches."""
    mbs = [mb for mb in mbs if mb.pieces]
    first = _free(mbs, full)
    head, rest = mbs[:first], mbs[first:]
    if len(head) < 2 or any(mb.recompute or mb.pad_to for mb in head):
        return mbs
    sec = [timer.seconds(mb) for mb in head]
    improved = True
    while improved and budget.left > 0:
        improved = False
        a = 0
        while a < len(head):
            x = 0
            while x < len(head[a].pieces) and budget.left > 0:
                found = _repack_one(head, sec, a, x, timer, cap, budget)
                if found is None:
                    x += 1
                    continue
                b, head[a], head[b] = found
                sec[a], sec[b] = timer.seconds(head[a]), timer.seconds(head[b])
                improved = True
                if not head[a].pieces:
                    del head[a], sec[a]
                    break
            else:
                a += 1
    return head + rest


def _repack_one(mbs: list[MicroBatch], sec: list[float], a: int, x: int, timer: Timer, cap: int, budget: Budget
                ) -> tuple[int, MicroBatch, MicroBatch] | None:
    """The first micro-batch b that takes piece x of micro-batch a (moved, or traded for the smallest piece of
    its kind that makes it fit) with less time in sum: (b, new a, new b)."""
    out = _without(timer, mbs[a], x, budget)
    if out is None:
        return None
    rest, t_rest, added = out
    p, d, bar = mbs[a].pieces[x], timer.d, None
    for b, dst in enumerate(mbs):
        if b == a or dst.ckpt_layers != mbs[a].ckpt_layers:
            continue
        bar = sec[a] + sec[b] - 1e-12
        room = cap - timer(dst)[4]
        fits = [y for y in dst.pieces if (y.cp_rank is None) == (p.cp_rank is None) and _width(y, d) < _width(p, d)
                and _width(y, d) >= _width(p, d) - (room.min() if p.cp_rank is None else room[y.cp_rank])]
        smallest = min(fits, key=lambda y: (_width(y, d), dst.pieces.index(y)), default=None)
        for q in (None, smallest) if smallest is not None else (None,):
            est = _estimate(dst, p, q, added, timer, cap)
            if est is None or t_rest + est >= bar or not budget.spend():
                continue
            new_b = _swap_in(dst, p, q, q.cp_rank if q is not None else _rank_for(p, None, dst, timer, cap))
            t_b = timer.seconds(new_b)
            new_a = rest if q is None else _swap_in(rest, q, None, p.cp_rank)
            if timer.seconds(new_a) + t_b < bar and timer.fits(new_b, cap) and timer.fits(new_a, cap):
                return b, new_a, new_b
    return None


def trade(reps: list[list[MicroBatch]], timer: Timer, cap: int, full: dict[int, int], budget: Budget,
          trades: int = 2) -> list[list[MicroBatch]]:
    """Pieces between replicas (module docstring): per trade, the best over the slowest replica's pieces and the
    ``NEAREST`` smaller pieces of their kind elsewhere; each estimated first (Eq. 2), only those that could beat
    the best so far simulated. At most ``trades`` trades per replica."""
    reps = [list(r) for r in reps]
    sec = [[timer.seconds(mb) for mb in r] for r in reps]
    total = np.array([sum(t) for t in sec])
    free = [[x for x, mb in enumerate(r[:_free(r, full)]) if mb.pieces and not (mb.recompute or mb.pad_to)]
            for r in reps]
    for _ in range(trades * len(reps)):
        slow = int(np.argmax(total))
        best = _best_trade(reps, sec, total, free, slow, timer, cap, budget)
        if best is None:
            break
        _, a, g, b, new_a, new_b = best
        reps[slow][a], sec[slow][a] = new_a, timer.seconds(new_a)
        reps[g][b], sec[g][b] = new_b, timer.seconds(new_b)
        total[slow], total[g] = sum(sec[slow]), sum(sec[g])
    return reps


def _best_trade(reps: list[list[MicroBatch]], sec: list[list[float]], total: np.ndarray, free: list[list[int]],
                slow: int, timer: Timer, cap: int, budget: Budget) -> tuple | None:
    """The best trade of a piece of replica ``slow`` (after, a, g, b, new a, new b), or None."""
    index: dict[bool, list[tuple[int, int, int, Piece]]] = {True: [], False: []}  # by kind: sharded or not
    for g, r in enumerate(reps):
        for b in free[g] if g != slow else ():
            for q in r[b].pieces:
                index[q.cp_rank is None].append((q.tokens, g, b, q))
    for entries in index.values():
        entries.sort(key=lambda e: e[0])
    sizes = {kind: np.array([e[0] for e in entries]) for kind, entries in index.items()}
    best = None
    for a in free[slow]:
        for x, p in enumerate(reps[slow][a].pieces):
            out = _without(timer, reps[slow][a], x, budget)
            if out is None:
                continue
            rest, t_rest, added = out
            floor = total[slow] - sec[slow][a] + t_rest  # the sender ends here at least, whatever it gets back
            kind = p.cp_rank is None
            stop = int(np.searchsorted(sizes[kind], p.tokens, side="left"))
            for _, g, b, q in index[kind][max(0, stop - NEAREST):stop]:
                dst, bar = reps[g][b], total[slow] * (1 - 1e-9) if best is None else best[0]
                if floor >= bar:
                    break
                est = _estimate(dst, p, q, added, timer, cap) if dst.ckpt_layers == reps[slow][a].ckpt_layers else None
                if est is None or total[g] - sec[g][b] + est >= bar or not budget.spend():
                    continue
                new_b = _swap_in(dst, p, q, q.cp_rank)
                side_b = total[g] - sec[g][b] + timer.seconds(new_b)
                if side_b >= bar:
                    continue
                new_a = _swap_in(rest, q, None, p.cp_rank)
                after = max(total[slow] - sec[slow][a] + timer.seconds(new_a), side_b)
                if after < bar and timer.fits(new_b, cap) and timer.fits(new_a, cap):
                    best = (after, a, g, b, new_a, new_b)
    return best
