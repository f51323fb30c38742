"""`longpack train`'s settings, grouped by concern, each group checked when made and read by the modules that use it:
:class:`ModelArgs` (the checkpoint and the numerics), :class:`DataArgs` (the rows and the held-out rows),
:class:`OptimArgs` (the objective, AdamW and the schedule), :class:`ParallelArgs` (sharding, pipeline, threads,
collectives, planning ahead), :class:`OutputArgs` (the model written, logs, checkpoints and resume), and
:class:`TrainArgs` holding them with the plan's :class:`~longpack.runspec.RunSpec`. Each field's ``metadata`` carries
its flag and help: the CLI's train options are made from these declarations (longpack/cli/train_cmd.py). Also here:
the checks of the process layout that need no process group (:func:`check_layout`) and what a resumed run must share
with its checkpoint (:func:`settings`, :func:`refuse_changed`). Free of torch: a bad command line is refused before
torch is imported."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ...runspec import RunSpec
from ..kernel.names import LOSS_MODES, check_head_loss, check_kernels

__all__ = ["DTYPE_NAMES", "LOSS_MODES", "SHARDS", "ModelArgs", "DataArgs", "OptimArgs", "ParallelArgs", "OutputArgs",
           "TrainArgs", "GROUPS", "check_layout", "opt"]

DTYPE_NAMES = ("float32", "float64", "bfloat16")
SHARDS = ("auto", "layer", "step")


def opt(default: Any, help: str, flag: str | None = "", **click: Any) -> Any:  # noqa: A002  (click's own word)
    """A field with its CLI flag (``""``: the field's name with dashes; None: no flag) and help, and click's
    keywords (min, max) for the option made from it."""
    return field(default=default, metadata={"flag": flag, "help": help, **click})


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    path: str | None = opt(None, "Local Hugging Face checkpoint to fine-tune (config.json + safetensors).",
                           "--model-path")
    dtype: str = opt("float32", "float32, float64 or bfloat16.")
    kernels: str = opt("auto", "A decoder layer's kernels: compile (torch.compile of its norms and MLP), eager, or "
                               "auto (compile on CUDA, eager elsewhere).")
    head_loss: str = opt("auto", "The LM head's fused linear cross-entropy: liger (Liger's kernel: CUDA, "
                                 "liger_kernel installed, --loss token_mean), longpack, or auto (liger where it "
                                 "can run, else longpack).")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, float64 or bfloat16")
        check_kernels(self.kernels)
        check_head_loss(self.head_loss)


@dataclass(frozen=True, kw_only=True)
class DataArgs:
    path: str | None = opt(None, "Tokenized SFT rows: JSONL, Parquet or a save_to_disk folder with input_ids (+ "
                                 "labels or --mask-column), or messages / text with --tokenizer.", "--data")
    mask_column: str | None = opt(None, "0/1 target mask column of --data, e.g. completion_mask or assistant_masks.")
    tokenizer: str | None = opt(None, "Local HF tokenizer folder: the tokens of text or messages rows (README, "
                                      "'Data').")
    cache_dir: str | None = opt(None, "Where the rows' token store is cached (default: .longpack-cache beside "
                                      "--data; README, 'Data').")
    num_proc: int | None = opt(None, "Processes that read and tokenize the rows (default: the cores available).",
                               min=1)
    keep_untargeted: bool = opt(False, "Keep rows with no target (e.g. no assistant turn) in the plan; by default "
                                       "they are left out and counted.")
    eval_data: str | None = opt(None, "Held-out rows (as --data): their exact mean loss, run on the training "
                                      "engine, without an optimizer step.")
    eval_every: int = opt(0, "Evaluate every N steps (0: after the last step only).", min=0)
    content: str | None = opt(None, "", None)  # the rows' digest (rows.TokenRows.digest), set once they are read

    def __post_init__(self) -> None:
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"--num-proc {self.num_proc}: must be >= 1")
        if self.eval_every < 0 or (self.eval_every and not self.eval_data):
            raise ValueError(f"--eval-every {self.eval_every}: give a number of steps >= 1 with --eval-data FILE")


@dataclass(frozen=True, kw_only=True)
class OptimArgs:
    lr: float = opt(1e-3, "AdamW learning rate (the peak, with a schedule).")
    lr_scheduler: str = opt("constant", "constant, linear or cosine (decay to --min-lr over the run's steps, after "
                                        "the warmup).")
    warmup_steps: int = opt(0, "Steps of linear warmup to --lr.", min=0)
    warmup_ratio: float = opt(0.0, "Warmup as a share of the run's steps (when --warmup-steps is 0).", min=0.0,
                              max=0.999)
    min_lr: float = opt(0.0, "The rate linear and cosine decay end at.", min=0.0)
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm (over every rank, shard and stage) to this; 0: "
                                    "no clipping.", min=0.0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", min=0.0)
    loss: str = opt("token_mean", "token_mean or sequence_mean, exact over each step.")

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"--lr {self.lr}: a learning rate must be >= 0")
        if self.loss not in LOSS_MODES:
            raise ValueError(f"--loss {self.loss!r}: choose one of {', '.join(LOSS_MODES)}")
        from .optim import check_schedule

        check_schedule(self.lr_scheduler, self.lr, self.min_lr, self.warmup_steps, self.warmup_ratio)
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm {self.max_grad_norm}: must be >= 0 (0: no clipping)")
        if not self.weight_decay >= 0:
            raise ValueError(f"--weight-decay {self.weight_decay}: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ParallelArgs:
    pp: int = opt(1, "Pipeline stages: the decoder split over pp processes per plan rank, state-aware 1F1B; FSDP2 "
                     "shards within each stage.", min=1)
    fsdp: bool = opt(True, "Shard parameters, gradients and AdamW state with FSDP2 over all processes; on one "
                           "bfloat16 process, FSDP2 keeps them fp32 and computes in bf16 (--no-fsdp: all bf16).")
    shard: str = opt("auto", "FSDP2's gathers: step (whole weights and gradients while a step runs, one all-gather "
                             "and one reduce-scatter a step), layer (ZeRO-3: per layer and pass) or auto (step when "
                             "that takes at most a quarter of the --hardware memory, else layer).")
    threads: int | None = opt(None, "torch threads per process (default: cores / processes on the machine).", min=1)
    timeout: float = opt(600.0, "Seconds a collective waits for the other ranks before the run ends with one line "
                                "naming the step.")
    plan_ahead: int = opt(4, "Steps planned ahead on a background thread while earlier ones train (0: the whole "
                             "run before step 0).", min=0)

    def __post_init__(self) -> None:
        if self.shard not in SHARDS:
            raise ValueError(f"--shard {self.shard!r}: choose auto, layer or step")
        if self.pp < 1:
            raise ValueError(f"--pp {self.pp}: must be >= 1")
        if self.plan_ahead < 0:
            raise ValueError(f"--plan-ahead {self.plan_ahead}: must be >= 0 (0: plan the whole run before step 0)")
        if not self.timeout > 0:
            raise ValueError(f"--timeout {self.timeout}: must be > 0 seconds")


@dataclass(frozen=True, kw_only=True)
class OutputArgs:
    output_dir: str | None = opt(None, "Write the trained model here as a Hugging Face checkpoint (a new or empty "
                                       "folder).")
    overwrite_output_dir: bool = opt(False, "Allow a non-empty --output-dir: its model files are replaced.")
    log_dir: str | None = opt(None, "Per-step metrics.jsonl (and TensorBoard events when tensorboard is installed);"
                                    " default: --output-dir.")
    report_to: str = opt("", "Also report the per-step metrics to: wandb (installed; WANDB_MODE=offline without a "
                             "network).")
    json_log: bool = opt(False, "Print one JSON object per line instead of text.", "--json")
    checkpoint_dir: str | None = opt(None, "Where checkpoints go.")
    checkpoint_every: int = opt(0, "Save every N steps (0: never).", min=0)
    resume: bool = opt(False, "Continue from the latest checkpoint (an error when there is none).")
    resume_if_present: bool = opt(False, "Continue from the latest checkpoint if there is one, else start at step 0.")
    space_check: bool = opt(True, "Check before step 0 that --output-dir and --checkpoint-dir can be written and hold "
                                  "the final model and two checkpoints (--no-space-check: skip).")

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every}: must be >= 0 (0: never)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every} needs --checkpoint-dir DIR to write to")
        if self.resume and self.resume_if_present:
            raise ValueError("--resume and --resume-if-present contradict each other (--resume demands a checkpoint, "
                             "--resume-if-present starts at step 0 without one); give one of them")
        if (self.resume or self.resume_if_present) and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the run to continue")
        from .metrics import REPORTERS

        for name in filter(None, self.report_to.split(",")):
            if name not in REPORTERS:
                raise ValueError(f"--report-to {name!r}: choose {', '.join(REPORTERS)} (metrics.jsonl and "
                                 "TensorBoard are always written with a log folder)")
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"--report-to {name}: the {name} package is not installed; pip install {name}")


GROUPS = {"model": ModelArgs, "data": DataArgs, "optim": OptimArgs, "parallel": ParallelArgs, "out": OutputArgs}
# the flat names TrainArgs.of takes for fields whose name in their group differs
_FLAT = {"model_path": ("model", "path"), "data": ("data", "path"), "data_content": ("data", "content")}


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """A training run's settings: the planner and the plan's RunSpec, and the groups of the module docstring."""

    planner: str = "unified"  # as `longpack train` and LongpackConfig
    run: RunSpec = field(default_factory=lambda: RunSpec(workload="tiny-longtail", model="tiny-llama",
                                                         hardware="cpu", token_cap=4096, global_batch=32))
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    out: OutputArgs = field(default_factory=OutputArgs)
    dry_run: bool = False  # fake tensors, the model's config alone (runtime/run/dry_run.py)

    @classmethod
    def of(cls, *, planner: str = "unified", run: RunSpec | None = None, dry_run: bool = False,
           **flat: Any) -> TrainArgs:
        """TrainArgs from flat keywords, each a field of one group (``lr``, ``checkpoint_dir``, ...; ``data``,
        ``model_path`` and ``data_content`` name the groups' ``path`` / ``content``)."""
        parts: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        owner = {f.name: g for g, c in GROUPS.items() for f in fields(c) if f.name not in ("path", "content")}
        for key, value in flat.items():
            group, name = _FLAT.get(key) or (owner.get(key), key)
            if group is None:
                raise TypeError(f"TrainArgs.of: no setting {key!r}")
            parts[group][name] = value
        made = {g: GROUPS[g](**kw) for g, kw in parts.items()}
        return cls(planner=planner, run=run or cls().run, dry_run=dry_run, **made)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainArgs:
        """The inverse of ``dataclasses.asdict`` (a spawned rank's settings)."""
        groups = {g: GROUPS[g](**d[g]) for g in GROUPS}
        return cls(planner=d["planner"], run=RunSpec(**d["run"]), dry_run=d["dry_run"], **groups)

    def with_content(self, digest: str) -> TrainArgs:
        return replace(self, data=replace(self.data, content=digest))


def check_layout(args: TrainArgs, world: int) -> int:
    """Refuse (one line) what the command line gets wrong about the processes, the planner or the data path, with
    no process group and no torch; returns the plan's ranks per pipeline stage (``world / pp``)."""
    from ...planners import get_planner

    pp, d = args.parallel.pp, args.data
    if world % pp:
        raise ValueError(f"--pp {pp} must divide the number of processes ({world})")
    ranks = world // pp  # the plan's ranks: one pipeline's stages run each plan rank's micro-batches
    if args.run.cp < 1 or ranks % args.run.cp:
        raise ValueError(f"--cp {args.run.cp} must divide the number of processes per pipeline stage ({ranks})")
    get_planner(args.planner)
    for flag, path in (("--data", d.path), ("--eval-data", d.eval_data), ("--model-path", args.model.path),
                       ("--tokenizer", d.tokenizer if d.tokenizer and os.sep in d.tokenizer else None)):
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{flag} {path}: no such file or folder")
    if args.model.path is not None:
        from .preflight import check_model_dir

        check_model_dir(args.model.path, weights=not args.dry_run)
    return ranks
