"""Balance and waste metrics of a Plan (HBP's DBR, PR, ABR; DBR and PR as OmniBal's code computes them).

Computed per (step, micro-batch index) across the step's N data-parallel replicas, then averaged over the
(step, micro-batch) slots that hold any work. Lower is better except ``ave_t``.

* DBR, dist balance ratio: ``Σ_n (T_max − T_n) / (N · T_max)`` with T_n the tokens replica n runs in that slot,
  padding included (OmniBal ``get_pad_dist_ratio``).
* ABR, attention balance ratio: the same on A_n = Σ attention pairs (s_i² for whole documents,
  stop² − start² for a chunk): equal tokens can hide 2x different attention work.
* PR, padding ratio: pad tokens / padded tokens over the whole plan.
* CR, communication ratio: tokens of pieces sharded over a CP group of more than one rank / all tokens.
* Ave-T: mean real tokens per non-empty micro-batch of a replica (HBP Table 3: 128K packing gives ≈128K).

Cost: O(pieces).

>>> from longpack.plan import MicroBatch, Piece, Plan, Replica, Step
>>> mb = lambda *ls: MicroBatch(pieces=tuple(Piece(i, 0, n, None) for i, n in ls))
>>> step = Step(cp=1, token_cap=8, replicas=(Replica((mb((0, 1), (1, 1), (2, 1), (3, 1)),)),
...                                           Replica((mb((4, 2), (5, 2)),))))
>>> m = plan_metrics(Plan("demo", 2, {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2}, (step,)))
>>> m.dbr, m.abr                                  # same tokens, attention 4 vs 8
(0.0, 0.25)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan import Plan

__all__ = ["PlanMetrics", "plan_metrics", "imbalance"]


@dataclass(frozen=True)
class PlanMetrics:
    dbr: float
    abr: float
    pr: float
    cr: float
    ave_t: float
    tokens: int
    pad_tokens: int
    micro_batches: int


def imbalance(loads: np.ndarray) -> float:
    """``Σ (max − x) / (N · max)`` of one slot; 0 for a single replica or an empty slot.

    >>> imbalance(np.array([4.0, 2.0]))
    0.25
    """
    top = float(loads.max()) if loads.size else 0.0
    if loads.size < 2 or top <= 0:
        return 0.0
    return float((top - loads).sum() / (loads.size * top))


def plan_metrics(plan: Plan) -> PlanMetrics:
    """DBR, ABR, PR, CR and Ave-T of ``plan`` (see the module docstring)."""
    dbr, abr, replica_tokens = [], [], []
    real = padded = sharded = mbs = 0
    for step in plan.steps:
        depth = len(step.replicas[0].micro_batches) if step.replicas else 0
        for m in range(depth):
            t = np.zeros(len(step.replicas))
            a = np.zeros(len(step.replicas))
            for r, rep in enumerate(step.replicas):
                mb = rep.micro_batches[m]
                for p in mb.pieces:
                    n = p.stop - p.start
                    real += n
                    padded += mb.pad_to or n
                    t[r] += mb.pad_to or n
                    a[r] += p.stop * p.stop - p.start * p.start
                    if p.cp_rank is None and step.replica_cp(r) > 1:
                        sharded += n
                if mb.pieces:
                    mbs += 1
                    replica_tokens.append(mb.tokens)
            if t.max() > 0:
                dbr.append(imbalance(t))
                abr.append(imbalance(a))
    return PlanMetrics(dbr=float(np.mean(dbr)) if dbr else 0.0, abr=float(np.mean(abr)) if abr else 0.0,
                       pr=(padded - real) / padded if padded else 0.0, cr=sharded / real if real else 0.0,
                       ave_t=float(np.mean(replica_tokens)) if replica_tokens else 0.0, tokens=real,
                       pad_tokens=padded - real, micro_batches=mbs)
