"""Epoch-scale planning in columns: a whole run planned at once against one step at a time, and 10M samples.

    python bench/plan_columns.py [--samples 1000000] [--big 10000000] [--repeat 3] [--write]

For isf, fixed_cp and skrull on lmsys-chat-1m (qwen2.5-0.5b on H100, DP4·CP8, global batch 256, the workload's
--max-len), in one process: ``longpack bench planning``'s measurement (jobs.bench_planning: the run's plan in
columns, its seconds over those of ``numpy.sort`` of the same lengths timed just before, the peak traced memory of
a second run), the median of ``--repeat``; beside it the same run planned one step at a time (PlanStream.next_step,
each batch by plan_batch: what ``longpack train`` streams); and one run of ``--big`` samples for its peak memory.
The plans are equal (tests/test_columns.py), so only their cost is compared.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from _report import write_section

from longpack import jobs
from longpack.planners import PlanContext, get_planner, global_batches
from longpack.planners.stream import PlanStream

PLANNERS = ("isf", "fixed_cp", "skrull")


def _one_at_a_time(planner: str, spec: jobs.RunSpec) -> float:
    """Seconds to plan the run step by step, each step's batch by plan_batch (what ``longpack train`` streams)."""
    lengths, max_len = jobs.load_workload(spec)
    ctx = PlanContext(cost=jobs.build_cost(spec), seed=spec.seed)
    batches = global_batches(len(lengths), spec.global_batch, seed=spec.seed)
    t0 = time.perf_counter()
    stream = PlanStream(get_planner(planner), lengths, batches, ctx, max_len=max_len, validate=False)
    for _ in range(len(stream)):
        stream.next_step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--big", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows = []
    for planner in PLANNERS:
        spec = jobs.RunSpec(workload="lmsys-chat-1m", samples=args.samples, dp=4, cp=8, global_batch=256)
        runs = [jobs.bench_planning(planner, spec) for _ in range(args.repeat)]
        seconds = statistics.median(r["seconds"] for r in runs)
        ratio = statistics.median(r["vs_numpy_sort"] for r in runs)
        alone = _one_at_a_time(planner, spec)
        big = jobs.bench_planning(planner, jobs.RunSpec(workload="lmsys-chat-1m", samples=args.big, dp=4, cp=8))
        rows.append((planner, seconds, ratio, runs[0]["peak_mib"], alone, alone / seconds, big["seconds"],
                     big["peak_mib"]))
        print(f"{planner:9s} {seconds:.3f} s ({ratio:.1f}x numpy.sort, {runs[0]['peak_mib']:.0f} MiB); one batch at "
              f"a time {alone:.2f} s ({alone / seconds:.1f}x); {args.big:,}: {big['seconds']:.2f} s, "
              f"{big['peak_mib']:.0f} MiB", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.write:
        body = (f"| planner | s per {args.samples:,} (median of {args.repeat}) | / numpy.sort | peak MiB | one batch "
                f"at a time, s | speedup | s per {args.big:,} | peak MiB ({args.big:,}) |\n"
                "|---|---|---|---|---|---|---|---|\n"
                + "\n".join(f"| {p} | {s:.3f} | {r:.1f} | {m:.0f} | {a:.2f} | {x:.1f}x | {bs:.2f} | {bm:.0f} |"
                            for p, s, r, m, a, x, bs, bm in rows)
                + f"\n\nlmsys-chat-1m, qwen2.5-0.5b on H100 at DP4·CP8, global batch 256; one process. The first "
                "columns are `longpack bench planning --planner P --workload lmsys-chat-1m --samples N --json`: "
                "seconds of the run's plan (in columns), the same over numpy.sort of the same lengths timed just "
                "before, and the peak tracemalloc sees. \"One batch at a time\" plans the same run step by step "
                "(PlanStream.next_step, plan_batch per batch: what longpack train streams), in the same process. The "
                f"plans are equal. The process's peak resident memory over the whole benchmark was {rss:.2f} GiB.")
        write_section("plan_columns", "Epoch-scale plans in columns",
                      f"python bench/plan_columns.py --samples {args.samples} --big {args.big} --write", body)


if __name__ == "__main__":
    main()
