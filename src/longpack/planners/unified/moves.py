"""Local search on one pipeline stage's times: three moves, each priced exactly by Eq. 2's closed form.

With one stage a replica's time is the sum of its micro-batches' and a micro-batch's time does not depend on its
replica, so :class:`~.layout.Mb`'s sums price every move below exactly, in O(d). A round runs, in order:

* :func:`repack` (per replica, the slowest first): move one sample to another micro-batch of its replica (a
  sharded one, or an own one to that micro-batch's least-loaded rank with room), where the two then take less
  time in sum. It pays where the packing left a share whose exchange nothing hides, or a half-empty micro-batch
  whose samples fit elsewhere.
* :func:`trade` (between replicas): swap a sample of the slowest replica for a slightly smaller one of its kind in
  another, where the slowest then ends sooner and the other stays below it. It balances finer than whole
  micro-batches and puts the longer of two near-equal samples onto a rank that waits anyway.
* :func:`balance` (after each): the slowest replica gives a whole micro-batch to another, for one of that
  replica's or for nothing, while that lowers the slowest.

Rounds repeat while the slowest replica gets faster (at most ``ROUNDS``) and it is above the layout's ``floor``
(a lower bound: nothing can beat it). Chains' micro-batches never move or change (they hold memory from their
first chunk on); a moved micro-batch runs first in its new replica. Guarantees: every move keeps coverage, the cap
and memory, and lowers the slowest replica or a replica's sum, so the search only improves and ends.
:class:`Budget` bounds it by a count of priced layouts (``--opt budget=N``): deterministic, unlike wall time.
Cost: O(budget · d), plus O(samples · log samples) per trade call to index samples by size.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from .layout import Layout, Mb

__all__ = ["Budget", "search", "balance", "repack", "trade", "trial", "members", "BUDGET"]

BUDGET = 16  # default layouts the local search prices, per sample of the global batch
ROUNDS = 3  # most rounds of repacking and trading
NEAREST = 8  # the smaller samples of its kind, nearest in size, a sample may trade with
TRADES = 2  # most trades between replicas per replica and round
SWAPS = 4  # most micro-batch moves between replicas per micro-batch of the step

Member = tuple[int, int]  # (sample position, rank); rank -1: sharded over the group


class Budget:
    """What is left of the local search's allowance of priced layouts."""

    def __init__(self, n: int) -> None:
        self.left = n

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def search(lay: Layout, budget: Budget, trades: int | None = None) -> None:
    """The rounds of the module docstring on ``lay``, in place; ``trades``: most trades per replica and round
    (default ``TRADES``, 0: none)."""
    balance(lay)
    slowest = max(lay.replica_s(g) for g in range(len(lay.reps)))
    for _ in range(ROUNDS):
        if slowest <= lay.floor * (1 + 1e-12) or budget.left <= 0:
            break
        for g in sorted(range(len(lay.reps)), key=lambda g: -lay.replica_s(g)):
            repack(lay.reps[g], lay.cap, budget)
        balance(lay)
        if trades != 0:
            trade(lay, budget, TRADES if trades is None else trades)
            balance(lay)
        before, slowest = slowest, max(lay.replica_s(g) for g in range(len(lay.reps)))
        if not slowest < before * (1 - 1e-9):
            break


def balance(lay: Layout) -> None:
    """Whole micro-batches between replicas: each move takes the pair (given, taken back or nothing) whose larger
    new time is least; a moved one goes first in its new replica. Each move lowers the slowest replica and the sum
    of squared times; at most ``SWAPS`` per micro-batch. O(m · M) per move (m: the slowest replica's
    micro-batches, M: all), in numpy."""
    reps = lay.reps
    total = np.array([lay.replica_s(g) for g in range(len(reps))])
    sec = [np.array([mb.t for mb in rep] + [0.0]) for rep in reps]  # each replica's micro-batches, then nothing
    for _ in range(SWAPS * sum(len(r) for r in reps)):
        slow, lens = int(np.argmax(total)), [len(x) for x in sec]
        owner = np.repeat(np.arange(len(reps)), lens)
        slot = np.arange(owner.size) - np.repeat(np.cumsum(lens) - lens, lens)
        back, other = np.concatenate(sec), owner != slow
        back, owner, slot = back[other], owner[other], slot[other]
        delta, dest = sec[slow][:-1, None] - back[None, :], total[owner]
        after = np.where((delta > 0) & (delta < total[slow] - dest), np.maximum(total[slow] - delta, dest + delta),
                         np.inf)
        if not after.size or not after.min() < total[slow] * (1 - 1e-9):
            break
        a, b = np.unravel_index(int(np.argmin(after)), after.shape)
        g, x, given = int(owner[b]), int(slot[b]), reps[slow].pop(int(a))
        if x < len(reps[g]):
            reps[slow].insert(0, reps[g].pop(x))
        reps[g].insert(0, given)
        total[slow], total[g] = total[slow] - delta[a, b], total[g] + delta[a, b]
        for h in (slow, g):
            sec[h] = np.array([mb.t for mb in reps[h]] + [0.0])


def trial(mb: Mb, cap: int, out: Member | None = None, into: Member | None = None) -> float | None:
    """``mb``'s seconds with member ``out`` taken out and ``into`` put in, or None over the cap or memory. O(d)."""
    r, loc, tok, w, sh, n = mb.r, mb.loc, mb.tok, mb.w, mb.sh, mb.n
    count = len(mb.own) + len(mb.shared)
    for sign, m in ((-1, out), (1, into)):
        if m is None:
            continue
        i, j = m
        count += sign
        if j < 0:
            w, sh, n = w + sign * r.w[i], sh + sign * r.share[i], n + sign * r.n[i]
        else:
            loc, tok = list(loc), list(tok)
            loc[j] += sign * r.own[i]
            tok[j] += sign * r.n[i]
    if max(tok) + w > min(cap, r.mem):
        return None
    return r.time(max(loc), sh, n) if count else 0.0


