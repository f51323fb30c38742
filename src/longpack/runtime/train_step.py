"""One optimizer step's forward and backward on a rank, and the gradient sum over the ranks that hold the same
parameters: what `longpack train`, its evaluation and ``LongpackTrainer`` all run (see :func:`run_step`)."""

from __future__ import annotations

from typing import Any

import torch

from ..plan import Plan
from .context_parallel import CPGroups
from .data import Source
from .dist import DistContext, all_reduce_sum
from .memory import ActivationMeter
from .passes import NO_CLOCK
from .step import run_micro_batches

__all__ = ["run_step"]


def run_step(model: torch.nn.Module, plan: Plan, step: int, mbs: Any, source: Source, ctx: DistContext,
             groups: CPGroups | None, mode: str, sync: Any, pipe: Any = None) -> tuple[torch.Tensor, float]:
    """Forward/backward of this rank's micro-batches of ``step`` and the gradient sum over every rank holding the
    same parameters (FSDP2's reduce-scatter through ``sync``, or one all-reduce); returns (loss, tokens, targets)
    summed over ranks, and this rank's measured activation peak. ``pipe``: this rank's
    :class:`~longpack.runtime.pipeline.PipelineStage` under pipeline parallelism. ``longpack train`` and the
    Trainer both run their steps through this."""
    layout = pipe.layout if pipe is not None else None
    rank, offset = (layout.prank, layout.offset) if layout else (ctx.rank, 0)
    cp, cp_rank, group = groups.of(plan.steps[step], rank, offset) if groups else (1, 0, None)
    meter = ActivationMeter()
    clock = sync.begin(plan, step, rank) if sync is not None else None
    with meter.measure(model):
        if pipe is not None:
            loss, tokens, targets = pipe.run_step(plan, step, mbs, source, None, mode, cp, cp_rank, group)
        else:
            loss, tokens, targets = run_micro_batches(model, plan, step, mbs, source, mode=mode, device=ctx.device,
                                                      cp_rank=cp_rank, cp_group=group, cp=cp,
                                                      clock=clock or NO_CLOCK)
    # the step's statistics stay on the device (NCCL takes no host tensor): read once, after the reduction
    counts = torch.tensor([float(tokens), float(targets)], dtype=torch.float64).to(loss.device)  # one copy
    stats = torch.cat([loss.to(torch.float64).reshape(1), counts])
    if sync is not None:
        sync.end()
        all_reduce_sum([stats])
        tied = pipe.tied_weight if pipe is not None else None
        if tied is not None and layout is not None and layout.tied_group is not None:  # the same shard, both ends
            all_reduce_sum([tied.grad.to_local()], group=layout.tied_group)
        return stats, float(meter.peak)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if layout is None:
        all_reduce_sum(grads + [stats])
    else:  # gradients within the stage (and a tied embedding between the first and last stage); stats everywhere
        if layout.n > 1:
            all_reduce_sum(grads, group=layout.stage_group)
        all_reduce_sum([stats])
        if layout.tied_group is not None:
            tied = next(i for i, p in enumerate(params) if p is pipe.tied_weight)
            all_reduce_sum([grads[tied]], group=layout.tied_group)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return stats, float(meter.peak)
