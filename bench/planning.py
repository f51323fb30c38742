"""Planning cost: per global batch (online scheduling) and per full epoch, for every planner.

    python bench/planning.py [--samples 1000000] [--batches 200] [--write]

Per batch: 256 sequences of lmsys-chat-1m at DP4 x CP8, qwen2.5-0.5b on H100, BucketSize 26K; the median over
``--batches`` consecutive global batches. Per epoch: every global batch of ``--samples`` samples, wall seconds
(untraced), the same as a ratio to ``numpy.sort`` of the lengths timed beside it, and peak traced memory (a
second, traced run). ``--write`` puts the table in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
from _report import write_section

from longpack.cost import CostModel, TrainConfig
from longpack.hardware import get_hardware
from longpack.model import get_model
from longpack.planners import PLANNERS, PlanContext, Planner, get_planner, global_batches
from longpack.workloads import generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--planners", default=",".join(sorted(PLANNERS)))
    ap.add_argument("--epoch-budget-s", type=float, default=240.0,
                    help="a planner slower than this per epoch is timed on a prefix of the batches and scaled")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    cost = CostModel(get_model("qwen2.5-0.5b"), get_hardware("h100"), TrainConfig(dp=4, cp=8, token_cap=26 * 1024))
    ctx = PlanContext(cost=cost)
    lengths = generate("lmsys-chat-1m", args.samples, seed=0)
    batches = global_batches(len(lengths), 256, seed=0)
    rows = []
    for name in args.planners.split(","):
        planner = get_planner(name)
        per_batch = []
        for b in batches[: args.batches]:
            t0 = time.perf_counter()
            planner.plan(lengths, [b], ctx, max_len=128 * 1024)
            per_batch.append(time.perf_counter() - t0)
        # A planner that would take longer than --epoch-budget-s plans a prefix of the epoch's batches; its epoch
        # time is that measurement scaled to all batches, and the table says so.
        median = float(np.median(per_batch))
        whole_pool = type(planner).plan is not Planner.plan  # plans the epoch at once (HBP): never scaled
        part = batches if whole_pool or median * len(batches) <= args.epoch_budget_s else \
            batches[: max(1, int(args.epoch_budget_s / max(median, 1e-9)))]
        t0 = time.perf_counter()
        np.sort(lengths)  # the yardstick, timed beside the epoch: a ratio to it moves less with load than seconds
        sort_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        planner.plan(lengths, part, ctx, max_len=128 * 1024)
        epoch = (time.perf_counter() - t0) * len(batches) / len(part)
        traced = part if len(part) == len(batches) else part[: max(1, len(part) // 10)]  # tracing is slow
        tracemalloc.start()
        planner.plan(lengths, traced, ctx, max_len=128 * 1024)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        note = "" if len(part) == len(batches) else f" (scaled from {len(part)} batches)"
        mem_note = "" if len(traced) == len(batches) else f" ({len(traced)} batches)"
        rows.append((name, median * 1e3, epoch, epoch / sort_s, peak, note, mem_note))
        print(f"{name:14s} {rows[-1][1]:8.3f} ms/batch  {epoch:7.2f} s/epoch{note}  {epoch / sort_s:8.1f}x sort  "
              f"{peak:8.1f} MiB{mem_note}", flush=True)
    if args.write:
        body = ("| planner | ms per global batch (median) | s per epoch | epoch / numpy.sort | peak MiB (epoch) |\n"
                "|---|---|---|---|---|\n"
                + "\n".join(f"| {n} | {b:.3f} | {e:.2f}{note} | {r:.1f} | {p:.0f}{mem} |"
                            for n, b, e, r, p, note, mem in rows)
                + f"\n\nEpoch = {args.samples:,} lmsys-chat-1m samples in {len(batches):,} global batches of 256; "
                "one process, one core busy. Epoch / numpy.sort: the epoch's seconds over those of numpy.sort of "
                "the same million lengths, timed just before it. Peak memory is what tracemalloc sees (Python "
                "objects and numpy buffers) during planning, lengths excluded.")
        write_section("planning", "Planning cost", "python bench/planning.py --write", body)


if __name__ == "__main__":
    main()