def apply(mb: Mb, out: Member | None, into: Member | None) -> None:
    """Take ``out`` out of ``mb`` and put ``into`` in (members keep their order; a newcomer goes last)."""
    if out is not None:
        (mb.shared.remove(out[0]) if out[1] < 0 else mb.own.remove(out))
    if into is not None:
        (mb.shared.append(into[0]) if into[1] < 0 else mb.own.append(into))
    mb.sums()


def members(mb: Mb) -> list[Member]:
    return [(i, -1) for i in mb.shared] + list(mb.own)


def repack(mbs: list[Mb], cap: int, budget: Budget) -> None:
    """One replica's samples between its micro-batches (module docstring), in place: first improvement, pass after
    pass while one helps; an emptied micro-batch is dropped. O(samples · m) prices a pass, for m micro-batches."""
    improved = True
    while improved and budget.left > 0 and len(mbs) > 1:
        improved = False
        for src in list(mbs):
            for p in members(src):
                if budget.left > 0 and _move(mbs, src, p, cap, budget):
                    improved = True
                    if not (src.shared or src.own):
                        mbs.remove(src)


def _move(mbs: list[Mb], src: Mb, p: Member, cap: int, budget: Budget) -> bool:
    """Move member p of ``src`` to the first micro-batch that takes it with less time in sum; whether one did. A
    share whose exchange own work hid is not tried: it frees only its share, which it costs wherever it goes."""
    rest = trial(src, cap, p)
    if rest is None or rest >= src.t or (p[1] < 0 and rest and src.t - rest <= src.r.share[p[0]] + 1e-12 * src.t):
        return False
    if not budget.spend():
        return False
    for dst in mbs:
        rank = -1 if p[1] < 0 else _least_rank(dst, src.r.n[p[0]], cap)
        if dst is src or dst.r is not src.r or rank < -1 or not budget.spend():
            continue
        grown = trial(dst, cap, None, (p[0], rank))
        if grown is not None and rest + grown < src.t + dst.t - 1e-12:
            apply(src, p, None)
            apply(dst, None, (p[0], rank))
            return True
    return False


def _least_rank(mb: Mb, n: int, cap: int) -> int:
    """The rank of ``mb`` with least own work among those with room for n more tokens (-2: none)."""
    room = min(cap, mb.r.mem) - mb.w
    return min((j for j in range(mb.r.d) if mb.tok[j] + n <= room), key=mb.loc.__getitem__, default=-2)


def trade(lay: Layout, budget: Budget, trades: int = TRADES) -> None:
    """Samples between replicas (module docstring), in place: per trade, the best over the slowest replica's
    samples and the ``NEAREST`` smaller samples of their kind elsewhere; at most ``trades`` trades per replica.
    Samples are indexed by size once, each with where it sits now."""
    reps, total = lay.reps, [lay.replica_s(g) for g in range(len(lay.reps))]
    index: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # by kind (sharded or not): (tokens, sample)
    where: dict[int, tuple[int, Mb, Member]] = {}  # sample -> (replica, micro-batch, member)
    for g, rep in enumerate(reps):
        for mb in rep:
            for q in members(mb):
                index[q[1] < 0].append((mb.r.n[q[0]], q[0]))
                where[q[0]] = (g, mb, q)
    for entries in index.values():
        entries.sort()
    for _ in range(trades * len(reps)):
        slow = max(range(len(reps)), key=total.__getitem__)
        best = _best_trade(lay, total, slow, index, where, budget)
        if best is None:
            break
        _, src, p, g, dst, q = best
        apply(src, p, (q[0], p[1]))
        apply(dst, q, (p[0], q[1]))
        where[p[0]], where[q[0]] = (g, dst, (p[0], q[1])), (slow, src, (q[0], p[1]))
        total[slow], total[g] = lay.replica_s(slow), lay.replica_s(g)


def _best_trade(lay: Layout, total: list[float], slow: int, index: dict[bool, list[tuple[int, int]]],
                where: dict[int, tuple[int, Mb, Member]], budget: Budget) -> tuple | None:
    """The best trade of a sample of replica ``slow``: (slowest after, its micro-batch, member, other replica, its
    micro-batch, member there), or None."""
    best = None
    for src in lay.reps[slow]:
        for p in members(src):
            rest = trial(src, lay.cap, p)
            if rest is None or rest >= src.t or not budget.spend():
                continue
            floor = total[slow] - src.t + rest  # the sender ends here at least, whatever it gets back
            kind, seen = p[1] < 0, 0
            stop = bisect_left(index[kind], (src.r.n[p[0]], -1))
            while stop > 0 and seen < NEAREST:
                stop -= 1
                g, dst, q = where[index[kind][stop][1]]
                if g == slow:
                    continue
                seen, bar = seen + 1, total[slow] * (1 - 1e-9) if best is None else best[0]
                if floor >= bar:
                    break
                if dst.r is not src.r or not budget.spend():
                    continue
                t_b = trial(dst, lay.cap, q, (p[0], q[1]))
                side = total[g] - dst.t + t_b if t_b is not None else bar
                t_a = trial(src, lay.cap, p, (q[0], p[1])) if side < bar else None
                if t_a is not None and max(total[slow] - src.t + t_a, side) < bar:
                    best = (max(total[slow] - src.t + t_a, side), src, p, g, dst, q)
    return best
