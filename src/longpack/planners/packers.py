"""Bin packers and number partitioners shared by all planners.

Packers take integer ``weights`` (tokens each item costs a bin) and a ``capacity`` and return bins as lists of
item positions; every item lands in exactly one bin and no bin exceeds the capacity (an item heavier than the
capacity raises: callers apply the over-long policy first). Partitioners split items into k groups of near-equal
total cost.

=================  ==========================================  ===================================
name               rule                                        cost
=================  ==========================================  ===================================
next_fit           in order; open a new bin when full          O(n)
first_fit_dec      sort heavy first; first bin with room       O(n · bins)
best_fit_dec       sort heavy first; fullest bin with room     O(n · bins)
isf                OmniBal ISF: shuffle + sequential fill,     O(iters · n)
                   accept near-full bins, repack the rest
spfhp              histogram best-fit over remaining space     O(n + S²) for S distinct sizes
lpt                k groups, heaviest first to lightest group  O(n log n)
karmarkar_karp     k-way largest differencing                  O(n log n · k)
=================  ==========================================  ===================================

>>> first_fit_dec([5, 4, 3, 2, 2], 7)
[[0, 3], [1, 2], [4]]
>>> sorted(karmarkar_karp([8, 7, 6, 5, 4], 2))        # 14 vs 16 (the optimum, 15/15, is {8,7} {6,5,4})
[[0, 2], [1, 3, 4]]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

Weights = Sequence[int] | np.ndarray

__all__ = ["next_fit", "first_fit_dec", "best_fit_dec", "isf", "spfhp", "lpt", "karmarkar_karp", "PACKERS"]


def _check(weights: Weights, capacity: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.int64)
    if capacity < 1:
        raise ValueError(f"bin capacity {capacity}: must be >= 1")
    if w.size and (w.max() > capacity or w.min() < 0):
        i = int(np.argmax((w > capacity) | (w < 0)))
        raise ValueError(f"item {i} weighs {int(w[i])}, outside [0, capacity {capacity}]")
    return w


def _next_fit_ends(w: np.ndarray, capacity: int, max_items: int = 0) -> np.ndarray:
    """End positions of next-fit bins: each bin ends where the running sum since its start first exceeds the
    capacity, found by binary search on the prefix sums (O(bins · log n), no Python step per item)."""
    cs = np.cumsum(w)
    ends = []
    start, base = 0, 0
    while start < w.size:
        end = int(np.searchsorted(cs, base + capacity, side="right"))
        if max_items:
            end = min(end, start + max_items)
        ends.append(end)
        base = int(cs[end - 1])
        start = end
    return np.asarray(ends, dtype=np.int64)


def next_fit(weights: Weights, capacity: int, max_items: int = 0) -> list[list[int]]:
    """Items in the given order; close the open bin when the next item does not fit (or it holds
    ``max_items`` items, when that is > 0)."""
    w = _check(weights, capacity)
    ends = _next_fit_ends(w, capacity, max_items)
    return [b.tolist() for b in np.split(np.arange(w.size), ends[:-1])] if ends.size else []


def _decreasing(w: np.ndarray) -> list[int]:
    # Stable sort on (-weight, position): ties keep input order, so results are deterministic.
    return np.lexsort((np.arange(w.size), -w)).tolist()


def first_fit_dec(weights: Weights, capacity: int) -> list[list[int]]:
    """First-fit decreasing: ≤ 11/9·OPT + 6/9 bins."""
    w = _check(weights, capacity)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in _decreasing(w):
        x = int(w[i])
        for b, r in enumerate(room):
            if x <= r:
                bins[b].append(i)
                room[b] -= x
                break
        else:
            bins.append([i])
            room.append(capacity - x)
    return bins


def best_fit_dec(weights: Weights, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the bin left with the least room; same worst case as FFD, often tighter."""
    w = _check(weights, capacity)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in _decreasing(w):
        x = int(w[i])
        best, best_room = -1, capacity + 1
        for b, r in enumerate(room):
            if x <= r < best_room:
                best, best_room = b, r
        if best < 0:
            bins.append([i])
            room.append(capacity - x)
        else:
            bins[best].append(i)
            room[best] -= x
    return bins


