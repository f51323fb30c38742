"""Resuming a run, on its own world or another.

A step's loss is the mean over its global batch's targets, whatever ranks, micro-batches, chunks and CP groups run
them (docs/EXECUTION.md), and the global batches are a function of the data, the seed and ``--global-batch``
alone (planners.global_batches). So a run continues on another layout — processes, CP, PP, FSDP, token cap,
hardware, planner (same_run.LAYOUT) — with the same mathematics: the same batches from the next one on, each
planned for the new world; only the order of floating-point reductions differs.

:func:`begin` (before any step is planned: the launcher, or each rank under torchrun) finds the newest intact
checkpoint, refuses a setting that changes what is trained (naming the flag), checks the run's length against
the LR schedule, and starts the plan stream at the checkpoint's step, comparing the global batches it trained with
this run's (their samples and the tokens kept of each) and, for a policy that cuts over-long samples, the cut.
A planner that lays out the whole run at once for its world (hbp: its own global batches) resumes only on its own
layout, the first steps of its plan compared. :func:`resume` (each rank, once the model and AdamW exist) loads
their state through DCP into this rank's layout (runtime/run/checkpoint.py), the sampler and the LR schedule;
:func:`announce` says what changed. Cost: one read of the checkpoint's files for their checksums, and the
fingerprint, O(samples trained).
"""

from __future__ import annotations

import sys
from typing import Any

from ...plan import Plan, step_dict
from ...planners.stream import PlanStream
from ..dist import DistContext
from . import checkpoint
from .same_run import LAYOUT, refuse_changed, settings
from .train_args import TrainArgs

__all__ = ["fingerprint", "begin", "resume", "announce", "record"]


def fingerprint(plan: Plan, n: int, cache: list[dict[str, Any]]) -> str:
    """Fingerprint of the plan's first ``n`` steps (planned already); ``cache``: their JSON, grown as steps run."""
    cache.extend(step_dict(st) for st in plan.steps[len(cache):n])
    return checkpoint.steps_fingerprint(cache[:n])


def _cut(stream: PlanStream) -> dict[str, Any]:
    o = stream.plan.meta.get("overlong", {})
    return {"policy": o.get("policy"), "limit": o.get("limit"), "split_len": o.get("split_len")}


def world_of(args: TrainArgs, world: int, stream: PlanStream) -> dict[str, Any]:
    """The layout a checkpoint is written on (its ``world`` record)."""
    return {"nproc": world, "cp": args.run.cp, "pp": args.parallel.pp, "fsdp": args.parallel.fsdp,
            "token_cap": stream.plan.meta.get("token_cap", args.run.token_cap), "hardware": args.run.hardware,
            "planner": args.planner}


def record(args: TrainArgs, world: int, stream: PlanStream, done: int, cache: list[dict[str, Any]]
           ) -> dict[str, Any]:
    """What a checkpoint after ``done`` steps records for a resume: the settings, the world, the trained global
    batches' fingerprint, the over-long cut, the run's length (and, for a whole-run planner, its plan's)."""
    out = {"settings": settings(args, world), "world": world_of(args, world, stream), "total_steps": len(stream),
           "batches": stream.trained_fingerprint(done), "overlong": _cut(stream)}
    if stream.whole:
        out["plan"] = fingerprint(stream.plan, done, cache)
    return out


def begin(args: TrainArgs, world: int, stream: PlanStream, warn: Any = None) -> dict[str, Any] | None:
    """The checkpoint this run continues (its metadata, with ``"changed"``: {flag: (then, now)} of the layout), the
    stream started at its step; None when not resuming (or ``--resume-if-present`` finds none)."""
    out = args.out
    if not (out.resume or out.resume_if_present) or not out.checkpoint_dir:
        return None
    meta = checkpoint.newest(out.checkpoint_dir, warn)
    if meta is None:
        if out.resume_if_present:
            return None
        raise ValueError(f"--resume: no checkpoint in {out.checkpoint_dir}; check the folder, or use "
                         "--resume-if-present to start at step 0 when there is none")
    where = f"--resume: the checkpoint {meta['path']}"
    changed = refuse_changed(meta.get("settings", {}), settings(args, world), where, args.data.path)
    if "planner" in changed and any(_whole(name) for name in changed["planner"]):
        a, b = changed["planner"]
        raise ValueError(f"{where} was planned by --planner {a}, this run by {b}: hbp forms its own global batches "
                         "for its world, so a run resumes across planners only between those that keep the run's "
                         "batches (every planner but hbp); resume with the same --planner")
    done = int(meta["step"])
    o = args.optim
    if (o.lr_scheduler != "constant" or o.warmup_ratio) and meta.get("total_steps", len(stream)) != len(stream):
        raise ValueError(f"{where} was a run of {meta['total_steps']} steps and its --lr-scheduler "
                         f"{o.lr_scheduler} (or --warmup-ratio) spans them; resume with the same --steps")
    if done > len(stream):
        raise ValueError(f"{where} has trained {done} steps; --steps {len(stream)} is fewer")
    if stream.whole or "batches" not in meta:
        _same_plan(meta, args, stream, changed, where)
    else:
        _same_batches(meta, stream, changed, where)
    meta["changed"] = changed
    return meta


