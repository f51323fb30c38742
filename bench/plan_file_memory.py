"""Peak memory of `longpack simulate PLAN.json` per byte of the plan's JSON: the factor behind the refusal of a plan
file too large for the machine (jobs.PLAN_BYTES_PER_JSON_BYTE).

For each size, `longpack plan` writes a plan of the workload's steps; a fresh process imports longpack, notes its
peak resident memory, reads and validates the file (jobs.load_plan_file) and simulates it (jobs.summarize) as the
command does, and reports the rise of its peak over the JSON's bytes.

    python bench/plan_file_memory.py [--steps 200 800] [--write]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import write_section

CHILD = r"""
import json, resource, sys
from pathlib import Path
from longpack import jobs
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
p = jobs.load_plan_file(Path(sys.argv[1]))
m = p.meta
spec = jobs.RunSpec(model=m["model"], hardware=m["hardware"], dp=m["dp"], cp=m["cp"], token_cap=m["token_cap"])
jobs.summarize(p, jobs.build_cost(spec))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak}))
"""


def measure(steps: int, planner: str, folder: Path) -> dict:
    out = folder / f"plan-{steps}.json"
    subprocess.run([sys.executable, "-m", "longpack.cli", "plan", "--planner", planner, "--workload",
                    "chatqa2-long-sft", "--model", "qwen2.5-7b", "--hardware", "h100", "--dp", "8", "--global-batch",
                    "64", "--steps", str(steps), "--samples", str(64 * steps), "--out", str(out)],
                   check=True, capture_output=True, text=True)
    got = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(out)], check=True, capture_output=True,
                                    text=True).stdout)
    size = out.stat().st_size
    return {"steps": steps, "json_bytes": size, "rise_bytes": got["peak"] - got["base"],
            "factor": (got["peak"] - got["base"]) / size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[200, 800])
    ap.add_argument("--planner", default="isf")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in args.steps:
            r = measure(steps, args.planner, Path(tmp))
            rows.append(r)
            print(f"{r['steps']:6d} steps: {r['json_bytes'] / 2**20:8.1f} MiB of JSON, peak rose "
                  f"{r['rise_bytes'] / 2**20:8.1f} MiB: {r['factor']:.1f} bytes per JSON byte", flush=True)
    slope = _slope(rows)
    if slope is not None:
        print(f"slope between the smallest and the largest plan: {slope:.1f} bytes per JSON byte")
    if args.write:
        body = ("| steps | plan JSON (MiB) | peak rise (MiB) | bytes per JSON byte |\n|---|---|---|---|\n"
                + "".join(f"| {r['steps']:,} | {r['json_bytes'] / 2**20:.1f} | {r['rise_bytes'] / 2**20:.1f} | "
                          f"{r['factor']:.1f} |\n" for r in rows)
                + (f"\nBetween the smallest and the largest plan the peak grows {slope:.1f} bytes per JSON byte: "
                   "rounded up, the factor a large file is refused by (jobs.PLAN_BYTES_PER_JSON_BYTE)."
                   if slope else "")
                + f"\n\nPlanner {args.planner}, chatqa2-long-sft, qwen2.5-7b on h100, dp 8, global batch 64; the "
                  "peak resident memory of a fresh process over its peak after importing longpack.")
        write_section("plan-file-memory", "Memory of simulating a plan file",
                      f"python bench/plan_file_memory.py --steps {' '.join(map(str, args.steps))} --write", body)


def _slope(rows: list[dict]) -> float | None:
    """The peak's growth per JSON byte from the smallest plan to the largest (the constant overhead cancels)."""
    if len(rows) < 2 or rows[-1]["json_bytes"] == rows[0]["json_bytes"]:
        return None
    return (rows[-1]["rise_bytes"] - rows[0]["rise_bytes"]) / (rows[-1]["json_bytes"] - rows[0]["json_bytes"])


if __name__ == "__main__":
    main()
