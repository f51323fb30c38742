"""``longpack train``: its options declared once — the plan's flags in :data:`PLAN_OPTIONS`, every other one a field
of the run's argument groups (runtime/run/train_args.py, each field's metadata its flag and help) — and the
command, which makes the groups, checks what needs no torch, and runs (``--dry-run``, the launcher, or this rank
under torchrun)."""

from __future__ import annotations

import inspect
import json
import os
import typing
from dataclasses import fields
from typing import Annotated, Any

import typer

from ..runspec import RunSpec
from .app import app
from .options import (
    TOKEN_CAP_HELP,
    Column,
    Config,
    GlobalBatch,
    Hardware,
    Lengths,
    MaxLen,
    Opt,
    Overlong,
    PlannerName,
    Samples,
    Seed,
    Steps,
    Workload,
    parse_options,
)

__all__ = ["train", "PLAN_OPTIONS"]

_MODEL = Annotated[str, typer.Option(help="Model shape (random init).")]
_CP = Annotated[int, typer.Option(min=1, help="Context-parallel degree (dp = processes / (cp x pp)).")]
_EPOCHS = Annotated[int, typer.Option(min=1, help="Passes over the rows, each a new permutation (seeded by --seed "
                                      "and the epoch) planned as global batches of its own; --steps counts over all "
                                      "of them.")]
_CAP = Annotated[int, typer.Option("--token-cap", "--bucket-size", min=0, help=TOKEN_CAP_HELP)]
_CKPT = Annotated[int, typer.Option(min=0, help="Checkpointed layers the plan starts from (the planner may add more "
                                    "per micro-batch).")]
_NPROC = Annotated[int, typer.Option(min=1, help="Processes to spawn (ignored under torchrun).")]
_DRY = Annotated[bool, typer.Option(help="Run the first steps on fake tensors in this one process for each of --nproc "
                                    "ranks (the model from its config alone, no weights read) and print each rank's "
                                    "memory peak beside the cost model's prediction and the --hardware capacity.")]
_DRY_STEPS = Annotated[int, typer.Option(min=1, help="Steps a dry run plays.")]
_DRY_RANKS = Annotated[str, typer.Option(help="Ranks a dry run plays: all, or e.g. 0,5.")]

# (parameter, annotation, default): the plan's flags and the command's own, before the argument groups' fields
PLAN_OPTIONS: list[tuple[str, Any, Any]] = [
    ("planner", PlannerName, "unified"), ("workload", Workload, "tiny-longtail"), ("lengths", Lengths, None),
    ("column", Column, "length"), ("samples", Samples, None), ("model", _MODEL, "tiny-llama"),
    ("hardware", Hardware, "cpu"), ("cp", _CP, 1), ("global_batch", GlobalBatch, 32), ("steps", Steps, None),
    ("seed", Seed, 0), ("epochs", _EPOCHS, 1), ("token_cap", _CAP, 4096), ("max_len", MaxLen, None),
    ("overlong", Overlong, "split"), ("opt", Opt, None), ("ckpt_layers", _CKPT, 0), ("nproc", _NPROC, 1),
    ("dry_run", _DRY, False), ("dry_run_steps", _DRY_STEPS, 1), ("dry_run_ranks", _DRY_RANKS, "all"),
]


def _group_options() -> list[tuple[str, Any, Any, str, str]]:
    """(parameter, annotation, default, group, field) of every field with a flag in the argument groups."""
    from ..runtime.run.train_args import GROUPS

    out = []
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            flag = f.metadata.get("flag", "")
            if flag is None:
                continue
            names = (flag,) if flag else ()  # none given: typer spells the flag from the name (--x/--no-x for bools)
            keys = {k: f.metadata[k] for k in ("min", "max") if k in f.metadata}
            param = flag[2:].replace("-", "_") if flag else f.name
            option = typer.Option(*names, help=f.metadata["help"], **keys)
            out.append((param, Annotated[hints[f.name], option], f.default, group, f.name))
    return out


