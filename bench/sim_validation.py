"""Simulator validation: predicted step time (calibrated cost model) vs measured step time of real CPU training.

    python bench/sim_validation.py [--steps 8] [--write]

1. ``longpack calibrate --nproc 2`` on this machine (tiny-llama, 2 processes of 1 thread timing each point at once,
   as the 2 training processes run).
2. For random_padded, isf and skrull: ``longpack train --nproc 2`` on tiny-longtail (2 gloo ranks, DP 2) logs every
   step's wall time; the same plan is simulated with the calibrated HardwareSpec.
3. Per-step relative error (predicted − measured) / measured; the goal is within 10%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import numpy as np
from _report import write_section

from longpack import jobs
from longpack.sim import simulate

PLANNERS = ("random_padded", "isf", "skrull")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hw = f"{tmp}/cpu.json"
        cal = json.loads(subprocess.run([sys.executable, "-m", "longpack.cli", "calibrate", "--out", hw, "--threads",
                                         "1", "--nproc", "2", "--json"], capture_output=True, text=True,
                                        check=True).stdout)
        rows = []
        for planner in PLANNERS:
            out = subprocess.run([sys.executable, "-m", "longpack.cli", "train", "--workload", "tiny-longtail",
                                  "--planner", planner, "--nproc", "2", "--steps", str(args.steps), "--json"],
                                 capture_output=True, text=True, check=True).stdout
            measured = [json.loads(x)["step_seconds"] for x in out.splitlines() if x.startswith('{"step"')]
            spec = jobs.RunSpec(workload="tiny-longtail", model="tiny-llama", hardware=hw, dp=2, token_cap=4096,
                                global_batch=32, steps=args.steps, seed=0)
            lengths, max_len = jobs.load_workload(spec)
            cost = jobs.build_cost(spec)
            plan, _ = jobs.run_plan(planner, lengths, spec, cost, max_len)
            predicted = [s.time_s for s in simulate(plan, cost).steps]
            err = (np.array(predicted) - np.array(measured)) / np.array(measured)
            # the first step pays one-time costs (allocator warm-up, first collectives): reported, not averaged
            rows.append((planner, float(np.mean(measured[1:])), float(np.mean(predicted[1:])),
                         float(np.mean(np.abs(err[1:]))), float(np.max(np.abs(err[1:]))), float(err[0])))
            print(rows[-1], flush=True)
    if args.write:
        body = ("| plan | measured s/step | predicted s/step | mean abs error | max abs error | first step error |\n"
                "|---|---|---|---|---|---|\n"
                + "\n".join(f"| {p} | {m:.3f} | {s:.3f} | {100 * e:.1f}% | {100 * x:.1f}% | {100 * f:+.1f}% |"
                            for p, m, s, e, x, f in rows)
                + f"\n\nCalibration fit (tiny-llama, 2 processes x 1 thread, {len(cal['points'])} micro-batches): rms "
                f"{100 * cal['rms_relative_error']:.1f}%, max {100 * cal['max_relative_error']:.1f}%. Training: 2 gloo "
                f"processes, tiny-longtail, global batch 32, token cap 4096, {args.steps} steps; errors over steps "
                "2.. (the first step carries one-time costs).")
        write_section("sim_validation", "Simulator validation (calibrated CPU model vs real steps)",
                      "python bench/sim_validation.py --write", body)


if __name__ == "__main__":
    main()
