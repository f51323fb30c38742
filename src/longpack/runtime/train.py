"""Training orchestrator: plan once (deterministically, on every rank), then run the plan for real.

Per step and rank: the :class:`~longpack.runtime.data.PlanSampler` gives this rank's micro-batches; each is
forwarded and backpropagated with exact global weights (runtime/loss.py); gradients are summed across ranks in one
all-reduce; AdamW steps. Every ``checkpoint_every`` steps rank 0 saves model, optimizer, sampler position and RNG;
``resume`` continues from the latest checkpoint at the exact next step. Rank 0 logs one line (or one JSON object)
per step: loss, tokens, step time, tokens/s; a summary at the end.

Launch: ``torchrun --nproc-per-node N -m longpack.cli train ...`` (gloo on CPU, nccl on GPU), or
``longpack train --nproc N`` which spawns the N processes itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .. import jobs
from ..model import get_model
from ..plan import Plan
from . import checkpoint
from .context_parallel import CPGroups
from .data import PlanSampler, SyntheticCorpus
from .dist import DistContext, all_reduce_sum, free_port, init_distributed
from .model import Decoder, DecoderConfig
from .step import run_micro_batches

__all__ = ["TrainArgs", "train", "build_plan", "launch"]


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    planner: str = "isf"
    run: jobs.RunSpec = field(default_factory=lambda: jobs.RunSpec(workload="tiny-longtail", model="tiny-llama",
                                                                    hardware="cpu", bucket_size=4096,
                                                                    global_batch=32))
    lr: float = 1e-3
    weight_decay: float = 0.0
    loss: str = "token_mean"
    dtype: str = "float32"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    json_log: bool = False
    threads: int | None = None


def build_plan(args: TrainArgs, world: int) -> Plan:
    """The plan every rank computes identically (same inputs, same seed)."""
    spec = args.run
    if spec.cp < 1 or world % spec.cp:
        raise ValueError(f"--cp {spec.cp} must divide the number of processes ({world})")
    spec = replace(spec, dp=world // spec.cp)
    if args.planner == "unified" and "shard_chains" not in spec.options:
        # the runtime runs chunk chains at cp = 1 only: unified keeps chains off CP groups
        spec = replace(spec, options=dict(spec.options) | {"shard_chains": 0})
    lengths, default_max_len = jobs.load_workload(spec)
    cost = jobs.build_cost(spec)
    plan, _ = jobs.run_plan(args.planner, lengths, spec, cost, default_max_len)
    return plan


def _emit(ctx: DistContext, args: TrainArgs, record: dict[str, Any]) -> None:
    if ctx.rank != 0:
        return
    if args.json_log:
        print(json.dumps(record), flush=True)
    elif "summary" in record:
        s = record["summary"]
        print(f"done: {s['steps']} steps, {s['tokens_per_second']:.0f} tokens/s, final loss {s['final_loss']:.4f}",
              flush=True)
    else:
        print(f"step {record['step']:5d}  loss {record['loss']:.4f}  tokens {record['tokens']:6d}  "
              f"{record['step_seconds']:.3f} s  {record['tokens'] / record['step_seconds']:.0f} tokens/s", flush=True)


def train(args: TrainArgs, ctx: DistContext | None = None) -> dict[str, Any]:
    """Run the plan; returns {"steps": [per-step records], "summary": {...}, "model": the trained model}."""
    ctx = ctx or init_distributed()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[args.dtype]
    plan = build_plan(args, ctx.world)
    fingerprint = checkpoint.plan_fingerprint(plan.to_json())
    spec = get_model(args.run.model)
    torch.manual_seed(args.run.seed)
    model = Decoder(DecoderConfig.from_spec(spec)).to(device=ctx.device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    corpus = SyntheticCorpus(spec.vocab, seed=args.run.seed)
    sampler = PlanSampler(plan, ctx.rank)
    groups = CPGroups.for_plan(plan, ctx.world) if ctx.distributed and max(s.cp for s in plan.steps) > 1 else None
    if args.resume and args.checkpoint_dir:
        state = checkpoint.load_latest(args.checkpoint_dir)
        if state is not None:
            if state["plan"] != fingerprint:
                raise ValueError(f"--resume: the checkpoint in {args.checkpoint_dir} was made for another plan; "
                                 "use the same workload, planner, layout and seed")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sampler.load_state_dict(state["sampler"])
    records = []
    t_start = time.perf_counter()
    for step, mbs in sampler:
        t0 = time.perf_counter()
        cp, cp_rank, group = groups.of(plan.steps[step], ctx.rank) if groups else (1, 0, None)
        loss, tokens = run_micro_batches(model, plan, step, mbs, corpus, mode=args.loss, device=ctx.device,
                                         cp_rank=cp_rank, cp_group=group, cp=cp)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        stats = torch.tensor([loss, float(tokens)], dtype=torch.float64)
        all_reduce_sum(grads + [stats])
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": step, "loss": float(stats[0]), "tokens": int(stats[1]),
               "step_seconds": time.perf_counter() - t0}
        records.append(rec)
        _emit(ctx, args, rec)
        if args.checkpoint_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            if ctx.rank == 0:
                checkpoint.save(args.checkpoint_dir, step + 1, model=model, optimizer=opt,
                                sampler=sampler.state_dict(), fingerprint=fingerprint)
            if ctx.distributed:
                torch.distributed.barrier()
    elapsed = time.perf_counter() - t_start
    total = sum(r["tokens"] for r in records)
    summary = {"tokens_per_second": total / elapsed if elapsed > 0 else 0.0,
               "final_loss": records[-1]["loss"] if records else float("nan"), "steps": len(records)}
    _emit(ctx, args, {"summary": summary})
    return {"steps": records, "summary": summary, "model": model}


def _worker(rank: int, world: int, port: int, args_dict: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    args_dict = dict(args_dict)
    args_dict["run"] = jobs.RunSpec(**args_dict["run"])
    args = TrainArgs(**args_dict)
    if args.threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        train(args)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def launch(args: TrainArgs, nproc: int) -> None:
    """Spawn ``nproc`` local processes (gloo on CPU) running :func:`train`; rank 0 prints."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    build_plan(args, nproc)  # fail fast in the parent with a clear message, before spawning anything
    if nproc == 1:
        train(args)
        return
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(nproc, free_port(), asdict(args)), nprocs=nproc, join=False,
                             start_method="spawn")
    while not ctx.join():
        pass
    sys.stdout.flush()
