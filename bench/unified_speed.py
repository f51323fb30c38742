"""Unified's planning time per global batch against isf, on the two setups its speed is held to.

    python bench/unified_speed.py [--lmsys 60] [--chatqa 8] [--write]

* lmsys-chat-1m, 256-sample batches, qwen2.5-0.5b at DP4·CP8 on H100, BucketSize 26K, --max-len 128K (the setup
  of bench/planning.py);
* chatqa2-long-sft, 2,048-sample batches of 20,000 samples, qwen2.5-7b at DP32·CP8 on H100 (a DP32 cell of the
  quality matrix, whose first four batches are its steps).

Per batch, isf and unified plan it one after the other in this process (CPU seconds, one core), so their ratio
holds whatever else the machine runs; the table gives each one's median over the batches and the ratio of the
medians, and unified's slowest batch. ``--write`` puts it in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _report import write_section

from longpack import jobs
from longpack.cost import CostModel, TrainConfig
from longpack.hardware import get_hardware
from longpack.model import get_model
from longpack.planners import PlanContext, get_planner, global_batches
from longpack.workloads import generate


def cases(lmsys: int, chatqa: int) -> list[tuple[str, np.ndarray, list[np.ndarray], PlanContext, int | None]]:
    """(name, lengths, batches, context, max_len) of the two setups."""
    cost = CostModel(get_model("qwen2.5-0.5b"), get_hardware("h100"), TrainConfig(dp=4, cp=8, token_cap=26 * 1024))
    lengths = generate("lmsys-chat-1m", 256 * lmsys, seed=0)
    out = [("lmsys-chat-1m, 256 a batch, qwen2.5-0.5b DP4·CP8", lengths, global_batches(len(lengths), 256, seed=0),
            PlanContext(cost=cost), 128 * 1024)]
    spec = jobs.RunSpec(workload="chatqa2-long-sft", samples=max(20_000, 2048 * chatqa), model="qwen2.5-7b",
                        hardware="h100", dp=32, cp=8, global_batch=2048, seed=0)
    lengths, max_len = jobs.load_workload(spec)  # the quality matrix's samples: its first batches are these
    out.append(("chatqa2-long-sft, 2,048 a batch, qwen2.5-7b DP32·CP8", lengths,
                global_batches(len(lengths), 2048, seed=0)[:chatqa], PlanContext(cost=jobs.build_cost(spec)), max_len))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lmsys", type=int, default=60, help="lmsys batches")
    ap.add_argument("--chatqa", type=int, default=8, help="chatqa2 batches")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, lengths, batches, ctx, max_len in cases(args.lmsys, args.chatqa):
        spent: dict[str, list[float]] = {"isf": [], "unified": []}
        for b in batches:
            for planner in spent:
                p = get_planner(planner)
                t0 = time.process_time()
                p.plan(lengths, [b], ctx, max_len=max_len)
                spent[planner].append(time.process_time() - t0)
        isf, uni = (float(np.median(spent[p])) for p in ("isf", "unified"))
        rows.append((name, len(batches), isf * 1e3, uni * 1e3, uni / isf, max(spent["unified"]) * 1e3))
        print(f"{name}: {len(batches)} batches, isf {isf * 1e3:.2f} ms, unified {uni * 1e3:.1f} ms "
              f"({uni / isf:.1f}x isf), slowest {rows[-1][5]:.1f} ms", flush=True)
    if args.write:
        body = ("| setup | batches | isf, ms a batch (median) | unified, ms a batch (median) | unified / isf | "
                "unified's slowest batch, ms |\n|---|---|---|---|---|---|\n"
                + "\n".join(f"| {n} | {k} | {i:.2f} | {u:.1f} | {r:.1f} | {m:.1f} |" for n, k, i, u, r, m in rows)
                + "\n\nCPU seconds of one process on one core; each batch planned by isf and then by unified, so the "
                "ratio is taken under the same load.")
        write_section("unified_speed", "Unified's planning time against isf",
                      f"python bench/unified_speed.py --lmsys {args.lmsys} --chatqa {args.chatqa} --write", body)


if __name__ == "__main__":
    main()
