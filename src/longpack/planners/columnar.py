"""Packed baselines planned for many global batches at once, into columns (:mod:`longpack.columns`).

The batches become the rows of a matrix (row = batch, column = position in it), so each rule runs as a few numpy
calls over a block of rows instead of Python per batch:

- :func:`isf_steps`: the ISF baseline (planners/baselines.py): ISF per batch (:func:`~.isf_rows.isf_rows`), the
  packs shuffled per batch by counter-keyed sort keys and dealt round-robin, pack j to replica j mod dp.
- :func:`fixed_cp_steps`: fixed CP: replica r's contiguous slice of the batch packed in order (next fit).

Rows go in blocks of about 2^16 samples, so the working arrays stay small and are reused. A batch holding a
sample longer than a micro-batch (a chain) has its whole samples planned in the rows, then its chains placed by
:func:`~longpack.planners.base.place_chains`, as the object planners do; that step is kept as an object. Every step
equals its batch planned alone, so a run planned at once equals its steps planned one at a time (tested).

Cost: O(batches · width · log width) for the sorts and O(pieces) for the columns, in O(block + pieces) memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ..columns import PIECE_COLUMNS, StepColumns
from .base import Batch, PlanContext, assemble_step, place_chains
from .isf_rows import isf_rows, next_fit_rows, row_order

__all__ = ["Rows", "Placed", "plan_rows", "isf_steps", "fixed_cp_steps"]

BLOCK = 1 << 16  # samples per block of rows


class Placed(NamedTuple):
    """Where a block's entries go: ``replica``, ``micro`` and ``rank`` (a CP rank, −1 sharded; None: all sharded)
    per entry, ``within`` its order inside its micro-batch (None: position in the batch), ``depth`` per row."""

    replica: np.ndarray
    micro: np.ndarray
    depth: np.ndarray
    rank: np.ndarray | None = None
    within: np.ndarray | None = None


Layout = Callable[["Rows"], Placed]


class Rows:
    """Batches ``parts[lo:hi]`` as rows of a matrix: ``lengths``/``samples`` (rows, width), ``counts`` and
    ``index`` (the global batch's number) per row, ``mask`` of real entries."""

    def __init__(self, parts: Sequence[Batch], lo: int, hi: int) -> None:
        part = parts[lo:hi]
        self.counts = np.array([b.samples.size for b in part], dtype=np.int64)
        self.index = np.array([b.index for b in part], dtype=np.int64)
        self.width = int(self.counts.max(initial=0))
        self.mask = np.arange(self.width)[None, :] < self.counts[:, None]
        self.lengths = np.zeros((hi - lo, self.width), dtype=np.int64)
        self.samples = np.zeros((hi - lo, self.width), dtype=np.int64)
        if part:
            self.lengths[self.mask] = np.concatenate([b.lengths for b in part])
            self.samples[self.mask] = np.concatenate([b.samples for b in part])


def plan_rows(batches: Sequence[Batch], ctx: PlanContext, layout: Layout, rows_limit: int,
              block: int = BLOCK) -> StepColumns:
    """Steps of ``batches`` laid out by ``layout`` block by block, then the chained batches' chains placed."""
    chained = [i for i, b in enumerate(batches) if b.chains.size]
    parts = list(batches)
    for i in chained:
        b, whole = batches[i], batches[i].whole
        parts[i] = Batch(b.index, b.samples[whole], b.lengths[whole], b.piece_len, b.split_len)
    n = len(parts)
    depth = np.zeros(n, dtype=np.int64)
    total = sum(b.samples.size for b in parts)
    cols = {k: np.empty(total, dtype=np.int32) for k in PIECE_COLUMNS}
    step, at = max(1, block // max(1, max((b.samples.size for b in parts), default=1))), 0
    for lo in range(0, n, step):
        rows = Rows(parts, lo, min(n, lo + step))
        placed = layout(rows)
        depth[lo:lo + step] = placed.depth
        out = _pieces(rows, lo, placed)
        for k, v in out.items():
            cols[k][at:at + v.size] = v
        at += out["step"].size
    steps = StepColumns(cols, cp=np.full(n, ctx.cp), token_cap=np.full(n, ctx.token_cap),
                        replicas=np.full(n, ctx.dp), depth=depth, ckpt=np.full(n, ctx.ckpt_layers))
    for i in chained:
        replicas = [[mb for mb in rep.micro_batches if mb.pieces] for rep in steps[i].replicas]
        place_chains(batches[i], replicas, ctx, rows=rows_limit)
        steps.explicit[i] = assemble_step(replicas, cp=ctx.cp, token_cap=ctx.token_cap)
    return steps


def _pieces(rows: Rows, first: int, placed: Placed) -> dict[str, np.ndarray]:
    """Piece columns of a block whose first row is step ``first``: every entry where ``placed`` puts it, ordered
    by step, replica, micro and order within."""
    width = max(rows.width, 1)
    replica, micro = placed.replica, placed.micro
    within = np.arange(rows.width)[None, :] if placed.within is None else placed.within
    key = np.where(rows.mask, (replica * (int(micro.max(initial=0)) + 1) + micro) * width + within,
                   np.iinfo(np.int64).max)
    order = np.argsort(key, axis=1)
    at = (order + (np.arange(order.shape[0]) * width)[:, None])[np.take_along_axis(rows.mask, order, axis=1)]

    def col(a: np.ndarray) -> np.ndarray:
        return a.ravel()[at]

    stop = col(rows.lengths)
    if stop.size and max(int(stop.max()), int(rows.samples.max())) > np.iinfo(np.int32).max:
        raise ValueError("a sample id or length beyond 2^31 - 1 does not fit the plan's int32 columns")
    rank = np.full(stop.size, -1, dtype=np.int32) if placed.rank is None else col(placed.rank)
    return {"step": at // width + first, "replica": col(replica), "micro": col(micro), "sample": col(rows.samples),
            "start": np.zeros(stop.size, dtype=np.int32), "stop": stop, "rank": rank}


def isf_steps(batches: Sequence[Batch], ctx: PlanContext, pack_cap: int, iters: int,
              too_short: Callable[[int], Exception]) -> StepColumns:
    """The ISF baseline's steps for ``batches`` (rank weights ceil(len/cp) packed to ``pack_cap``; a sample
    heavier than that raises ``too_short(sample)``)."""

    def layout(rows: Rows) -> Placed:
        weights = -(-rows.lengths // ctx.cp)
        if weights.size and int(weights.max()) > pack_cap:
            r, c = np.unravel_index(int(np.argmax(weights)), weights.shape)
            raise too_short(int(rows.samples[r, c]))
        seeds = ctx.seed + rows.index
        label, made = isf_rows(weights, rows.counts, pack_cap, seeds,
                               threshold=pack_cap - min(128, pack_cap // 32), iters=iters)
        rank = np.take_along_axis(row_order(seeds, made), np.maximum(label, 0), axis=1)
        return Placed(rank % ctx.dp, rank // ctx.dp, -(-made // ctx.dp))

    return plan_rows(batches, ctx, layout, 0)


def fixed_cp_steps(batches: Sequence[Batch], ctx: PlanContext, max_items: int) -> StepColumns:
    """Fixed CP's steps for ``batches``: replica r packs the r-th of dp contiguous slices (the first n mod dp one
    longer, as ``numpy.array_split``) in order, next fit to the token cap, at most ``max_items`` per micro-batch
    (0: no limit)."""
    dp = ctx.dp

    def layout(rows: Rows) -> Placed:
        small, extra = rows.counts // dp, rows.counts % dp
        r = np.arange(dp)[None, :]
        first = r * small[:, None] + np.minimum(r, extra[:, None])  # (rows, dp) slice starts
        pos = np.arange(rows.width)[None, :]
        replica = np.clip((pos[:, :, None] >= first[:, None, :]).sum(axis=2) - 1, 0, dp - 1)
        # every (row, replica) slice becomes a row of its own, laid out from its start, for next fit
        local = pos - np.take_along_axis(first, replica, axis=1)
        sub_row = np.arange(rows.counts.size)[:, None] * dp + replica
        sub = np.zeros((rows.counts.size * dp, max(rows.width, 1)), dtype=np.int64)
        sub[sub_row[rows.mask], local[rows.mask]] = -(-rows.lengths[rows.mask] // ctx.cp)
        bins = next_fit_rows(np.cumsum(sub, axis=1), (small[:, None] + (r < extra[:, None])).ravel(),
                             ctx.token_cap, max_items)
        micro = np.where(rows.mask, bins[sub_row, np.maximum(local, 0)], 0)
        depth = (bins.max(axis=1, initial=-1).reshape(-1, dp) + 1).max(axis=1, initial=0)
        return Placed(replica, micro, depth)

    return plan_rows(batches, ctx, layout, max_items)
