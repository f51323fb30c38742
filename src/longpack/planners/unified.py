"""Unified scheduler: one cost-driven search over how a global batch runs, instead of one paper's fixed recipe.

Per global batch the planner enumerates a few discrete knobs, turns each combination into a Step with one greedy
placement, scores it with the simulator on the same cost model, refines the best layouts of the three best CP
degrees by local search on simulated times, and keeps the fastest that fits memory (ties: the earlier
candidate, so the result is deterministic).

Knobs (each is one paper's lever, made a choice instead of a fixed setting):

* **CP degree** d of the step, over the divisors of ``--cp`` (HBP's per-group SP degree): world/d replicas. Only
  with ``--opt widen=1`` also wider groups (2·cp, 4·cp, ... dividing the world) while the longest sample's share
  plus its K/V exchange at the previous degree still exceeds a quarter of the mean rank load.
* **Checkpointing** k: the configured layers, or the fewest that let the longest sample sit sharded whole
  without a chain (HBP's checkpointing where it pays). Only the micro-batches holding such long samples use k;
  the others keep the configured layers and pay no recompute. Each such candidate has a twin that runs those
  samples instead as two-piece chains at the configured layers: the head, what the ranks cannot hold (plus
  room for its K/V store), is recomputed and the tail kept — the least recompute memory allows (the lower
  bound's), where checkpointing k layers re-runs k/L of every token's forward. The same twin exists for
  candidates with chains: memory-sized chains whose last piece is as long as a rank can keep beside the K/V
  store of the pieces before it (and each earlier piece as long as memory allows beside its own prefix's K/V),
  the earlier pieces recomputed — uniform chunks of a full cap would leave no room for that store.
* **Budget split** K in {1, 2, 4} (and 8 with pp > 1): a micro-batch holds at most B = cap(k) // K tokens per rank.
  Samples longer than B·d become ChunkFlow chains of the fewest chunks of at most B·d tokens (even, or full after
  one short first piece, whichever the estimate says is faster) whose first N − K chunks are recomputed, so the
  K kept chunks fit the cap; smaller micro-batches also shorten pipeline bubbles when pp > 1.
* **Sharding threshold** α in {∞, 2, 1, 1/2, unit, light}: a sample that fits one rank (s ≤ B) is still sharded
  over the CP group when its whole-rank time exceeds α·τ, where τ is the mean rank load if every sample ran whole
  (compute-driven sharding, which Skrull's DACP never does: it shards only for memory); ``unit`` shards it when
  its whole-rank time exceeds the step's longest unit instead (over samples, the largest of the shorter of whole
  on a rank and share plus own exchange), so on wide CP groups, whose exchange crosses nodes, every sample that
  can end within that unit stays whole; ``light`` also shards what outlasts the unit on top of the lightest
  replica's shared work (an own sample runs after its replica's shares), and deals the shared samples again.
  Samples with B < s ≤ B·d are always sharded (memory-forced, as in DACP).

Placement of one candidate (loads are cost-model seconds, so both Σ s and Σ s² are balanced):

1. chains to replicas, heaviest first to the least-loaded (LPT), then sharded samples to replicas the same way;
2. whole samples to ranks, heaviest first to the least-loaded rank (its replica's shared load plus its own);
3. per replica, the fewest micro-batches m that hold every rank's tokens within B: sharded samples dealt over the
   m micro-batches (heaviest first, to the lightest micro-batch with room), then each rank's own samples to the
   micro-batch that is lightest after adding in Eq. 2 terms (own work up to the micro-batch's K/V exchange time
   is free); if one does not fit anywhere, m + 1. Big samples (sharded whole only with more checkpointing) get
   micro-batches of their own, then chains follow, each contiguous and in order;
4. (d > 1) own samples move from those micro-batches into the big and chain micro-batches of their replica, on
   their rank, while they stay under that micro-batch's K/V exchange and fit the cap and memory (a chain's chunks
   otherwise exchange with nothing else to do);
5. refine (pp = 1), on the two best layouts of the best degree (and its best that shards other samples, when those
   two shard the same) and the best of the next two degrees: each replica keeps the fastest of its balanced
   micro-batches and dense ones (sharded samples first fit, spread, or first fit leaving room to hide the
   exchange; own samples where they lengthen a micro-batch least); fold each replica's regular micro-batches into
   its big and chain micro-batches (every piece to the host it lengthens least, own samples sharded where no rank
   has room), kept where faster; then on the slowest replica's busiest rank, shard its largest own sample, move an
   own sample to the fastest replica's idlest rank, or trade sharded samples between the slowest and the fastest
   replica (one moved, or two swapped); a move stays only if the slowest replica gets faster in the simulator;
6. (pp = 1) balance the refined layouts by moving whole micro-batches between replicas, which the simulator times
   alike in any replica: the slowest gives one to another replica, for one of its or for nothing, while that
   lowers the slowest (:func:`_swap_micro_batches`; chains' micro-batches stay). On 7B ChatQA2 at DP4·CP8 this
   takes the step with an 81K chain from 0.35 s between its lightest and slowest replica to 0.013 s;
7. (pp = 1, the chosen layout) in up to ``ROUNDS`` rounds, while the slowest replica gets faster: repack each
   replica by moving single pieces between its micro-batches before its first chain piece, or trading one for a
   smaller piece, where the simulator says the two micro-batches take less time in sum (a share beside own work
   that hides its exchange, a half-empty micro-batch emptied into others' room; :func:`_repack`), and balance
   again; then trade a piece of the slowest replica for a slightly smaller one of its kind in another replica,
   where the simulator says the slowest gets faster and the other stays below it (the longer of two near-equal
   own samples onto a rank that waits anyway; :func:`_shift_pieces`), and balance again. On 7B ChatQA2 this
   takes 0.002-0.010 s off each step at DP4·CP8 (efficiency .9699 → .9705) and 0.001-0.007 s at DP32·CP8
   (.9701 → .9705).
8. (refine on, the chosen layout) empty micro-batches into the room beside chains' last pieces, or beside
   those and recomputed chunks, kept where the simulator says it is no slower (planners/beside.py).

Guarantees: coverage, the token cap on every rank of every micro-batch, chain order and contiguity, equal
micro-batch counts, determinism (every tie broken by position). The candidate (d = cp, configured k, K = 1,
α = ∞) — plain cost-balanced packing with memory-forced sharding — is always evaluated, so the result is never
slower in the simulator than that plan when it fits memory (a candidate over memory only wins if all are).

Cost: C candidates × (O(n log n + n·m + n·replicas) placement + O(pieces) simulation) + up to 5 × ``refine`` moves ×
O(pieces of two replicas) + balancing, O(m·M) per move for M micro-batches (a few ms a step); C ≤ |degrees| · 3 · 4 ·
6, fewer after removing candidates that give the same placement. Per 256-sample lmsys batch: 86 ms median before the
rounds of step 7 (bench/planning.py in a quiet hour; side by side, the memo of micro-batch times took it from 139 to
124 ms and balancing adds nothing measurable); 378 ms with them, measured on a slower machine where every other
planner took 1.3-2.5× its earlier time; 337 ms in docs/BENCHMARKS.md now, with ``mixed_groups`` (side by side on 30
batches: 319 ms median without, 390 ms with — its bound test on every step that shards, its search on a few). Those
rounds and trades add about half again on lmsys, for little there: on the first 30 batches of that benchmark in one
slow hour, median 201 ms with one pass of repacking and balancing (the code before them) against 309 ms now; in
another run turning :func:`_shift_pieces` off took the mean from 404 to 262 ms and the summed step time from 2.2540 to
2.2548 s (0.04%: many trades of about 1e-4 each). ChatQA2, whose long samples add degrees, takes about 6.4 s per
2,048-sample batch of 7B at DP32·CP8 (balancing 0.1 s of it; in the busier hour 10 s, and 15 s without the memo);
repacking and trading between replicas add about 2.5 s there (four batches one after the other in a busy hour: 89 s
without, 99-110 s with).
Options: ``degrees`` (comma-separated CP degrees to consider, default as above), ``splits`` (values of K), ``alphas``
(thresholds; ``inf`` for none, ``unit``, ``light``), ``refine`` (local-search moves, default 32 or one per replica,
whichever is more; 0 turns it off, with balancing, repacking and trading: half the planning time on lmsys batches,
for 0.04% of step time there and 1.0% on 7B ChatQA2 at DP4·CP8), ``trades`` (most trades of pieces between replicas,
per replica, in step 7; default 2; 0 turns them off: about a third less planning time on lmsys batches, for 0.04%
of step time there and 0.05% on 7B ChatQA2 at DP4·CP8), ``shard_chains`` (0: chains only at CP degree 1 — what
``longpack train`` sets, since the runtime runs chains at cp = 1 only), ``widen`` (1: CP groups wider than
``--cp`` too, as above; default 0), ``mixed_groups`` (default 1: then lay each step that shards a sample out again
on CP groups of several sizes — of ``degrees`` when given, else divisors of ``--cp`` unless widened — one
micro-batch per group, and keep that where the simulator says it is at least 3% faster — planners/groups.py; 0
keeps one degree a step. Such steps are held to the weaker bound of layouts on several degrees).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Piece, Plan, Step
from ..sim.bounds import min_ckpt
from ..sim.simulate import _with_cp, micro_batch_times, simulate_step
from .base import Batch, PlanContext, Planner, assemble_step, register
from .beside import fill_step
from .groups import regroup
from .packers import lpt

__all__ = ["Unified", "Candidate"]

UNIT = -1.0  # the sharding threshold at the step's longest unit (``alphas=unit``), not a multiple of τ
LIGHT = -2.0  # the same, less the lightest replica's shared work (``alphas=light``)
ALPHAS = (math.inf, 2.0, 1.0, 0.5, UNIT, LIGHT)
SWAPS = 4  # most micro-batch moves between replicas per micro-batch of the step (_swap_micro_batches)
PASSES = 8  # most passes of _repack over a replica's micro-batches
ROUNDS = 3  # most rounds of repacking and trading (Layout.step)
SHIFTS = 2  # most trades of pieces between replicas, per replica (_shift_pieces)
NEAREST = 8  # the smaller pieces of its kind, nearest in size, a piece may trade with (_shift_pieces)
TRADES = 1  # smaller pieces _repack tries to trade a piece for, per micro-batch (more found nothing more on ChatQA2)
ARRAY_REPLICAS = 12  # the deals price all replicas in one numpy call from this many on; below, numpy's per-call cost
# loses to a plain loop (measured: 43 against 21 µs a sample at 4 replicas, 47 against 422 µs at 128)


class Candidate(NamedTuple):
    degree: int
    ckpt: int
    split: int
    alpha: float
    tail: bool = False  # big samples as two-piece chains (small recomputed head, kept tail) instead of ckpt


@register
class Unified(Planner):
    """One cost-driven search over CP degree, checkpointing, micro-batch budget and sharding (module docstring)."""

    name = "unified"
    options = ("alphas", "degrees", "refine", "splits", "trades", "mixed_groups", "shard_chains", "widen")

    def plan_batch(self, batch: Batch, ctx: PlanContext) -> Step:
        lengths = {int(s): int(n) for s, n in zip(batch.samples.tolist(), batch.lengths.tolist(), strict=True)}
        seen: set[tuple] = set()
        timers: dict[int, _Timer] = {}  # per degree: memoised micro-batch times, shared by its candidates
        # per degree: the best two layouts, and the best whose sharded samples differ from the best one's (the
        # greedy's times of different shardings can be close while refine moves them far apart)
        per_degree: dict[int, list[tuple[tuple[bool, float, int], _Layout]]] = {}
        for c in self.candidates(batch, ctx):
            if c.degree not in timers:
                timers[c.degree] = _Timer(c.degree, _with_cp(ctx.cost, c.degree, ctx.world // c.degree)
                                          if c.degree != ctx.cp else ctx.cost)
            timer = timers[c.degree]
            layout = self._build(batch, ctx, timer, c, seen)
            if layout is None:  # infeasible, or the same placement as an earlier candidate
                continue
            key = (*self._score(layout, lengths, ctx), len(seen))
            kept = per_degree.setdefault(c.degree, [])
            kept.append((key, layout))
            kept.sort(key=lambda kv: kv[0])
            other = next((kv for kv in kept[2:] if kv[1].sharding != kept[0][1].sharding), None)
            del kept[2:]
            if other is not None and all(kv[1].sharding == kept[0][1].sharding for kv in kept[1:]):
                kept.append(other)
        if not per_degree:
            raise ValueError(f"global batch {batch.index}: no CP degree in --opt degrees fits its samples")
        # local search on the best layouts of the best degrees (pp = 1: replica times add up), then the fastest:
        # the two best of the best degree, and the best of the next two
        given = _count(ctx, "refine", "32")  # default: 32 moves, or one per replica when there are more
        ranked = sorted(per_degree.values(), key=lambda kept: kept[0][0])
        finalists = ranked[0] + [kept[0] for kept in ranked[1:3]]
        best: tuple[tuple[bool, float, int], _Layout] | None = None
        for key, layout in finalists:
            moves = given if given is not None else max(32, len(layout.own))
            if moves and layout.cost.cfg.pp == 1 and not key[0]:
                layout.refine(moves)
                key = (*self._score(layout, lengths, ctx), key[2])
            if best is None or key < best[0]:
                best = (key, layout)
        assert best is not None
        best[1].repack = best[1].balance  # the chosen layout only: finalists are compared without it (planning time)
        trades = _count(ctx, "trades", str(SHIFTS))
        best[1].shifts = SHIFTS if trades is None else trades
        step = self._fill(best[1], lengths, ctx) if given != 0 else best[1].step()  # refine=0: no local search
        if _flag(ctx.option("mixed_groups", True)):  # sizes of --opt degrees, else divisors of --cp unless widened
            sizes = _numbers(ctx, "degrees", int, "8,4,2,1", "integers") or (
                None if _flag(ctx.option("widen", False)) else _divisors(ctx.cp))
            step = regroup(step, lengths, ctx.cost, self.name, sizes)
        return step

    def _score(self, layout: _Layout, lengths: dict[int, int], ctx: PlanContext, step: Step | None = None
               ) -> tuple[bool, float]:
        """(over memory, simulated step time) of a layout (or ``step``, laid out at its degree)."""
        step = step or layout.step()
        plan = Plan(planner=self.name, world=ctx.world, lengths=lengths, steps=(step,))
        rep = simulate_step(0, step, plan, layout.cost, bound=False, times=layout.timer)
        return rep.oom, rep.time_s

    def _fill(self, layout: _Layout, lengths: dict[int, int], ctx: PlanContext) -> Step:
        """The layout's step with chain-free micro-batches emptied into the room beside chains' last pieces, or
        beside those and recomputed chunks (planners/beside.py): the fastest of the three in the simulator (ties:
        the fewer micro-batches; a recomputed chunk runs what joins it twice)."""
        step = layout.step()
        filled = [f for f in (fill_step(step, layout.cost, lengths.__getitem__, recomputed=r) for r in (False, True))
                  if f.replicas != step.replicas]
        if not filled:
            return step
        if len(filled) == 2 and filled[0].replicas == filled[1].replicas:
            filled = filled[1:]
        best = (self._score(layout, lengths, ctx, step), 0, step)
        for n, f in enumerate(filled, start=1):
            best = min(best, (self._score(layout, lengths, ctx, f), -n, f), key=lambda t: t[:2])
        return best[2]

    # --- the search space -------------------------------------------------------------------------------------
    def candidates(self, batch: Batch, ctx: PlanContext) -> list[Candidate]:
        cost = ctx.cost
        world = ctx.world
        degrees = _numbers(ctx, "degrees", int, "8,4,2,1", "integers") or self._degrees(batch, ctx)
        for d in degrees:
            if d < 1 or world % d:
                raise ValueError(f"--opt degrees: {d} must divide the world size {world} (--dp x --cp)")
        splits = _numbers(ctx, "splits", int, "1,2,4", "integers") or ([1, 2, 4, 8] if cost.cfg.pp > 1 else [1, 2, 4])
        alphas = (_numbers(ctx, "alphas", _alpha, "inf,1,0.5,unit", "positive numbers, inf, unit or light")
                  or list(ALPHAS))
        longest = float(batch.lengths.max())
        k0 = ctx.ckpt_layers
        out = []
        for d in degrees:
            ckpts = [k0]
            k = int(min_ckpt(np.array([-(-longest // d)]), cost)[0])  # the longest sharded whole, no chain
            if k > k0:
                ckpts.append(k)
            for k in ckpts:
                # With one pipeline stage a smaller budget only adds micro-batches, unless chains need room for K.
                chains = longest > cost.token_cap(k) * d
                for split in (splits if cost.cfg.pp > 1 or chains else splits[:1]):
                    out += [Candidate(d, k, split, a) for a in (alphas if d > 1 else alphas[:1])]
                    twin = k > k0 or (chains and split == splits[0])
                    if twin and (d == 1 or _flag(ctx.option("shard_chains", True))):
                        out += [Candidate(d, k, split, a, True) for a in (alphas if d > 1 else alphas[:1])]
        return out

    @staticmethod
    def _degrees(batch: Batch, ctx: PlanContext) -> list[int]:
        """Divisors of --cp, the CP groups the user asked for. With ``--opt widen=1`` also larger groups (2·cp,
        4·cp, ... dividing the world) while the longest sample's share and exchange at the previous degree still
        exceed a quarter of the mean rank load (a wider group then shortens the longest unit, or lets its exchange
        hide under the other ranks' work)."""
        cp, world, cost = ctx.cp, ctx.world, ctx.cost
        out = _divisors(cp)
        if not _flag(ctx.option("widen", False)):
            return out
        s = batch.lengths.astype(np.float64)
        t_loc, _ = _times(s, cost, 1, ctx.ckpt_layers)
        tau = float(t_loc.sum()) / world
        d = cp
        while 2 * d <= world and world % (2 * d) == 0:
            _, t_sh = _times(np.array([s.max()]), cost, d, ctx.ckpt_layers)
            if float(t_sh[0]) + ctx.cost.cp_comm_s(float(s.max())) <= tau / 4:
                break
            d *= 2
            out.insert(0, d)
        return out

    # --- one candidate ----------------------------------------------------------------------------------------
    def _build(self, batch: Batch, ctx: PlanContext, timer: _Timer, c: Candidate, seen: set[tuple]
               ) -> _Layout | None:
        cost = timer.cost
        d, k0, kb = c.degree, ctx.ckpt_layers, c.ckpt
        cap = cost.token_cap(k0)
        budget = cap // c.split
        if budget < 1:
            return None
        limit = batch.split_len or np.iinfo(np.int64).max
        whole_len = min(budget * d, limit)
        big_len = min(cost.token_cap(kb) * d, limit) if kb > k0 else whole_len
        lengths, samples = batch.lengths, batch.samples
        s = lengths.astype(np.float64)
        # big: too long for the normal micro-batches but whole-sharded in their own, with kb checkpointed layers
        is_big = (lengths > whole_len) & (lengths <= big_len)
        is_chain = lengths > max(whole_len, big_len)
        if d > 1 and is_chain.any() and not _flag(ctx.option("shard_chains", True)):
            return None
        t_loc, t_sh = _times(s, cost, d, k0)
        fits_rank = (lengths <= budget) & ~is_chain & ~is_big
        tau = float(t_loc[fits_rank].sum() + t_sh[~fits_rank].sum() * d) / ctx.world
        sharded = ~fits_rank & ~is_chain & ~is_big
        if d > 1 and c.alpha in (UNIT, LIGHT):
            # keep whole every sample that ends before the step's longest unit (the largest, over samples, of the
            # shorter of whole on a rank, where it fits, and its share plus its own exchange), shard the rest
            t_unit = t_sh + cost.cp_comm_s(s, k0)
            unit = float(np.max(np.where(fits_rank, np.minimum(t_loc, t_unit), t_unit)))
            sharded |= fits_rank & (t_loc > unit)
        elif d > 1 and math.isfinite(c.alpha) and c.alpha > 0:
            sharded |= fits_rank & (t_loc > c.alpha * tau)
        local = fits_rank & ~sharded
        if d == 1:
            local, sharded = local | sharded, np.zeros_like(sharded)
        placement_key = (d, kb if is_big.any() else k0, c.tail and bool(is_big.any() or is_chain.any()), budget,
                         tuple(np.flatnonzero(sharded).tolist()), whole_len, c.alpha == LIGHT)
        if placement_key in seen:
            return None
        seen.add(placement_key)
        n_rep = ctx.world // d
        built = self._tail(batch, cost, c, k0, budget, limit, is_big, is_chain, n_rep)
        if built is None:
            return None
        tail, rep_load, ckpt_big = built
        # A replica's ranks each take max(comm, own work) + shared work (Eq. 2): local work up to the K/V
        # exchange time is free, so both greedy passes below price a placement by that, not by a plain sum.
        start = rep_load.copy()
        shared, comm = _deal_shared(_heaviest_first(t_sh, np.flatnonzero(sharded)), t_sh, s, rep_load, cost, k0)
        if d > 1 and c.alpha == LIGHT:
            # an own sample sits on top of its replica's shared work: shard also those that outlast the unit on
            # the lightest replica, and deal the shared samples again
            more = local & (t_loc > unit - float(rep_load.min()))
            if more.any():
                sharded, local, rep_load = sharded | more, local & ~more, start
                shared, comm = _deal_shared(_heaviest_first(t_sh, np.flatnonzero(sharded)), t_sh, s, rep_load,
                                            cost, k0)
        own = _deal_own(_heaviest_first(t_loc, np.flatnonzero(local)), t_loc, comm, rep_load, d)
        step_cap = cost.token_cap(kb) if ckpt_big else cap
        return _Layout(timer, k0, budget, step_cap, lengths, samples, t_loc, t_sh, shared, own, tail)

    def _tail(self, batch: Batch, cost: CostModel, c: Candidate, k0: int, budget: int, limit: int,
              is_big: np.ndarray, is_chain: np.ndarray, n_rep: int
              ) -> tuple[list[list[MicroBatch]], np.ndarray, bool] | None:
        """The micro-batches that follow a replica's packed ones: big samples (in checkpointed micro-batches of
        their own, or as two-piece tail chains), then chains, each dealt heaviest first to the least-loaded
        replica. Returns (per replica micro-batches, per replica estimated seconds, whether any micro-batch uses
        the big samples' checkpointing), or None when memory cannot hold a chain."""
        d, kb, cap = c.degree, c.ckpt, cost.token_cap(k0)
        lengths, samples = batch.lengths, batch.samples
        rank = None if d > 1 else 0
        rep_load = np.zeros(n_rep)
        tail: list[list[MicroBatch]] = [[] for _ in range(n_rep)]
        units: list[list[MicroBatch]] = []  # one list of micro-batches per big sample or chain, dealt below
        est: list[float] = []
        big_pos = np.flatnonzero(is_big)
        ckpt_big = bool(big_pos.size) and not c.tail
        if big_pos.size and c.tail:
            # two-piece chains at the normal checkpointing: the head, what a rank cannot hold, is recomputed
            for i in big_pos.tolist():
                n, sample = int(lengths[i]), int(samples[i])
                head = max(0, n - d * _tail_tokens(cost, -(-n // d), k0, cap))
                cuts = [0, head, n] if head else [0, n]
                units.append(_pieces(sample, cuts, rank, k0))
                est.append(_pieces_s(cuts, d, 1, cost, k0) + cost.cp_comm_s(float(n), k0)
                           + cost.cp_comm_s(float(head), k0, True) - cost.cp_comm_s(float(head), k0))
        elif big_pos.size:
            _, t_big = _times(lengths[big_pos].astype(np.float64), cost, d, kb)
            big_est = t_big + np.array([cost.cp_comm_s(float(n), kb) for n in lengths[big_pos].tolist()])
            for g, members in enumerate(lpt(big_est, n_rep)):  # nothing hides their exchange
                tail[g].extend(_big_micro_batches(big_pos[np.asarray(members, dtype=np.int64)], lengths, samples,
                                                  cost.token_cap(kb), d, kb))
                rep_load[g] += float(big_est[members].sum()) if members else 0.0
        first_chain = len(units)
        for i in np.flatnonzero(is_chain).tolist():
            n, sample = int(lengths[i]), int(samples[i])
            if c.tail:
                # memory-sized: pieces as long as memory allows beside the K/V store of what came before, the
                # last kept, the rest recomputed
                sized = _memory_chain(n, d, cost, k0, budget, limit)
                if sized is None:
                    return None
                units.append(_pieces(sample, sized, rank, k0))
                est.append(_pieces_s(sized, d, 1, cost, k0))
            else:
                chunk = min(budget * d, limit)
                # keep as many chunks' activations as the cap holds (more than K when --max-len made them small)
                kept = max(c.split, cap // -(-chunk // d))
                cuts, t_chain = _chain_cuts(n, chunk, d, kept, cost, k0)
                units.append(_pieces(sample, cuts, rank, k0, kept))
                est.append(t_chain)
        for lo, hi in ((0, first_chain), (first_chain, len(units))):  # big samples first, then chains
            for g, members in enumerate(lpt(est[lo:hi], n_rep)):
                for m in members:
                    tail[g].extend(units[lo + m])
                    rep_load[g] += est[lo + m]
        return tail, rep_load, ckpt_big


class _Timer:
    """The simulator's :func:`micro_batch_times` at CP degree ``d``, memoised for one planning call: the scorer,
    the dense packings and refine time the same micro-batches again and again (on a 2,048-sample 7B ChatQA2
    batch at DP32·CP8, 46 thousand distinct micro-batches among 130 thousand calls). Keys are the micro-batches
    themselves (frozen, hashed by value); the six per-rank arrays are kept as one read-only block, whose rows are
    returned (callers share them). Memory: O(distinct micro-batches · d), dropped with the planning call (on that
    batch, tracemalloc's peak while planning goes from 13 to 42 MiB; a tuple of six arrays per entry took 70)."""

    def __init__(self, d: int, cost: CostModel) -> None:
        self.d, self.cost = d, cost
        self._memo: dict[MicroBatch, np.ndarray] = {}

    def __call__(self, mb: MicroBatch) -> tuple[np.ndarray, ...]:
        hit = self._memo.get(mb)
        if hit is None:
            hit = np.stack(micro_batch_times(mb, self.d, self.cost))
            hit.flags.writeable = False
            self._memo[mb] = hit
        return tuple(hit)

    def seconds(self, mb: MicroBatch) -> float:
        """The micro-batch's simulated time: its slowest rank's (0 when empty)."""
        return float(self(mb)[0].max()) if mb.pieces else 0.0


@dataclass
class _Host:
    """A tail micro-batch that takes guests: its index in the tail, the guests' cost factor, per rank own work,
    token room, held tokens and K/V prefix, and its shares' time, exchange and sharded tokens."""

    index: int
    mb: MicroBatch
    scale: float
    load: np.ndarray
    dist: float
    comm: float
    sharded: float
    room: np.ndarray
    base: np.ndarray
    prefix: np.ndarray
    chain: int | None  # the chain sample whose chunk this is
    keeps: bool  # a chunk whose activations stay until the chain's last: its guests' stay too


class _Layout:
    """One candidate's placement: per replica its sharded samples, each rank's own samples, and the big
    micro-batches and chains that follow; micro-batches are built per replica on demand (and rebuilt by refine)."""

    def __init__(self, timer: _Timer, ckpt: int, budget: int, cap: int, lengths: np.ndarray,
                 samples: np.ndarray, t_loc: np.ndarray, t_sh: np.ndarray, shared: list[list[int]],
                 own: list[list[list[int]]], tail: list[list[MicroBatch]]) -> None:
        self.timer, self.cost, self.d = timer, timer.cost, timer.d
        self.ckpt, self.budget, self.cap = ckpt, budget, cap
        self.lengths, self.samples, self.t_loc, self.t_sh = lengths, samples, t_loc, t_sh
        self.shared, self.own, self.tail = shared, own, tail
        self._mbs: dict[int, list[MicroBatch]] = {}
        self.fold: set[int] = set()  # replicas whose regular micro-batches fold into their tail (refine)
        self.balance = False  # swap whole micro-batches between replicas in step() (refine: the finalists)
        self.repack = False  # then move single pieces within each replica, and swap again (the chosen layout)
        self.shifts = SHIFTS  # and trade pieces between replicas, at most this many per replica (0: none)
        self.dense = False  # also try dense packings per replica (refine: the finalists only, for planning time)
        self.sharding = frozenset(i for g in shared for i in g)  # the samples it shards, as built
        self._where: dict[int, int] | None = None  # sample id -> position in the batch (built on first use)
        self.hiding = _hiding_tokens(self.cost, budget, self.d, ckpt)  # the dense packing's reserve (one per layout)

    def replica(self, g: int) -> list[MicroBatch]:
        if g not in self._mbs:
            args = (self.shared[g], self.own[g], self.lengths, self.samples, self.t_loc, self.t_sh, self.budget,
                    self.d, self.ckpt, self.cost)
            regular = _micro_batches(*args)
            if self.dense and self.d > 1 and self.cost.cfg.pp == 1 and self.shared[g]:
                # one pipeline stage: micro-batch times add up, so dense packing may beat balanced micro-batches
                # (refine turns this on for the finalists: four packings per replica cost planning time)
                best = _total_s(regular, self.timer)
                for spread, reserve in ((False, 0), (True, 0), (False, self.hiding)):
                    other = _dense_micro_batches(*args, spread=spread, reserve=reserve)
                    t = _total_s(other, self.timer)
                    if t < best * (1 - 1e-9):
                        regular, best = other, t
            self._mbs[g] = self._hide_under_tail(regular, self.tail[g], g in self.fold)
        return self._mbs[g]

    def _hide_under_tail(self, regular: list[MicroBatch], tail: list[MicroBatch], fold: bool = False
                         ) -> list[MicroBatch]:
        """Move own samples from a replica's regular micro-batches into its big and chain micro-batches, on the
        same CP rank, while that rank's own work stays under the micro-batch's K/V exchange (free by Eq. 2) and
        within the token cap and memory (activations held for the chain and the K/V store of its prefix). Only
        micro-batches whose tokens no later one holds take guests: big ones (guests then pay the checkpointed
        layers' second forward), recomputed chunks (4/3 of their estimate) and a chain's last chunk. Empty
        regular micro-batches are dropped. Never slower by the estimate; O(pieces · tail).

        ``fold``: move every piece of the regular micro-batches instead, sharded ones too, each (sharded first,
        then heaviest first) to the host whose estimated time grows least, over its exchange if need be — a
        regular micro-batch emptied saves its whole time (refine keeps this only where the simulator says it is
        faster). O(pieces · tail)."""
        if self.d == 1 or not tail or not regular:
            return regular + tail
        cost = self.cost
        if self._where is None:
            self._where = {int(x): i for i, x in enumerate(self.samples.tolist())}
        where = self._where
        hosts = [h for h in self._hosts(tail, where) if fold or not h.keeps]
        moved: dict[int, set[int]] = {}  # regular micro-batch -> samples taken out of it
        extra: dict[int, list[Piece]] = {}  # tail micro-batch -> its guests
        if fold:
            self._fold(regular, hosts, where, moved, extra)
        else:
            guests = sorted(((float(self.t_loc[where[p.sample]]), p.stop - p.start, p, m)
                             for m, mb in enumerate(regular) for p in mb.pieces if p.cp_rank is not None),
                            key=lambda x: (-x[0], x[2].sample))
            for h in hosts:
                for t, n, p, m in guests:
                    j = p.cp_rank
                    if p.sample in moved.get(m, ()) or n > h.room[j] or h.load[j] + t * h.scale > 0.9 * h.comm:
                        continue
                    if cost.memory_bytes(h.base[j] + n, h.mb.ckpt_layers, h.prefix[j]) > cost.hw.memory_bytes:
                        continue
                    extra.setdefault(h.index, []).append(p)
                    moved.setdefault(m, set()).add(p.sample)
                    h.room[j] -= n
                    h.base[j] += n
                    h.load[j] += t * h.scale
        out_tail = [MicroBatch(pieces=mb.pieces + tuple(extra[x]), ckpt_layers=mb.ckpt_layers,
                               recompute=mb.recompute, pad_to=mb.pad_to) if x in extra else mb
                    for x, mb in enumerate(tail)]
        kept = []
        for m, mb in enumerate(regular):
            gone = moved.get(m)
            pieces = tuple(p for p in mb.pieces if not gone or p.sample not in gone)
            if pieces:
                kept.append(mb if len(pieces) == len(mb.pieces) else
                            MicroBatch(pieces=pieces, ckpt_layers=mb.ckpt_layers, recompute=mb.recompute,
                                       pad_to=mb.pad_to))
        return kept + out_tail

    def _hosts(self, tail: list[MicroBatch], where: dict[int, int]) -> list[_Host]:
        """The tail micro-batches with their state: those that may take guests (see :meth:`_hide_under_tail`)
        and the chunks a chain keeps (``keeps``: a guest's activations then stay until the chain's last chunk,
        on top of every later chunk's, as the simulator charges them)."""
        d, cost = self.d, self.cost
        held: dict[int, np.ndarray] = {}  # chain sample -> tokens per rank its kept chunks hold
        hosts = []
        for x, mb in enumerate(tail):
            _, local, dist, comm, tokens, prefix = self.timer(mb)
            first = mb.pieces[0]
            full = int(self.lengths[where[first.sample]])
            chain = first if len(mb.pieces) == 1 and (first.start > 0 or first.stop < full) else None
            last = chain is not None and chain.stop == full
            base = tokens + held.get(chain.sample, 0.0) if chain is not None else tokens.copy()
            keeps = chain is not None and not mb.recompute and not last
            if chain is not None and keeps:
                held[chain.sample] = held.get(chain.sample, np.zeros(d)) + tokens
            # a guest pays what its host pays: the second forward of a recomputed chunk, checkpointed layers
            scale = (4 / 3 if mb.recompute else 1.0) * (1 + mb.ckpt_layers / (3 * cost.layers))
            sharded = float(_sharded_tokens(mb))
            hosts.append(_Host(x, mb, scale, local - cost.fixed_s, float(dist[0]), float(comm[0]), sharded,
                               self.cap - tokens, base, prefix, chain.sample if chain else None, keeps))
        return hosts

    def _fold(self, regular: list[MicroBatch], hosts: list[_Host], where: dict[int, int],
              moved: dict[int, set[int]], extra: dict[int, list[Piece]]) -> None:
        """Fold mode of :meth:`_hide_under_tail`: every piece of the regular micro-batches to the host whose
        estimated time (shares + max(exchange, busiest own work)) grows least, within the cap and memory."""
        d, cost = self.d, self.cost
        items = [(p.cp_rank is not None, -float(self.t_loc[where[p.sample]] if p.cp_rank is not None
                                                 else self.t_sh[where[p.sample]]), p.sample, m, p)
                 for m, mb in enumerate(regular) for p in mb.pieces]
        for _, _, _, m, p in sorted(items, key=lambda x: x[:3]):
            n, i = p.stop - p.start, where[p.sample]
            best: tuple[float, int, Piece, int, slice] | None = None
            # an own piece may also go sharded (into a host its rank has no room or memory in, or where that
            # grows the host less); ties: on its rank
            forms = [p] if p.cp_rank is None else [p, Piece(p.sample, p.start, p.stop, None)]
            for q in forms:
                w = -(-n // d) if q.cp_rank is None else n
                ranks = slice(None) if q.cp_rank is None else slice(q.cp_rank, q.cp_rank + 1)
                for x, h in enumerate(hosts):
                    if np.any(h.room[ranks] < w) or any(
                            np.any(cost.memory_bytes(y.base[ranks] + w, y.mb.ckpt_layers, y.prefix[ranks])
                                   > cost.hw.memory_bytes) for y in _carriers(hosts, x)):
                        continue
                    busiest = float(h.load.max())
                    before = h.dist + max(h.comm, busiest)
                    if q.cp_rank is None:
                        after = h.dist + float(self.t_sh[i]) * h.scale + max(
                            cost.cp_comm_s(h.sharded + n, h.mb.ckpt_layers, h.mb.recompute), busiest)
                    else:
                        after = h.dist + max(h.comm, busiest, float(h.load[q.cp_rank]) + float(self.t_loc[i]) * h.scale)
                    if best is None or after - before < best[0]:
                        best = (after - before, x, q, w, ranks)
            if best is None:
                continue
            _, x, q, w, ranks = best
            h = hosts[x]
            extra.setdefault(h.index, []).append(q)
            moved.setdefault(m, set()).add(q.sample)
            h.room[ranks] -= w
            for y in _carriers(hosts, x):
                y.base[ranks] += w
            if q.cp_rank is None:
                h.dist += float(self.t_sh[i]) * h.scale
                h.sharded += n
                h.comm = cost.cp_comm_s(h.sharded, h.mb.ckpt_layers, h.mb.recompute)
            else:
                h.load[q.cp_rank] += float(self.t_loc[i]) * h.scale

    def replica_s(self, g: int) -> float:
        """Simulated time of replica g (one pipeline stage): Σ over its micro-batches of the slowest rank."""
        return _total_s(self.replica(g), self.timer)

    def step(self) -> Step:
        reps = [self.replica(g) for g in range(len(self.own))]
        if self.balance:  # a few ms (the scorer and the final step ask for it: both get the same)
            full = dict(zip(self.samples.tolist(), self.lengths.tolist(), strict=True))
            reps = _swap_micro_batches(reps, self.timer, full)
            # each replica only gets faster, and swapping and trading only lower the slowest: never slower
            slowest = max(_total_s(r, self.timer) for r in reps)
            packed: dict[tuple[MicroBatch, ...], list[MicroBatch]] = {}  # a replica repacked, or left as it was

            def repack(mbs: list[MicroBatch]) -> list[MicroBatch]:
                key = tuple(mbs)
                if key not in packed:
                    out = _repack(mbs, self.timer, self.cap, full)
                    packed[key] = packed[tuple(out)] = out
                return packed[key]

            for _ in range(ROUNDS if self.repack else 0):
                reps = _swap_micro_batches([repack(r) for r in reps], self.timer, full)
                if self.shifts:
                    reps = _swap_micro_batches(_shift_pieces(reps, self.timer, self.cap, full, self.shifts),
                                               self.timer, full)
                before, slowest = slowest, max(_total_s(r, self.timer) for r in reps)
                if not slowest < before * (1 - 1e-9):
                    break
        return assemble_step(reps, cp=self.d, token_cap=self.cap)

    def refine(self, moves: int) -> None:
        """Local search on the simulated times, for what the greedy's estimates miss (own work that cannot share
        the exchange's micro-batch, micro-batches not aligned across ranks, a lone mid-size sample that leaves
        its CP peers idle). First, every replica keeps the fastest of its balanced and dense packings
        (:func:`_dense_micro_batches`, one pipeline stage), then, per replica with big or chain micro-batches,
        the fold of :meth:`_hide_under_tail`, kept where that replica gets faster. Then two moves, on the
        slowest replica's busiest rank, kept only if that replica gets faster (and, for the second, the
        receiving replica stays below the old time): shard its largest own sample over the replica's CP group;
        or move the own sample closest to half the gap to the fastest replica's idlest rank; then, if that move
        is not kept, :meth:`_trade_shared`. At most ``moves`` tries, each O(pieces of two replicas + sharded
        samples of two replicas squared). Last (one stage), :meth:`step` balances the replicas by moving whole
        micro-batches between them (:func:`_swap_micro_batches`)."""
        n_rep = len(self.own)
        self.dense = True  # each replica keeps the fastest of its packings (never slower than before)
        self.balance = self.cost.cfg.pp == 1  # then step() swaps micro-batches between replicas
        self._mbs.clear()
        times = [self.replica_s(g) for g in range(n_rep)]
        if self.d > 1:
            for g in range(n_rep):  # fold: empty the regular micro-batches into the tail where that is faster
                if self.tail[g] and len(self._mbs[g]) > len(self.tail[g]):
                    before = self._mbs.pop(g)
                    self.fold.add(g)
                    t = self.replica_s(g)
                    if t < times[g] * (1 - 1e-9):
                        times[g] = t
                    else:
                        self.fold.discard(g)
                        self._mbs[g] = before
        tried: set[tuple[str, int]] = set()
        for _ in range(moves):
            slow = max(range(n_rep), key=lambda g: (times[g], -g))
            fast = min(range(n_rep), key=lambda g: (times[g], g))
            loads = [float(self.t_loc[mine].sum()) if mine else 0.0 for mine in self.own[slow]]
            j = max(range(self.d), key=lambda x: (loads[x], -x))
            mine = self.own[slow][j]
            big = max((i for i in mine if ("shard", i) not in tried), key=lambda x: (self.t_loc[x], -x),
                      default=None)
            if self.d > 1 and big is not None:
                tried.add(("shard", big))
                mine.remove(big)
                self.shared[slow] = sorted(self.shared[slow] + [big], key=lambda x: (-float(self.t_sh[x]), x))
                self._mbs.pop(slow, None)
                t = self.replica_s(slow)
                if t < times[slow] * (1 - 1e-9):
                    times[slow] = t
                    continue
                self.shared[slow].remove(big)
                self.own[slow][j] = sorted(mine + [big], key=lambda x: (-float(self.t_loc[x]), x))
                self._mbs.pop(slow, None)
            gap = times[slow] - times[fast]
            if n_rep < 2 or gap <= 1e-3 * times[slow]:
                if big is None:
                    return
                continue
            pick = [i for i in self.own[slow][j] if ("move", i) not in tried and self.t_loc[i] < gap]
            if pick:
                i = min(pick, key=lambda x: (abs(float(self.t_loc[x]) - gap / 2), x))
                tried.add(("move", i))
                dest = [float(self.t_loc[m].sum()) if m else 0.0 for m in self.own[fast]]
                jj = min(range(self.d), key=lambda x: (dest[x], x))
                self._move(i, (slow, j), (fast, jj))
                new = (self.replica_s(slow), self.replica_s(fast))
                if max(new) < times[slow] * (1 - 1e-9):
                    times[slow], times[fast] = new
                    continue
                self._move(i, (fast, jj), (slow, j))
            traded = self._trade_shared(slow, fast, times, tried) if self.d > 1 else None
            if traded is None and not pick and big is None:
                return

    def _trade_shared(self, slow: int, fast: int, times: list[float], tried: set[tuple]) -> bool | None:
        """Refine's third move: a sharded sample of the slowest replica to the fastest, or swapped for a lighter
        one of it, whose estimated cost difference (share + marginal exchange) is closest to half the gap; kept if
        both replicas end below the old slowest time. None when no such trade is left to try."""
        cost, k = self.cost, self.ckpt
        gap = times[slow] - times[fast]
        c0 = float(cost.cp_comm_s(1e-9, k))

        def price(items: list[int]) -> np.ndarray:
            n = self.lengths[np.asarray(items, dtype=np.int64)].astype(np.float64)
            return self.t_sh[np.asarray(items, dtype=np.int64)] + np.asarray(cost.cp_comm_s(n, k)) - c0

        out, into = list(self.shared[slow]), list(self.shared[fast]) + [-1]  # -1: a plain move, nothing back
        if not out:
            return None
        back = np.append(price(into[:-1]) if len(into) > 1 else np.zeros(0), 0.0)
        diff = price(out)[:, None] - back[None, :]
        score = np.where((diff > 0) & (diff < gap), np.abs(diff - gap / 2), np.inf)
        for a, b in zip(*np.nonzero(np.isfinite(score)), strict=True):
            if ("trade", out[a], into[b]) in tried:
                score[a, b] = np.inf
        if not np.isfinite(score).any():
            return None
        a, b = np.unravel_index(int(np.argmin(score)), score.shape)
        i, j = out[a], into[b]
        tried.add(("trade", i, j))
        before = (list(self.shared[slow]), list(self.shared[fast]))

        def heavy_first(x: int) -> tuple[float, int]:
            return -float(self.t_sh[x]), x

        self.shared[slow] = sorted([x for x in out if x != i] + ([j] if j >= 0 else []), key=heavy_first)
        self.shared[fast] = sorted([x for x in into[:-1] if x != j] + [i], key=heavy_first)
        self._mbs.pop(slow, None)
        self._mbs.pop(fast, None)
        new = (self.replica_s(slow), self.replica_s(fast))
        if max(new) < times[slow] * (1 - 1e-9):
            times[slow], times[fast] = new
            return True
        self.shared[slow], self.shared[fast] = before
        self._mbs.pop(slow, None)
        self._mbs.pop(fast, None)
        return False

    def _move(self, i: int, src: tuple[int, int], dst: tuple[int, int]) -> None:
        self.own[src[0]][src[1]].remove(i)
        self.own[dst[0]][dst[1]] = sorted(self.own[dst[0]][dst[1]] + [i], key=lambda x: (-float(self.t_loc[x]), x))
        self._mbs.pop(src[0], None)
        self._mbs.pop(dst[0], None)


def _swap_micro_batches(reps: list[list[MicroBatch]], timer: _Timer, full: dict[int, int]
                        ) -> list[list[MicroBatch]]:
    """Balance the replicas of one pipeline stage by moving whole micro-batches: a replica's time is the sum of
    its micro-batches' and a micro-batch's time does not depend on its replica, so every move below is exact in
    the simulator. While one helps, the slowest replica gives one of its micro-batches to another replica, for
    one of that replica's or for nothing, the pair whose larger new time is least (ties: the first replica and
    micro-batches). A micro-batch holding a chain's piece stays (its chain's order, and the memory the chain
    holds); a moved one goes first in its new replica, where no chain holds memory yet, so no micro-batch's
    memory changes. Each move lowers the slowest replica and the sum of squared replica times, so it ends; at
    most ``SWAPS`` per micro-batch. Cost: O(m · M) per move (m: the slowest replica's micro-batches, M: all)."""
    reps = [list(r) for r in reps]
    times = [[timer.seconds(mb) for mb in r] for r in reps]
    movable = [[bool(mb.pieces) and not _holds_chunk(mb, full) for mb in r] for r in reps]
    total = np.array([sum(t) for t in times])
    for _ in range(SWAPS * sum(len(r) for r in reps)):
        slow = int(np.argmax(total))
        give = [x for x, ok in enumerate(movable[slow]) if ok]
        # every other replica's movable micro-batches, and nothing (-1), as candidates to give back
        back = [(g, x) for g in range(len(reps)) if g != slow for x in
                [*(x for x, ok in enumerate(movable[g]) if ok), -1]]
        if not give or not back:
            break
        t_give = np.array([times[slow][x] for x in give])
        t_back = np.array([times[g][x] if x >= 0 else 0.0 for g, x in back])
        dest = total[np.array([g for g, _ in back])]
        delta = t_give[:, None] - t_back[None, :]
        after = np.maximum(total[slow] - delta, dest[None, :] + delta)
        after = np.where((delta > 0) & (delta < (total[slow] - dest)[None, :]), after, np.inf)
        a, b = np.unravel_index(int(np.argmin(after)), after.shape)
        if not after[a, b] < total[slow] * (1 - 1e-9):
            break
        (g, x), y = back[b], give[a]
        mb, t = reps[slow].pop(y), times[slow].pop(y)
        movable[slow].pop(y)
        if x >= 0:
            reps[slow].insert(0, reps[g].pop(x))
            times[slow].insert(0, times[g].pop(x))
            movable[slow].insert(0, movable[g].pop(x))
        reps[g].insert(0, mb)
        times[g].insert(0, t)
        movable[g].insert(0, True)
        total[slow] -= float(delta[a, b])
        total[g] += float(delta[a, b])
    return reps


def _fits(mb: MicroBatch, timer: _Timer, cap: int) -> bool:
    """Whether a micro-batch that no chain holds memory in fits the token cap and memory on every rank."""
    t = timer(mb)
    return bool(np.all(t[4] <= cap)) and bool(np.all(
        np.asarray(timer.cost.memory_bytes(t[4], mb.ckpt_layers, t[5])) <= timer.cost.hw.memory_bytes))


def _free(mbs: list[MicroBatch], full: dict[int, int]) -> int:
    """How many of a replica's first micro-batches precede its first chain piece (no chain holds memory there)."""
    return next((x for x, mb in enumerate(mbs) if _holds_chunk(mb, full)), len(mbs))


def _shift_pieces(reps: list[list[MicroBatch]], timer: _Timer, cap: int, full: dict[int, int],
                  shifts: int = SHIFTS) -> list[list[MicroBatch]]:
    """Lower the slowest replica by trading one of its pieces for a slightly smaller piece of its kind (sharded
    or own, on each other's rank) in another replica: the ``NEAREST`` smaller ones in the step. Besides
    balancing finer than whole micro-batches, this saves work no replica can alone: the longer of two
    near-equal own samples onto a rank that waits for another rank of its micro-batch anyway.

    Only micro-batches before a replica's first chain piece trade (no chain holds memory there, so the cap and
    each micro-batch's own memory are all a trade must respect), neither recomputed nor padded ones. Each trade
    is first estimated by Eq. 2 from the memoised times of the receiving micro-batch (what the piece adds, read
    off its own micro-batch, less about the traded piece's share of it, on that piece's rank, or on every rank
    with the grown exchange); only trades whose estimate beats the best so far are simulated, the receiver first
    (the sender's side is timed only if the receiver's beats the best), and none once the sender without the piece
    (a floor: a micro-batch never gets faster as it grows) reaches the best (28% fewer micro-batches timed on
    256-sample lmsys batches, plans byte-identical on eight qwen cells of the quality matrix). A trade is kept
    only if the simulator says both replicas end below the old slowest time, so the slowest replica falls and
    the loop ends; at most ``shifts`` trades per replica (``SHIFTS``, or ``--opt trades``). Cost per trade:
    O(pieces of the step) to index them by size, then O(P · NEAREST) estimates for P pieces of the slowest
    replica, and a few simulated micro-batches (about 1.5 s a 2,048-sample 7B ChatQA2 batch at DP32·CP8, in a busy
    hour; on 256-sample lmsys batches at DP4·CP8 about a third of the planning time)."""
    reps = [list(r) for r in reps]
    sec = [[timer.seconds(mb) for mb in r] for r in reps]
    total = np.array([sum(t) for t in sec])
    # the micro-batches that may trade (a trade keeps every micro-batch's pieces non-empty: this never changes)
    free = [[x for x, mb in enumerate(r[:_free(r, full)]) if mb.pieces and not (mb.recompute or mb.pad_to)]
            for r in reps]
    for _ in range(shifts * len(reps)):
        slow = int(np.argmax(total))
        index, sizes = _trade_index(reps, free, slow)
        best: tuple[float, int, int, int, MicroBatch, MicroBatch] | None = None
        for a in free[slow]:
            src = reps[slow][a]
            before = timer(src)
            for x, p in enumerate(src.pieces):
                if p.cp_rank is not None and before[0][p.cp_rank] < before[0].max():
                    continue  # its rank waits for another: taking it out cannot shorten the micro-batch
                rest = replace(src, pieces=src.pieces[:x] + src.pieces[x + 1:])
                t_rest = timer.seconds(rest)
                if t_rest >= sec[slow][a]:
                    continue
                # the sender ends at least here whatever it gets back (a micro-batch's time never falls as it grows)
                floor_a = total[slow] - sec[slow][a] + t_rest
                after_src = timer(rest)
                added = float(before[1][p.cp_rank] - after_src[1][p.cp_rank]) if p.cp_rank is not None else \
                    float(before[2][0] - after_src[2][0])
                kind = p.cp_rank is None
                stop = int(np.searchsorted(sizes[kind], p.tokens, side="left"))
                for _, g, b, q in index[kind][max(0, stop - NEAREST):stop]:
                    dst = reps[g][b]
                    if dst.ckpt_layers != src.ckpt_layers:
                        continue
                    bar = total[slow] * (1 - 1e-9) if best is None else best[0]
                    if floor_a >= bar:
                        break
                    est = _trade_estimate(dst, p, q, added, timer, cap)
                    if est is None or total[g] - sec[g][b] + est >= bar:
                        continue
                    new_b = replace(dst, pieces=tuple(y for y in dst.pieces if y != q)
                                    + (Piece(p.sample, p.start, p.stop, q.cp_rank),))
                    side_b = total[g] - sec[g][b] + timer.seconds(new_b)
                    if side_b >= bar:  # the receiver alone ends no faster: no need to time the sender's side
                        continue
                    new_a = replace(rest, pieces=rest.pieces + (Piece(q.sample, q.start, q.stop, p.cp_rank),))
                    after = max(total[slow] - sec[slow][a] + timer.seconds(new_a), side_b)
                    if after < bar and _fits(new_b, timer, cap) and _fits(new_a, timer, cap):
                        best = (after, a, g, b, new_a, new_b)
        if best is None:
            break
        _, a, g, b, new_a, new_b = best
        reps[slow][a], sec[slow][a] = new_a, timer.seconds(new_a)
        reps[g][b], sec[g][b] = new_b, timer.seconds(new_b)
        total[slow], total[g] = sum(sec[slow]), sum(sec[g])
    return reps


def _trade_index(reps: list[list[MicroBatch]], free: list[list[int]], slow: int
                 ) -> tuple[dict[bool, list[tuple[int, int, int, Piece]]], dict[bool, np.ndarray]]:
    """The pieces the slowest replica may trade with, by kind (sharded or not): (tokens, replica, micro-batch,
    piece) sorted by tokens, and the sorted token counts for bisection. O(pieces · log pieces)."""
    index: dict[bool, list[tuple[int, int, int, Piece]]] = {True: [], False: []}
    for g, r in enumerate(reps):
        if g != slow:
            for b in free[g]:
                for q in r[b].pieces:
                    index[q.cp_rank is None].append((q.tokens, g, b, q))
    for entries in index.values():
        entries.sort(key=lambda e: e[0])
    return index, {kind: np.array([e[0] for e in entries]) for kind, entries in index.items()}


def _trade_estimate(dst: MicroBatch, p: Piece, q: Piece, added: float, timer: _Timer, cap: int) -> float | None:
    """Eq. 2 estimate of micro-batch ``dst``'s time with piece p in place of its piece q (p on q's rank, or
    sharded like it), or None when p does not fit the cap there. ``added``: what p adds, read off its own
    micro-batch (own work on its rank, or every rank's share); q gives back about its part of that, in
    proportion to the tokens each puts on a rank (work per token grows with length, so q gives back no more).
    Used by :func:`_shift_pieces` and :func:`_repack_into`. O(d)."""
    d, cost, fixed = timer.d, timer.cost, timer.cost.fixed_s
    rank_s, local, dist, comm, tokens, _ = timer(dst)
    room = cap - tokens
    w_p, w_q = _width(p, d), _width(q, d)
    more = added * (1 - w_q / w_p)
    if p.cp_rank is None:
        if np.any(room + w_q < w_p):
            return None
        grown = cost.cp_comm_s(_sharded_tokens(dst) + p.tokens - q.tokens, dst.ckpt_layers, dst.recompute)
        return float(np.max(np.maximum(grown, local - fixed) + dist + more)) + fixed
    j = int(q.cp_rank or 0)
    if room[j] + w_q < w_p:
        return None
    return max(float(rank_s.max()), float(max(comm[0], local[j] - fixed + more) + dist[j]) + fixed)


def _repack(mbs: list[MicroBatch], timer: _Timer, cap: int, full: dict[int, int]) -> list[MicroBatch]:
    """Lower one replica's simulated time (one pipeline stage) by moving single pieces between its micro-batches:
    what the packings leave behind, such as a share in a micro-batch whose exchange nothing hides while an own-heavy
    one has room for it beside work that would, or a half-empty micro-batch whose pieces fit elsewhere.

    First improvement, in passes over the micro-batches and their pieces, while one helps (at most ``PASSES``): a
    piece that can shorten its micro-batch (a sharded one, or an own one on a rank whose time is the micro-batch's)
    moves to another micro-batch with the same checkpointing where it fits the cap and memory (an own piece to the
    rank of least own work among those with room), or trades places with a smaller piece of its kind there
    (sharded or own, on each other's rank; the ``TRADES`` smallest that make it fit). A change is kept only if the
    two micro-batches' simulated times fall in sum, so the replica gets faster and the loop ends; a micro-batch
    emptied is dropped. Only the micro-batches before the replica's first chain piece are repacked (a chain holds
    memory from its first chunk on), and none where one of those is recomputed or padded. Cost: O(P · M) micro-batch
    timings per pass for P pieces that can shorten theirs and M micro-batches, fewer where an estimate says the
    change cannot pay (Eq. 2 with what the piece adds, read off its own micro-batch; a change it rejects is not
    simulated, so a rare helpful one may be missed, never a harmful one kept)."""
    mbs = [mb for mb in mbs if mb.pieces]
    first = _free(mbs, full)
    if first < len(mbs):  # chains hold memory from their first chunk on: repack only the micro-batches before it
        return _repack(mbs[:first], timer, cap, full) + mbs[first:]
    if len(mbs) < 2 or any(mb.recompute or mb.pad_to for mb in mbs):
        return mbs
    sec = [timer.seconds(mb) for mb in mbs]
    for _ in range(PASSES):
        improved = False
        a = 0
        while a < len(mbs):
            x = 0
            while x < len(mbs[a].pieces):
                src = mbs[a]
                p = src.pieces[x]
                rank_s = timer(src)[0]
                if p.cp_rank is not None and rank_s[p.cp_rank] < rank_s.max():
                    x += 1  # its rank waits for another: taking it out cannot shorten the micro-batch
                    continue
                rest = replace(src, pieces=src.pieces[:x] + src.pieces[x + 1:])
                t_rest = timer.seconds(rest)
                if t_rest >= sec[a]:
                    x += 1
                    continue
                found = _repack_into(mbs, sec, a, p, rest, t_rest, timer, cap)
                if found is None:
                    x += 1
                    continue
                b, new_a, new_b = found
                mbs[a], mbs[b] = new_a, new_b
                sec[a], sec[b] = timer.seconds(new_a), timer.seconds(new_b)
                improved = True
                if not new_a.pieces:
                    del mbs[a], sec[a]
                    break
            else:
                a += 1
        if not improved:
            break
    return mbs


def _repack_into(mbs: list[MicroBatch], sec: list[float], a: int, p: Piece, rest: MicroBatch, t_rest: float,
                 timer: _Timer, cap: int) -> tuple[int, MicroBatch, MicroBatch] | None:
    """The first micro-batch b that takes piece p of micro-batch a (moved, or traded for a smaller piece) with
    less time in sum: (b, new a, new b), or None (:func:`_repack`)."""
    d = timer.d
    w = _width(p, d)
    fixed = timer.cost.fixed_s
    # what p adds where it goes, read off its own micro-batch: own work on its rank, or every rank's share of it
    before, after = timer(mbs[a]), timer(rest)
    added = float(before[1][p.cp_rank] - after[1][p.cp_rank]) if p.cp_rank is not None else \
        float(before[2][0] - after[2][0])
    n = p.tokens
    for b, dst in enumerate(mbs):
        if b == a or dst.ckpt_layers != mbs[a].ckpt_layers:
            continue
        rank_s, local, dist, comm, tokens, _ = timer(dst)
        room = cap - tokens
        if p.cp_rank is None:
            moved = p if np.all(room >= w) else None
            # estimate by Eq. 2 with the grown exchange and every rank's share; a move it says cannot pay is skipped
            sharded = timer.cost.cp_comm_s(_sharded_tokens(dst) + n, dst.ckpt_layers, dst.recompute)
            guess = float(np.max(np.maximum(sharded, local - fixed) + dist + added)) + fixed
        else:
            ok = np.flatnonzero(room >= w)
            j = int(ok[np.argmin(local[ok])]) if ok.size else -1
            moved = Piece(p.sample, p.start, p.stop, j) if ok.size else None
            guess = max(float(rank_s.max()), float(max(comm[0], local[j] - fixed + added) + dist[j]) + fixed)
        if moved is not None and t_rest + guess < sec[a] + sec[b] - 1e-12:
            new_b = replace(dst, pieces=dst.pieces + (moved,))
            if t_rest + timer.seconds(new_b) < sec[a] + sec[b] - 1e-12 and _fits(new_b, timer, cap):
                return b, rest, new_b
        trades = sorted((_width(q, d), y) for y, q in enumerate(dst.pieces)
                        if (q.cp_rank is None) == (p.cp_rank is None) and _width(q, d) < w
                        and _width(q, d) >= w - (room.min() if p.cp_rank is None else room[q.cp_rank]))
        for _, y in trades[:TRADES]:
            q = dst.pieces[y]
            est = _trade_estimate(dst, p, q, added, timer, cap)
            if est is None or t_rest + est >= sec[a] + sec[b] - 1e-12:
                continue
            new_b = replace(dst, pieces=dst.pieces[:y] + dst.pieces[y + 1:]
                            + (Piece(p.sample, p.start, p.stop, q.cp_rank),))
            t_b = timer.seconds(new_b)
            if t_rest + t_b >= sec[a] + sec[b] - 1e-12:  # a gets q back: no faster than without it
                continue
            new_a = replace(rest, pieces=rest.pieces + (Piece(q.sample, q.start, q.stop, p.cp_rank),))
            if timer.seconds(new_a) + t_b < sec[a] + sec[b] - 1e-12 and _fits(new_a, timer, cap) and \
                    _fits(new_b, timer, cap):
                return b, new_a, new_b
    return None


def _holds_chunk(mb: MicroBatch, full: dict[int, int]) -> bool:
    """Whether a micro-batch holds a piece of a chain (part of a sample, not all of it; ``full``: sample lengths)."""
    return any(p.start > 0 or p.stop < full[p.sample] for p in mb.pieces)


def _width(p: Piece, d: int) -> int:
    """Tokens a piece puts on a rank of a CP group of d: its share, ceil(tokens / d), when sharded; all of it on
    its rank otherwise."""
    return -(-p.tokens // d) if p.cp_rank is None else p.tokens


def _sharded_tokens(mb: MicroBatch) -> int:
    """Tokens of a micro-batch's sharded pieces (what its K/V exchange moves)."""
    return sum(p.tokens for p in mb.pieces if p.cp_rank is None)


def _times(s: np.ndarray, cost: CostModel, d: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(whole on one rank, one rank's share when sharded over d ranks) compute seconds per sample."""
    pairs = cost.cfg.causal_factor * s * s
    local = np.asarray(cost.linear_s(s, k, ideal=True)) + np.asarray(cost.attn_s(pairs, s, k))
    q = s / (2 * d) if d > 1 else s
    shard = np.asarray(cost.linear_s(s / d, k, ideal=True)) + np.asarray(cost.attn_s(pairs / d, q, k))
    return local + np.asarray(cost.docs_s(1)), shard + np.asarray(cost.docs_s(2))


def _pieces_s(bounds: list[int], d: int, kept: int, cost: CostModel, k: int) -> float:
    """Estimated seconds on each of d ranks of a chain with pieces [bounds[j], bounds[j+1]); all but the last
    ``kept`` are recomputed (their forward runs twice)."""
    total = 0.0
    for j, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        pairs = cost.cfg.causal_factor * (b * b - a * a) / d
        t = float(cost.linear_s((b - a) / d, k, ideal=True)) + float(cost.attn_s(pairs, (b - a) / (2 * d), k))
        total += t * (4 / 3 if j < len(bounds) - 1 - kept else 1.0)
    return total


def _memory_terms(cost: CostModel, k: int) -> tuple[float, float, float]:
    """(activation bytes per token with k checkpointed layers, K/V store bytes per prefix token, bytes a rank has
    for both) of :meth:`CostModel.memory_bytes`."""
    act = cost.hw.fragmentation * cost.act_bytes_per_token(k)
    kv = float(cost.kv_store_bytes(1.0))
    return act, kv, cost.hw.memory_bytes - cost.static_bytes - cost.hw.reserve_gib * 2**30


def _tail_tokens(cost: CostModel, per_rank: int, k: int, cap: int) -> int:
    """Most of a sample's ``per_rank`` tokens a rank can keep as the last piece of a chain with ``k``
    checkpointed layers: its activations plus the K/V store of the head before it must fit memory, and the cap.
    O(1) plus a short correction loop."""
    if cost.memory_bytes(per_rank, k) <= cost.hw.memory_bytes and per_rank <= cap:
        return per_rank
    act, kv, free = _memory_terms(cost, k)
    n = min(cap, per_rank, int((free - kv * per_rank) // (act - kv))) if act > kv else 0
    while n > 0 and cost.memory_bytes(n, k, per_rank - n) > cost.hw.memory_bytes:
        n -= 1
    return max(n, 0)


def _memory_chain(n: int, d: int, cost: CostModel, k: int, budget: int, limit: int) -> list[int] | None:
    """Piece bounds of a chain of n tokens over d ranks: the last piece as long as a rank can keep beside the K/V
    store of the head (:func:`_tail_tokens`), the head cut greedily into pieces as long as memory allows beside
    the K/V of what precedes each, all at most ``budget`` tokens per rank and ``limit`` tokens; None when memory
    cannot hold even one token more. O(pieces)."""
    tail = min(_tail_tokens(cost, -(-n // d), k, budget) * d, limit)
    if tail <= 0:
        return None
    head = max(0, n - tail)
    act, kv, free = _memory_terms(cost, k)
    bounds, pos = [0], 0
    while pos < head:
        room = min(budget, int((free - kv * pos / d) // act))
        if room <= 0:
            return None
        pos = min(head, pos + min(room * d, limit))
        bounds.append(pos)
    return bounds + [n] if head else [0, n]


def _pieces(sample: int, cuts: list[int], rank: int | None, ckpt: int, kept: int = 1) -> list[MicroBatch]:
    """A chain with pieces [cuts[j], cuts[j+1]), one per micro-batch, all but the last ``kept`` recomputed."""
    return [MicroBatch((Piece(sample, a, b, rank),), ckpt_layers=ckpt, recompute=j < len(cuts) - 1 - kept)
            for j, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]


def _deal_shared(order: list[int], t_sh: np.ndarray, s: np.ndarray, rep_load: np.ndarray, cost: CostModel, k: int
                 ) -> tuple[list[list[int]], np.ndarray]:
    """Sharded samples (given heaviest first) to replicas: each to the one whose load grows least, counting its
    share and how much it lengthens that replica's K/V exchange. Updates ``rep_load`` to the shared compute
    alone (exchange taken out) and returns (samples per replica, exchange seconds per replica). O(n · replicas)."""
    n_rep = rep_load.size
    shared: list[list[int]] = [[] for _ in range(n_rep)]
    sh_tokens = np.zeros(n_rep)
    comm = np.zeros(n_rep)
    for i in order:
        if n_rep >= ARRAY_REPLICAS:  # equal values either way: the same choice
            # np.argmin keeps the first of equal values: ties go to the lowest replica
            g = int(np.argmin(rep_load + t_sh[i] + cost.cp_comm_s(sh_tokens + s[i], k) - comm))
        else:
            g = min(range(n_rep), key=lambda r: (rep_load[r] + t_sh[i] + cost.cp_comm_s(sh_tokens[r] + s[i], k)
                                                 - comm[r], r))
        shared[g].append(i)
        sh_tokens[g] += s[i]
        grown = cost.cp_comm_s(sh_tokens[g], k)
        rep_load[g] += float(t_sh[i]) + grown - comm[g]
        comm[g] = grown
    rep_load -= comm
    return shared, comm


def _deal_own(items: list[int], t_loc: np.ndarray, comm: np.ndarray, base: np.ndarray, d: int
              ) -> list[list[list[int]]]:
    """Own samples (given heaviest first) to the ranks of len(comm) replicas of d ranks: each to the replica whose
    Eq. 2 time max(exchange, own work) + shared work is least after adding it to that replica's least-loaded rank
    (ties: the replica whose least-loaded rank is emptiest, then the first). Own work that still hides under the
    exchange is free; priced after adding, a rank just under its exchange is no longer mistaken for an empty one.
    O(items · replicas) in numpy + O(items · log d)."""
    n_rep = len(comm)
    own: list[list[list[int]]] = [[[] for _ in range(d)] for _ in range(n_rep)]
    heaps = [[(0.0, j) for j in range(d)] for _ in range(n_rep)]  # per replica: (own load, rank)
    least = np.zeros(n_rep)
    scalar = n_rep < ARRAY_REPLICAS  # the same choices either way
    comm_l, base_l, least_l = comm.tolist(), base.tolist(), [0.0] * n_rep
    for i in items:
        t = float(t_loc[i])
        if scalar:
            after_l = [max(c, x + t) + b for c, x, b in zip(comm_l, least_l, base_l, strict=True)]
            top = min(after_l) * (1 + 1e-12)
            g = min((r for r in range(n_rep) if after_l[r] <= top), key=lambda r: (least_l[r], r))
        else:
            after = np.maximum(comm, least + t) + base
            tied = np.flatnonzero(after <= after.min() * (1 + 1e-12))
            g = int(tied[np.argmin(least[tied])]) if tied.size > 1 else int(tied[0])
        load, j = heapq.heappop(heaps[g])
        own[g][j].append(i)
        heapq.heappush(heaps[g], (load + t, j))
        least[g] = least_l[g] = heaps[g][0][0]
    return own


def _heaviest_first(t: np.ndarray, pos: np.ndarray) -> list[int]:
    return pos[np.lexsort((pos, -t[pos]))].tolist()


def _chain_cuts(n: int, chunk: int, d: int, kept: int, cost: CostModel, k: int) -> tuple[list[int], float]:
    """ChunkFlow chain cuts of a sample of n tokens: the fewest pieces of at most ``chunk`` tokens, either as even
    as integers allow or full chunks after one short first piece, whichever :func:`_pieces_s` estimates faster
    (ties: even), with that estimate. A short piece has the fewest queries per attention block; first, it attends
    to no prefix, so its slower blocks cost little; last, it attends to the longest prefix (on lmsys at CP 256,
    one 1.5M sample in 12 pieces: 0.4 s of 9.9 s when last). Full chunks instead of even ones keep the other
    pieces' blocks at the largest size. O(pieces)."""
    count = -(-n // chunk)
    even = [n * j // count for j in range(count + 1)]
    first = n - (count - 1) * chunk
    options = [even] + ([[0] + [first + chunk * j for j in range(count)]] if count > 1 and first < chunk else [])
    timed = [(_pieces_s(cuts, d, kept, cost, k), i, cuts) for i, cuts in enumerate(options)]
    t, _, cuts = min(timed)
    return cuts, t


def _big_micro_batches(pos: np.ndarray, lengths: np.ndarray, samples: np.ndarray, cap: int, d: int,
                       ckpt: int) -> list[MicroBatch]:
    """Samples sharded whole with ``ckpt`` checkpointed layers, first-fit decreasing into micro-batches of at most
    ``cap`` tokens per rank (only these micro-batches pay the recompute)."""
    rank = None if d > 1 else 0
    bins: list[list[int]] = []
    room: list[int] = []
    for i in pos[np.lexsort((pos, -lengths[pos]))].tolist():
        w = -(-int(lengths[i]) // d)
        b = next((x for x, r in enumerate(room) if w <= r), None)
        if b is None:
            bins.append([])
            room.append(cap)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= w
    return [MicroBatch(pieces=tuple(Piece(int(samples[i]), 0, int(lengths[i]), rank) for i in members),
                       ckpt_layers=ckpt) for members in bins]


def _carriers(hosts: list[_Host], x: int) -> list[_Host]:
    """Host x and, when it is a kept chunk, the later chunks of its chain (they carry its guests' activations)."""
    h = hosts[x]
    return [h] + ([y for y in hosts[x + 1:] if y.chain == h.chain] if h.keeps else [])


def _micro_batches(shared: list[int], own: list[list[int]], lengths: np.ndarray, samples: np.ndarray,
                   t_loc: np.ndarray, t_sh: np.ndarray, budget: int, d: int, ckpt: int, cost: CostModel
                   ) -> list[MicroBatch]:
    """The fewest micro-batches of at most ``budget`` tokens per rank holding a replica's samples (step 3)."""
    if not shared and not any(own):
        return []
    sh_tok = [-(-int(lengths[i]) // d) for i in shared]
    need = max(sum(sh_tok) + sum(int(lengths[i]) for i in mine) for mine in own)
    m = max(1, -(-need // budget))
    if m == 1:  # everything fits one micro-batch on every rank (need <= budget): nothing to deal
        return _whole_pieces([shared], [[(j, i) for j, mine in enumerate(own) for i in mine]], lengths, samples,
                             d, ckpt)
    while True:
        layout = _deal(shared, own, lengths, t_loc, t_sh, sh_tok, budget, m, cost, ckpt)
        if layout is not None:
            break
        m += 1
    sh_of, own_of = layout
    sharded = [[i for i, mb in zip(shared, sh_of, strict=True) if mb == b] for b in range(m)]
    placed = [[(j, i) for j, mine in enumerate(own) for i, mb in zip(mine, own_of[j], strict=True) if mb == b]
              for b in range(m)]
    return _whole_pieces(sharded, placed, lengths, samples, d, ckpt)


def _whole_pieces(sharded: list[list[int]], placed: list[list[tuple[int, int]]], lengths: np.ndarray,
                  samples: np.ndarray, d: int, ckpt: int) -> list[MicroBatch]:
    """Micro-batches of whole samples: per micro-batch its sharded samples (all d ranks; rank 0 when d = 1), then
    its (rank, sample) own ones, in the given order; empty ones are left out."""
    rank = None if d > 1 else 0
    out = []
    for members, mine in zip(sharded, placed, strict=True):
        pieces = [Piece(int(samples[i]), 0, int(lengths[i]), rank) for i in members]
        pieces += [Piece(int(samples[i]), 0, int(lengths[i]), j) for j, i in mine]
        if pieces:
            out.append(MicroBatch(pieces=tuple(pieces), ckpt_layers=ckpt))
    return out


def _total_s(mbs: list[MicroBatch], timer: _Timer) -> float:
    """Simulated time of micro-batches run one after another (one pipeline stage)."""
    return sum(timer.seconds(mb) for mb in mbs)


def _dense_micro_batches(shared: list[int], own: list[list[int]], lengths: np.ndarray, samples: np.ndarray,
                         t_loc: np.ndarray, t_sh: np.ndarray, budget: int, d: int, ckpt: int, cost: CostModel,
                         spread: bool = False, reserve: int = 0) -> list[MicroBatch]:
    """A replica's samples in few full micro-batches, for one pipeline stage, where micro-batch times add up and
    only the per-micro-batch costs and the K/V exchange own work does not hide are lost: sharded samples first fit
    decreasing (each micro-batch pays the exchange's latency once, and h once), or with ``spread`` dealt over the
    fewest micro-batches that could hold all, each to the lightest with room (more exchanges for own work to hide
    under), or with ``reserve`` leaving that many tokens of each micro-batch's budget free of shares (room for own
    work to hide the exchange; a share too large for that still fits a micro-batch of its own); then the own samples
    of every rank, heaviest first, each to the micro-batch whose time grows least by
    Eq. 2 (own work up to the exchange and the busiest rank's own work is free; ties: the fullest that fits on
    that rank, so room stays for the larger), a new micro-batch when none has room.
    O(samples · micro-batches)."""
    m = max(1, -(-max(sum(-(-int(lengths[i]) // d) for i in shared) + sum(int(lengths[i]) for i in mine)
                          for mine in own) // budget)) if spread else 0
    used: list[int] = [0] * m
    members: list[list[int]] = [[] for _ in range(m)]
    sh_tokens: list[float] = [0.0] * m
    sh_time = [0.0] * m
    for i in shared:  # heaviest first
        w = -(-int(lengths[i]) // d)
        limit = budget - reserve if w <= budget - reserve else budget
        fit = [x for x, u in enumerate(used) if u + w <= limit]
        b = (min(fit, key=lambda x: (sh_time[x], x)) if spread else fit[0]) if fit else None
        if b is None:
            used.append(0)
            members.append([])
            sh_tokens.append(0.0)
            sh_time.append(0.0)
            b = len(used) - 1
        used[b] += w
        sh_time[b] += float(t_sh[i])
        members[b].append(i)
        sh_tokens[b] += float(lengths[i])
    comm = [float(cost.cp_comm_s(x, ckpt)) for x in sh_tokens]
    placed: list[list[tuple[int, int]]] = [[] for _ in used]  # per micro-batch: (rank, sample)
    room = [[budget - u for u in used] for _ in own]  # per rank, per micro-batch
    loc = [[0.0] * len(used) for _ in own]
    top = [0.0] * len(used)  # per micro-batch: its busiest rank's own work
    items = sorted(((j, i) for j, mine in enumerate(own) for i in mine), key=lambda x: (-float(t_loc[x[1]]), x))
    for j, i in items:  # heaviest first, over all ranks
        n, t = int(lengths[i]), float(t_loc[i])
        fit = [b for b in range(len(top)) if n <= room[j][b]]
        if not fit:  # a micro-batch of own samples only
            for r in range(len(own)):
                room[r].append(budget)
                loc[r].append(0.0)
            used.append(0)
            comm.append(0.0)
            top.append(0.0)
            members.append([])
            placed.append([])
            fit = [len(top) - 1]
        # the micro-batch's time grows by what its busiest rank's own work then exceeds (Eq. 2)
        b = min(fit, key=lambda x: (max(comm[x], top[x], loc[j][x] + t) - max(comm[x], top[x]), room[j][x], x))
        room[j][b] -= n
        loc[j][b] += t
        top[b] = max(top[b], loc[j][b])
        placed[b].append((j, i))
    return _whole_pieces(members, placed, lengths, samples, d, ckpt)


def _hiding_tokens(cost: CostModel, budget: int, d: int, ckpt: int) -> int:
    """Own tokens a rank needs to hide the exchange of a micro-batch full of shares (short samples' rate)."""
    rate = float(cost.linear_s(1000.0, ckpt, ideal=True)) / 1000.0
    return int(math.ceil(float(cost.cp_comm_s(float(budget * d), ckpt)) / rate))


def _deal(shared: list[int], own: list[list[int]], lengths: np.ndarray, t_loc: np.ndarray, t_sh: np.ndarray,
          sh_tok: list[int], budget: int, m: int, cost: CostModel, ckpt: int
          ) -> tuple[list[int], list[list[int]]] | None:
    """Micro-batch index of every sample for m micro-batches, or None when something fits nowhere."""
    used = [0] * m
    sh_time = [0.0] * m
    sh_of = []
    for i, w in zip(shared, sh_tok, strict=True):  # already heaviest first
        fit = [b for b in range(m) if used[b] + w <= budget]
        if not fit:
            return None
        b = min(fit, key=lambda x: (sh_time[x], x))
        used[b] += w
        sh_time[b] += float(t_sh[i])
        sh_of.append(b)
    tokens = np.zeros(m)
    for i, b in zip(shared, sh_of, strict=True):
        tokens[b] += float(lengths[i])
    comm = cost.cp_comm_s(tokens, ckpt).tolist()  # one array call (the same values as m scalar ones)
    own_of = []
    for mine in own:
        room = [budget - u for u in used]
        loc = [0.0] * m
        where = []
        for i in mine:
            n, t = int(lengths[i]), float(t_loc[i])
            fit = [b for b in range(m) if n <= room[b]]
            if not fit:
                return None
            # The lightest after adding, in Eq. 2 terms (own work up to the K/V exchange time is free).
            b = min(fit, key=lambda x: (max(comm[x], loc[x] + t) + sh_time[x], loc[x], x))
            room[b] -= n
            loc[b] += t
            where.append(b)
        own_of.append(where)
    return sh_of, own_of


def _numbers(ctx: PlanContext, name: str, cast: Callable[[str], Any], example: str, kind: str) -> list:
    """Comma-separated values of option ``name`` ([] when not given), or one line naming the option and the fix."""
    text = ctx.option(name, None)
    if text is None or text == "":
        return []
    try:
        return [cast(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--opt {name}={text!r}: expected comma-separated {kind}, e.g. {name}={example}") from None


def _count(ctx: PlanContext, name: str, example: str) -> int | None:
    """Option ``name`` as a whole number >= 0 (None when not given), or one line naming the option and the fix."""
    text = ctx.option(name, None)
    if text is None or text == "":
        return None
    try:
        value = int(str(text).strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"--opt {name}={text!r}: expected a whole number >= 0 (0 turns it off), e.g. {name}={example}")
    return value


def _alpha(text: str) -> float:
    """A sharding threshold of ``--opt alphas``: a float (multiple of τ, ``inf`` for none), ``unit`` or ``light``."""
    if text.strip().lower() in ("unit", "light"):
        return UNIT if text.strip().lower() == "unit" else LIGHT
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def _divisors(n: int) -> list[int]:
    """Divisors of ``n``, largest first."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def _flag(value: object) -> bool:
    return str(value).strip().lower() not in ("0", "false", "no", "off")
