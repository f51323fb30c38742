"""A step laid out again on CP groups of several sizes (Step.degrees; FlexSP's heterogeneous groups, compared in HBP
Table 12), for the unified planner's ``mixed_groups`` option.

One CP degree per step makes every sharded sample pay the exchange of the widest group the step needs: on
chunkflow-eval at DP32·CP8 a 260K-token sample needs CP 128, and the 11-77K samples beside it then exchange over
groups of 128 too. :func:`regroup` keeps the planner's choice of which samples to shard and tries, for every split of
the world of :func:`shapes` (at most ``PARTS`` groups whose sizes divide it, or one or two wide groups and many narrow
ones), one greedy layout, one micro-batch per group at the step's checkpointing, timed by Eq. 2's closed form
(planners/unified/layout.py, the simulator's own terms):

1. the sharded samples, longest first, each to the group whose micro-batch then ends soonest;
2. the others, longest first, each to the rank (of any group) that finishes first by Eq. 2 — its own work hides
   under its group's K/V exchange — within the token cap; one that fits no rank is sharded as in 1.

The fastest layout replaces the step when it is at least ``MIN_GAIN`` (3%) faster: each span of a new size is one
more process group (on GPUs, an NCCL communicator that holds memory and takes setup, neither priced by the cost
model), and a gain within the cost model's error does not pay for that. Before the search, a step stays when the
bound of layouts on several sizes (``bounds.mixed_step_bound`` without its split) leaves no room for that gain.
Steps with chains, whose samples do not fit one micro-batch per group, or that shard no sample stay as they are.
Guarantees: the result is a valid Step (coverage, the token cap on every rank) and never slower in the simulator
than the step given. Cost: per split, O(sharded samples × groups · d) + O(own samples × world), for each split of
:func:`shapes` (86 of a world of 256, 46 of a world of 32); the bound, O(samples · sizes), comes first.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import combinations_with_replacement

import numpy as np

from ...cost import CostModel
from ...plan import Plan, Replica, Step
from ...sim.bounds import mixed_step_bound
from ...sim.simulate import simulate_step
from .layout import Mb, Rates
from .moves import apply, trial

__all__ = ["PARTS", "partitions", "shapes", "regroup", "layout_on_groups", "divisors"]

PARTS = 8  # most groups in one step
WIDE = 16  # a wide group of a head holds at least world / WIDE ranks
NARROW = 8  # the narrow groups of a tail hold at most this many ranks (one node)
MIN_GAIN = 0.03  # a step moves to groups of several sizes only when that is at least this much faster


def partitions(world: int, sizes: list[int], parts: int = PARTS) -> set[tuple[int, ...]]:
    """Every way to write ``world`` as a sum of at most ``parts`` of ``sizes``, each listed in descending order."""
    return {c[::-1] for n in range(1, parts + 1) for c in combinations_with_replacement(sorted(sizes), n)
            if sum(c) == world}


@lru_cache(maxsize=64)
def shapes(world: int, allowed: tuple[int, ...] | None = None) -> list[tuple[int, ...]]:
    """The group sizes :func:`regroup` tries: every split into at most ``PARTS`` groups whose sizes divide the
    world (and are in ``allowed`` when given), and every split into one or two wide groups (at least world /
    ``WIDE``) plus groups of one size up to ``NARROW`` for the rest (many small groups: samples that fit a node
    exchange over NVLink). Only splits into more than one size, each once, largest first."""
    sizes = divisors(world, allowed)
    out = partitions(world, sizes)
    wide = [d for d in sizes if d * WIDE >= world and d < world]
    for head in [(a,) for a in wide] + [(a, b) for a in wide for b in wide if b <= a and a + b < world]:
        left = world - sum(head)
        out.update(head + (q,) * (left // q) for q in sizes if q <= NARROW and q < min(head) and left % q == 0)
    return sorted((s for s in out if len(set(s)) > 1), reverse=True)


def divisors(world: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The group sizes a split may use, largest first: the divisors of the world (in ``allowed`` when given)."""
    return [d for d in range(world, 0, -1) if world % d == 0 and (allowed is None or d in allowed)]


class _Step:
    """A step's samples by position (longest first), whether the step shards each, and their Eq. 2 terms at the
    step's checkpointing at each of ``sizes`` and 1."""

    def __init__(self, step: Step, lengths: dict[int, int], cost: CostModel, sizes: Sequence[int]) -> None:
        pieces = [p for r in step.replicas for mb in r.micro_batches for p in mb.pieces]
        self.ids = sorted({p.sample for p in pieces}, key=lambda i: (-lengths[i], i))
        self.n = np.array([lengths[i] for i in self.ids], dtype=np.int64)
        self.sharded = {p.sample for p in pieces if p.cp_rank is None}
        ckpt = max((mb.ckpt_layers for r in step.replicas for mb in r.micro_batches), default=0)
        self.rates = {d: Rates(cost.at_cp(d), d, self.n, ckpt) for d in {*sizes, 1}}


