"""A step laid out again on CP groups of several sizes (Step.degrees; FlexSP's heterogeneous groups, PAPERS.md HBP
Table 12), for the unified planner's ``mixed_groups`` option.

One CP degree per step makes every sharded sample pay the exchange of the widest group the step needs: on
chunkflow-eval at DP32·CP8 a 260K-token sample needs CP 128, and the 11-77K samples beside it then exchange over
groups of 128 too. :func:`regroup` keeps the planner's choice of which samples to shard and tries, for every split of
the world into at most ``PARTS`` groups whose sizes divide it, one greedy layout, one micro-batch per group at the
step's checkpointing:

1. the sharded samples, longest first, each to the group whose micro-batch gets least slower (simulator times);
2. the others, longest first, each to the rank (of any group) that finishes first by Eq. 2 — its own work hides
   under its group's K/V exchange — within the token cap; one that fits no rank is sharded as in 1.

The fastest layout in the simulator replaces the step when it is faster. Steps with chains, or whose samples do not
fit one micro-batch per group, stay as they are. Guarantees: the result is a valid Step (coverage, the token cap on
every rank) and never slower in the simulator than the step given. Cost: per split, O(sharded samples × groups)
micro-batch timings + O(own samples × groups) + one step simulation, for each split into groups of more than one
size: 34 of a world of 256 (about 10-20 s a DP32·CP8 step on these CPUs), 27 of a world of 32.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Piece, Plan, Replica, Step
from ..sim.simulate import micro_batch_times, simulate_step

__all__ = ["PARTS", "partitions", "regroup", "layout_on_groups"]

PARTS = 8  # most groups in one step


def partitions(world: int, sizes: list[int], parts: int = PARTS) -> list[tuple[int, ...]]:
    """Every way to write ``world`` as a sum of at most ``parts`` of ``sizes``, each listed in descending order."""
    out: list[tuple[int, ...]] = []

    def grow(left: int, largest: int, acc: tuple[int, ...]) -> None:
        if left == 0:
            out.append(acc)
            return
        if len(acc) == parts:
            return
        for s in sizes:
            if s <= min(left, largest):
                grow(left - s, s, acc + (s,))

    grow(world, world, ())
    return out


class _Group:
    """One CP group being filled: its degree, sharded samples and per-rank own samples."""

    def __init__(self, cost: CostModel, degree: int, world: int) -> None:
        self.d = degree
        self.cost = cost if cost.cfg.cp == degree else CostModel(cost.model, cost.hw,
                                                                 replace(cost.cfg, cp=degree, dp=world // degree))
        self.shared: list[tuple[int, int]] = []  # (sample, length)
        self.own: list[list[tuple[int, int]]] = [[] for _ in range(degree)]
        self.own_tokens = np.zeros(degree)
        self.own_s = np.zeros(degree)
        self.share_tokens = 0.0

    def micro_batch(self, ckpt: int, extra: tuple[int, int] | None = None) -> MicroBatch:
        shared = self.shared + ([extra] if extra else [])
        pieces = [Piece(i, 0, n, None) for i, n in shared]
        pieces += [Piece(i, 0, n, r) for r, xs in enumerate(self.own) for i, n in xs]
        return MicroBatch(tuple(pieces), ckpt_layers=ckpt)

    def time(self, ckpt: int, cap: int, extra: tuple[int, int] | None = None) -> tuple[float, float, float]:
        """(micro-batch time, K/V exchange, shared compute) with ``extra`` sharded too; inf over the cap."""
        mb = self.micro_batch(ckpt, extra)
        if not mb.pieces:
            return 0.0, 0.0, 0.0
        t, _, dist, comm, tokens, _ = micro_batch_times(mb, self.d, self.cost)
        if float(np.max(tokens)) > cap:
            return np.inf, np.inf, np.inf
        return float(t.max()), float(comm[0]), float(dist[0])


def layout_on_groups(step: Step, lengths: dict[int, int], cost: CostModel,
                     degrees: tuple[int, ...]) -> Step | None:
    """The greedy layout of ``step``'s samples on groups of ``degrees`` (module docstring); None when it does not
    fit one micro-batch per group."""
    world = sum(degrees)
    ckpt = max((mb.ckpt_layers for r in step.replicas for mb in r.micro_batches), default=0)
    cap = step.token_cap
    groups = [_Group(cost, d, world) for d in degrees]
    pieces = [p for r in step.replicas for mb in r.micro_batches for p in mb.pieces]
    shared = sorted({p.sample for p in pieces if p.cp_rank is None}, key=lambda i: (-lengths[i], i))
    own = sorted({p.sample for p in pieces if p.cp_rank is not None}, key=lambda i: (-lengths[i], i))

    def share(i: int) -> bool:
        best = min((g.time(ckpt, cap, (i, lengths[i]))[0], -g.d, k) for k, g in enumerate(groups))
        if not np.isfinite(best[0]):
            return False
        g = groups[best[2]]
        g.shared.append((i, lengths[i]))
        g.share_tokens += float(np.ceil(lengths[i] / g.d))
        return True

    if not all(share(i) for i in shared):
        return None
    base = [g.time(ckpt, cap) for g in groups]
    for i in own:
        n = lengths[i]
        best: tuple[float, int, int, float] | None = None
        for k, g in enumerate(groups):
            r = int(np.argmin(g.own_s))
            if g.share_tokens + g.own_tokens[r] + n > cap:
                continue
            alone = float(g.cost.sequence_s(n))
            finish = max(base[k][1], g.own_s[r] + alone) + base[k][2]
            if best is None or finish < best[0]:
                best = (finish, k, r, alone)
        if best is None:
            if not share(i):
                return None
            base = [g.time(ckpt, cap) for g in groups]
            continue
        _, k, r, alone = best
        groups[k].own[r].append((i, n))
        groups[k].own_tokens[r] += n
        groups[k].own_s[r] += alone
    return Step(cp=max(degrees), token_cap=cap, group=step.group, degrees=degrees,
                replicas=tuple(Replica((g.micro_batch(ckpt),)) for g in groups))


def regroup(step: Step, lengths: dict[int, int], cost: CostModel, planner: str = "unified") -> Step:
    """``step``, or the fastest of its layouts on groups of several sizes when one is faster in the simulator."""
    world = cost.cfg.dp * cost.cfg.cp
    if cost.cfg.pp > 1 or any(p.start > 0 or p.stop < lengths[p.sample]
                              for r in step.replicas for mb in r.micro_batches for p in mb.pieces):
        return step
    plan = Plan(planner=planner, world=world, lengths=lengths, steps=(step,))
    best, best_s = step, simulate_step(0, step, plan, cost, bound=False).time_s
    for degrees in partitions(world, [d for d in range(world, 0, -1) if world % d == 0]):
        if len(set(degrees)) == 1:  # one size: a layout of one degree, the planner's own business
            continue
        laid = layout_on_groups(step, lengths, cost, degrees)
        if laid is None:
            continue
        rep = simulate_step(0, laid, plan, cost, bound=False)
        if not rep.oom and rep.time_s < best_s:
            best, best_s = laid, rep.time_s
    return best
