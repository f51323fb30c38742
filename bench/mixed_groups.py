"""What one CP degree per step costs: unified's steps laid out again on CP groups of different sizes (a what-if).

    python bench/mixed_groups.py [--cells qwen2.5-7b:32:chunkflow-eval ...] [--steps 4] [--write]

The Plan contract gives a step one CP degree (ARCHITECTURE.md, invariant 4: world // cp replicas). FlexSP (PAPERS.md,
HBP's Table 12) instead runs one step on groups of several sizes. This script measures what that would buy on the
simulator's micro-batch model, without changing the contract: for each step of unified's plan it tries partitions of
the world into groups whose sizes divide it (at most ``PARTS`` groups), lays the step out greedily — the samples unified
sharded, longest first, each to the group whose micro-batch time grows least; then the rest, longest first, each to
the rank (of any group) that finishes first by Eq. 2 (own work hides under its group's K/V exchange) within memory,
else sharded like the first — one micro-batch per group at the configured checkpointing, and times each group with
``sim.simulate.micro_batch_times`` at its own degree. The step takes its slowest group plus the gradient all-reduce.
Steps with chains, or whose samples do not fit one micro-batch per group, keep unified's time.

No lower bound covers such layouts (sim/bounds.py bounds plans of one degree per step), so there is no efficiency
here, only time against unified's. Cost: per step, partitions × O(samples × groups) micro-batch timings.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace

import numpy as np
from _report import write_section

from longpack import jobs
from longpack.cost import CostModel
from longpack.plan import MicroBatch, Piece, Plan, Step
from longpack.sim.simulate import micro_batch_times, simulate

CELLS = ("qwen2.5-7b:32:chunkflow-eval", "qwen2.5-0.5b:32:chunkflow-eval", "qwen2.5-7b:4:chunkflow-eval",
         "qwen2.5-7b:32:chatqa2-long-sft")
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
    """One CP group of the what-if: its degree, sharded samples and per-rank own samples."""

    def __init__(self, cost: CostModel, degree: int, world: int) -> None:
        self.d = degree
        self.cost = cost if cost.cfg.cp == degree else CostModel(cost.model, cost.hw,
                                                                 replace(cost.cfg, cp=degree, dp=world // degree))
        self.cap = float(self.cost.token_cap(None))
        self.shared: list[tuple[int, int]] = []  # (sample, length)
        self.own: list[list[tuple[int, int]]] = [[] for _ in range(degree)]
        self.own_tokens = np.zeros(degree)
        self.own_s = np.zeros(degree)
        self.share_tokens = 0.0

    def micro_batch(self, extra: tuple[int, int] | None = None) -> MicroBatch:
        shared = self.shared + ([extra] if extra else [])
        pieces = [Piece(i, 0, n, None) for i, n in shared]
        pieces += [Piece(i, 0, n, r) for r, xs in enumerate(self.own) for i, n in xs]
        return MicroBatch(tuple(pieces))

    def time(self, extra: tuple[int, int] | None = None) -> tuple[float, float, float]:
        """(micro-batch time, K/V exchange, shared compute) with ``extra`` sharded too; inf over memory."""
        mb = self.micro_batch(extra)
        if not mb.pieces:
            return 0.0, 0.0, 0.0
        t, _, dist, comm, tokens, _ = micro_batch_times(mb, self.d, self.cost)
        if float(np.max(tokens)) > self.cap:
            return np.inf, np.inf, np.inf
        return float(t.max()), float(comm[0]), float(dist[0])


def mixed_step_time(step: Step, plan: Plan, cost: CostModel, degrees: tuple[int, ...]) -> float:
    """Slowest group's time of the greedy layout of ``step`` on groups of ``degrees`` (inf when it does not fit)."""
    world = sum(degrees)
    groups = [_Group(cost, d, world) for d in degrees]
    pieces = [p for r in step.replicas for mb in r.micro_batches for p in mb.pieces]
    length = {p.sample: plan.effective_length(p.sample) for p in pieces}
    shared = sorted({p.sample for p in pieces if p.cp_rank is None}, key=lambda i: (-length[i], i))
    own = sorted({p.sample for p in pieces if p.cp_rank is not None}, key=lambda i: (-length[i], i))

    def share(i: int) -> bool:
        times = [(g.time((i, length[i]))[0], -g.d, k) for k, g in enumerate(groups)]
        best = min(times)
        if not np.isfinite(best[0]):
            return False
        g = groups[best[2]]
        g.shared.append((i, length[i]))
        g.share_tokens += float(np.ceil(length[i] / g.d))
        return True

    if not all(share(i) for i in shared):
        return np.inf
    base = [g.time() for g in groups]
    for i in own:
        n = length[i]
        best = None
        for k, g in enumerate(groups):
            r = int(np.argmin(g.own_s))
            if g.share_tokens + g.own_tokens[r] + n > g.cap:
                continue
            alone = float(g.cost.sequence_s(n))
            finish = max(base[k][1], g.own_s[r] + alone) + base[k][2]
            if best is None or finish < best[0]:
                best = (finish, k, r, alone)
        if best is None:
            if not share(i):
                return np.inf
            base = [g.time() for g in groups]
            continue
        _, k, r, alone = best
        groups[k].own[r].append((i, n))
        groups[k].own_tokens[r] += n
        groups[k].own_s[r] += alone
    return max(g.time()[0] for g in groups)


