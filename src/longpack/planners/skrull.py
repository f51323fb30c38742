"""Skrull (NeurIPS 2025, arXiv 2505.19609): global data scheduling (GDS) + distributed-aware context parallelism (DACP).

The CP group stays fixed; only data placement changes.

**GDS** (Algorithm 2), per global batch:

1. Split the batch over the dp replicas by estimated compute (LPT on each sequence's whole-sequence time; option
   ``partition="kk"`` for Karmarkar-Karp).
2. Per replica, sort ascending and try m = ceil(Σ s / (C·N)) micro-batches as strided slices ``sub[j::m]`` (each
   gets a mix of long and short); if a slice exceeds C·N tokens or DACP fails on it, try m + 1.
3. Pad replicas with empty micro-batches to equal counts (collectives never deadlock).

**DACP** (Algorithm 1, App. B.1), per micro-batch of K sequences on N CP ranks with token budget C each: in ascending
order, put each sequence whole on the least-loaded rank if it fits, else on the rank with the most room, else
shard it over all ranks if the tightest rank can hold ceil(s/N); if not even that, roll back: turn one local
sequence of the tightest rank into a sharded one and retry. Loads are compute seconds from the cost model (the
paper's FLOPs(S) and FLOPs(S, N) = FLOPs(S)/N with the kernel-efficiency loss of short shards).

Rollback, as we correct Algorithm 1's printed form: the rank gets back s − ceil(s/N) tokens, every other
rank is charged ceil(s/N), all loads are fixed, and a rank driven below zero rolls back in turn. Option
``rollback``: ``shortest`` (default, the paper's "first local sequence", which in ascending order is the
shortest), ``longest`` (frees the most memory per rollback: fewer rollbacks and so faster to plan, and it keeps
more short sequences local), or ``none`` (the Table 3 ablation: a sequence that fits nowhere is sharded anyway,
overflowing the cap — an OOM in a real run, a capacity error in ``Plan.validate``).

``skrull_rr`` is the round-robin baseline of Table 3 (Algorithm 4): the same GDS, but DACP replaced by "most room
first" with no compute balancing, taking each micro-batch's sequences in the order they were drawn (Algorithm 4
iterates the sequences; only Algorithm 1 sorts them); the same rollback options.

Guarantees (rollback on): DACP fails only when even sharding every sequence would not fit (a rank driven
negative always still holds a local sequence to roll back); coverage, every rank within the token cap, chunk
order for split samples, equal micro-batch counts, determinism. Termination: every rollback removes a local
sequence and local placements only grow as the scan advances, so DACP makes at most 2K placement decisions; GDS
tries at most K + 1 values of m and m = K always succeeds (one sequence ≤ C·N per micro-batch).

Cost: O(K·N) per DACP call, O(K²·N) worst case per replica; 1.6 ms median for a 256-sequence batch at DP4·CP8
(bench/planning.py, docs/BENCHMARKS.md). DACP's code and its example: planners/dacp.py.
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
