"""Where pipeline stages sit: each stage's decoder layers (:func:`stage_bounds`, :func:`split_model`), each rank's
stage, plan rank and process groups (:class:`Layout`), and the step line's pipeline phrase.

World = pp · n with n = dp·cp the plan's ranks: global rank = stage · n + plan rank, so stage s of plan rank r talks
to ranks r + (s ± 1)·n. Stage s keeps decoder layers [a_s, b_s) of a contiguous near-equal split; stage 0 also the
embeddings, the last stage the final norm and LM head. Execution is runtime/kernel/pipeline.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .engine import decoder_layers, num_layers

__all__ = ["stage_bounds", "split_model", "Layout", "pipeline_phrase"]


def stage_bounds(layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous near-equal layer ranges of ``pp`` stages (the first stages take the remainder).

    >>> stage_bounds(5, 2)
    [(0, 3), (3, 5)]
    """
    if pp > layers:
        raise ValueError(f"--pp {pp}: the model has {layers} decoder layers; give at most {layers} stages")
    base, extra = divmod(layers, pp)
    out, a = [], 0
    for s in range(pp):
        b = a + base + (1 if s < extra else 0)
        out.append((a, b))
        a = b
    return out


def split_model(model: Any, stage: int, pp: int) -> Any:
    """Keep stage ``stage``'s layers of a transformers CausalLM (in place): the embeddings only on stage 0, the final
    norm and LM head only on the last stage (identity elsewhere). Layer indices stay global."""
    a, b = stage_bounds(num_layers(model), pp)[stage]
    inner = model.model
    inner.layers = torch.nn.ModuleList(decoder_layers(model)[a:b])
    if stage > 0:
        inner.embed_tokens = None
    if stage < pp - 1:
        inner.norm = torch.nn.Identity()
        model.lm_head = torch.nn.Identity()
    return model


@dataclass(frozen=True)
class Layout:
    """Where a rank sits in a dp·cp × pp world: its stage, its plan rank, the group of its stage's ranks (gradients
    are summed there; None when a stage is one rank), for tied embeddings, the group of the first and last
    stages' ranks of its plan rank (None otherwise), and the group of its plan rank's ranks in every stage (the
    gradient norm is summed there)."""

    pp: int
    n: int
    stage: int
    prank: int
    stage_group: Any = None
    tied_group: Any = None
    cross_group: Any = None

    @property
    def offset(self) -> int:
        return self.stage * self.n

    @classmethod
    def build(cls, rank: int, world: int, pp: int, tied: bool) -> Layout:
        """Every rank creates every group, in the same order (torch.distributed's rule)."""
        if world % pp:
            raise ValueError(f"--pp {pp} must divide the number of processes ({world})")
        n = world // pp
        stage, prank = divmod(rank, n)
        stage_groups = [dist.new_group(list(range(s * n, (s + 1) * n))) if n > 1 else None for s in range(pp)]
        tied_groups = [dist.new_group([r, (pp - 1) * n + r]) for r in range(n)] if tied and pp > 1 else [None] * n
        cross = [dist.new_group([s * n + r for s in range(pp)]) for r in range(n)]
        return cls(pp, n, stage, prank, stage_groups[stage], tied_groups[prank] if stage in (0, pp - 1) else None,
                   cross[prank])


def pipeline_phrase(record: dict[str, Any]) -> str:
    """The step line's pipeline part: busy seconds per stage and the bubble, measured against simulated."""
    pipe = record.get("pipeline")
    if not pipe:
        return ""
    per_stage: dict[int, float] = {}
    for stage, busy in zip(pipe["stage"], pipe["busy_seconds"], strict=True):
        per_stage[stage] = max(per_stage.get(stage, 0.0), busy)
    busy = "/".join(f"{per_stage[s]:.2f}" for s in sorted(per_stage))
    return (f"  pp busy {busy} s, bubble {max(pipe['measured_bubble']):.0%} measured / "
            f"{max(pipe['simulated_bubble']):.0%} simulated")