def isf(weights: Weights, capacity: int, *, threshold: int | None = None, iters: int = 10,
        seed: int = 0) -> list[list[int]]:
    """ISF, Iterative Sampling and Filtering (OmniBal, HBP's packer).

    Round i: shuffle the pool with seed + i, fill bins sequentially (next fit), accept bins whose total reaches
    ``threshold`` (default capacity − min(128, capacity/32)), return the rest to the pool. After ``iters`` rounds
    the remainder is packed once more and accepted as it is. Unlike OmniBal, an item heavier than the capacity
    raises instead of being skipped: no sample is dropped silently.
    """
    w = _check(weights, capacity)
    if threshold is None:
        threshold = capacity - min(128, capacity // 32)
    pool = np.arange(w.size)
    accepted: list[list[int]] = []
    for it in range(iters + 1):
        if pool.size == 0:
            break
        order = pool[np.random.default_rng(seed + it).permutation(pool.size)]
        wo = w[order]
        ends = _next_fit_ends(wo, capacity)
        sums = np.add.reduceat(wo, np.concatenate([[0], ends[:-1]]))
        ok = (sums >= threshold) | (it == iters)
        parts = np.split(order, ends[:-1])
        accepted.extend(parts[i].tolist() for i in np.flatnonzero(ok))
        rest = [parts[i] for i in np.flatnonzero(~ok)]
        pool = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
    return accepted


def spfhp(weights: Weights, capacity: int) -> list[list[int]]:
    """Shortest-pack-first histogram packing (Krell et al.): items by size, longest first, each into the open
    pack with the least remaining room that still fits (packs indexed by remaining room, not searched)."""
    w = _check(weights, capacity)
    by_room: dict[int, list[int]] = {}  # remaining room -> pack ids (LIFO)
    packs: list[list[int]] = []
    rooms_sorted: list[int] = []  # distinct remaining rooms, ascending
    for i in _decreasing(w):
        x = int(w[i])
        j = int(np.searchsorted(rooms_sorted, x))
        if j < len(rooms_sorted):
            room = rooms_sorted[j]
            pid = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms_sorted.pop(j)
        else:
            pid, room = len(packs), capacity
            packs.append([])
        packs[pid].append(i)
        new_room = room - x
        if new_room > 0:
            if new_room not in by_room:
                by_room[new_room] = []
                rooms_sorted.insert(int(np.searchsorted(rooms_sorted, new_room)), new_room)
            by_room[new_room].append(pid)
    return packs


def lpt(costs: Sequence[float] | np.ndarray, k: int) -> list[list[int]]:
    """Longest processing time first: heaviest item to the currently lightest group (≤ 4/3 · OPT makespan)."""
    c = np.asarray(costs, dtype=np.float64)
    heap = [(0.0, g) for g in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in np.lexsort((np.arange(c.size), -c)).tolist():
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + float(c[i]), g))
    return groups


def karmarkar_karp(costs: Sequence[float] | np.ndarray, k: int) -> list[list[int]]:
    """k-way largest differencing (Karmarkar-Karp): repeatedly merge the two partitions with the largest spread,
    pairing the heaviest group of one with the lightest of the other. Usually far better than LPT on many items."""
    c = np.asarray(costs, dtype=np.float64)
    if c.size == 0:
        return [[] for _ in range(k)]
    heap: list[tuple[float, int, list[Any]]] = []
    for i in range(c.size):
        groups = [(float(c[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(c[i]), i, groups))
    tie = c.size
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda g: -g[0])
        b = sorted(b, key=lambda g: g[0])
        merged = sorted(((x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b, strict=True)), key=lambda g: -g[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(g[1]) for g in heap[0][2]]


PACKERS = {"next_fit": next_fit, "ffd": first_fit_dec, "bfd": best_fit_dec, "isf": isf, "spfhp": spfhp}
