"""`longpack train`'s run on one rank: the user's rows and checkpoint, planned identically on every rank, trained.

Per step: the :class:`~longpack.runtime.data.PlanSampler` gives this rank's micro-batches; run_step
(runtime/train_step.py) forwards and backpropagates them with exact global weights (runtime/loss.py); gradients
are summed over ranks (FSDP2's reduce-scatter, or one all-reduce), clipped to the global norm, and AdamW and the
schedule step (runtime/optim.py); the step's figures are read from the device once, logged (runtime/step_log.py,
runtime/metrics.py) and, every --checkpoint-every steps, checkpointed (runtime/checkpoint.py). With --pp each
process keeps one stage's layers (runtime/pipeline.py). Around the loop: settings (runtime/train_args.py), inputs
and plan (runtime/run_plan.py), resume (runtime/resume.py), the output checkpoint (runtime/output.py), errors
(runtime/failure.py), and ``--nproc`` spawning (runtime/launch.py).

Launch: ``torchrun --nproc-per-node N -m longpack.cli train ...`` (gloo on CPU, nccl on GPU), or
``longpack train --nproc N``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import jobs
from ..cost import CostModel
from ..model import ModelSpec
from ..plan import Plan
from ..planners.stream import PlanStream
from ..progress import Meter
from . import checkpoint
from .accounting import chained_samples, data_report
from .ahead import PlanAhead
from .context_parallel import CPGroups
from .data import EpochSource, PlanSampler, Source
from .dist import DistContext, init_distributed
from .evaluate import Evaluation
from .failure import heartbeat, step_failure
from .fit import check_fits
from .metrics import MetricsLog
from .optim import adamw, build_scheduler, clip_gradients, warmup_of
from .output import save_output
from .resume import fingerprint, resume
from .run_plan import LAUNCHED, build_plan, held_out, load_source, model_spec, plan_stream, sharded, zero_stage
from .startup import Phases
from .step import check_step
from .step_log import emit, rank_record
from .train_args import TrainArgs, settings
from .train_step import run_step

__all__ = ["Prepared", "TrainArgs", "train", "build_plan", "plan_stream", "run_step", "settings", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class Prepared:
    """What the launcher read and planned before the ranks started (runtime/launch.py), handed to a rank that
    shares its memory (one process, or forked) so the rows and the plan are made once."""

    source: Source
    stream: PlanStream
    cost: CostModel
    clock: Phases  # the launcher's start-up so far (imports, data, plan), which the rank goes on counting


def train(args: TrainArgs, ctx: DistContext | None = None, prepared: Prepared | None = None) -> dict[str, Any]:
    """Run the plan; returns {"steps": [per-step records], "summary": {...}, "data": {...}, "model": model}."""
    clock = prepared.clock if prepared is not None else Phases()
    ctx = ctx or init_distributed(timeout=args.timeout)
    clock.mark("process_group")
    _one_voice(ctx.rank)
    if ctx.device.type == "cuda" and args.dtype != "bfloat16":
        raise ValueError(f"--dtype {args.dtype} on CUDA: the attention (FlashAttention varlen) runs in bfloat16; "
                         "use --dtype bfloat16 (parameters and optimizer state stay float32)")
    torch.set_num_threads(threads_per_process(args))
    spec = model_spec(args)
    check_fits(spec, world=ctx.world, local=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
               fsdp=sharded(args, ctx.world), dtype=DTYPES[args.dtype], device=ctx.device,
               per_layer=zero_stage(args, ctx.world, spec) == 3)
    launched = bool(os.environ.get(LAUNCHED))  # the launcher read the rows and planned: what it said is said
    if not launched and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # torchrun: once per machine
        check_folders(args, spec, ctx.world)
    say = jobs.say if ctx.rank == 0 and not launched else None
    source = prepared.source if prepared is not None else load_source(args, spec.vocab, say)
    if hasattr(source, "digest") and args.checkpoint_dir:  # what a checkpoint records, and a resume compares
        args = replace(args, data_content=source.digest())
    if args.run.epochs > 1 and prepared is None:  # the plan's samples are every epoch's copies of the rows
        n = len(source.lengths) if hasattr(source, "lengths") else len(jobs.load_workload(args.run)[0])
        source = EpochSource(source, n)
    if prepared is None:
        clock.mark("data")
    t_plan = time.perf_counter()
    if prepared is not None:
        stream, cost = prepared.stream, prepared.cost
    else:
        stream, cost = plan_stream(args, ctx.world, source, spec, note=say)
    ahead = PlanAhead(stream, args.plan_ahead, check=check_step)  # steps planned on a thread while others train
    header = time.perf_counter() - t_plan  # the over-long policy over the whole run (the whole plan at depth 0)
    clock.mark("plan")  # with a launcher's plan: this rank's checks and its planner thread
    try:
        evaluation = held_out(args, ctx.world, spec, say) if args.eval_data else None
        return _train(args, ctx, spec, source, ahead, cost, header, evaluation, clock)
    finally:
        ahead.close()


@dataclass
class _Parts:
    """What this rank trains with: the model (its stage's layers under --pp), optimizer and schedule, its plan
    rank's sampler, and the step's collectives (CP groups, FSDP2's step sync)."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    sampler: PlanSampler
    pipe: Any
    sync: Any
    groups: CPGroups | None
    prank: int
    mem_cost: CostModel  # the memory prediction at the run's own activation width (the planner assumes bf16)


def _parts(args: TrainArgs, ctx: DistContext, spec: ModelSpec, ahead: PlanAhead, cost: CostModel,
           clock: Phases) -> _Parts:
    pipe = _pipeline(args, spec, ctx, cost)
    model = _model(args, spec, ctx, ahead.plan, clock, pipe.stage if pipe else 0)
    if pipe is not None:
        pipe.model = model
    opt = adamw(model, args.lr, args.weight_decay)
    warmup = warmup_of(len(ahead), args.warmup_steps, args.warmup_ratio)
    sched = build_scheduler(opt, args.lr_scheduler, len(ahead), warmup, args.min_lr)
    prank = pipe.layout.prank if pipe else ctx.rank
    sync = None
    if sharded(args, ctx.world):
        from .parallelize import sync_for

        sync = sync_for(model, ctx.device, cost.cfg.zero_stage)
    return _Parts(model, opt, sched, PlanSampler(ahead.plan, prank, steps=len(ahead), ready=ahead.wait), pipe, sync,
                  CPGroups.build(set(), ctx.world, timeout=args.timeout) if ctx.distributed else None, prank,
                  CostModel(cost.model, cost.hw, replace(cost.cfg, act_bytes=DTYPES[args.dtype].itemsize)))


def _train(args: TrainArgs, ctx: DistContext, spec: ModelSpec, source: Source, ahead: PlanAhead, cost: CostModel,
           header: float, evaluation: Evaluation | None, clock: Phases) -> dict[str, Any]:
    """The training loop: per step, this rank's micro-batches forward and backward (run_step), the gradients
    clipped, AdamW and the schedule stepped, one read of the device, the step logged and checkpointed."""
    plan = ahead.plan
    report = data_report(plan, source)
    emit(ctx, args, {"run": {"processes": ctx.world, "threads": torch.get_num_threads(), "device": ctx.device.type,
                             "dtype": args.dtype, "head_loss": "longpack fused linear cross-entropy"}})
    emit(ctx, args, {"data": report})
    p = _parts(args, ctx, spec, ahead, cost, clock)
    first_layer = p.pipe.first_layer if p.pipe is not None else None
    cache: list[dict[str, Any]] = []  # the planned steps' JSON, for checkpoint fingerprints
    header += resume(args, p.model, p.opt, p.sampler, ctx, ahead, cache, first_layer, p.sched)
    norm_group = p.pipe.layout.cross_group if p.pipe is not None else None  # stages' squared norms add up
    tied = [p.pipe.tied_weight] if p.pipe is not None and p.pipe.last and p.pipe.tied_weight is not None else []
    log = _metrics_log(args, ctx, p.sampler.step)
    progress: Meter | None = None  # rank 0's line on stderr: steps done, tokens/s, time left
    records: list[dict[str, Any]] = []
    chained: set[int] = set()
    t_start = time.perf_counter()
    for step, mbs in p.sampler:
        heartbeat(step)
        t0, c0 = time.perf_counter(), time.thread_time()
        if ctx.rank == 0 and progress is None:  # from the first step this run trains (a resume's included)
            progress = Meter("train", len(ahead) - step, ("step",), "steps")
        if p.groups is not None:
            p.groups.add(plan.steps[step], ctx.world, args.pp)
        chained |= chained_samples(plan, step)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        lr = float(p.opt.param_groups[0]["lr"])
        try:  # every collective of the step: a peer that stops answering in any of them is said as such
            stats, peak = run_step(p.model, plan, step, mbs, source, ctx, p.groups, args.loss, p.sync, p.pipe)
            norm = clip_gradients(p.model.parameters(), args.max_grad_norm, norm_group, skip=tied)
            p.opt.step()
            p.sched.step()
            p.opt.zero_grad(set_to_none=True)
            compute_s = time.thread_time() - c0
            read = [stats, norm.reshape(1).to(stats)]
            if evaluation is not None and (step == len(ahead) - 1
                                           or args.eval_every and (step + 1) % args.eval_every == 0):
                read.append(evaluation.run(p.model, ctx, p.groups, args.loss, p.sync, p.pipe)[:1])
            loss_v, tokens_v, targets_v, norm_v, *held = torch.cat(read).tolist()  # the step's one device read
            step_s = time.perf_counter() - t0
            ranks = rank_record(plan, step, p.mem_cost, ctx, peak, p.prank, compute_s)
        except Exception as exc:
            raise step_failure(exc, step, ctx, args.timeout) from None
        rec = {"step": step, "loss": loss_v, "tokens": int(tokens_v), "targets": int(targets_v), "lr": lr,
               "grad_norm": norm_v, "step_seconds": step_s,
               "planner_wait_seconds": p.sampler.waited + (header if not records else 0.0), **ranks}
        rec.update({"eval_loss": held[0]} if held else {})
        rec.update({"pipeline": p.pipe.record(ctx.world, ctx.rank)} if p.pipe is not None else {})
        records.append(rec)
        emit(ctx, args, rec)
        if len(records) == 1:  # the first step this run trained: the start-up is over
            clock.mark("first_step")
            emit(ctx, args, {"startup": clock.record()})
        if log is not None:
            log.step(rec)
        if progress is not None:
            progress.hint = f"{sum(r['tokens'] for r in records) / (time.perf_counter() - t_start):,.0f} tokens/s"
            progress.tick()
        if args.checkpoint_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, step + 1, model=p.model, optimizer=p.opt,
                            sampler=p.sampler.state_dict(), fingerprint=fingerprint(plan, step + 1, cache),
                            rank=ctx.rank, settings=settings(args, ctx.world), first_layer=first_layer,
                            extra={"scheduler": p.sched.state_dict(), "total_steps": len(ahead)})
    for done in (log, progress):
        if done is not None:
            done.close()
    summary = _summary(args, records, report, len(chained), time.perf_counter() - t_start,
                       header + ahead.planning_seconds)
    if args.output_dir:
        save_output(args, p.model, ctx, p.pipe)
    emit(ctx, args, {"summary": summary})
    return {"steps": records, "summary": summary, "data": report, "model": p.model, "startup": clock.record()}


def _metrics_log(args: TrainArgs, ctx: DistContext, start: int) -> MetricsLog | None:
    """Rank 0's metrics.jsonl (+ TensorBoard, + --report-to) in --log-dir, else --output-dir; None without one.
    ``start``: the step a resumed run trains first (the records from it on, a killed run's, are dropped)."""
    where = args.log_dir or args.output_dir
    reporters = tuple(filter(None, args.report_to.split(",")))
    if reporters and not where:
        raise ValueError(f"--report-to {args.report_to}: needs --output-dir or --log-dir for its files")
    if not where or ctx.rank != 0:
        return None
    return MetricsLog(where, reporters, settings(args, ctx.world), resumed_at=start or None)


def _summary(args: TrainArgs, records: list[dict[str, Any]], report: dict[str, Any], chained: int, elapsed: float,
             planning: float) -> dict[str, Any]:
    total = sum(r["tokens"] for r in records)
    return {"tokens_per_second": total / elapsed if elapsed > 0 else 0.0,
            "final_loss": records[-1]["loss"] if records else float("nan"), "steps": len(records),
            "dropped_samples": report["dropped_samples"], "truncated_samples": report["truncated_samples"],
            "empty_rows_dropped": report["empty_rows_dropped"], "chained_samples": chained,
            "output_dir": args.output_dir, "threads": torch.get_num_threads(), "planning_seconds": planning,
            "planner_wait_seconds": sum(r["planner_wait_seconds"] for r in records)}

def _model(args: TrainArgs, spec: ModelSpec, ctx: DistContext, plan: Plan, clock: Phases,
           stage: int = 0) -> torch.nn.Module:
    from .hf_model import build, check_supported, load

    dtype = DTYPES[args.dtype]
    param_dtype = stored_dtype(dtype, sharded(args, ctx.world))
    longest = max((plan.effective_length(s) for s in plan.lengths), default=1)
    if args.model_path and sharded(args, ctx.world) and args.pp == 1:  # each rank reads its shards only
        from .head_loss import loss_head
        from .hf_model import config_of
        from .parallelize import parallelize
        from .shard_load import load_shards, meta_model, restore_buffers

        model = meta_model(config_of(spec, args.model_path), param_dtype)
        check_supported(model, longest)
        loss_head(model)
        clock.mark("model")
        parallelize(model, ctx.world, ctx.device, dtype)
        clock.mark("sharding")
        model.to_empty(device=ctx.device)
        load_shards(model, args.model_path)
        restore_buffers(model)
        clock.mark("model")
        return model.train()
    model = (load(args.model_path, param_dtype) if args.model_path
             else build(spec, args.run.seed, param_dtype, ctx.device))
    check_supported(model, longest)
    if args.pp > 1:
        from .pipeline import split_model

        split_model(model, stage, args.pp)
    model.to(ctx.device).train()
    clock.mark("model")
    if sharded(args, ctx.world):
        from .parallelize import parallelize

        parallelize(model, ctx.world, ctx.device, dtype, stages=args.pp)
        clock.mark("sharding")
    return model


def check_folders(args: TrainArgs, spec: ModelSpec, world: int) -> None:
    """The output and checkpoint folders written to and their space (runtime/preflight.check_space), unless
    ``--no-space-check``."""
    if not args.space_check or args.dry_run:
        return
    from .preflight import check_space

    dtype = DTYPES[args.dtype]
    out = 2 if dtype == torch.bfloat16 else dtype.itemsize
    state = stored_dtype(dtype, sharded(args, world)).itemsize
    check_space(args.output_dir, args.checkpoint_dir, spec.total_params, out, state)


def stored_dtype(dtype: torch.dtype, sharded: bool) -> torch.dtype:
    """The parameters' dtype for a run computing in ``dtype``: FSDP2 keeps fp32 shards and computes in bf16."""
    return torch.float32 if sharded and dtype == torch.bfloat16 else dtype


def threads_per_process(args: TrainArgs) -> int:
    """torch's threads in each process: ``--threads``, else the cores this process may use shared by the processes
    of its machine (LOCAL_WORLD_SIZE, which `--nproc` and torchrun both set), so the two launchers compute alike
    and give the same bits."""
    if args.threads:
        return args.threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _one_voice(rank: int) -> None:
    """Only longpack speaks, and only rank 0: transformers' progress bars off (the run prints its own progress),
    its warnings off on the other ranks, and FSDP2's notice that the wrapped model returns a view (its logits; the
    runner never writes into them in place, and the FSDP2 parity tests hold) not repeated per rank."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if rank != 0:
        hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def _pipeline(args: TrainArgs, spec: ModelSpec, ctx: DistContext, cost: CostModel) -> Any:
    """This rank's pipeline stage (None without --pp)."""
    if args.pp == 1:
        return None
    from .pipeline import Layout, PipelineStage

    layout = Layout.build(ctx.rank, ctx.world, args.pp, tied=spec.tied_embeddings)
    return PipelineStage(None, layout, ctx.rank, spec.hidden, DTYPES[args.dtype], cost)
