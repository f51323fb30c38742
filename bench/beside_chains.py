"""Micro-batches on long-document data: chains' last pieces filled with whole samples, against TRL's bfd_split.

    python bench/beside_chains.py [--samples 8192] [--write]

Per workload (ChatQA2 and LongWriter lengths, --max-len 16384 split, token cap 16384, qwen2.5-0.5b on H100, DP 8,
CP 1) and planner: the non-empty micro-batches of the plan and its simulated seconds, with whole samples moved
beside chains' last pieces (planners/beside.py) and without (``fill_replica`` and unified's ``fill_step`` replaced
by the identity in this process: the code before), beside the packs TRL's ``bfd_split`` makes of the same global
batches (every sample cut into 16K pieces, then best-fit decreasing into 16K packs; its pieces lose the attention
to the document's earlier tokens, a chain keeps it).
"""

from __future__ import annotations

import argparse
from unittest import mock

import numpy as np
from _report import write_section

from longpack import jobs
from longpack.planners.packers import best_fit_dec
from longpack.sim.simulate import simulate

PACK = 16384
PLANNERS = ("isf", "fixed_cp", "skrull", "chunkflow", "unified")


def _run(planner: str, spec: jobs.RunSpec, lengths: np.ndarray, default: int | None) -> tuple[int, float, float]:
    cost = jobs.build_cost(spec)
    plan, seconds = jobs.run_plan(planner, lengths, spec, cost, default, note=None)
    mbs = sum(1 for step in plan.steps for rep in step.replicas for mb in rep.micro_batches if mb.pieces)
    return mbs, simulate(plan, cost, bounds=False).total_s, seconds


def _trl_packs(lengths: np.ndarray, global_batch: int, seed: int) -> int:
    cut = [[PACK] * (n // PACK) + ([n % PACK] if n % PACK else []) for n in lengths.tolist()]
    batches = jobs.global_batches(len(lengths), global_batch, seed=seed)
    return sum(len(best_fit_dec(np.array([p for i in b for p in cut[i]]), PACK)) for b in batches)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows = ["| workload | planner | micro-batches without | with | TRL bfd_split packs | with / TRL | simulated s "
            "without | with | planning s without | with |", "|---|---|---|---|---|---|---|---|---|---|"]
    for workload in ("chatqa2-long-sft", "tulu3-longwriter"):
        spec = jobs.RunSpec(workload=workload, samples=args.samples, dp=8, token_cap=PACK, max_len=PACK)
        lengths, default = jobs.load_workload(spec)
        trl = _trl_packs(lengths, spec.global_batch, spec.seed)
        for planner in PLANNERS:
            with mock.patch("longpack.planners.beside.fill_replica", lambda mbs, *a, **k: list(mbs)), \
                    mock.patch("longpack.planners.unified.fill_step", lambda step, *a, **k: step):
                m0, t0, p0 = _run(planner, spec, lengths, default)
            m1, t1, p1 = _run(planner, spec, lengths, default)
            rows.append(f"| {workload} | {planner} | {m0:,} | {m1:,} ({m1 / m0 - 1:+.1%}) | {trl:,} | {m1 / trl:.3f} | "
                        f"{t0:.2f} | {t1:.2f} ({t1 / t0 - 1:+.2%}) | {p0:.2f} | {p1:.2f} |")
            print(rows[-1], flush=True)
    body = "\n".join(rows) + (
        f"\n\n{args.samples} samples of each workload, global batch 256, seed 0; qwen2.5-0.5b on the H100 cost model, "
        "DP 8, CP 1, --token-cap 16384, --max-len 16384 (over-long samples split into chains). Without: whole "
        "samples never join a chain's micro-batch (the code before). TRL's packs cut documents apart, so its count "
        "is a floor for exact training, not a plan of the same computation.")
    if args.write:
        write_section("beside_chains", "Whole samples beside chain pieces: micro-batches against TRL's bfd_split",
                      f"python bench/beside_chains.py --samples {args.samples} --write", body)


if __name__ == "__main__":
    main()
