"""Resuming a run: refuse a checkpoint whose settings, rows or plan differ from this run's (naming the flag), then
load it and continue at the exact next step (:func:`resume`). A plan's steps are fingerprinted by their JSON
(:func:`fingerprint`)."""

from __future__ import annotations

import sys
from typing import Any

from ...plan import Plan, step_dict
from ..dist import DistContext
from . import checkpoint
from .ahead import PlanAhead
from .train_args import TrainArgs, settings

__all__ = ["fingerprint", "check_resumable", "resume"]


def fingerprint(plan: Plan, n: int, cache: list[dict[str, Any]]) -> str:
    """Fingerprint of the plan's first ``n`` steps (planned already); ``cache``: their JSON, grown as steps run."""
    cache.extend(step_dict(st) for st in plan.steps[len(cache):n])
    return checkpoint.steps_fingerprint(cache[:n])


def check_resumable(meta: dict[str, Any], args: TrainArgs, world: int, ahead: PlanAhead,
                     cache: list[dict[str, Any]]) -> float:
    """Refuse a resume whose settings changed (naming the flag) or whose plan does not begin with the steps done;
    returns the seconds waited for those steps to be planned again."""
    where = f"--resume: the checkpoint {meta['path']}"
    for flag, now in settings(args, world).items():
        then = meta.get("settings", {}).get(flag, now)
        if then != now and flag == "data-content":
            raise ValueError(f"{where} was trained on other rows: the tokens or labels of --data {args.data.path} "
                             "differ "
                             f"from that run's (digest {now} vs {then}); resume with the same data")
        if then != now:
            raise ValueError(f"{where} was made with --{flag} {then!r}, this run has {now!r}; resume with the same "
                             f"--{flag} (only --steps may change)")
    done = int(meta["step"])
    decays = args.optim.lr_scheduler != "constant" or args.optim.warmup_ratio
    if decays and meta.get("total_steps", len(ahead)) != len(ahead):
        raise ValueError(f"{where} was a run of {meta['total_steps']} steps and its --lr-scheduler "
                         f"{args.optim.lr_scheduler} (or --warmup-ratio) spans them; resume with the same --steps")
    if done > len(ahead):
        raise ValueError(f"{where} has trained {done} steps; --steps {len(ahead)} is fewer")
    waited = ahead.wait(done - 1) if done else 0.0  # the steps already trained are planned again, and compared
    if fingerprint(ahead.plan, done, cache) != meta["plan"]:
        raise ValueError(f"{where}: this run's plan does not begin with the {done} steps already trained (planner "
                         f"{args.planner} lays out the whole run at once); resume with the same --steps")
    return waited


def resume(args: TrainArgs, ctx: DistContext, parts: Any, ahead: PlanAhead, cache: list[dict[str, Any]]) -> float:
    """Continue from the latest checkpoint when asked, into ``parts`` (runtime/run/parts.RunParts: the model,
    AdamW, the schedule, the sampler); the seconds waited on the planner meanwhile."""
    if not (args.out.resume or args.out.resume_if_present) or not args.out.checkpoint_dir:
        return 0.0
    warn = (lambda line: print(f"longpack: warning: {line}", file=sys.stderr, flush=True)) if ctx.rank == 0 else None
    meta = checkpoint.load_latest(args.out.checkpoint_dir, model=parts.model, optimizer=parts.opt, warn=warn,
                                  first_layer=parts.first_layer)
    if meta is None:
        if args.out.resume_if_present:
            return 0.0
        raise ValueError(f"--resume: no checkpoint in {args.out.checkpoint_dir}; check the folder, or use "
                         "--resume-if-present to start at step 0 when there is none")
    waited = check_resumable(meta, args, ctx.world, ahead, cache)
    parts.sampler.load_state_dict(meta["sampler"])
    if parts.sched is not None and "scheduler" in meta:
        parts.sched.load_state_dict(meta["scheduler"])
    if ctx.rank == 0:
        print(f"longpack: resuming from {meta['path']}: {meta['step']} steps trained, the next is step "
              f"{meta['step']}", file=sys.stderr, flush=True)
    return waited
