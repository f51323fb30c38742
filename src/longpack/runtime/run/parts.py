"""What a rank trains with (:class:`RunParts`): the model (its stage's layers under --pp), built or loaded, sharded
with FSDP2 where the run shards; AdamW and the schedule; this plan rank's sampler; the pipeline stage; and the
kernel's step runner (runtime/kernel/step_fn.py) holding FSDP2's step synchronisation. Also the dtype the
parameters are kept in and the folders' space check, which need the model's size."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...cost import CostModel
from ...model import ModelSpec
from ...plan import Plan
from ..dist import DistContext
from ..kernel.data import PlanSampler
from ..kernel.head_loss import resolve_head_loss, set_head_loss
from ..kernel.kernels import apply_kernels, resolve
from ..kernel.step_fn import StepRunner
from .ahead import PlanAhead
from .optim import adamw, build_scheduler, warmup_of
from .run_plan import sharded
from .startup import Phases
from .train_args import TrainArgs

__all__ = ["RunParts", "build_parts", "DTYPES", "stored_dtype", "check_folders"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class RunParts:
    """See the module docstring; ``mem_cost``: the memory prediction at the run's own activation width (the
    planner assumes bf16)."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    sampler: PlanSampler
    pipe: Any
    runner: StepRunner
    prank: int
    mem_cost: CostModel

    @property
    def first_layer(self) -> int | None:
        """Under --pp, the global index of this stage's first decoder layer (checkpoints name layers so)."""
        return self.pipe.first_layer if self.pipe is not None else None


def build_parts(args: TrainArgs, ctx: DistContext, spec: ModelSpec, ahead: PlanAhead, cost: CostModel,
                clock: Phases) -> RunParts:
    pipe = _pipeline(args, spec, ctx, cost)
    model = _model(args, spec, ctx, ahead.plan, clock, pipe.stage if pipe else 0)
    apply_kernels(model, resolve(args.model.kernels, ctx.device))
    set_head_loss(model, resolve_head_loss(args.model.head_loss, ctx.device, DTYPES[args.model.dtype],
                                           args.optim.loss))
    if pipe is not None:
        pipe.model = model
    o = args.optim
    opt = adamw(model, o.lr, o.weight_decay)
    sched = build_scheduler(opt, o.lr_scheduler, len(ahead), warmup_of(len(ahead), o.warmup_steps, o.warmup_ratio),
                            o.min_lr)
    prank = pipe.layout.prank if pipe else ctx.rank
    sync = None
    if sharded(args, ctx.world):
        from ..kernel.parallelize import sync_for

        sync = sync_for(model, ctx.device, cost.cfg.zero_stage)
    runner = StepRunner(ctx, o.loss, sync, pipe, args.parallel.timeout, cp=args.run.cp)
    mem = CostModel(cost.model, cost.hw, replace(cost.cfg, act_bytes=DTYPES[args.model.dtype].itemsize))
    sampler = PlanSampler(ahead.plan, prank, steps=len(ahead), ready=ahead.wait)
    return RunParts(model, opt, sched, sampler, pipe, runner, prank, mem)


def _model(args: TrainArgs, spec: ModelSpec, ctx: DistContext, plan: Plan, clock: Phases,
           stage: int = 0) -> torch.nn.Module:
    """The model on the device: a checkpoint each rank reads its shards of (FSDP2 without pipeline stages), or a
    checkpoint or preset built whole, split into its stage, and sharded where the run shards."""
    from .hf_model import build, check_supported, load

    dtype = DTYPES[args.model.dtype]
    param_dtype = stored_dtype(dtype, sharded(args, ctx.world))
    longest = max((plan.effective_length(s) for s in plan.lengths), default=1)
    if args.model.path and sharded(args, ctx.world) and args.parallel.pp == 1:
        return _sharded_load(args, spec, ctx, clock, longest)
    model = (load(args.model.path, param_dtype) if args.model.path
             else build(spec, args.run.seed, param_dtype, ctx.device))
    check_supported(model, longest)
    if args.parallel.pp > 1:
        from ..kernel.pipeline import split_model

        split_model(model, stage, args.parallel.pp)
    model.to(ctx.device).train()
    clock.mark("model")
    if sharded(args, ctx.world):
        from ..kernel.parallelize import parallelize

        parallelize(model, ctx.world, ctx.device, dtype, stages=args.parallel.pp)
        clock.mark("sharding")
    return model


def _sharded_load(args: TrainArgs, spec: ModelSpec, ctx: DistContext, clock: Phases, longest: int
                  ) -> torch.nn.Module:
    """The checkpoint built on meta, sharded, and each rank's shards read from the safetensors."""
    from ..kernel.head_loss import loss_head
    from ..kernel.parallelize import parallelize
    from .hf_model import check_supported, config_of
    from .shard_load import load_shards, meta_model, restore_buffers

    assert args.model.path is not None, "a sharded load reads a checkpoint folder"
    dtype = DTYPES[args.model.dtype]
    model = meta_model(config_of(spec, args.model.path), stored_dtype(dtype, True))
    check_supported(model, longest)
    loss_head(model)
    clock.mark("model")
    parallelize(model, ctx.world, ctx.device, dtype)
    clock.mark("sharding")
    model.to_empty(device=ctx.device)
    load_shards(model, args.model.path)
    restore_buffers(model)
    clock.mark("model")
    return model.train()


def _pipeline(args: TrainArgs, spec: ModelSpec, ctx: DistContext, cost: CostModel) -> Any:
    """This rank's pipeline stage (None without --pp)."""
    if args.parallel.pp == 1:
        return None
    from ..kernel.pipeline import Layout, PipelineStage

    layout = Layout.build(ctx.rank, ctx.world, args.parallel.pp, tied=spec.tied_embeddings)
    return PipelineStage(None, layout, ctx.rank, spec.hidden, DTYPES[args.model.dtype], cost)


def stored_dtype(dtype: torch.dtype, sharded: bool) -> torch.dtype:
    """The parameters' dtype for a run computing in ``dtype``: FSDP2 keeps fp32 shards and computes in bf16."""
    return torch.float32 if sharded and dtype == torch.bfloat16 else dtype


def check_folders(args: TrainArgs, spec: ModelSpec, world: int) -> None:
    """The output and checkpoint folders written to and their space (runtime/run/preflight.check_space), unless
    ``--no-space-check``."""
    if not args.out.space_check or args.dry_run:
        return
    from .preflight import check_space

    dtype = DTYPES[args.model.dtype]
    out = 2 if dtype == torch.bfloat16 else dtype.itemsize
    state = stored_dtype(dtype, sharded(args, world)).itemsize
    check_space(args.out.output_dir, args.out.checkpoint_dir, spec.total_params, out, state)
