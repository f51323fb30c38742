"""Held-out loss of `longpack train` (``--eval-data``, ``--eval-every``) on the training engine.

The held-out rows are planned once, by the run's planner and settings, as one step holding all of them (its
micro-batches bounded by the token cap like any step's), and run through the training step's own path
(runtime/kernel/step_fn.StepRunner: packed documents, CP shards, chains, pipeline stages, FSDP2) with the run's loss
mode. The figure is therefore the exact mean loss over the held-out targets, as plain training computes it, on
every path. The gradients the pass leaves are discarded (no optimizer step), so an evaluation costs one training
step of its rows; a forward-only pass would cost about a third, but needs chain and pipeline schedules of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...plan import Plan
from ..kernel.data import PlanSampler, Source
from ..kernel.step_fn import StepRunner

__all__ = ["Evaluation"]


@dataclass
class Evaluation:
    """The held-out rows (``source``) and their one-step ``plan``."""

    plan: Plan
    source: Source

    def run(self, model: torch.nn.Module, runner: StepRunner) -> torch.Tensor:
        """[loss, tokens, targets] of the held-out rows over every rank (a device tensor), through the run's own
        step runner; gradients cleared."""
        pipe = runner.pipe
        prank = pipe.layout.prank if pipe is not None else runner.ctx.rank
        mbs = PlanSampler(self.plan, prank, steps=1).micro_batches(0)
        stats, _ = runner.run(model, self.plan, 0, mbs, self.source)
        model.zero_grad(set_to_none=True)
        return stats
