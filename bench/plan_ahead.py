"""What training waits on the planner: the run planned ahead on a thread beside the run planned up front.

    python bench/plan_ahead.py [--planner unified] [--steps 8] [--write]

Two ``longpack train`` runs in one invocation, same rows, same planner, same seed: ``--plan-ahead 4`` (steps planned
on a background thread, four ahead of training) and ``--plan-ahead 0`` (the whole run planned before step 0). Each
step's logged ``planner_wait_seconds`` is shown beside the step's time, with the planner's own seconds and the
run's tokens/s. The plan is the same, so the losses must be equal (checked). Workload: lmsys-chat-1m lengths on
tiny-llama, 2 gloo processes at CP 2, global batch 128 (a step of about 60k tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _report import write_section


def _run(planner: str, steps: int, ahead: int, batch: int) -> tuple[list[dict], dict]:
    cmd = [sys.executable, "-m", "longpack.cli", "train", "--workload", "lmsys-chat-1m", "--samples", "4096",
           "--planner", planner, "--global-batch", str(batch), "--steps", str(steps), "--nproc", "2", "--cp", "2",
           "--plan-ahead", str(ahead), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return [x for x in lines if "step" in x], next(x["summary"] for x in lines if "summary" in x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--planner", default="unified")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    runs = {ahead: _run(args.planner, args.steps, ahead, args.global_batch) for ahead in (4, 0)}
    (a, sa), (b, sb) = runs[4], runs[0]
    if [x["loss"] for x in a] != [x["loss"] for x in b]:
        raise SystemExit("the two runs trained different steps: the plan must not depend on planning ahead")
    rows = ["| step | step s (ahead 4) | waited s (ahead 4) | step s (ahead 0) | waited s (ahead 0) |",
            "|---|---|---|---|---|"]
    for x, y in zip(a, b, strict=True):
        rows.append(f"| {x['step']} | {x['step_seconds']:.2f} | {x['planner_wait_seconds']:.4f} | "
                    f"{y['step_seconds']:.2f} | {y['planner_wait_seconds']:.4f} |")
    later = max(x["planner_wait_seconds"] for x in a[1:]) if len(a) > 1 else 0.0
    body = "\n".join(rows) + (
        f"\n\nPlanner {args.planner}, {args.steps} steps of {args.global_batch} rows. Planned ahead: waited "
        f"{sa['planner_wait_seconds']:.3f} s in all (step 0 {a[0]['planner_wait_seconds']:.3f} s, at most "
        f"{later:.4f} s at any later step); planning took {sa['planning_seconds']:.2f} s on the thread; "
        f"{sa['tokens_per_second']:.0f} tokens/s. Planned up front: waited {sb['planner_wait_seconds']:.3f} s, all "
        f"before step 0; {sb['tokens_per_second']:.0f} tokens/s (ratio ahead / up front "
        f"{sa['tokens_per_second'] / sb['tokens_per_second']:.3f}, over the steps only). Losses equal in both runs.")
    print(body)
    if args.write:
        write_section("plan_ahead", "Planning ahead: seconds each step waited on the planner",
                      f"python bench/plan_ahead.py --planner {args.planner} --steps {args.steps}", body)


if __name__ == "__main__":
    main()
