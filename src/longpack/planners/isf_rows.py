"""ISF (OmniBal's iterative sampling and filtering, HBP's packer) on many independent item sets at once.

Row r of a ``(rows, width)`` weight matrix holds one set's items in columns ``[0, counts[r])``; every row is
packed on its own, exactly as if it were packed alone, so a plan of many global batches equals its batches packed
one at a time. Per round i ≤ ``iters``:

1. A row whose pool fits one bin (total ≤ capacity) ends: its pool becomes its last bin (next fit would make that
   one bin whatever the order, and the filter would accept it by the last round).
2. The other rows shuffle their pools: item c of row r sorts by splitmix64(seed_r, i, c), a counter-based key, so
   the order is a pure function of (row seed, round, position) and all rows sort in one ``argsort(axis=1)``.
3. Next fit over the shuffled pool, all rows at once: one ``searchsorted`` per bin ordinal, on the rows' prefix
   sums laid end to end with gaps wider than any row's total.
4. Bins reaching ``threshold`` are accepted (every bin in the last round); the rest return to the pool.

Output: each item's bin, numbered per row in acceptance order, and each row's bin count. Guarantees: every item
of a row lands in exactly one of its row's bins; no bin exceeds the capacity; deterministic by seeds. It is the
algorithm of :func:`~longpack.planners.packers.isf` (HBP's packer, one pool, shuffled by numpy's Generator)
with keyed shuffles instead, which numpy can draw for every row at once; the bin counts match (tested).

Cost: O(rounds · rows · width · log width) for the sorts plus O(rounds · bins per row) vectorized searches; no
Python step per item or per row.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix", "isf_rows", "next_fit_rows", "row_order"]

_GOLD, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_LAST = np.iinfo(np.uint64).max


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function on a uint64 array (wrapping arithmetic): consecutive inputs give keys that
    behave as independent uniform draws, so ``mix(base + c)`` shuffles positions c by sorting."""
    x = np.asarray(x, dtype=np.uint64) + _GOLD
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _keys(seeds: np.ndarray, stream: int, width: int) -> np.ndarray:
    """(rows, width) sort keys of stream ``stream`` for rows seeded ``seeds``."""
    base = mix(mix(seeds.astype(np.uint64)) ^ mix(np.full(1, stream, dtype=np.uint64)))
    return mix(base[:, None] + np.arange(width, dtype=np.uint64)[None, :])


def _next_fit(cs: np.ndarray, n: np.ndarray, capacity: int, max_items: int = 0) -> np.ndarray:
    """Bin ends (rows, most bins) of next fit over rows with prefix sums ``cs`` and ``n`` items, −1 past a row's
    last bin. A bin ends where the running sum since its start first exceeds the capacity (or it holds
    ``max_items`` items, when > 0)."""
    rows, width = cs.shape
    gap = int(cs[:, -1].max(initial=0)) + capacity + 1  # wider than any row's total plus one bin
    flat = (cs + (np.arange(rows, dtype=np.int64) * gap)[:, None]).ravel()
    start = np.zeros(rows, dtype=np.int64)
    live = np.flatnonzero(n > 0)
    ends: list[np.ndarray] = []
    while live.size:
        s = start[live]
        base = np.where(s > 0, cs[live, np.maximum(s - 1, 0)], 0)
        end = np.minimum(np.searchsorted(flat, base + capacity + live * gap, side="right") - live * width, n[live])
        if max_items:
            end = np.minimum(end, s + max_items)
        col = np.full(rows, -1, dtype=np.int64)
        col[live] = end
        ends.append(col)
        start[live] = end
        live = live[end < n[live]]
    return np.stack(ends, axis=1) if ends else np.zeros((rows, 0), dtype=np.int64)


def _bin_of(ends: np.ndarray, width: int) -> np.ndarray:
    """(rows, width): the bin holding each position, given bin ends; positions past a row's items get a bin
    number past its last."""
    marks = np.zeros((ends.shape[0], width + 1), dtype=np.int64)
    real = ends > 0
    np.add.at(marks, (np.broadcast_to(np.arange(ends.shape[0])[:, None], ends.shape)[real], ends[real]), 1)
    return np.cumsum(marks[:, :width], axis=1)


