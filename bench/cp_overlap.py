"""Context parallelism on CPU: Skrull-style placement vs fixed CP, and K/V exchange overlap on vs off.

    python bench/cp_overlap.py [--steps 6] [--write]

Two gloo processes form one CP group (DP 1 x CP 2) training tiny-llama on tiny-longtail. The same global batches
are planned by ``skrull`` (short sequences whole on one rank, sequences over the 2K-token cap sharded) and by
``fixed_cp`` (every sequence sharded); each runs with the all-gather of K/V overlapped with local attention and
without. Step time = forward + backward + gradient all-reduce, median over ``--steps`` steps after one warm-up,
configurations interleaved over 2 rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

CONFIGS = [("skrull", True), ("skrull", False), ("fixed_cp", True), ("fixed_cp", False)]


def worker(rank: int, world: int, port: int, out: str, planner: str, overlap: bool, steps: int) -> None:
    import time

    from longpack import jobs
    from longpack.model import get_model
    from longpack.runtime.dist import all_reduce_sum, init_distributed
    from longpack.runtime.kernel.cp import CPContext, CPGroups
    from longpack.runtime.kernel.data import SyntheticCorpus
    from longpack.runtime.kernel.step import run_micro_batches
    from longpack.runtime.run.hf_model import build

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    spec = jobs.RunSpec(workload="tiny-longtail", model="tiny-llama", hardware="cpu", dp=1, cp=2, token_cap=2048,
                        global_batch=64, steps=steps + 1, seed=0)
    lengths, max_len = jobs.load_workload(spec)
    plan, _ = jobs.run_plan(planner, lengths, spec, jobs.build_cost(spec), max_len)
    groups = CPGroups.build({2}, world)
    model = build(get_model("tiny-llama"), 0, torch.float32).train()
    corpus = SyntheticCorpus(1024)
    times = []
    for s in range(len(plan.steps)):
        t0 = time.perf_counter()
        run_micro_batches(model, plan, s, plan.steps[s].replicas[0].micro_batches, corpus,
                          CPContext(degree=2, rank=rank, group=groups.group(2, rank), overlap=overlap))
        all_reduce_sum([p.grad for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"times": times[1:]}, out)
    torch.distributed.destroy_process_group()


def main() -> None:
    from longpack.runtime.dist import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    results: dict[tuple[str, bool], list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(2):
            for planner, overlap in CONFIGS:
                out = os.path.join(tmp, "t.pt")
                torch.multiprocessing.spawn(worker, args=(2, free_port(), out, planner, overlap, args.steps), nprocs=2)
                results[(planner, overlap)] += torch.load(out)["times"]
    med = {c: statistics.median(v) for c, v in results.items()}
    base = med[("fixed_cp", True)]
    for (planner, overlap), t in med.items():
        print(f"{planner:9s} overlap={overlap!s:5s} {t:.3f} s/step  {base / t:.2f}x vs fixed_cp")
    if args.write:
        from _report import write_section

        body = ("| placement | overlap | s per step (median) | vs fixed_cp (overlap on) |\n|---|---|---|---|\n"
                + "\n".join(f"| {p} | {'on' if o else 'off'} | {t:.3f} | {base / t:.2f}x |"
                            for (p, o), t in med.items())
                + f"\n\nDP 1 x CP 2 on 2 gloo processes (1 thread each), tiny-llama float32, tiny-longtail, global "
                f"batch 64, token cap 2048 per rank, {args.steps} steps x 2 rounds per configuration. Overlap on "
                "CPU/gloo can only hide the all-gather behind local attention in the forward pass; the backward "
                "all-reduce of K/V gradients is not overlapped.")
        write_section("cp_overlap", "Context parallelism: placement and overlap (real CPU runs)",
                      "python bench/cp_overlap.py --write", body)


if __name__ == "__main__":
    main()
