"""Exact loss normalisation over a whole optimizer step, from plan-known counts.

A sample of n tokens has n − 1 next-token targets (its last token predicts nothing). For a step:

* ``token_mean``: every target weighs 1 / (targets of all samples in the step, all micro-batches and ranks);
* ``sequence_mean``: a target of sample i weighs 1 / (samples with targets · targets of i).

Each rank computes Σ weight · cross-entropy over its micro-batches and backpropagates it; gradients are summed
(not averaged) across ranks, so the result is exactly the gradient of the global objective, whatever the packing,
chunking or placement — the equivalence Skrull and ChunkFlow rely on (PAPERS.md §5). When labels mask tokens the
plan cannot know (prompts), :func:`global_target_count` all-reduces the true count once per step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..plan import Plan, Step
from .data import IGNORE, Packed

__all__ = ["step_targets", "token_weights", "weighted_loss", "global_target_count", "MODES"]

MODES = ("token_mean", "sequence_mean")


def step_targets(plan: Plan, step: Step) -> dict[int, int]:
    """{sample: number of targets} for every sample in ``step`` (from the plan alone)."""
    out: dict[int, int] = {}
    for rep in step.replicas:
        for mb in rep.micro_batches:
            for p in mb.pieces:
                out[p.sample] = plan.effective_length(p.sample) - 1
    return out


def token_weights(batch: Packed, targets: dict[int, int], mode: str, total: int | None = None) -> torch.Tensor:
    """Weight of every token's target in ``batch`` under ``mode`` (0 where there is no target)."""
    valid = batch.labels != IGNORE
    if mode == "token_mean":
        denom = total if total is not None else sum(targets.values())
        w = torch.full(batch.labels.shape, 1.0 / max(denom, 1), dtype=torch.float64)
    elif mode == "sequence_mean":
        n = sum(1 for t in targets.values() if t > 0)
        per = torch.tensor([1.0 / (n * targets[int(s)]) if targets[int(s)] else 0.0
                            for s in batch.sample_of_token.tolist()], dtype=torch.float64)
        w = per
    else:
        raise ValueError(f"loss mode {mode!r}: choose one of {', '.join(MODES)}")
    return torch.where(valid, w, torch.zeros_like(w))


def weighted_loss(logits_tv: torch.Tensor, batch: Packed, weights_t: torch.Tensor) -> torch.Tensor:
    """Σ weight · cross-entropy over the micro-batch (this rank's contribution to the step objective)."""
    labels = batch.labels.clamp_min(0)
    ce = F.cross_entropy(logits_tv, labels, reduction="none")
    return (ce * weights_t.to(ce.dtype)).sum()


def global_target_count(batches: Iterable[Packed], group: dist.ProcessGroup | None = None) -> int:
    """Targets on every rank, summed with one all-reduce (for labels the plan cannot count)."""
    local = sum(int((b.labels != IGNORE).sum()) for b in batches)
    t = torch.tensor([local], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, group=group)
    return int(t.item())
