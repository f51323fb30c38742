"""`longpack train`'s settings (:class:`TrainArgs`, checked when made), the checks of the process layout that
need no process group (:func:`check_layout`), and what a resumed run must share with the checkpoint it continues
(:func:`settings`). Free of torch, so a bad command line is refused before torch is imported."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from .. import jobs

__all__ = ["DTYPE_NAMES", "LOSS_MODES", "SHARDS", "TrainArgs", "check_layout", "settings"]

DTYPE_NAMES = ("float32", "float64", "bfloat16")
SHARDS = ("auto", "layer", "step")
LOSS_MODES = ("token_mean", "sequence_mean")  # runtime/loss.py


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    planner: str = "unified"  # as `longpack train` and LongpackConfig
    run: jobs.RunSpec = field(default_factory=lambda: jobs.RunSpec(workload="tiny-longtail", model="tiny-llama",
                                                                    hardware="cpu", token_cap=4096,
                                                                    global_batch=32))
    data: str | None = None
    mask_column: str | None = None
    tokenizer: str | None = None
    cache_dir: str | None = None  # where the rows' token store is cached (store/cache.py; default beside the data)
    num_proc: int | None = None  # processes that tokenize rows (default: the cores available)
    keep_untargeted: bool = False  # rows with no target stay in the plan (default: left out, counted)
    model_path: str | None = None
    output_dir: str | None = None
    overwrite_output_dir: bool = False
    log_dir: str | None = None  # metrics.jsonl (+ TensorBoard events); default: output_dir
    eval_data: str | None = None
    eval_every: int = 0  # steps between held-out evaluations (0: at the end only, with eval_data)
    report_to: str = ""  # comma-separated: wandb
    fsdp: bool = True
    shard: str = "auto"  # FSDP2 gathers: auto, layer (ZeRO-3) or step (runtime/run_plan.zero_stage)
    lr: float = 1e-3
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_lr: float = 0.0
    max_grad_norm: float = 1.0
    loss: str = "token_mean"
    dtype: str = "float32"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    resume_if_present: bool = False
    json_log: bool = False
    threads: int | None = None
    timeout: float = 600.0
    pp: int = 1
    plan_ahead: int = 4
    data_content: str | None = None  # the rows' digest (rows.TokenRows.digest), set once they are loaded
    dry_run: bool = False  # fake tensors, the model's config alone (runtime/dry_run.py)
    space_check: bool = True  # the folders' free space checked before step 0 (runtime/preflight.check_space)

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"--lr {self.lr}: a learning rate must be >= 0")
        if self.loss not in LOSS_MODES:
            raise ValueError(f"--loss {self.loss!r}: choose one of {', '.join(LOSS_MODES)}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, float64 or bfloat16")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every}: must be >= 0 (0: never)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every} needs --checkpoint-dir DIR to write to")
        if self.resume and self.resume_if_present:
            raise ValueError("--resume and --resume-if-present contradict each other (--resume demands a checkpoint, "
                             "--resume-if-present starts at step 0 without one); give one of them")
        if (self.resume or self.resume_if_present) and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the run to continue")
        if self.shard not in SHARDS:
            raise ValueError(f"--shard {self.shard!r}: choose auto, layer or step")
        if self.pp < 1:
            raise ValueError(f"--pp {self.pp}: must be >= 1")
        if self.plan_ahead < 0:
            raise ValueError(f"--plan-ahead {self.plan_ahead}: must be >= 0 (0: plan the whole run before step 0)")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"--num-proc {self.num_proc}: must be >= 1")
        if not self.timeout > 0:
            raise ValueError(f"--timeout {self.timeout}: must be > 0 seconds")
        from .optim import check_schedule

        check_schedule(self.lr_scheduler, self.lr, self.min_lr, self.warmup_steps, self.warmup_ratio)
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm {self.max_grad_norm}: must be >= 0 (0: no clipping)")
        if not self.weight_decay >= 0:
            raise ValueError(f"--weight-decay {self.weight_decay}: must be >= 0")
        from .metrics import REPORTERS

        for name in filter(None, self.report_to.split(",")):
            if name not in REPORTERS:
                raise ValueError(f"--report-to {name!r}: choose {', '.join(REPORTERS)} (metrics.jsonl and "
                                 "TensorBoard are always written with a log folder)")
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"--report-to {name}: the {name} package is not installed; pip install {name}")
        if self.eval_every < 0 or (self.eval_every and not self.eval_data):
            raise ValueError(f"--eval-every {self.eval_every}: give a number of steps >= 1 with --eval-data FILE")


def settings(args: TrainArgs, world: int) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint it continues (every setting but --steps), by flag."""
    r = args.run
    return {"planner": args.planner, "data": args.data, "mask-column": args.mask_column, "tokenizer": args.tokenizer,
            "keep-untargeted": args.keep_untargeted, "model-path": args.model_path, "model": r.model,
            "workload": r.workload, "lengths": r.lengths_file,
            "samples": r.samples, "seed": r.seed, "epochs": r.epochs, "global-batch": r.global_batch, "cp": r.cp,
            "nproc": world,
            "token-cap": r.token_cap, "max-len": r.max_len, "overlong": r.overlong, "opt": dict(r.options),
            "ckpt-layers": r.ckpt_layers, "hardware": r.hardware, "loss": args.loss, "lr": args.lr,
            "weight-decay": args.weight_decay, "dtype": args.dtype, "fsdp": args.fsdp, "pp": args.pp,
            "lr-scheduler": args.lr_scheduler, "warmup-steps": args.warmup_steps, "warmup-ratio": args.warmup_ratio,
            "min-lr": args.min_lr, "max-grad-norm": args.max_grad_norm, "data-content": args.data_content}


def check_layout(args: TrainArgs, world: int) -> int:
    """Refuse (one line) what the command line gets wrong about the processes, the planner or the data path, with
    no process group and no torch; returns the plan's ranks per pipeline stage (``world / pp``)."""
    from ..planners import get_planner

    if world % args.pp:
        raise ValueError(f"--pp {args.pp} must divide the number of processes ({world})")
    ranks = world // args.pp  # the plan's ranks: one pipeline's stages run each plan rank's micro-batches
    if args.run.cp < 1 or ranks % args.run.cp:
        raise ValueError(f"--cp {args.run.cp} must divide the number of processes per pipeline stage ({ranks})")
    get_planner(args.planner)
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data), ("--model-path", args.model_path),
                       ("--tokenizer", args.tokenizer if args.tokenizer and os.sep in args.tokenizer else None)):
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{flag} {path}: no such file or folder")
    if args.model_path is not None:
        from .preflight import check_model_dir

        check_model_dir(args.model_path, weights=not args.dry_run)
    return ranks

