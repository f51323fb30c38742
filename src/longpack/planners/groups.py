"""A step laid out again on CP groups of several sizes (Step.degrees; FlexSP's heterogeneous groups, PAPERS.md HBP
Table 12), for the unified planner's ``mixed_groups`` option.

One CP degree per step makes every sharded sample pay the exchange of the widest group the step needs: on
chunkflow-eval at DP32·CP8 a 260K-token sample needs CP 128, and the 11-77K samples beside it then exchange over
groups of 128 too. :func:`regroup` keeps the planner's choice of which samples to shard and tries, for every split of
the world of :func:`shapes` (at most ``PARTS`` groups whose sizes divide it, or one or two wide groups and many narrow
ones), one greedy layout, one micro-batch per group at the step's checkpointing:

1. the sharded samples, longest first, each to the group whose micro-batch gets least slower (simulator times);
2. the others, longest first, each to the rank (of any group) that finishes first by Eq. 2 — its own work hides
   under its group's K/V exchange — within the token cap; one that fits no rank is sharded as in 1.

The fastest layout in the simulator replaces the step when it is at least ``MIN_GAIN`` (3%) faster: each span of
a new size is one more process group (on GPUs, an NCCL communicator that holds memory and takes setup, neither
priced by the cost model), and a gain within the cost model's error does not pay for that. Before the search, a
step stays when the bound of layouts on several sizes (``bounds.mixed_step_bound`` without its split) leaves no room
for that gain. Steps with chains, whose samples do not fit one micro-batch per group, or that shard no sample stay
as they are. Guarantees: the result is a valid Step (coverage, the token cap on every rank) and never slower in the
simulator than the step given. Cost: per split, O(sharded samples × groups) micro-batch timings (groups of one
degree with the same sharded samples timed once) + O(own samples × world) + one step simulation, for each split of
:func:`shapes` (86 of a world of 256, 46 of a world of 32); the bound, O(samples · sizes), comes first.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Piece, Plan, Replica, Step
from ..sim.bounds import mixed_step_bound
from ..sim.simulate import micro_batch_times, simulate_step

__all__ = ["PARTS", "partitions", "shapes", "regroup", "layout_on_groups"]

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
    """One CP group being filled: its degree, sharded samples and (at the end) per-rank own samples."""

    def __init__(self, cost: CostModel, degree: int, world: int) -> None:
        self.d = degree
        self.cost = cost if cost.cfg.cp == degree else CostModel(cost.model, cost.hw,
                                                                 replace(cost.cfg, cp=degree, dp=world // degree))
        self.shared: list[tuple[int, int]] = []  # (sample, length)
        self.own: list[list[tuple[int, int]]] = [[] for _ in range(degree)]
        self.share_tokens = 0.0

    def micro_batch(self, ckpt: int) -> MicroBatch:
        pieces = [Piece(i, 0, n, None) for i, n in self.shared]
        pieces += [Piece(i, 0, n, r) for r, xs in enumerate(self.own) for i, n in xs]
        return MicroBatch(tuple(pieces), ckpt_layers=ckpt)


def layout_on_groups(step: Step, lengths: dict[int, int], cost: CostModel,
                     degrees: tuple[int, ...]) -> Step | None:
    """The greedy layout of ``step``'s samples on groups of ``degrees`` (module docstring); None when it does not
    fit one micro-batch per group. Own samples go to the best rank of the whole world in one vectorised pass
    each."""
    world = sum(degrees)
    ckpt = max((mb.ckpt_layers for r in step.replicas for mb in r.micro_batches), default=0)
    cap = step.token_cap
    deal = _Deal(cost, degrees, lengths, cap, ckpt)
    pieces = [p for r in step.replicas for mb in r.micro_batches for p in mb.pieces]
    shared = sorted({p.sample for p in pieces if p.cp_rank is None}, key=lambda i: (-lengths[i], i))
    own = sorted({p.sample for p in pieces if p.cp_rank is not None}, key=lambda i: (-lengths[i], i))
    if any(deal.share(i) < 0 for i in shared):
        return None
    groups = deal.groups
    of_rank = np.repeat(np.arange(len(groups)), degrees)
    comm = np.array([deal.timed(k)[1] for k in range(len(groups))])
    dist = np.array([deal.timed(k)[2] for k in range(len(groups))])
    share_tok = np.array([g.share_tokens for g in groups])
    own_s, own_tok = np.zeros(world), np.zeros(world)
    placed: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i in own:
        n = lengths[i]
        alone = float(cost.sequence_s(n))  # one rank's time: the same in every group
        finish = np.maximum(comm[of_rank], own_s + alone) + dist[of_rank]  # Eq. 2: own work hides under the exchange
        finish[share_tok[of_rank] + own_tok + n > cap] = np.inf
        r = int(np.argmin(finish))
        if np.isfinite(finish[r]):
            placed[r].append((i, n))
            own_tok[r] += n
            own_s[r] += alone
            deal.held[of_rank[r]] = max(deal.held[of_rank[r]], own_tok[r])
            continue
        k = deal.share(i)
        if k < 0:
            return None
        _, comm[k], dist[k] = deal.timed(k)
        share_tok[k] = groups[k].share_tokens
    return _on_groups(step, groups, placed, degrees, ckpt)


class _Deal:
    """Sharded samples onto the groups of one split. A group's exchange and shared compute depend on its sharded
    samples only, so groups of one degree holding the same ones are timed once."""

    def __init__(self, cost: CostModel, degrees: tuple[int, ...], lengths: dict[int, int], cap: int, ckpt: int
                 ) -> None:
        self.groups = [_Group(cost, d, sum(degrees)) for d in degrees]
        self.lengths, self.cap, self.ckpt = lengths, cap, ckpt
        self.held = np.zeros(len(degrees))  # most own tokens on one rank of each group
        self._memo: dict[tuple, tuple[float, float, float]] = {}

    def timed(self, k: int, extra: tuple[int, int] | None = None) -> tuple[float, float, float]:
        """(time, K/V exchange, shared compute) of group k's sharded samples (and ``extra``); inf over the cap."""
        g = self.groups[k]
        key = (g.d, *g.shared, extra)
        if key not in self._memo:
            shares = g.shared + ([extra] if extra else [])
            mb = MicroBatch(tuple(Piece(i, 0, n, None) for i, n in shares), ckpt_layers=self.ckpt)
            if not mb.pieces:
                self._memo[key] = (0.0, 0.0, 0.0)
            else:
                time, _, dist, comm, tokens, _ = micro_batch_times(mb, g.d, g.cost)
                self._memo[key] = ((np.inf, np.inf, np.inf) if float(np.max(tokens)) > self.cap
                                   else (float(time.max()), float(comm[0]), float(dist[0])))
        return self._memo[key]

    def share(self, i: int) -> int:
        """Shard sample i on the group it slows least (within the cap); its index, or -1."""
        n, cap = self.lengths[i], self.cap
        best = min(((self.timed(k, (i, n))[0] if g.share_tokens + math.ceil(n / g.d) + self.held[k] <= cap
                     else np.inf, -g.d, k) for k, g in enumerate(self.groups)))
        if not np.isfinite(best[0]):
            return -1
        g = self.groups[best[2]]
        g.shared.append((i, n))
        g.share_tokens += math.ceil(n / g.d)
        return best[2]


