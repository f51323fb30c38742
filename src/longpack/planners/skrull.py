"""Skrull's GDS and DACP, ``skrull_rr`` beside them (Skrull, NeurIPS 2025, arXiv 2505.19609).

The CP group stays fixed; per global batch GDS splits the batch over replicas by estimated compute (LPT), cuts each
replica's sorted sequences into the fewest strided micro-batches that DACP can place, and pads replicas to equal
micro-batch counts; DACP (planners/dacp.py) puts each sequence whole on one CP rank or shards it over all, rolling
back a local sequence when nothing fits. Options: ``partition`` (lpt, kk), ``rollback`` (shortest, longest, none).
The algorithm, our correction of Algorithm 1's rollback and the termination argument: docs/PLANNERS.md, "Skrull".

Guarantees (rollback on): DACP fails only when sharding everything would not fit; coverage, every rank within the
token cap, equal micro-batch counts, determinism. Cost: O(K·N) per DACP call, O(K²·N) worst case per replica.
"""

from __future__ import annotations

import math

import numpy as np

from ..plan import MicroBatch, Piece
from .base import Batch, PlanContext, assemble_step, place_chains
from .dacp import dacp, round_robin, sequence_costs
from .packers import karmarkar_karp, lpt
from .registry import Planner, register

__all__ = ["dacp", "round_robin", "Skrull", "SkrullRR", "sequence_costs"]  # DACP: planners/dacp.py

ROLLBACKS = ("shortest", "longest", "none")


class Skrull(Planner):
    """Skrull: GDS over DP replicas + DACP inside each micro-batch (see the module docstring)."""

    name = "skrull"
    options = ("loads", "rollback", "partition")
    placer = staticmethod(dacp)
    draw_order = False  # DACP sorts each micro-batch ascending; round-robin takes sequences as drawn

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        cap, cp, dp = ctx.token_cap, ctx.cp, ctx.dp
        rollback = ctx.option("rollback", "shortest")
        if rollback not in ROLLBACKS:
            raise ValueError(f"--opt rollback={rollback}: choose one of {', '.join(ROLLBACKS)}")
        whole = batch.whole
        t_local, t_shard = sequence_costs(batch.lengths, ctx)
        part = karmarkar_karp if ctx.option("partition", "lpt") == "kk" else lpt
        bins = part(t_local[whole], dp) if whole.size else [[] for _ in range(dp)]
        replicas = []
        for b in bins:
            pos = whole[np.asarray(b, dtype=np.int64)]
            pos = pos[np.lexsort((batch.samples[pos], batch.lengths[pos]))]  # ascending, ties by sample id
            replicas.append(self._micro_batches(batch, pos, t_local, t_shard, ctx, rollback))
        place_chains(batch, replicas, ctx)
        return assemble_step(replicas, cp=cp, token_cap=cap)

    def plan_many(self, batches, ctx: PlanContext):
        """Skrull (DACP, LPT) plans many batches at once in columns (planners/skrull_rows.py), equal to
        :meth:`plan_batch` of each; one batch alone (its fixed cost is a few ms), round-robin and Karmarkar-Karp
        plan one batch at a time."""
        rollback = ctx.option("rollback", "shortest")
        if len(batches) < 2 or self.draw_order or ctx.option("partition", "lpt") == "kk" or rollback not in ROLLBACKS:
            return super().plan_many(batches, ctx)
        from .skrull_rows import skrull_steps

        return skrull_steps(batches, ctx, rollback)

    def _micro_batches(self, batch: Batch, pos: np.ndarray, t_local: np.ndarray, t_shard: np.ndarray,
                       ctx: PlanContext, rollback: str) -> list[MicroBatch]:
        """GDS step 2: the fewest strided micro-batches for which every slice fits and DACP succeeds."""
        if pos.size == 0:
            return []
        cap, cp = ctx.token_cap, ctx.cp
        lengths = batch.lengths[pos]
        # Σ ceil(s/cp) per rank is what must fit; start one below the fewest micro-batches that could hold it.
        m = max(1, math.ceil(int((-(-lengths // cp)).sum()) / cap)) - 1
        while m < pos.size:
            m += 1
            slices = [np.arange(j, pos.size, m) for j in range(m)]
            placed = []
            for sl in slices:
                if int((-(-lengths[sl] // cp)).sum()) > cap * cp:
                    break
                p = np.sort(pos[sl]) if self.draw_order else pos[sl]
                where = self.placer(batch.lengths[p].tolist(), cap=cap, cp=cp, t_local=t_local[p].tolist(),
                                    t_shard=t_shard[p].tolist(), rollback=rollback)
                if where is None:
                    break
                placed.append(MicroBatch(pieces=tuple(
                    Piece(int(batch.samples[k]), 0, int(batch.lengths[k]), r) for k, r in zip(p, where, strict=True)),
                    ckpt_layers=ctx.ckpt_layers))
            else:
                return placed
        raise AssertionError("unreachable: one sequence per micro-batch always fits")


register(Skrull)


@register
class SkrullRR(Skrull):
    """Skrull's GDS with the round-robin placement of Table 3 instead of DACP."""

    name = "skrull_rr"
    placer = staticmethod(round_robin)
    draw_order = True
