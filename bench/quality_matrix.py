"""Quality matrix: every planner x every built-in workload x (DP4·CP8, DP32·CP8) x three models, simulated.

    python bench/quality_matrix.py [--steps 4] [--samples 20000] [--planners a,b] [--opt KEY=VALUE ...] [--write]

For each cell: mean simulated step time, efficiency against the lower bound, speedup vs fixed_cp (time to train the
same samples: HBP regroups them into its own steps), DBR / ABR / CR / PR and OOM steps, all planners on the same
global batches (256 sequences per step for DP4, 2048 for DP32). With ``--opt`` (planner options, e.g. ``widen=1``:
CP groups wider than ``--cp`` 8) the table is written to a section of its own, beside the default one.
"""

from __future__ import annotations

import argparse

from _report import write_section

from longpack import jobs
from longpack.planners import PLANNERS
from longpack.workloads import WORKLOADS

MODELS = ("qwen2.5-0.5b", "qwen2.5-7b", "llama3.1-8b")
LAYOUTS = ((4, 8), (32, 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w != "tiny-longtail"))
    ap.add_argument("--planners", default=None, help="comma-separated (default: every planner)")
    ap.add_argument("--opt", action="append", default=[], help="KEY=VALUE planner option, repeatable")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    planners = args.planners.split(",") if args.planners else sorted(PLANNERS)
    options = dict(o.split("=", 1) for o in args.opt)
    rows = []
    for model in MODELS:
        for dp, cp in LAYOUTS:
            for workload in args.workloads.split(","):
                spec = jobs.RunSpec(workload=workload, samples=args.samples, model=model, hardware="h100", dp=dp,
                                    cp=cp, global_batch=64 * dp, steps=args.steps, seed=0, options=options)
                try:
                    res = jobs.compare(spec, planners, "fixed_cp")
                except ValueError as exc:  # e.g. a planner refusing an impossible setup: shown, not hidden
                    rows.append((model, f"DP{dp}xCP{cp}", workload, "-", str(exc)[:60], 0, 0, 0, 0, 0, 0, 0))
                    continue
                for name, r in res["planners"].items():
                    rows.append((model, f"DP{dp}xCP{cp}", workload, name, f"{r['step_time_s']:.3f}",
                                 r["efficiency"], r["speedup"], r["dbr"], r["abr"], r["cr"], r["pr"], r["oom_steps"]))
                best = max(res["planners"].items(), key=lambda kv: kv[1]["speedup"])
                print(f"{model} DP{dp}xCP{cp} {workload}: best {best[0]} {best[1]['speedup']:.2f}x", flush=True)
    if args.write:
        body = ("| model | layout | workload | planner | step s | efficiency | vs fixed_cp | DBR | ABR | CR | PR "
                "| OOM |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
                + "\n".join(f"| {m} | {lay} | {w} | {p} | {t} | {e:.3f} | {s:.2f}x | {d:.3f} | {a:.3f} | {c:.3f} | "
                            f"{pr:.3f} | {o} |" for m, lay, w, p, t, e, s, d, a, c, pr, o in rows)
                + "\n\n" + _short_of(rows)
                + f"\n\nH100 cost model, {args.samples:,} samples per workload, {args.steps} global batches of "
                "64 x DP sequences; the same batches for every planner (HBP regroups their samples into its own "
                "steps, often fewer, so its step time is per its steps and part of its speedup — the time to train "
                "the same samples — comes from taking fewer optimizer steps). Every planner's CP groups divide "
                "--cp 8" + (f"; planner options: {', '.join(args.opt)}" if args.opt else " (unified and hbp go "
                "wider only with --opt widen=1: the section below)") + ".")
        extra = (f" --planners {args.planners}" if args.planners else "") + "".join(f" --opt {o}" for o in args.opt)
        name = "quality_matrix" + "".join("_" + o.split("=", 1)[0] for o in args.opt)
        title = "Quality matrix (simulated)" + (f", --opt {' '.join(args.opt)}" if args.opt else "")
        write_section(name, title, f"python bench/quality_matrix.py --steps {args.steps} --samples {args.samples}"
                      f"{extra} --write", body)


def _short_of(rows: list[tuple]) -> str:
    """One line: the unified cells whose efficiency is below 0.97 (the table rounds to three digits, so a cell at
    0.9699 reads 0.970 there), to four digits."""
    short = [f"{m} {lay} {w} {e:.4f}" for m, lay, w, p, _, e, *_ in rows if p == "unified" and e < 0.97]
    if not short:
        return "Unified reaches efficiency 0.97 in every cell."
    return f"Unified below efficiency 0.97 in {len(short)} cells: " + "; ".join(short) + "."


if __name__ == "__main__":
    main()
