"""Unified scheduler: one cost-driven search over how a global batch runs, instead of one paper's fixed recipe.

Per global batch:

1. **Knobs** (planners/unified/knobs.py): every candidate setting of CP degree, checkpointing, micro-batch budget
   and sharding threshold, each one paper's lever made a choice.
2. **One greedy placement** per candidate (place.py, tail.py, layout.py): chains and big samples, then sharded
   samples, then whole samples to replicas and ranks by cost-model seconds, packed into micro-batches by Eq. 2.
   Each is scored by the simulator's terms (over memory, step time); a candidate placing exactly as an earlier
   one is skipped.
3. **Local search** (moves.py, one pipeline stage): the two best layouts of the best degree (and its best of
   another sharding) and the best of the next two are balanced by moving whole micro-batches between replicas;
   the fastest is searched further, in rounds of repacking pieces within a replica and trading pieces between
   replicas, within ``--opt budget`` simulated layouts.
4. **Beside chains** (planners/beside.py): micro-batches emptied into the room beside chains' last pieces, kept
   where the simulator says it is faster.
5. **Groups of several sizes** (planners/groups.py, ``mixed_groups``): a step that shards a sample laid out again
   on CP groups of several sizes, kept where it is at least 3% faster.

Guarantees: coverage, the token cap on every rank of every micro-batch, chain order and contiguity, equal
micro-batch counts, determinism (ties by position). The candidate (d = cp, configured k, K = 1, α = ∞), plain
cost-balanced packing with memory-forced sharding, is always scored and every later phase only keeps what the
simulator says is no slower, so the result is never slower than that plan when it fits memory.

Cost: C candidates × O(n log n + n · replicas) placement and O(micro-batches) scoring, C ≤ |degrees| · 2 · |splits|
· 6; the local search simulates at most ``budget`` layouts (default ``BUDGET`` per sample of the batch). Figures per
batch and per epoch are in docs/BENCHMARKS.md ("Planning cost").

Options: ``degrees``, ``splits``, ``alphas`` (the knobs' values), ``widen`` (1: CP groups wider than ``--cp``),
``shard_chains`` (0: chains only at CP degree 1, what ``longpack train`` sets), ``budget`` (simulated layouts the
local search may try; 0 turns it and the beside-chains phase off; ``refine=0`` is the same), ``trades`` (most trades
between replicas per replica and round; 0: none), ``mixed_groups`` (0: one degree a step).
"""

from __future__ import annotations

from ...plan import Plan, Step
from ...sim.simulate import _with_cp, simulate_step
from ..base import Batch, PlanContext, Planner, register
from ..beside import fill_step
from ..groups import regroup
from .knobs import Candidate, candidates, count, divisors, flag, numbers
from .layout import Layout, Timer
from .moves import BUDGET, Budget, balance, search
from .place import build

__all__ = ["Unified", "Candidate"]

Key = tuple[bool, float, int]  # (over memory, simulated seconds, candidate order)


@register
class Unified(Planner):
    """One cost-driven search over CP degree, checkpointing, micro-batch budget and sharding (module docstring)."""

    name = "unified"
    options = ("alphas", "budget", "degrees", "refine", "splits", "trades", "mixed_groups", "shard_chains", "widen")

    def plan_batch(self, batch: Batch, ctx: PlanContext) -> Step:
        lengths = {int(s): int(n) for s, n in zip(batch.samples.tolist(), batch.lengths.tolist(), strict=True)}
        finalists = self._finalists(batch, ctx, lengths)
        budget = Budget(self._budget(ctx, batch.samples.size))
        one_stage = ctx.cost.cfg.pp == 1
        best: tuple[Key, Layout] | None = None
        for key, layout in finalists:
            if one_stage and budget.left > 0 and not key[0]:
                layout.reps = balance([layout.replica(g) for g in range(len(layout.own))], layout.timer, layout.full)
                key = (*self._score(layout, lengths, ctx), key[2])
            if best is None or key < best[0]:
                best = (key, layout)
        assert best is not None
        layout = best[1]
        if one_stage and budget.left > 0 and not best[0][0]:
            layout.reps = search(layout.reps or [], layout.timer, layout.cap, layout.full, budget,
                                 count(ctx, "trades", "2"))
        step = self._fill(layout, lengths, ctx) if self._budget(ctx, 1) else layout.step()
        if flag(ctx.option("mixed_groups", True)):  # sizes of --opt degrees, else divisors of --cp unless widened
            sizes = numbers(ctx, "degrees", int, "8,4,2,1", "integers") or (
                None if flag(ctx.option("widen", False)) else divisors(ctx.cp))
            step = regroup(step, lengths, ctx.cost, self.name, sizes)
        return step

    def _finalists(self, batch: Batch, ctx: PlanContext, lengths: dict[int, int]) -> list[tuple[Key, Layout]]:
        """Every candidate placed and scored; the two best of the best degree (and its best of another sharding)
        and the best of the next two degrees."""
        seen: set[tuple] = set()
        timers: dict[int, Timer] = {}  # per degree: memoised micro-batch times, shared by its candidates
        per_degree: dict[int, list[tuple[Key, Layout]]] = {}
        for c in candidates(batch, ctx):
            if c.degree not in timers:
                timers[c.degree] = Timer(c.degree, _with_cp(ctx.cost, c.degree, ctx.world // c.degree)
                                         if c.degree != ctx.cp else ctx.cost)
            layout = build(batch, ctx, timers[c.degree], c, seen)
            if layout is None:  # infeasible, or the same placement as an earlier candidate
                continue
            kept = per_degree.setdefault(c.degree, [])
            kept.append(((*self._score(layout, lengths, ctx), len(seen)), layout))
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
        if count(ctx, "refine", "0") == 0:
            return 0
        given = count(ctx, "budget", "4000")
        return BUDGET * samples if given is None else given

    def _score(self, layout: Layout, lengths: dict[int, int], ctx: PlanContext, step: Step | None = None
               ) -> tuple[bool, float]:
        """(over memory, simulated step time) of a layout (or ``step``, laid out at its degree)."""
        step = step or layout.step()
        if layout.cost.cfg.pp == 1 and not step.mixed:
            return layout.timer.score(step, lengths)
        plan = Plan(planner=self.name, world=ctx.world, lengths=lengths, steps=(step,))
        rep = simulate_step(0, step, plan, layout.cost, bound=False, times=layout.timer)
        return rep.oom, rep.time_s

    def _fill(self, layout: Layout, lengths: dict[int, int], ctx: PlanContext) -> Step:
        """The layout's step with micro-batches emptied beside chains' last pieces, or beside those and
        recomputed chunks: the fastest of the three in the simulator (ties: the fewer micro-batches)."""
        step = layout.step()
        filled = [f for f in (fill_step(step, layout.cost, lengths.__getitem__, recomputed=r) for r in (False, True))
                  if f.replicas != step.replicas]
        if len(filled) == 2 and filled[0].replicas == filled[1].replicas:
            filled = filled[1:]
        best = (self._score(layout, lengths, ctx, step), 0, step)
        for n, f in enumerate(filled, start=1):
            best = min(best, (self._score(layout, lengths, ctx, f), -n, f), key=lambda t: t[:2])
        return best[2]