def _on_groups(step: Step, groups: list[_Group], placed: list[list[tuple[int, int]]], degrees: tuple[int, ...],
               ckpt: int) -> Step:
    """The step of one micro-batch per group, each group's ranks holding their ``placed`` own samples."""
    first = 0
    for g in groups:
        g.own = placed[first:first + g.d]
        first += g.d
    return Step(cp=max(degrees), token_cap=step.token_cap, group=step.group, degrees=degrees,
                replicas=tuple(Replica((g.micro_batch(ckpt),)) for g in groups))


def shapes(world: int, allowed: list[int] | None = None) -> list[tuple[int, ...]]:
    """The group sizes :func:`regroup` tries: every split into at most ``PARTS`` groups whose sizes divide the
    world (and are in ``allowed`` when given), and every split into one or two wide groups (at least world /
    ``WIDE``) plus groups of one size up to ``NARROW`` for the rest (many small groups: samples that fit a node
    exchange over NVLink). Only splits into more than one size, each once, largest first."""
    sizes = _sizes(world, allowed)
    out = set(partitions(world, sizes))
    wide = [d for d in sizes if d * WIDE >= world and d < world]
    heads = [(a,) for a in wide] + [(a, b) for a in wide for b in wide if b <= a and a + b < world]
    for head in heads:
        left = world - sum(head)
        out.update(head + (q,) * (left // q) for q in sizes if q <= NARROW and q < min(head) and left % q == 0)
    return sorted((s for s in out if len(set(s)) > 1), reverse=True)


def _sizes(world: int, allowed: list[int] | None) -> list[int]:
    """The group sizes a split may use, largest first: the divisors of the world (in ``allowed`` when given)."""
    return [d for d in range(world, 0, -1) if world % d == 0 and (allowed is None or d in allowed)]


WIDE = 16  # a wide group of a head holds at least world / WIDE ranks
NARROW = 8  # the narrow groups of a tail hold at most this many ranks (one node)


def regroup(step: Step, lengths: dict[int, int], cost: CostModel, planner: str = "unified",
            sizes: list[int] | None = None) -> Step:
    """``step``, or the fastest of its layouts on groups of several sizes (of ``sizes`` when given) when one is at
    least ``MIN_GAIN`` faster in the simulator. A step that shards no sample stays (without an exchange a group's
    size changes nothing), and so does one whose bound of layouts on several sizes (without its split term, a few
    tens of ms) leaves no room for that gain."""
    world = cost.cfg.dp * cost.cfg.cp
    pieces = [p for r in step.replicas for mb in r.micro_batches for p in mb.pieces]
    if (cost.cfg.pp > 1 or all(p.cp_rank is not None for p in pieces)
            or any(p.start > 0 or p.stop < lengths[p.sample] for p in pieces)):
        return step
    plan = Plan(planner=planner, world=world, lengths=lengths, steps=(step,))
    worth = (1.0 - MIN_GAIN) * simulate_step(0, step, plan, cost, bound=False).time_s  # what a layout must beat
    samples = np.array(sorted(lengths[i] for i in {p.sample for p in pieces}), dtype=np.float64)
    if mixed_step_bound(samples, cost, _sizes(world, sizes), split=False) >= worth:
        return step  # no layout on several sizes can be MIN_GAIN faster: skip the search (most lmsys steps)
    best, best_s = step, worth
    for degrees in shapes(world, sizes):
        laid = layout_on_groups(step, lengths, cost, degrees)
        if laid is None:
            continue
        rep = simulate_step(0, laid, plan, cost, bound=False)
        if not rep.oom and rep.time_s < best_s:
            best, best_s = laid, rep.time_s
    return best


MIN_GAIN = 0.03  # a step moves to groups of several sizes only when that is at least this much faster (module doc)