def next_fit_rows(cs: np.ndarray, n: np.ndarray, capacity: int, max_items: int = 0) -> np.ndarray:
    """Next fit on every row at once (rows with prefix sums ``cs`` of ``n`` items each): each item's bin, −1 past
    a row's items; equal to :func:`~longpack.planners.packers.next_fit` on each row alone."""
    b = _bin_of(_next_fit(cs, n, capacity, max_items), cs.shape[1])
    return np.where(np.arange(cs.shape[1])[None, :] < n[:, None], b, -1)


def row_order(seeds: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(rows, most counts): a seeded shuffle of each row's ``counts`` items, as the rank of item b of row r (the
    position it is dealt to); past a row's count, unspecified."""
    width = max(int(counts.max(initial=0)), 1)
    key = _keys(seeds, 1 << 32, width)  # a stream no round of isf_rows uses
    key[np.arange(width)[None, :] >= counts[:, None]] = _LAST
    perm = np.argsort(key, axis=1)
    rank = np.empty_like(perm)
    np.put_along_axis(rank, perm, np.broadcast_to(np.arange(width), perm.shape), axis=1)
    return rank


def isf_rows(weights: np.ndarray, counts: np.ndarray, capacity: int, seeds: np.ndarray, *, threshold: int,
             iters: int) -> tuple[np.ndarray, np.ndarray]:
    """ISF on each row of ``weights`` (see the module docstring): (bin of each item, −1 for padding; bins per
    row)."""
    w = np.asarray(weights, dtype=np.int64)
    rows, width = w.shape
    pool = np.arange(width)[None, :] < np.asarray(counts)[:, None]
    label = np.full((rows, width), -1, dtype=np.int64)
    made = np.zeros(rows, dtype=np.int64)
    active = np.flatnonzero(pool.any(axis=1))
    for it in range(iters + 1):
        if not active.size:
            break
        p = pool[active]
        wp = np.where(p, w[active], 0)
        fits = wp.sum(axis=1) <= capacity
        if fits.any():
            done = active[fits]
            label[done] = np.where(pool[done], made[done, None], label[done])
            made[done] += 1
            pool[done] = False
            active, p, wp = active[~fits], p[~fits], wp[~fits]
            if not active.size:
                break
        key = _keys(seeds[active], it, width)
        key[~p] = _LAST
        order = np.argsort(key, axis=1)
        cs = np.cumsum(np.take_along_axis(wp, order, axis=1), axis=1)
        ends = _next_fit(cs, p.sum(axis=1), capacity)
        _accept(label, pool, made, active, order, cs, ends, threshold if it < iters else 0)
        active = active[pool[active].any(axis=1)]
    return label, made


def _accept(label: np.ndarray, pool: np.ndarray, made: np.ndarray, active: np.ndarray, order: np.ndarray,
            cs: np.ndarray, ends: np.ndarray, threshold: int) -> None:
    """Give this round's bins that reach ``threshold`` the next bin numbers of their rows and take their items
    out of the pool (in place)."""
    starts = np.concatenate([np.zeros((active.size, 1), dtype=np.int64), ends[:, :-1]], axis=1)
    real = ends > 0
    top = np.take_along_axis(cs, np.maximum(ends - 1, 0), axis=1)
    below = np.where(starts > 0, np.take_along_axis(cs, np.maximum(starts - 1, 0), axis=1), 0)
    ok = real & (top - below >= threshold)
    number = made[active, None] + np.cumsum(ok, axis=1) - 1
    made[active] += ok.sum(axis=1)
    b = np.minimum(_bin_of(ends, cs.shape[1]), ends.shape[1] - 1)
    n = np.where(real, ends, 0).max(axis=1)
    take = (np.arange(cs.shape[1])[None, :] < n[:, None]) & np.take_along_axis(ok, b, axis=1)
    r_idx = np.broadcast_to(np.arange(active.size)[:, None], cs.shape)[take]
    cols = order[take]
    label[active[r_idx], cols] = np.take_along_axis(number, b, axis=1)[take]
    pool[active[r_idx], cols] = False
