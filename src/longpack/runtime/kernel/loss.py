"""Exact loss normalisation over a whole optimizer step, from plan-known counts.

A sample's targets come from its source: the user's labels or masks (``longpack.rows``), or every next token of
a synthetic sample (n − 1 of n; the last token predicts nothing). Every rank holds the counts of every sample, so
the step's normaliser needs no communication. For a step:

* ``token_mean``: every target weighs 1 / (targets of all samples in the step, all micro-batches and ranks);
* ``sequence_mean``: a target of sample i weighs 1 / (samples with targets · targets of i).

Each rank computes Σ weight · cross-entropy over its micro-batches and backpropagates it; gradients are summed
(not averaged) across ranks, so the result is exactly the gradient of the global objective, whatever the packing,
chunking or placement — the equivalence Skrull and ChunkFlow rely on (Skrull App. A; both need a global loss
normaliser).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...plan import Plan, Step
from .data import IGNORE, Packed, Source
from .names import LOSS_MODES

__all__ = ["step_targets", "token_weights", "weighted_loss", "MODES"]

MODES = LOSS_MODES


def step_targets(plan: Plan, step: Step, source: Source) -> dict[int, int]:
    """{sample: number of real targets} for every sample in ``step`` (as far as the plan keeps it)."""
    out: dict[int, int] = {}
    for rep in step.replicas:
        for mb in rep.micro_batches:
            for p in mb.pieces:
                if p.sample not in out:
                    out[p.sample] = source.target_count(p.sample, plan.effective_length(p.sample))
    return out


def token_weights(batch: Packed, targets: dict[int, int], mode: str, total: int | None = None) -> torch.Tensor:
    """Weight of every token's target in ``batch`` under ``mode`` (0 where there is no target), made on the
    batch's labels' device (the host, before the runner moves the batch: runtime/kernel/runner.py)."""
    valid = batch.labels != IGNORE
    if mode == "token_mean":
        denom = total if total is not None else sum(targets.values())
        w = torch.full(batch.labels.shape, 1.0 / max(denom, 1), dtype=torch.float64, device=batch.labels.device)
    elif mode == "sequence_mean":
        n = sum(1 for t in targets.values() if t > 0)
        per = torch.tensor([1.0 / (n * targets[int(s)]) if targets[int(s)] else 0.0
                            for s in batch.sample_of_token.tolist()], dtype=torch.float64)
        w = per.to(batch.labels.device)
    else:
        raise ValueError(f"loss mode {mode!r}: choose one of {', '.join(MODES)}")
    return torch.where(valid, w, torch.zeros_like(w))


def weighted_loss(logits_tv: torch.Tensor, batch: Packed, weights_t: torch.Tensor | None = None) -> torch.Tensor:
    """Σ weight · cross-entropy over the micro-batch (this rank's contribution to the step objective); the
    weights are the batch's own unless given."""
    weights_t = batch.weights if weights_t is None else weights_t
    if weights_t is None:
        raise ValueError("the micro-batch has no token weights (runtime/kernel/runner.prepare sets them)")
    labels = batch.labels.clamp_min(0)
    ce = F.cross_entropy(logits_tv, labels, reduction="none")
    return (ce * weights_t.to(ce.dtype)).sum()