def _whole(planner: str) -> bool:
    from ...planners import get_planner

    return bool(type(get_planner(planner)).whole_run)


def _same_plan(meta: dict[str, Any], args: TrainArgs, stream: PlanStream, changed: dict[str, Any], where: str
               ) -> None:
    """A resume on the checkpoint's own layout, its plan's trained steps made again and compared."""
    if changed:
        why = (f"--planner {args.planner} lays out the whole run, its global batches included, for its world"
               if stream.whole else "it was written before checkpoints recorded their global batches")
        flags = ", ".join(f"--{f} {a!r} -> {b!r}" for f, (a, b) in changed.items())
        raise ValueError(f"{where} resumes only on the layout it was written on ({why}); this run changes {flags}")
    done = int(meta["step"])
    while stream.made < done:
        stream.next_step()
    if fingerprint(stream.plan, done, []) != meta["plan"]:
        raise ValueError(f"{where}: this run's plan does not begin with the {done} steps already trained (planner "
                         f"{args.planner} lays out the whole run at once); resume with the same --steps")


def _same_batches(meta: dict[str, Any], stream: PlanStream, changed: dict[str, Any], where: str) -> None:
    """The stream started at the checkpoint's step, its trained global batches and over-long cut compared."""
    then, now = meta.get("overlong", {}), _cut(stream)
    if then.get("policy") in ("truncate", "drop") and then.get("limit") != now["limit"]:
        flags = ", ".join(f"--{f}" for f in changed) or "this run's settings"
        raise ValueError(f"{where} cut samples at {then['limit']} tokens (--overlong {then['policy']}); with "
                         f"{flags} this run cuts at {now['limit']}, training other tokens; give --max-len "
                         f"{then['limit']} to keep the cut")
    done = int(meta["step"])
    stream.start_at(done)
    if stream.trained_fingerprint(done) != meta["batches"]:
        raise ValueError(f"{where}: the first {done} global batches of this run differ from those it trained "
                         "(the same data, --seed and --global-batch make the same ones); resume with that run's "
                         "settings")


def announce(meta: dict[str, Any] | None, args: TrainArgs, world: int, stream: PlanStream,
             say: Any = None) -> dict[str, Any] | None:
    """The resume's line (through ``say``) and its JSON record: the step, the world then and now, what changed and
    what was kept."""
    if meta is None:
        return None
    k, now = int(meta["step"]), world_of(args, world, stream)
    procs = f"{world} process{'es' if world > 1 else ''}"
    then = meta.get("world") or {"nproc": meta.get("settings", {}).get("nproc", world)}
    changed = {f: list(v) for f, v in meta.get("changed", {}).items()}
    kept = sorted(f for f in meta.get("settings", {}) if f not in LAYOUT)
    if changed:
        was = f" (was {then['nproc']})" if then["nproc"] != world else ""
        rest = ", ".join(f"--{f} {a} -> {b}" for f, (a, b) in changed.items() if f != "nproc")
        line = (f"resuming step {k} on {procs}{was}: same global batches, re-planned"
                + (f"; changed {rest}" if rest else ""))
    else:
        line = f"resuming step {k} on {procs}, as before: same global batches"
    if say is not None:
        say(f"{line} (from {meta['path']})")
    return {"resume": {"step": k, "from": meta["path"], "world": {"then": then, "now": now}, "changed": changed,
                       "kept": kept, "line": line}}


def resume(meta: dict[str, Any] | None, ctx: DistContext, parts: Any) -> None:
    """Load the checkpoint :func:`begin` chose into ``parts`` (runtime/run/parts.RunParts: the model and AdamW, in
    this rank's layout; the sampler; the schedule)."""
    if meta is None:
        return
    checkpoint.load(meta, model=parts.model, optimizer=parts.opt, first_layer=parts.first_layer)
    parts.sampler.load_state_dict(meta["sampler"])
    if parts.sched is not None and "scheduler" in meta:
        parts.sched.load_state_dict(meta["scheduler"])


def warner(rank: int) -> Any:
    """Rank 0's (or the launcher's) warning printer; None elsewhere."""
    return (lambda line: print(f"longpack: warning: {line}", file=sys.stderr, flush=True)) if rank == 0 else None