def layout_on_groups(step: Step, lengths: dict[int, int], cost: CostModel, degrees: tuple[int, ...]) -> Step | None:
    """The greedy layout of ``step``'s samples on groups of ``degrees`` (module docstring); None when it does not
    fit one micro-batch per group."""
    s = _Step(step, lengths, cost, degrees)
    mbs = _lay(s, degrees, step.token_cap)
    return None if mbs is None else _on_groups(step, s, mbs, degrees)


def _lay(s: _Step, degrees: tuple[int, ...], cap: int) -> list[Mb] | None:
    """One micro-batch per group of ``degrees`` (module docstring), or None. Own samples go to the best rank of
    the whole world in one vectorised pass each."""
    mbs = [Mb(s.rates[d], [], []) for d in degrees]
    of_rank = np.repeat(np.arange(len(degrees)), degrees)
    at = np.concatenate([np.arange(d) for d in degrees])  # each rank's index in its group
    loc, tok, own = np.zeros(of_rank.size), np.zeros(of_rank.size), s.rates[1].own

    def share(i: int) -> bool:  # shard sample i where its group ends soonest (within the cap), larger groups first
        ends = [(t, -mb.r.d, k) for k, mb in enumerate(mbs) if (t := trial(mb, cap, None, (i, -1))) is not None]
        if ends:
            apply(mbs[min(ends)[2]], None, (i, -1))
        return bool(ends)

    def groups() -> tuple[np.ndarray, ...]:  # per rank, its group's exchange, shares + h, and tokens left
        return tuple(np.array(v)[of_rank] for v in ([mb.r.x(mb.n) for mb in mbs], [mb.sh + mb.r.h for mb in mbs],
                                                     [cap - mb.w for mb in mbs]))

    if not all(share(i) for i, x in enumerate(s.ids) if x in s.sharded):
        return None
    hid, add, room = groups()
    for i in (i for i, x in enumerate(s.ids) if x not in s.sharded):
        finish = np.where(room - tok >= s.n[i], np.maximum(hid, loc + own[i]) + add, np.inf)
        r = int(np.argmin(finish))
        if np.isfinite(finish[r]):
            mbs[of_rank[r]].own.append((i, int(at[r])))
            loc[r], tok[r] = loc[r] + own[i], tok[r] + s.n[i]
            continue
        for mb in mbs:
            mb.sums()
        if not share(i):  # it fits no rank: sharded where it slows a group least, the groups timed again
            return None
        hid, add, room = groups()
    for mb in mbs:
        mb.sums()
    return mbs


def _on_groups(step: Step, s: _Step, mbs: list[Mb], degrees: tuple[int, ...]) -> Step:
    return Step(cp=max(degrees), token_cap=step.token_cap, group=step.group, degrees=degrees,
                replicas=tuple(Replica((mb.micro_batch(s.ids),)) for mb in mbs))


def regroup(step: Step, lengths: dict[int, int], cost: CostModel, planner: str = "unified",
            sizes: list[int] | None = None) -> Step:
    """``step``, or the fastest of its layouts on groups of several sizes (of ``sizes`` when given) when one is at
    least ``MIN_GAIN`` faster. A step that shards no sample stays (without an exchange a group's size changes
    nothing), and so does one whose bound of layouts on several sizes (without its split term, a few tens of ms)
    leaves no room for that gain."""
    world = cost.cfg.dp * cost.cfg.cp
    pieces = [p for r in step.replicas for mb in r.micro_batches for p in mb.pieces]
    if (cost.cfg.pp > 1 or all(p.cp_rank is not None for p in pieces)
            or any(p.start > 0 or p.stop < lengths[p.sample] for p in pieces)):
        return step
    plan = Plan(planner=planner, world=world, lengths=lengths, steps=(step,))
    worth = (1.0 - MIN_GAIN) * simulate_step(0, step, plan, cost, bound=False).time_s  # what a layout must beat
    samples = np.array(sorted(lengths[i] for i in {p.sample for p in pieces}), dtype=np.float64)
    if mixed_step_bound(samples, cost, divisors(world, sizes), split=False) >= worth:
        return step  # no layout on several sizes can be MIN_GAIN faster: skip the search (most lmsys steps)
    best, best_s, s = None, worth - cost.grad_allreduce_s(), _Step(step, lengths, cost, divisors(world, sizes))
    for degrees in shapes(world, tuple(sizes) if sizes else None):
        mbs = _lay(s, degrees, step.token_cap)
        if mbs is not None and max(mb.t for mb in mbs) < best_s and all(max(mb.tok) + mb.w <= mb.r.mem for mb in mbs):
            best, best_s = (mbs, degrees), max(mb.t for mb in mbs)
    return step if best is None else _on_groups(step, s, *best)
