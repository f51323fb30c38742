"""Real training throughput of plans: tiny Llama on 2 gloo processes, the same samples for every planner.

    python bench/train_throughput.py [--samples 384] [--global-batch 32] [--write]

Each planner trains the same ``--samples`` tiny-longtail samples (one epoch of its own plan, so HBP's regrouping
covers the same data) with ``longpack train --nproc 2 --json``; we report real tokens per second (padding
excluded), mean step time and the ratio to random_padded, all measured in one run of this script, planners
interleaved over ``--repeat`` rounds and the median kept (the machine is shared and noisy). HBP runs with
SP-1 groups [512, 4096] because the CPU runtime executes data parallelism only here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from _report import write_section

PLANNERS = {"random_padded": [], "isf": [], "skrull": [], "hbp": ["--opt", "groups=512:1:0,4096:1:0",
                                                                  "--opt", "curriculum=0"]}


def run(planner: str, extra: list[str], samples: int, gb: int) -> dict:
    cmd = [sys.executable, "-m", "longpack.cli", "train", "--workload", "tiny-longtail", "--samples", str(samples),
           "--global-batch", str(gb), "--planner", planner, "--nproc", "2", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    steps = [x for x in lines if "step" in x]
    tokens = sum(s["tokens"] for s in steps)
    seconds = sum(s["step_seconds"] for s in steps)
    return {"tokens_per_second": tokens / seconds, "step_seconds": seconds / len(steps), "steps": len(steps),
            "tokens": tokens, "final_loss": lines[-1]["summary"]["final_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=384)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {p: [] for p in PLANNERS}
    for _ in range(args.repeat):
        for planner, extra in PLANNERS.items():
            results[planner].append(run(planner, extra, args.samples, args.global_batch))
            print(planner, results[planner][-1], flush=True)
    med = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for p, rs in results.items()}
    base = med["random_padded"]["tokens_per_second"]
    rows = [(p, m["tokens_per_second"], m["tokens_per_second"] / base, m["step_seconds"], int(m["steps"]),
             int(m["tokens"])) for p, m in med.items()]
    for r in rows:
        print(f"{r[0]:14s} {r[1]:8.0f} tokens/s  {r[2]:5.2f}x  {r[3]:6.3f} s/step  {r[4]} steps  {r[5]} tokens")
    if args.write:
        import torch

        body = ("| planner | tokens/s (median) | vs random_padded | s per step | steps | real tokens |\n"
                "|---|---|---|---|---|---|\n"
                + "\n".join(f"| {p} | {t:.0f} | {x:.2f}x | {s:.3f} | {n} | {k} |" for p, t, x, s, n, k in rows)
                + f"\n\ntiny-llama (4 layers, hidden 256, vocab 1024), float32, {args.samples} tiny-longtail samples, "
                f"global batch {args.global_batch}, token cap 4096 per micro-batch, 2 gloo processes with 1 thread "
                f"each, torch {torch.__version__}; median of {args.repeat} interleaved rounds.")
        write_section("train_throughput", "Training throughput (real CPU runs)",
                      "python bench/train_throughput.py --write", body)


if __name__ == "__main__":
    main()
