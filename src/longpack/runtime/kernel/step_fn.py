"""The kernel's step function: one optimizer step's forward and backward on this rank and the gradient sum over
the ranks that hold the same parameters — what `longpack train`, its evaluation, the dry run and
``LongpackTrainer`` all call (:class:`StepRunner`)."""

from __future__ import annotations

from typing import Any

import torch

from ...plan import Plan
from ..dist import DistContext, all_reduce_sum
from .cp import CPContext, CPGroups
from .data import Source
from .host import to_device
from .memory import ActivationMeter
from .passes import NO_CLOCK
from .step import run_micro_batches

__all__ = ["StepRunner"]


class StepRunner:
    """This process's steps: ``run`` forwards and backpropagates its micro-batches of a plan step and sums the
    gradients (FSDP2's reduce-scatter through ``sync``, or one all-reduce). It makes each step's CP context itself
    (the CP groups every rank makes in the same order, the first time a step needs them), so no driver sets up
    context parallelism. ``mode``: the loss normalisation (runtime/kernel/loss.py); ``sync``: FSDP2's step
    synchronisation (runtime/kernel/parallelize.py), None without FSDP2; ``pipe``: this rank's pipeline stage;
    ``timeout``: seconds a collective of the CP groups waits for its peers; ``cp``: the run's CP degree — the
    groups of every degree dividing it are made here, before the first step (a step on groups of several sizes
    makes its unaligned spans when it first runs)."""

    def __init__(self, ctx: DistContext, mode: str = "token_mean", sync: Any = None, pipe: Any = None,
                 timeout: float | None = None, cp: int = 1) -> None:
        self.ctx, self.mode, self.sync, self.pipe = ctx, mode, sync, pipe
        degrees = {d for d in range(2, cp + 1) if cp % d == 0 and ctx.world % d == 0}
        self.groups = CPGroups.build(degrees, ctx.world, timeout=timeout) if ctx.distributed else None

    def run(self, model: torch.nn.Module, plan: Plan, step: int, mbs: Any, source: Source
            ) -> tuple[torch.Tensor, float]:
        """(loss, tokens, targets) of ``step`` summed over ranks, a device tensor, and this rank's measured
        activation peak."""
        layout = self.pipe.layout if self.pipe is not None else None
        rank, offset = (layout.prank, layout.offset) if layout else (self.ctx.rank, 0)
        clock = self.sync.begin(plan, step, rank) if self.sync is not None else None
        cp = self._context(plan, step, rank, offset, clock or NO_CLOCK)
        meter = ActivationMeter()
        with meter.measure(model):
            if self.pipe is not None:
                loss, tokens, targets = self.pipe.run_step(plan, step, mbs, source, cp, None, self.mode)
            else:
                loss, tokens, targets = run_micro_batches(model, plan, step, mbs, source, cp, self.mode)
        # the step's statistics stay on the device (NCCL takes no host tensor): read once, after the reduction
        counts = to_device(torch.tensor([float(tokens), float(targets)], dtype=torch.float64), loss.device)
        stats = torch.cat([loss.to(torch.float64).reshape(1), counts])
        self._reduce(model, stats)
        return stats, float(meter.peak)

    def _context(self, plan: Plan, step: int, rank: int, offset: int, clock: Any) -> CPContext:
        """This rank's CP context for ``step``, its groups made now if the step is the first to need them."""
        if self.groups is None:
            return CPContext(device=self.ctx.device, clock=clock)
        self.groups.add(plan.steps[step], self.ctx.world, self.pipe.pp if self.pipe is not None else 1)
        return self.groups.context(plan.steps[step], rank, offset, device=self.ctx.device, clock=clock)

    def _reduce(self, model: torch.nn.Module, stats: torch.Tensor) -> None:
        """The step's gradients summed over the ranks holding the same parameters, and its statistics over all."""
        layout = self.pipe.layout if self.pipe is not None else None
        tied = self.pipe.tied_weight if self.pipe is not None else None
        if self.sync is not None:
            self.sync.end()
            all_reduce_sum([stats])
            if tied is not None and layout is not None and layout.tied_group is not None:  # the same shard, both ends
                all_reduce_sum([tied.grad.to_local()], group=layout.tied_group)
            return
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if layout is None:
            all_reduce_sum(grads + [stats])
        else:  # gradients within the stage (and a tied embedding between the first and last stage); stats everywhere
            if layout.n > 1:
                all_reduce_sum(grads, group=layout.stage_group)
            all_reduce_sum([stats])
            if layout.tied_group is not None:
                i = next(k for k, p in enumerate(params) if p is tied)
                all_reduce_sum([grads[i]], group=layout.tied_group)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
