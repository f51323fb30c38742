"""A step's context parallelism as one object: :class:`CPContext` (this rank's degree, place and process group in
its CP group for one step, the overlap switch, the device and the pass clock), made from the step by
:class:`CPGroups`, which holds every group the run's steps use, each made once when a step first needs it (every
rank makes every group, in the same order, so collectives never mismatch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...plan import Plan, Step
from .passes import NO_CLOCK

__all__ = ["CPContext", "CPGroups"]


@dataclass(frozen=True)
class CPContext:
    """This rank in its CP group for one step: ``degree`` ranks, this one ``rank``, their ``group`` (None at degree
    1); ``overlap``: K/V exchanges issued before local attention and waited for after it; ``device``: where the
    micro-batches go (None: the model's); ``clock``: the step's pass schedule under per-layer sharding
    (runtime/kernel/passes.py), told before every pass."""

    degree: int = 1
    rank: int = 0
    group: Any = None
    overlap: bool = True
    device: torch.device | None = None
    clock: Any = NO_CLOCK


@dataclass(frozen=True)
class CPGroups:
    """Process groups of the CP degrees a plan's steps use, each made once, when a step first needs it (every rank
    makes every group, in the same order).
    Replica i of a step with CP degree c is ranks [i·c, (i+1)·c); in a step on groups of several sizes the groups
    follow one another (:meth:`Step.spans`), and each (first rank, size) gets its own group."""

    groups: dict[int, list[dist.ProcessGroup | None]]
    spans: dict[tuple[int, int], dist.ProcessGroup | None] = field(default_factory=dict)
    wait: timedelta | None = None  # how long a collective of these groups waits for its peers

    @classmethod
    def build(cls, degrees: set[int], world: int, spans: set[tuple[int, int]] | None = None,
              timeout: float | None = None) -> CPGroups:
        """``timeout``: seconds a collective of these groups waits for its peers (torch's default otherwise)."""
        out = cls({}, {}, timedelta(seconds=timeout) if timeout else None)
        out._make(degrees, world, spans or set())
        return out

    def _make(self, degrees: set[int], world: int, spans: set[tuple[int, int]]) -> None:
        """Create the groups not made yet (every rank calls this with the same arguments, in the same order)."""
        for c in sorted(degrees - set(self.groups)):
            if world % c:
                raise ValueError(f"CP degree {c} does not divide the world of {world} processes")
            self.groups[c] = [dist.new_group(list(range(i * c, (i + 1) * c)), timeout=self.wait) if c > 1 else None
                              for i in range(world // c)]
        for first, c in sorted(spans - set(self.spans)):
            if c > 1 and first % c:  # an aligned span already has its group above
                self.spans[(first, c)] = dist.new_group(list(range(first, first + c)), timeout=self.wait)

    @classmethod
    def for_plan(cls, plan: Plan, world: int, timeout: float | None = None, stages: int = 1) -> CPGroups:
        """The groups of every step of ``plan`` (:meth:`add` for each)."""
        out = cls.build(set(), world, timeout=timeout)
        for st in plan.steps:
            out.add(st, world, stages)
        return out

    def add(self, step: Step, world: int, stages: int = 1) -> None:
        """Make the groups ``step`` needs that do not exist yet: its degree's aligned groups, or the unaligned
        spans of a step on groups of several sizes; with ``stages`` pipeline stages of world/stages ranks each,
        every stage's. Every rank adds every step, in order (a step planned ahead adds its groups when it runs)."""
        n = world // stages
        spans = {(first + s * n, c) for first, c in step.spans() for s in range(stages)} if step.degrees else set()
        self._make({c for _, c in spans} if step.degrees else {step.cp}, world, spans)

    def group(self, cp: int, rank: int) -> dist.ProcessGroup | None:
        return self.groups[cp][rank // cp]

    def context(self, step: Step, rank: int, offset: int = 0, **rest: Any) -> CPContext:
        """Plan rank ``rank``'s :class:`CPContext` in its replica of ``step`` (its degree, CP rank and group);
        ``offset``: the global rank of the plan's rank 0 (a pipeline stage's first rank); ``rest``: the context's
        other fields (device, clock, overlap)."""
        replica, cp_rank = step.position(rank)
        cp = step.replica_cp(replica)
        first = rank - cp_rank + offset
        group = None if cp <= 1 else self.spans[(first, cp)] if first % cp else self.groups[cp][first // cp]
        return CPContext(degree=cp, rank=cp_rank, group=group, **rest)
