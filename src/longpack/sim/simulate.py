"""Simulate a Plan on the cost model: per-step, per-rank compute, communication, overlap, idle and memory.

Per micro-batch and CP rank j (Skrull Eq. 2):

    time_j = max(T_comm(sharded), T_local_j) + T_dist_j + T_fixed

* ``T_local_j``: rank j's local pieces (linear share + attention on whole documents, q = piece length);
* ``T_dist_j``: its 1/cp share of every sharded piece (zigzag: attention blocks of q = s/(2·cp));
* ``T_comm``: the K/V all-gathers and gradient reduce-scatters of the sharded pieces (the all-gathers again in a
  recomputed layer, and in a ``recompute`` micro-batch's second forward), overlapped with local compute. The CP
  ranks meet in those collectives every layer, so a micro-batch takes ``max_j time_j``.

A replica's time is the sum over its micro-batches; with pp > 1 it is the makespan of its micro-batches through
the pipeline (sim/pipeline.py: 1F1B, or state-aware 1F1B when chunk chains are present), and the step reports the
bubble ratio. A step takes its slowest replica plus the gradient all-reduce. Idle is what a rank waits for the
step's slowest rank.

Memory per rank is the cost model's ``static + α·tokens + reserve`` plus what unfinished chunk chains hold (their
kept chunks' activations and their K/V store), walked micro-batch by micro-batch (sim/memory.py).
A rank over the hardware's memory is an OOM.

A step whose replicas are CP groups of several sizes (``Step.degrees``) times each replica at its own degree, and
is held to the lower bound of such layouts (bounds.mixed_step_bound), which is weaker than that of one degree.
A step's bound ranges over the CP degrees the run allows: the divisors of ``--cp``, or of the step's widest group
when a planner was told it may go wider.

Padded micro-batches (``pad_to > 0``) compute every row at the padded length: padding costs time and memory.
Cost: O(pieces + ranks) per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Plan, Step
from ..progress import tick
from .bounds import mixed_step_bound, step_lower_bound
from .memory import ReplicaMemory
from .pipeline import Item
from .pipeline import schedule as pipeline_schedule

__all__ = ["StepReport", "SimReport", "simulate", "simulate_step", "micro_batch_times", "pipeline_items",
           "kept_chunks", "forward_seconds"]


@dataclass(frozen=True)
class StepReport:
    """One optimizer step; per-rank tuples are indexed by global rank = replica · cp + cp_rank (groups of several
    sizes: the replicas' groups one after the other)."""

    step: int
    cp: int
    time_s: float
    allreduce_s: float
    lower_bound_s: float
    bubble_ratio: float
    replica_s: tuple[float, ...]
    compute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    overlap_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    peak_mem_bytes: tuple[float, ...]
    oom_ranks: tuple[int, ...]

    @property
    def oom(self) -> bool:
        return bool(self.oom_ranks)


@dataclass(frozen=True)
class SimReport:
    steps: tuple[StepReport, ...]

    @property
    def total_s(self) -> float:
        return float(sum(s.time_s for s in self.steps))

    @property
    def mean_step_s(self) -> float:
        return self.total_s / max(1, len(self.steps))

    @property
    def efficiency(self) -> float:
        """Σ lower bounds / Σ simulated step times, in (0, 1]."""
        return float(sum(s.lower_bound_s for s in self.steps)) / self.total_s if self.total_s > 0 else 1.0

    @property
    def peak_mem_gib(self) -> float:
        return max((max(s.peak_mem_bytes) for s in self.steps), default=0.0) / 2**30

    @property
    def oom_steps(self) -> int:
        return sum(1 for s in self.steps if s.oom)


def micro_batch_times(mb: MicroBatch, cp: int, cost: CostModel) -> tuple[np.ndarray, ...]:
    """Per-rank (time, local compute, dist compute, comm, tokens, prefix tokens) of one micro-batch."""
    causal, ckpt = cost.cfg.causal_factor, mb.ckpt_layers
    if not mb.pieces:
        z = np.zeros(cp)
        return z, z.copy(), z.copy(), z.copy(), z.copy(), z.copy()
    _, starts, stops, ranks = zip(*mb.pieces, strict=True)
    start = np.asarray(starts, dtype=np.float64)
    n = np.full(start.size, float(mb.pad_to)) if mb.pad_to else np.asarray(stops, dtype=np.float64) - start
    end = start + n  # a padded row of a chain piece still attends to the chain's earlier tokens
    pairs = causal * (end * end - start * start)
    dist = np.array([r is None for r in ranks]) if cp > 1 else np.zeros(start.size, dtype=bool)
    j = np.array([0 if r is None else r for r in ranks], dtype=np.int64)[~dist]
    nd = n[dist]
    tok_dist = float(np.ceil(nd / cp).sum())
    attn_dist = float(np.sum(cost.attn_s(pairs[dist] / cp, nd / (2 * cp), ckpt))) if nd.size else 0.0
    docs_dist = 2.0 * nd.size  # two zigzag blocks per rank
    shard_tokens = float(nd.sum())
    nl = n[~dist]
    tok_local = np.bincount(j, weights=nl, minlength=cp).astype(np.float64)
    attn_local = np.bincount(j, weights=np.asarray(cost.attn_s(pairs[~dist], nl, ckpt), dtype=np.float64)
                             if nl.size else None, minlength=cp).astype(np.float64)
    docs_local = np.bincount(j, minlength=cp).astype(np.float64)
    prefix = np.bincount(j, weights=start[~dist], minlength=cp) + float(start[dist].sum()) / cp
    if mb.pad_to:  # padded rows all have one length: one batched attention call per rank
        docs_local, docs_dist = np.minimum(docs_local, 1), min(docs_dist, 2)
    tokens = tok_local + tok_dist
    lin = np.asarray(cost.linear_s(tokens, ckpt), dtype=np.float64)
    ideal = np.asarray(cost.linear_s(tokens, ckpt, ideal=True), dtype=np.float64)
    if mb.recompute:
        # ChunkFlow: a chunk whose activations were dropped runs its forward twice.
        k = ckpt / cost.layers
        lin, ideal = lin * (1.0 + 1.0 / (3.0 + k)), ideal * (1.0 + 1.0 / (3.0 + k))
        scale = 1.0 + 1.0 / (1.0 + cost.cfg.attn_bwd_factor + k)
        attn_local, attn_dist = attn_local * scale, attn_dist * scale
    share = np.divide(tok_local, tokens, out=np.zeros(cp), where=tokens > 0)
    # Linear work splits by tokens; the small-GEMM loss (lin - ideal) is a per-micro-batch overhead that
    # nothing overlaps, like the launch cost. Every term is linear in the placement (sim/exact.py relies on it).
    local = ideal * share + attn_local + np.asarray(cost.docs_s(docs_local))
    dist_s = ideal * (1 - share) + (lin - ideal) + attn_dist + float(cost.docs_s(docs_dist))
    comm = cost.cp_comm_s(shard_tokens, ckpt, mb.recompute)  # a dropped forward gathers its K/V again
    fixed = cost.fixed_s
    time = np.maximum(comm, local) + dist_s + fixed
    return time, local + fixed, dist_s, np.full(cp, comm), tokens, prefix


def simulate_step(index: int, step: Step, plan: Plan, cost: CostModel, *, bound: bool = True,
                  times: Callable[[MicroBatch], tuple[np.ndarray, ...]] | None = None) -> StepReport:
    """One step's report; ``bound=False`` skips the lower bound (planners evaluating candidates). ``times``: what
    :func:`micro_batch_times` gives for a micro-batch at the step's CP degree on this cost model (a planner's
    memoised copy; it must not differ from it)."""
    reps = step.replicas
    run_cost = cost
    spans = step.spans()  # (first rank, degree) of each replica's group
    n_ranks = sum(d for _, d in spans)
    costs = {d: cost.at_cp(d) for _, d in spans}
    if step.mixed:
        times = None  # a planner's memo is for one degree
    busy = np.zeros(n_ranks)
    compute = np.zeros(n_ranks)
    comm = np.zeros(n_ranks)
    overlap = np.zeros(n_ranks)
    peak = np.zeros(n_ranks)
    replica_s, bubbles = [], []
    for rep, (first, cp) in zip(reps, spans, strict=True):
        cost = costs[cp]
        sl = slice(first, first + cp)
        mb_times = []
        memory = ReplicaMemory(cost, cp, plan.effective_length)
        for mb in rep.micro_batches:
            time, local, dist, c, tokens, prefix = times(mb) if times else micro_batch_times(mb, cp, cost)
            mb_times.append(float(time.max()) if mb.pieces else 0.0)
            busy[sl] += time
            compute[sl] += local + dist
            comm[sl] += c
            overlap[sl] += np.minimum(c, local)
            peak[sl] = np.maximum(peak[sl], memory.peak(mb, tokens, prefix))
        if cost.cfg.pp > 1:
            items = pipeline_items(rep.micro_batches, forward_seconds(rep.micro_batches, mb_times), plan)
            res = pipeline_schedule(items, cost.cfg.pp, k=kept_chunks(rep.micro_batches, plan))
            replica_s.append(res.makespan)
            bubbles.append(res.bubble_ratio)
        else:
            replica_s.append(sum(mb_times))
    has_work = any(mb.pieces for rep in reps for mb in rep.micro_batches)
    allreduce = cost.grad_allreduce_s() if has_work else 0.0
    slowest = max(replica_s, default=0.0)
    oom = tuple(int(i) for i in np.flatnonzero(peak > cost.hw.memory_bytes))
    lb = 0.0
    if has_work and bound:  # a step over memory is held to the bound that ignores memory
        lengths = [plan.effective_length(p.sample) for rep in reps for mb in rep.micro_batches for p in mb.pieces
                   if p.start == 0]
        lb = _bound(np.sort(np.asarray(lengths, dtype=np.float64)), run_cost, n_ranks, step.mixed,
                    plan.meta.get("overlong", {}).get("split_len"), not oom, max(run_cost.cfg.cp, step.cp))
    return StepReport(step=index, cp=step.cp, time_s=slowest + allreduce, allreduce_s=allreduce, lower_bound_s=lb,
                      bubble_ratio=max(bubbles, default=0.0),
                      replica_s=tuple(replica_s), compute_s=tuple(compute.tolist()), comm_s=tuple(comm.tolist()),
                      overlap_s=tuple(overlap.tolist()), idle_s=tuple((slowest - busy).tolist()),
                      peak_mem_bytes=tuple(peak.tolist()), oom_ranks=oom)


def forward_seconds(mbs: tuple[MicroBatch, ...], times: list[float]) -> list[float]:
    """Per micro-batch forward seconds of one stage from its whole time (F + 2F backward, + F when recomputed)."""
    return [t / (3.0 + (1.0 if mb.recompute else 0.0)) for mb, t in zip(mbs, times, strict=True)]


def pipeline_items(mbs: tuple[MicroBatch, ...], fwd: list[float], plan: Plan) -> list[Item]:
    """The non-empty micro-batches as pipeline items, in order: forward seconds ``fwd[i]``, chained when they hold
    pieces of the same split sample, recomputed as the plan marks (the simulator and runtime/kernel/pipeline.py both
    schedule these)."""
    items = []
    for mb, f in zip(mbs, fwd, strict=True):
        if not mb.pieces:
            continue
        chain = next((p.sample for p in mb.pieces if plan.is_chunk(p)), None)
        items.append(Item(fwd=f, chain=chain, recompute=mb.recompute))
    return items


def kept_chunks(mbs: tuple[MicroBatch, ...], plan: Plan) -> int:
    """K of a replica's chains: the most chunks one chain keeps activations for (1 when there are none)."""
    kept: dict[int, int] = {}
    for mb in mbs:
        for p in mb.pieces:
            if plan.is_chunk(p) and not mb.recompute:
                kept[p.sample] = kept.get(p.sample, 0) + 1
    return max(kept.values(), default=1)


_BOUNDS: dict[tuple[Any, ...], float] = {}
BOUND_MEMO = 4096  # entries kept; each is one step's bound


def _bound(lengths: np.ndarray, cost: CostModel, n_ranks: int, mixed: bool, split_len: int | None,
           memory: bool, widest: int) -> float:
    """A step's lower bound (bounds.py) over the CP degrees that divide ``widest`` (the run's --cp, or the step's
    own widest group when a planner was allowed wider ones), memoised: it is a pure function of the step's sorted
    sample lengths and the setup, and comparing planners on the same global batches asks for the same bound once
    per planner (each solves small MILPs). The memo holds the last :data:`BOUND_MEMO` bounds."""
    key = (lengths.tobytes(), cost.model, cost.cfg, repr(cost.hw), n_ranks, mixed, split_len, memory, widest)
    hit = _BOUNDS.get(key)
    if hit is not None:
        return hit
    bound_of = mixed_step_bound if mixed else step_lower_bound
    lb = bound_of(lengths, cost, degrees=[d for d in range(1, n_ranks + 1) if n_ranks % d == 0 and widest % d == 0],
                  split_len=split_len, memory=memory)
    if len(_BOUNDS) >= BOUND_MEMO:
        _BOUNDS.pop(next(iter(_BOUNDS)))
    _BOUNDS[key] = lb
    return lb


def simulate(plan: Plan, cost: CostModel, *, bounds: bool = True) -> SimReport:
    """Simulate every step of ``plan``; see the module docstring for the time model. ``bounds=False`` skips each
    step's lower bound (``lower_bound_s`` 0, so no efficiency), for callers that report times only: the bound
    solves small MILPs for steps with few replicas (sim/replica_bound.py)."""
    if plan.world != cost.cfg.dp * cost.cfg.cp:
        raise ValueError(f"plan world {plan.world} != --dp {cost.cfg.dp} x --cp {cost.cfg.cp}; "
                         "simulate with the layout the plan was made for")
    reports = []
    for i, step in enumerate(plan.steps):
        reports.append(simulate_step(i, step, plan, cost, bound=bounds))
        tick("simulated")
    return SimReport(steps=tuple(reports))
