"""Rank 0's step lines (:func:`emit`: text or JSON on stdout) and what every rank measured in a step
(:func:`rank_rows`, :func:`rank_fields`): its memory beside the cost model's prediction, and its compute seconds."""

from __future__ import annotations

import json
from typing import Any

import torch

from ...cost import CostModel
from ...plan import Plan
from ..dist import DistContext
from ..kernel.memory import predicted_bytes
from ..kernel.stages import pipeline_phrase
from .train_args import TrainArgs

__all__ = ["emit", "show", "rank_rows", "rank_fields", "rank_prediction"]


def emit(ctx: DistContext, args: TrainArgs, record: dict[str, Any]) -> None:
    """Rank 0 says ``record`` (:func:`show`); the others say nothing."""
    if ctx.rank == 0:
        show(args, record)


def show(args: TrainArgs, record: dict[str, Any]) -> None:
    """A record on stdout: its JSON line under --json, else its line of text."""
    if args.out.json_log:  # a step's sample ids go to metrics.jsonl only (runtime/run/metrics.py)
        print(json.dumps({k: v for k, v in record.items() if k != "samples"}), flush=True)
    elif "summary" in record:
        s = record["summary"]
        print(f"done: {s['steps']} steps, {s['tokens_per_second']:.0f} tokens/s, final loss {s['final_loss']:.4f}, "
              f"waited {s['planner_wait_seconds']:.2f} s on the planner (planning took {s['planning_seconds']:.2f} s)"
              + (f", saved {s['output_dir']}" if s.get("output_dir") else ""), flush=True)
    elif "run" in record:
        r = record["run"]
        print(f"run: {r['processes']} process{'es' if r['processes'] > 1 else ''}, {r['threads']} thread"
              f"{'s' if r['threads'] > 1 else ''} each, {r['device']}, {r['dtype']}, head loss: {r['head_loss']}, "
              f"layers: {r['kernels']}", flush=True)
    elif "data" in record:
        print("data: " + record["data"]["line"], flush=True)
    elif "resume" in record:
        pass  # said as the run began (resume.announce)
    elif "startup" in record:
        from .startup import Phases

        print(Phases.line(record["startup"]), flush=True)
    else:
        mem = record["memory"]
        print(f"step {record['step']:5d}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  grad norm "
              f"{record['grad_norm']:.3g}  targets {record['targets']:6d}  tokens "
              f"{record['tokens']:6d}  {record['step_seconds']:.3f} s  {record['tokens'] / record['step_seconds']:.0f}"
              f" tokens/s  mem {max(mem['measured_bytes']) / 2**20:.1f} MiB measured / "
              f"{max(mem['predicted_bytes']) / 2**20:.1f} predicted ({mem['what']})  waited "
              f"{record['planner_wait_seconds']:.3f} s on the planner" + pipeline_phrase(record)
              + (f"  eval loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""),
              flush=True)


def rank_prediction(plan: Plan, step: int, rank: int, cost: CostModel, activations_only: bool) -> float:
    """The cost model's peak bytes on ``rank`` in ``step``: its largest micro-batch at that one's checkpointing."""
    st = plan.steps[step]
    replica, cp_rank = st.position(rank)
    cp = st.replica_cp(replica)
    best = 0.0
    for mb in st.replicas[replica].micro_batches:
        tokens = mb.rank_tokens(cp)[cp_rank] if mb.pieces else 0
        prefix = max((p.start for p in mb.pieces), default=0)
        best = max(best, predicted_bytes(cost, tokens, mb.ckpt_layers, prefix, activations_only=activations_only))
    return best


def rank_rows(plan: Plan, step: int, cost: CostModel, ctx: DistContext, measured_cpu: float, prank: int,
              compute_s: float) -> torch.Tensor:
    """This rank's column of every rank's step figures (host, [3, world], zero in the other ranks' columns), to be
    summed over the ranks and read with the step's own figures (runtime/run/loop.share, read_once): its memory
    (measured peak beside the cost model's prediction) and its compute seconds, the CPU seconds its own thread
    spent in the step (time.thread_time: forward, backward, clipping and AdamW; waiting in a collective costs
    none, so the slowest rank is the step's critical path and the others' shortfall their idle, however busy the
    machine; on a GPU, the host's time launching)."""
    on_gpu = ctx.device.type == "cuda"
    rows = torch.zeros((3, ctx.world), dtype=torch.float64)
    rows[0, ctx.rank] = float(torch.cuda.max_memory_allocated(ctx.device)) if on_gpu else measured_cpu
    rows[1, ctx.rank] = rank_prediction(plan, step, prank, cost, activations_only=not on_gpu)
    rows[2, ctx.rank] = compute_s
    return rows


def rank_fields(values: list[float], world: int, on_gpu: bool) -> dict[str, Any]:
    """The step record's ``memory`` and ``compute_seconds`` from :func:`rank_rows`' values, read back."""
    measured, predicted, compute = values[:world], values[world:2 * world], values[2 * world:3 * world]
    return {"memory": {"what": "cuda max_memory_allocated" if on_gpu else "activations held for backward",
                       "measured_bytes": [int(x) for x in measured],
                       "predicted_bytes": [int(x) for x in predicted]},
            "compute_seconds": [round(x, 6) for x in compute]}
