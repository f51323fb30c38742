"""Pipeline bubbles measured on real stage processes beside the simulator's (runtime/kernel/pipeline.py,
sim/pipeline.py).

    python bench/pipeline_bubble.py [--unit 512] [--steps 3] [--write]

1. **The paper's toy** (ChunkFlow Fig. 2): micro-batches of 4, 2, 1, 1 units, PP 4, on 4 gloo processes — a Llama of
   4 decoder layers (one per stage, hidden 512), a unit being ``--unit`` tokens of packed 128-token documents so
   that forward time follows tokens. Run as plain 1F1B (simulated bubble 4/7 = 57.14%), and ChunkFlow's variant:
   the 4-unit sequence as one document in two chunks of 2 units with K = 2 beside bins of 2 + 1 + 1 (47.83%). The
   schedule is made from the unit lengths, as in the paper; measured bubble = 1 − Σ(F + B seconds) / (pp ·
   makespan), each rank timing its own ops (median over ``--steps``).
2. **A tiny-longtail plan**: ``longpack train --planner chunkflow --pp 2`` (chunks of 256, K = 1), per stage and
   step the measured busy seconds beside the busy seconds of the simulated schedule (cost model, cpu preset), and
   both bubbles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _report import write_section


def _toy_plan(variant: str, unit: int):
    from longpack.plan import MicroBatch, Piece, Plan, Replica, Step

    doc = 128
    per_unit = unit // doc
    lengths: dict[int, int] = {}
    mbs, fwd = [], []

    def packed(units: int) -> MicroBatch:
        pieces = []
        for _ in range(units * per_unit):
            s = len(lengths)
            lengths[s] = doc
            pieces.append(Piece(s, 0, doc, 0))
        return MicroBatch(tuple(pieces))

    if variant == "1f1b":
        for u in (4, 2, 1, 1):
            mbs.append(packed(u))
            fwd.append(float(u))
    else:  # chunk 2, K = 2: bins [2], [1 + 1], then the 4-unit document as two chunks
        mbs += [packed(2), packed(2)]
        fwd += [2.0, 2.0]
        s = len(lengths)
        lengths[s] = 4 * unit
        for a in (0, 2 * unit):
            mbs.append(MicroBatch((Piece(s, a, a + 2 * unit, 0),)))
            fwd.append(2.0)
    plan = Plan(f"toy-{variant}", 1, lengths, (Step(cp=1, token_cap=4 * unit, replicas=(Replica(tuple(mbs)),)),))
    plan.validate()
    return plan, fwd


def _toy_worker(rank: int, world: int, port: int, out: str, variant: str, unit: int, steps: int) -> None:
    import torch

    from longpack.model import ModelSpec
    from longpack.runtime.dist import all_reduce_sum, init_distributed, leave
    from longpack.runtime.kernel.data import SyntheticCorpus
    from longpack.runtime.kernel.pipeline import Layout, PipelineStage, split_model
    from longpack.runtime.run.hf_model import build

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    spec = ModelSpec(name="toy", layers=world, hidden=512, heads=8, kv_heads=2, head_dim=64, ffn=1376, vocab=256)
    model = split_model(build(spec, 0, torch.float32).train(), rank, world)
    stage = PipelineStage(model, Layout.build(rank, world, world, tied=False), rank, spec.hidden, torch.float32)
    plan, fwd = _toy_plan(variant, unit)
    corpus = SyntheticCorpus(spec.vocab, seed=0)
    rows = []
    for _ in range(steps + 1):  # the first step warms up
        torch.distributed.barrier()
        stage.run_step(plan, 0, plan.steps[0].replicas[0].micro_batches, corpus, fwd_s=fwd)
        model.zero_grad(set_to_none=True)
        vals = torch.zeros((2, world), dtype=torch.float64)
        vals[:, rank] = torch.tensor([stage.useful, stage.span])
        all_reduce_sum([vals])
        useful, span = vals.tolist()
        rows.append({"measured": 1 - sum(useful) / (world * max(span)), "simulated": stage.simulated_bubble,
                     "busy": useful})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows[1:], f)
    leave()


def toy(variant: str, unit: int, steps: int) -> dict:
    import torch.multiprocessing as mp

    from longpack.runtime.dist import free_port

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.spawn(_toy_worker, args=(4, free_port(), out, variant, unit, steps), nprocs=4)
        with open(out) as f:
            rows = json.load(f)
    return {"measured": statistics.median(r["measured"] for r in rows), "simulated": rows[0]["simulated"],
            "runs": [r["measured"] for r in rows]}


def longtail(steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "longpack.cli", "train", "--planner", "chunkflow", "--opt", "chunk_size=256",
           "--opt", "k=1", "--pp", "2", "--nproc", "2", "--steps", str(steps), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(x) for x in out.splitlines() if x.startswith('{"step"')]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unit", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lines = []
    for variant, label in (("1f1b", "1F1B, micro-batches 4, 2, 1, 1"),
                           ("chunked", "state-aware 1F1B, chunk 2, K = 2")):
        r = toy(variant, args.unit, args.steps)
        line = (f"| {label} | {r['simulated']:.2%} | {r['measured']:.2%} | "
                f"{(r['measured'] - r['simulated']) * 100:+.1f} | {', '.join(f'{x:.1%}' for x in r['runs'])} |")
        print(line, flush=True)
        lines.append(line)
    tail = []
    for rec in longtail(args.steps):
        p = rec["pipeline"]
        busy = " / ".join(f"{b:.2f}" for b in p["busy_seconds"])
        sim = " / ".join(f"{b:.2f}" for b in p["simulated_busy_seconds"])
        row = (f"| {rec['step']} | {rec['tokens']:,} | {busy} | {sim} | {p['measured_bubble'][0]:.1%} | "
               f"{p['simulated_bubble'][0]:.1%} |")
        print(row, flush=True)
        tail.append(row)
    if args.write:
        import torch

        body = ("| the paper's toy on 4 processes | simulated bubble | measured bubble (median) | points | "
                "measured per step |\n|---|---|---|---|---|\n" + "\n".join(lines)
                + f"\n\nA unit = {args.unit} tokens (packed 128-token documents; the chunked sequence is one "
                f"{4 * args.unit}-token document); Llama shape, 4 layers of hidden 512, one per stage, float32, "
                f"1 thread per process, torch {torch.__version__}, gloo; {args.steps} steps after one warm-up.\n\n"
                "| tiny-longtail step (chunkflow, PP 2) | tokens | busy s per stage, measured | busy s per "
                "stage, simulated | bubble measured | bubble simulated |\n|---|---|---|---|---|---|\n"
                + "\n".join(tail)
                + "\n\n`longpack train --planner chunkflow --opt chunk_size=256 --opt k=1 --pp 2 --nproc 2 --json`"
                "; simulated busy seconds are the cost model's (cpu preset), which prices this machine's CPU "
                "roughly: compare their split across stages and the bubbles, not the absolute seconds. "
                "The machine has 2 cores, so 4 stage processes share them: when more than two stages are busy "
                "at once each runs slower, which the simulator does not model.")
        write_section("pipeline_bubble", "Pipeline bubbles: measured on stage processes vs simulated",
                      "python bench/pipeline_bubble.py --write", body)


if __name__ == "__main__":
    main()
