"""ChunkFlow's uniform chunks and state-aware chunk scheduling (ChunkFlow, ICML 2025, arXiv 2503.02356).

Per global batch, with ChunkSize C (option ``chunk_size``) and K (option ``k``, default 1): sequences longer than
C become chains of C-token chunks, shorter ones are packed first-fit-decreasing into chunks of C; only a chain's
last K chunks keep activations (the others are marked ``recompute``); chains and chunks are spread over replicas by
LPT. Peak memory is set by C and K, not by the longest sequence. The algorithm, the backward order and the
default C: docs/PLANNERS.md, "ChunkFlow".

Guarantees: coverage, caps, chain order on one replica, K respected, determinism. Cost: O(n log n + n·chunks)
per global batch.

>>> import numpy as np
>>> from longpack.cost import CostModel, TrainConfig
>>> from longpack.hardware import get_hardware
>>> from longpack.model import get_model
>>> from longpack.planners.base import PlanContext
>>> cost = CostModel(get_model("tiny"), get_hardware("cpu"), TrainConfig(token_cap=100))
>>> ctx = PlanContext(cost=cost, options={"chunk_size": 4, "k": 1})
>>> plan = ChunkFlow().plan(np.array([10, 2, 1, 1]), [np.arange(4)], ctx)
>>> for mb in plan.steps[0].replicas[0].micro_batches:
...     print([(p.sample, p.start, p.stop) for p in mb.pieces], "recompute" if mb.recompute else "keep")
[(2, 0, 1), (3, 0, 1)] keep
[(0, 0, 4)] recompute
[(0, 4, 8)] recompute
[(0, 8, 10), (1, 0, 2)] keep
"""

from __future__ import annotations

import math

import numpy as np

from ..plan import MicroBatch, Piece
from .base import Batch, PlanContext, assemble_step
from .packers import lpt
from .registry import Planner, register

__all__ = ["ChunkFlow", "chunk_size_for"]


def chunk_size_for(ctx: PlanContext, k: int) -> int:
    """Largest ChunkSize whose K kept chunks fit the token cap per rank (K · ceil(C / cp) <= cap).

    >>> from longpack.cost import CostModel, TrainConfig
    >>> from longpack.hardware import get_hardware
    >>> from longpack.model import get_model
    >>> ctx = PlanContext(cost=CostModel(get_model("tiny"), get_hardware("cpu"), TrainConfig(cp=2, token_cap=32)))
    >>> chunk_size_for(ctx, 3)     # 3 chunks of ceil(20 / 2) = 10 tokens per rank fit a cap of 32; 21 would not
    20
    """
    return max(1, ctx.token_cap // k * ctx.cp)


@register
class ChunkFlow(Planner):
    """Uniform chunks + state-aware chunk scheduling (see the module docstring)."""

    name = "chunkflow"
    options = ("chunk_size", "k")

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        k = int(ctx.option("k", 1))
        if k < 1:
            raise ValueError(f"--opt k={k}: K must be >= 1")
        size = int(ctx.option("chunk_size", chunk_size_for(ctx, k)))
        if not 1 <= math.ceil(size / ctx.cp) * k <= ctx.token_cap:
            raise ValueError(f"--opt chunk_size={size}: K={k} chunks of {math.ceil(size / ctx.cp)} tokens per rank "
                             f"exceed the token cap {ctx.token_cap}; use chunk_size <= {chunk_size_for(ctx, k)}")
        size = min(size, batch.piece_len)
        chains, standalone = self._chunks(batch, size, ctx, k)
        units = standalone + chains
        cost = [sum(self._estimate(mb, ctx) for mb in u) for u in units]
        groups = lpt(cost, ctx.dp)
        replicas = []
        for g in groups:
            g = sorted(g)  # standalone chunks (listed first) before chains, each chain contiguous
            replicas.append([mb for u in g for mb in units[u]])
        return assemble_step(replicas, cp=ctx.cp, token_cap=ctx.token_cap)

    def _chunks(self, batch: Batch, size: int, ctx: PlanContext, k: int
                ) -> tuple[list[list[MicroBatch]], list[list[MicroBatch]]]:
        """(chains as lists of chunk micro-batches, standalone chunks as one-element lists)."""
        cp, ckpt = ctx.cp, ctx.ckpt_layers
        shard = None if cp > 1 else 0
        lengths, samples = batch.lengths, batch.samples
        long_pos = np.flatnonzero(lengths > size)
        short_pos = np.flatnonzero(lengths <= size)
        # Bins in per-rank token units; a chain's last short piece seeds a bin short sequences may fill.
        cap = size // cp if cp > 1 else size
        bins: list[list[Piece]] = []
        room: list[int] = []
        chains: list[list[MicroBatch]] = []
        tails: dict[int, int] = {}  # chain index -> its seeded bin
        for c, i in enumerate(long_pos.tolist()):
            s, n = int(samples[i]), int(lengths[i])
            full = n // size
            pieces = [Piece(s, j * size, (j + 1) * size, shard) for j in range(full)]
            chains.append([MicroBatch(pieces=(p,), ckpt_layers=ckpt) for p in pieces])
            if n % size:
                tails[c] = len(bins)
                bins.append([Piece(s, full * size, n, shard)])
                room.append(cap - math.ceil((n - full * size) / cp))
        order = short_pos[np.lexsort((samples[short_pos], -lengths[short_pos]))]
        for i in order.tolist():
            w = math.ceil(int(lengths[i]) / cp)
            piece = Piece(int(samples[i]), 0, int(lengths[i]), shard)
            for b, r in enumerate(room):
                if w <= r:
                    bins[b].append(piece)
                    room[b] -= w
                    break
            else:
                bins.append([piece])
                room.append(cap - w)
        for c, b in tails.items():
            chains[c].append(MicroBatch(pieces=tuple(bins[b]), ckpt_layers=ckpt))
        for chain in chains:
            n = len(chain)
            chain[:] = [MicroBatch(pieces=mb.pieces, ckpt_layers=ckpt, recompute=j < n - k)
                        for j, mb in enumerate(chain)]
        seeded = set(tails.values())
        standalone = [[MicroBatch(pieces=tuple(b), ckpt_layers=ckpt)] for j, b in enumerate(bins) if j not in seeded]
        return chains, standalone

    @staticmethod
    def _estimate(mb: MicroBatch, ctx: PlanContext) -> float:
        """Compute seconds of one chunk on one rank (for DP balancing): linear + attention with its prefix."""
        cost, cp = ctx.cost, ctx.cp
        tokens = sum(p.stop - p.start for p in mb.pieces) / cp
        pairs = sum(p.stop * p.stop - p.start * p.start for p in mb.pieces) * cost.cfg.causal_factor / cp
        t = float(cost.linear_s(tokens, ideal=True)) + float(cost.attn_s(pairs, max(1.0, tokens)))
        return t * (4 / 3 if mb.recompute else 1.0)
