"""`longpack train`'s run on one rank: the user's rows and checkpoint, planned identically on every rank, trained.

:func:`train` makes what the loop needs — the process group, the model's shapes (checked to fit), the rows
(run_plan.load_source: the token store's cache), the plan streamed ahead on a thread (ahead.py), the held-out rows
— or takes what the launcher made (:class:`Prepared`); then the rank's parts (parts.py), its resume (resume.py),
its loop (loop.py), the summary and the output checkpoint (output.py). ``--nproc`` spawning: launch.py.

Launch: ``torchrun --nproc-per-node N -m longpack.cli train ...`` (gloo on CPU, nccl on GPU), or
``longpack train --nproc N``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...cost import CostModel
from ...planners.stream import PlanStream
from ...runspec import load_workload, say
from ..dist import DistContext, init_distributed
from ..kernel.data import EpochSource, Source
from ..kernel.head_loss import head_loss_name, resolve_head_loss
from ..kernel.kernels import KERNEL_NAMES, resolve
from ..kernel.step import check_step
from .accounting import data_report
from .ahead import PlanAhead
from .fit import check_fits
from .loop import Loop, Setup
from .metrics import MetricsLog
from .output import save_output
from .parts import DTYPES, build_parts, check_folders, stored_dtype
from .resume import announce, begin, resume, warner
from .run_plan import (
    LAUNCHED,
    build_plan,
    held_out,
    load_source,
    model_spec,
    plan_stream,
    sharded,
    with_digest,
    zero_stage,
)
from .same_run import settings
from .startup import Phases
from .step_log import emit
from .train_args import TrainArgs

__all__ = ["Prepared", "TrainArgs", "train", "build_plan", "plan_stream", "settings", "DTYPES", "stored_dtype",
           "check_folders", "threads_per_process"]


@dataclass
class Prepared:
    """What the launcher read and planned before the ranks started (runtime/run/launch.py), handed to a rank that
    shares its memory (one process, or forked) so the rows and the plan are made once."""

    source: Source
    stream: PlanStream
    cost: CostModel
    clock: Phases  # the launcher's start-up so far (imports, data, plan), which the rank goes on counting
    resumed: dict[str, Any] | None = None  # the checkpoint the run continues (resume.begin), its stream started there


def train(args: TrainArgs, ctx: DistContext | None = None, prepared: Prepared | None = None) -> dict[str, Any]:
    """Run the plan; returns {"steps": [per-step records], "summary": {...}, "data": {...}, "model": model}."""
    clock = prepared.clock if prepared is not None else Phases()
    ctx = ctx or init_distributed(timeout=args.parallel.timeout)
    clock.mark("process_group")
    _one_voice(ctx.rank)
    if ctx.device.type == "cuda" and args.model.dtype != "bfloat16":
        raise ValueError(f"--dtype {args.model.dtype} on CUDA: the attention (FlashAttention varlen) runs in "
                         "bfloat16; use --dtype bfloat16 (parameters and optimizer state stay float32)")
    torch.set_num_threads(threads_per_process(args))
    spec = model_spec(args)
    check_fits(spec, world=ctx.world, local=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
               fsdp=sharded(args, ctx.world), dtype=DTYPES[args.model.dtype], device=ctx.device,
               per_layer=zero_stage(args, ctx.world, spec) == 3)
    launched = bool(os.environ.get(LAUNCHED))  # the launcher read the rows and planned: what it said is said
    if not launched and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # torchrun: once per machine
        check_folders(args, spec, ctx.world)
    note = say if ctx.rank == 0 and not launched else None
    source = prepared.source if prepared is not None else load_source(args, spec.vocab, note)
    args = with_digest(args, source)
    if args.run.epochs > 1 and prepared is None:  # the plan's samples are every epoch's copies of the rows
        n = len(source.lengths) if hasattr(source, "lengths") else len(load_workload(args.run)[0])
        source = EpochSource(source, n)
    if prepared is None:
        clock.mark("data")
    t_plan = time.perf_counter()
    if prepared is not None:
        stream, cost, resumed = prepared.stream, prepared.cost, prepared.resumed
    else:
        stream, cost = plan_stream(args, ctx.world, source, spec, note=note)
        resumed = begin(args, ctx.world, stream, warner(ctx.rank))  # before any step: a resume starts at its own
        announce(resumed, args, ctx.world, stream, note)
    ahead = PlanAhead(stream, args.parallel.plan_ahead, check=check_step)  # planned on a thread while others train
    header = time.perf_counter() - t_plan  # the over-long policy over the whole run (the whole plan at depth 0)
    clock.mark("plan")  # with a launcher's plan: this rank's checks and its planner thread
    try:
        evaluation = held_out(args, ctx.world, spec, note) if args.data.eval_data else None
        return _train(args, ctx, Setup(spec, source, ahead, cost, header, evaluation, clock), resumed)
    finally:
        ahead.close()


def _train(args: TrainArgs, ctx: DistContext, s: Setup, resumed: dict[str, Any] | None) -> dict[str, Any]:
    """The rank's run around its loop (runtime/run/loop.py): the first lines, the parts, the resume, the loop,
    the summary and the output model."""
    report = data_report(s.ahead.plan, s.source)
    if not os.environ.get(LAUNCHED):  # else the launcher said them before spawning
        for record in first_records(args, ctx.world, ctx.device.type, s.ahead.stream, s.source, resumed):
            emit(ctx, args, record)
    p = build_parts(args, ctx, s.spec, s.ahead, s.cost, s.clock)
    loop = Loop(args, ctx, s, p)
    resume(resumed, ctx, p)
    loop.run(_metrics_log(args, ctx, p.sampler.step))
    summary = loop.summary(report)
    if args.out.output_dir:
        save_output(args, p.model, ctx, p.pipe)
    emit(ctx, args, {"summary": summary})
    return {"steps": loop.records, "summary": summary, "data": report, "model": p.model, "startup": s.clock.record()}


def _metrics_log(args: TrainArgs, ctx: DistContext, start: int) -> MetricsLog | None:
    """Rank 0's metrics.jsonl (+ TensorBoard, + --report-to) in --log-dir, else --output-dir; None without one.
    ``start``: the step a resumed run trains first (the records from it on, a killed run's, are dropped)."""
    where = args.out.log_dir or args.out.output_dir
    reporters = tuple(filter(None, args.out.report_to.split(",")))
    if reporters and not where:
        raise ValueError(f"--report-to {args.out.report_to}: needs --output-dir or --log-dir for its files")
    if not where or ctx.rank != 0:
        return None
    return MetricsLog(where, reporters, settings(args, ctx.world), resumed_at=start or None)


def first_records(args: TrainArgs, world: int, device: str, stream: Any, source: Any,
                  resumed: dict[str, Any] | None, local: int | None = None) -> list[dict[str, Any]]:
    """The run's first records, said once by rank 0 (or by `--nproc`'s launcher before it spawns the ranks, as
    soon as the rows are read and the first step planned): the resume (when resuming), the processes and their
    threads (``local``: processes on this machine, default LOCAL_WORLD_SIZE), the data line."""
    said = announce(resumed, args, world, stream)
    on = torch.device(device)
    return [*([said] if said is not None else []),
            {"run": {"processes": world, "threads": threads_per_process(args, local), "device": device,
                     "dtype": args.model.dtype,
                     "head_loss": head_loss_name(resolve_head_loss(args.model.head_loss, on,
                                                                   DTYPES[args.model.dtype], args.optim.loss)),
                     "kernels": KERNEL_NAMES[resolve(args.model.kernels, on)]}},
            {"data": data_report(stream.plan, source)}]


def threads_per_process(args: TrainArgs, local: int | None = None) -> int:
    """torch's threads in each process: ``--threads``, else the cores this process may use shared by the processes
    of its machine (``local``, default LOCAL_WORLD_SIZE, which `--nproc` and torchrun both set), so the two
    launchers compute alike and give the same bits."""
    if args.parallel.threads:
        return args.parallel.threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // (local or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _one_voice(rank: int) -> None:
    """Only longpack speaks, and only rank 0: transformers' progress bars off (the run prints its own progress),
    its warnings off on the other ranks, FSDP2's notice that the wrapped model returns a view (its logits; the
    runner never writes into them in place, and the FSDP2 parity tests hold) not repeated per rank, and DCP's
    notice that a process without a group (one process, no FSDP2) saves or loads its checkpoint alone."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if rank != 0:
        hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