def shape(degrees: tuple[int, ...]) -> str:
    """``128+64+2×32``: the group sizes, largest first, repeats counted."""
    return "+".join(f"{n}×{d}" if n > 1 else str(d) for d, n in sorted(Counter(degrees).items(), reverse=True))


def cell(name: str, steps: int) -> tuple[str, list[tuple[float, float, tuple[int, ...]]]]:
    """Per step of unified's plan on ``name`` (MODEL:DP:WORKLOAD at CP 8): (unified's time, best what-if, degrees)."""
    model, dp, workload = name.split(":")
    spec = jobs.RunSpec(workload=workload, samples=20000, model=model, hardware="h100", dp=int(dp), cp=8,
                        global_batch=64 * int(dp), steps=steps, seed=0)
    lengths, max_len = jobs.load_workload(spec)
    cost = jobs.build_cost(spec)
    plan, _ = jobs.run_plan("unified", lengths, spec, cost, max_len)
    report = simulate(plan, cost, bounds=False)
    world = cost.cfg.dp * cost.cfg.cp
    sizes = [d for d in range(world, 0, -1) if world % d == 0]
    shapes = partitions(world, sizes)
    rows = []
    for step, rep in zip(plan.steps, report.steps, strict=True):
        best, degrees = rep.time_s, (step.cp,) * len(step.replicas)
        if not any(plan.is_chunk(p) for r in step.replicas for mb in r.micro_batches for p in mb.pieces):
            for option in shapes:
                t = mixed_step_time(step, plan, cost, option) + rep.allreduce_s
                if t < best:
                    best, degrees = t, option
        rows.append((rep.time_s, best, degrees))
        print(name, f"step {rep.step}: unified {rep.time_s:.4f} s (CP {step.cp}), what-if {best:.4f} s on "
              f"{shape(degrees)}", flush=True)
    return name, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=list(CELLS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    table = []
    for name in args.cells:
        _, rows = cell(name, args.steps)
        ours, whatif = sum(r[0] for r in rows), sum(r[1] for r in rows)
        shapes = "; ".join(shape(r[2]) for r in rows)
        table.append((name, f"{ours:.3f}", f"{whatif:.3f}", f"{whatif / ours:.3f}", shapes))
        print(*table[-1], flush=True)
    if args.write:
        body = ("| cell (model:DP:workload, CP 8) | unified, s | mixed groups (what-if), s | ratio "
                "| groups per step |\n"
                "|---|---|---|---|---|\n"
                + "\n".join("| " + " | ".join(r) + " |" for r in table)
                + "\n\nH100 cost model, 64·DP samples a step, the first steps of each workload (seed 0). The what-if "
                "keeps unified's choice of which samples to shard and lays each step out greedily on groups of "
                "several CP degrees, one micro-batch per group; no planner emits such plans and no lower bound "
                "covers them. Steps whose samples do not fit one micro-batch per group (ChatQA2 at CP 2-4, many "
                "micro-batches a replica) and steps with chains keep unified's layout (its degree × replicas shown): "
                "the what-if cannot lay them out, which says nothing of what groups would buy there.")
        write_section("mixed_groups", "What one CP degree per step costs (what-if)",
                      f"python bench/mixed_groups.py --steps {args.steps} --write", body)


if __name__ == "__main__":
    main()
