"""Summarise bench/gpu.sh's outputs: the calibration fit, and tokens/s and MFU of each trained plan.

    python bench/gpu_report.py OUT_DIR --model M --workload W --steps N --batch B --cap C [--write]

Peak memory: the largest measured per-rank figure of the timed steps (CUDA max_memory_allocated; on the CPU dry
run, activations held for backward) beside the cost model's prediction for the same rank and step.

MFU = model FLOPs per second / the GPU's dense bf16 peak: linear FLOPs 3 x (forward) per token and attention
3 x forward per (query, key) pair of the causal documents actually trained (rebuilt from the same plan), over the
measured wall time of the steps after the first (compile and allocator warm-up excluded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _report import write_section

from longpack import jobs
from longpack.model import get_model

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--cap", type=int, required=True)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    try:
        cal = json.loads((out / "calibrate.json").read_text())
    except (OSError, ValueError):
        cal = {}  # the calibration stage failed: bench/gpu.sh lists it
    import torch

    gpu = cal.get("gpu") or (torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)")
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    spec = get_model(args.model)
    rows = []
    for planner in ("random_padded", "bfd", "isf", "unified"):
        path = out / f"train-{planner}.jsonl"
        log = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")] if path.exists() else []
        steps = [r for r in log if "step" in r]
        if not steps:
            print(f"{planner:14s} no steps logged ({path.name}): left out")
            continue
        run = jobs.RunSpec(workload=args.workload, samples=20000, model=args.model, hardware="h100", dp=1, cp=1,
                           global_batch=args.batch, steps=args.steps, token_cap=args.cap)
        lengths, default_max_len = jobs.load_workload(run)
        plan, _ = jobs.run_plan(planner, lengths, run, jobs.build_cost(run), default_max_len)
        flops = []
        for step in plan.steps:
            tokens = pairs = 0.0
            for rep in step.replicas:
                for mb in rep.micro_batches:
                    for p in mb.pieces:
                        tokens += p.stop - p.start
                        pairs += 0.5 * (p.stop * p.stop - p.start * p.start)
            flops.append(3 * (tokens * (spec.layers * spec.linear_flops_per_token + spec.head_flops_per_token)
                              + pairs * spec.layers * spec.attn_flops_per_pair))
        timed = steps[1:] or steps
        seconds = sum(r["step_seconds"] for r in timed)
        tok = sum(r["tokens"] for r in timed)
        achieved = sum(flops[r["step"]] for r in timed) / seconds
        mem = max(max(r["memory"]["measured_bytes"]) for r in timed) / 2**30
        pred = max(max(r["memory"]["predicted_bytes"]) for r in timed) / 2**30
        rows.append((planner, tok / seconds, achieved, achieved / peak if peak else None, steps[-1]["loss"], mem,
                     pred))
        print(f"{planner:14s} {tok / seconds:10.0f} tokens/s  {achieved / 1e12:8.2f} TFLOP/s  "
              f"MFU {'-' if not peak else f'{100 * achieved / peak:.1f}%'}  final loss {steps[-1]['loss']:.4f}")
    if not rows:
        raise SystemExit("bench/gpu_report.py: no planner logged a step")
    base = rows[0][1]
    fit = (f"Calibration fit on the GPU: rms {100 * cal['rms_relative_error']:.1f}%, max "
           f"{100 * cal['max_relative_error']:.1f}% over {len(cal['points'])} packs." if cal else
           "Calibration: failed (bench/gpu.sh's stage list).")
    body = (f"GPU: {gpu}; model {args.model} (random init, {cal.get('dtype', 'bfloat16')}), {args.workload}, "
            f"global batch {args.batch}, token cap {args.cap}, {args.steps} steps (first excluded).\n\n"
            f"{fit}\n\n"
            f"| planner | tokens/s | vs {rows[0][0]} | TFLOP/s | MFU | final loss | peak GiB measured | predicted |\n"
            "|---|---|---|---|---|---|---|---|\n"
            + "\n".join(f"| {p} | {t:.0f} | {t / base:.2f}x | {a / 1e12:.2f} | "
                        f"{'-' if m is None else f'{100 * m:.1f}%'} | {loss:.4f} | {mg:.2f} | {pg:.2f} |"
                        for p, t, a, m, loss, mg, pg in rows))
    if args.write:
        write_section("gpu", "GPU: calibration, packed vs padded throughput and MFU", "bench/gpu.sh", body)


if __name__ == "__main__":
    main()
