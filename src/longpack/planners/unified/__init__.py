"""Unified scheduler: one cost-driven search over how a global batch runs, instead of one paper's fixed recipe.

Per global batch: every candidate of CP degree, micro-batch budget, chain form and sharding threshold
(knobs.py) is placed greedily by cost-model seconds (place.py, tail.py) into micro-batches priced by Eq. 2's
closed form (layout.py); the best layouts are balanced and searched locally (moves.py); micro-batches are emptied
beside chains (planners/beside.py); a sharding step may be laid out on CP groups of several sizes
(planners/unified/groups.py). The phases, options and why the result is never slower than plain cost-balanced packing:
docs/PLANNERS.md, "Unified".

Guarantees: coverage, the token cap on every rank of every micro-batch, chain order and contiguity, equal
micro-batch counts, determinism (ties by position). Cost: C candidates × O(n log n + n · replicas), C ≤ |degrees|
· 2 · |splits| · 5, plus at most ``budget`` priced layouts in the local search (docs/BENCHMARKS.md, "Planning
cost"). Options: ``degrees``, ``splits``, ``alphas``, ``widen``, ``shard_chains``, ``budget``, ``trades``,
``mixed_groups``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

from ...plan import Step
from ..base import Batch, PlanContext
from ..beside import fill_step
from ..registry import Planner, register
from .groups import MIN_GAIN, divisors, regroup
from .knobs import Candidate, candidates
from .layout import Layout, Rates, floor
from .moves import BUDGET, Budget, balance, search
from .place import build

__all__ = ["Unified", "Candidate"]

Key = tuple[bool, float, int]  # (over memory, seconds, candidate order)
VARIANT_ALPHAS = 2  # a degree's variants (smaller splits, tail twins) at its best alphas only (knobs.py)


@register
class Unified(Planner):
    """One cost-driven search over CP degree, checkpointing, micro-batch budget and sharding (module docstring)."""

    name = "unified"
    options = ("alphas", "budget", "degrees", "refine", "splits", "trades", "mixed_groups", "shard_chains", "widen")

    def plan_batch(self, batch: Batch, ctx: PlanContext) -> Step:
        lengths = dict(zip(batch.samples.tolist(), batch.lengths.tolist(), strict=True))

        @cache
        def rates(d: int, k: int) -> Rates:
            """The batch's Eq. 2 terms at CP degree d with k checkpointed layers (for this call)."""
            return Rates(ctx.cost.at_cp(d), d, batch.lengths, k)

        budget, one_stage = Budget(self._budget(ctx, batch.samples.size)), ctx.cost.cfg.pp == 1
        best: tuple[Key, Layout] | None = None
        for key, lay in self._finalists(batch, ctx, lengths, rates):
            if one_stage and budget.left > 0 and not key[0]:
                balance(lay)
                key = (*lay.score(), key[2])
            if best is None or key < best[0]:
                best = (key, lay)
        assert best is not None
        lay = best[1]
        if one_stage and budget.left > 0 and not best[0][0]:
            search(lay, budget, ctx.count("trades", "2"))
        step = lay.step()
        if self._budget(ctx, 1) and any(lay.chains):  # never slower with one stage (beside.py); else simulated
            filled = fill_step(step, lay.cost, lengths.__getitem__)
            if one_stage or lay.simulated(filled) < lay.simulated(step):
                step = filled
        # groups of the sizes of --opt degrees, else divisors of --cp unless widened, tried only where the closed
        # form's bound on them leaves room for the gain regroup asks
        sizes = ctx.numbers("degrees", int, "8,4,2,1", "integers") or (None if ctx.flag("widen", False) else
                                                                       divisors(ctx.cp))
        room = (1 - MIN_GAIN) * lay.score()[1] - floor([rates(d, ctx.ckpt_layers) for d in sizes or divisors(
            ctx.world)]) if one_stage and ctx.flag("mixed_groups", True) else 0.0
        return regroup(step, lengths, ctx.cost, self.name, sizes) if room > 0 else step

    def _finalists(self, batch: Batch, ctx: PlanContext, lengths: dict[int, int],
                   rates: Callable[[int, int], Rates]) -> list[tuple[Key, Layout]]:
        """Every candidate placed and scored; the two best of the best degree (and its best of another sharding)
        and the best of the next two degrees."""
        seen: set[tuple] = set()
        per_degree: dict[int, list[tuple[Key, Layout]]] = {}
        alphas: dict[int, list[tuple[Key, float]]] = {}  # per degree, its plain candidates' keys and thresholds
        best = math.inf  # the fastest layout within memory so far: a degree whose bound reaches it is skipped
        one = ctx.cost.cfg.pp == 1  # one stage: the closed form's bound holds
        for c in candidates(batch, ctx, rates):
            if one and rates(c.degree, ctx.ckpt_layers).bound >= best:
                continue
            plain = sorted(alphas.get(c.degree, []))  # with stages, a smaller split can beat every plain layout
            if c.variant and (c.alpha not in [a for _, a in plain[:VARIANT_ALPHAS]] or one and plain[0][0][1] > best):
                continue
            lay = build(batch, ctx, rates, c, seen, lengths)
            if lay is None:  # infeasible, or the same placement as an earlier candidate
                continue
            kept = per_degree.setdefault(c.degree, [])
            kept.append(((*lay.score(), len(seen)), lay))
            if not c.variant:
                alphas.setdefault(c.degree, []).append((kept[-1][0], c.alpha))
            if not kept[-1][0][0]:
                best = min(best, kept[-1][0][1])
            kept.sort(key=lambda kv: kv[0])
            # and the best that shards other samples than the best, when the two best shard the same (the
            # greedy's times of two shardings can be close while the search moves them apart)
            other = next((kv for kv in kept[2:] if kv[1].sharding != kept[0][1].sharding), None)
            del kept[2:]
            if other is not None and all(kv[1].sharding == kept[0][1].sharding for kv in kept[1:]):
                kept.append(other)
        if not per_degree:
            raise ValueError(f"global batch {batch.index}: no CP degree in --opt degrees fits its samples")
        ranked = sorted(per_degree.values(), key=lambda kept: kept[0][0])
        return ranked[0] + [kept[0] for kept in ranked[1:3]]

    @staticmethod
    def _budget(ctx: PlanContext, samples: int) -> int:
        """``--opt budget`` (default ``BUDGET`` per sample of the batch); ``--opt refine=0``, its older spelling,
        turns the search off."""
        if ctx.count("refine", "0") == 0:
            return 0
        given = ctx.count("budget", "4000")
        return BUDGET * samples if given is None else given