def _signature() -> inspect.Signature:
    rows = [(n, a, d) for n, a, d in PLAN_OPTIONS] + [(n, a, d) for n, a, d, *_ in _group_options()]
    rows.append(("config", Config, None))
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
                              for n, a, d in rows])


def train(**kw: Any) -> None:
    """Fine-tune a model on a plan for real with PyTorch (torchrun, or --nproc N local processes on gloo)."""
    args = train_args(kw)
    world = int(os.environ.get("WORLD_SIZE", kw["nproc"]))
    _check(args, world)
    if args.dry_run:
        _dry_run(args, world, kw["dry_run_steps"], kw["dry_run_ranks"])
        return
    _run(args, kw["nproc"])


train.__signature__ = _signature()  # type: ignore[attr-defined]
train.__annotations__ = {p.name: p.annotation for p in train.__signature__.parameters.values()}  # type: ignore
app.command()(train)


def train_args(kw: dict[str, Any]) -> Any:
    """The run's TrainArgs from the command's parameters (no torch: bad input is refused fast)."""
    from ..runtime.run.train_args import GROUPS, TrainArgs

    workload, lengths = kw["workload"], kw["lengths"]
    if workload is not None and lengths is not None:
        workload = None  # an explicit --lengths file wins over the default workload
    if kw["data"] is not None:
        workload, lengths = None, None  # the rows' own lengths are planned
    run = RunSpec(workload=workload, lengths_file=lengths, column=kw["column"], samples=kw["samples"],
                  model=kw["model"], hardware=kw["hardware"], cp=kw["cp"], global_batch=kw["global_batch"],
                  steps=kw["steps"], seed=kw["seed"], token_cap=kw["token_cap"] or None, max_len=kw["max_len"],
                  overlong=kw["overlong"], options=parse_options(kw["opt"]), ckpt_layers=kw["ckpt_layers"],
                  epochs=kw["epochs"])
    parts: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    for param, _, _, group, name in _group_options():
        parts[group][name] = kw[param]
    groups = {g: GROUPS[g](**values) for g, values in parts.items()}
    return TrainArgs(planner=kw["planner"], run=run, dry_run=kw["dry_run"], **groups)


def _check(args: Any, world: int) -> None:
    """The folders and the layout, before torch is imported."""
    from ..runtime.run.preflight import check_checkpoint_dir, check_output_dir
    from ..runtime.run.same_run import settings
    from ..runtime.run.train_args import check_layout

    out, resuming = args.out, args.out.resume or args.out.resume_if_present
    check_output_dir(out.output_dir, args.model.path, out.checkpoint_dir, out.overwrite_output_dir, resuming)
    now = {k: v for k, v in settings(args, world).items() if k != "data-content"}  # the rows are not read yet
    check_checkpoint_dir(out.checkpoint_dir, resuming, now)
    check_layout(args, world)


def _run(args: Any, nproc: int) -> None:
    """This rank under torchrun, or the launcher of ``nproc`` processes; any error as this rank's one line."""
    from ..runtime.run.failure import one_line
    from ..runtime.run.launch import launch
    from ..runtime.run.train import train as run_train

    try:
        if "WORLD_SIZE" in os.environ:
            run_train(args)
        else:
            launch(args, nproc)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (this rank's error, one line; torch's BaseException ones too)
        rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        raise ValueError(f"{rank}{one_line(exc)}") from None


def _dry_run(args: Any, world: int, steps: int, ranks: str) -> None:
    """`longpack train --dry-run` (runtime/run/dry_run.py), in this one process; its errors in one line."""
    from ..runtime.run.dry_run import dry_run, parse_ranks
    from ..runtime.run.failure import one_line

    if "WORLD_SIZE" in os.environ:
        raise ValueError("--dry-run runs in one process: start it without torchrun, with --nproc N for the world it "
                         "plays")
    parse_ranks(ranks, world)
    try:
        result = dry_run(args, world, steps, ranks)
    except Exception as exc:  # noqa: BLE001  (one line, as a run's own error)
        raise ValueError(f"--dry-run: {one_line(exc)}") from None
    if args.out.json_log:
        print(json.dumps(result))
