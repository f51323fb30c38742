"""What a resumed run must share with the checkpoint it continues: every setting by its flag (:func:`settings`),
the ones a resume may change (:data:`LAYOUT`), and the comparison that refuses the others by name
(:func:`refuse_changed`). Pure Python: the launcher's and the CLI's pre-flight checks use it before torch is
imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .train_args import TrainArgs

__all__ = ["settings", "LAYOUT", "refuse_changed"]


def settings(args: TrainArgs, world: int) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint it continues (every setting but --steps), by flag."""
    r, d, o, p = args.run, args.data, args.optim, args.parallel
    return {"planner": args.planner, "data": d.path, "mask-column": d.mask_column, "tokenizer": d.tokenizer,
            "keep-untargeted": d.keep_untargeted, "model-path": args.model.path, "model": r.model,
            "workload": r.workload, "lengths": r.lengths_file, "samples": r.samples, "seed": r.seed,
            "epochs": r.epochs, "global-batch": r.global_batch, "cp": r.cp, "nproc": world,
            "token-cap": r.token_cap, "max-len": r.max_len, "overlong": r.overlong, "opt": dict(r.options),
            "ckpt-layers": r.ckpt_layers, "hardware": r.hardware, "loss": o.loss, "lr": o.lr,
            "weight-decay": o.weight_decay, "dtype": args.model.dtype, "fsdp": p.fsdp, "pp": p.pp,
            "lr-scheduler": o.lr_scheduler, "warmup-steps": o.warmup_steps, "warmup-ratio": o.warmup_ratio,
            "min-lr": o.min_lr, "max-grad-norm": o.max_grad_norm, "data-content": d.content}


LAYOUT = ("nproc", "cp", "pp", "fsdp", "token-cap", "hardware", "planner", "opt", "ckpt-layers")
"""Settings a resume may change: they lay the same global batches out on other ranks, micro-batches and chunks,
and the loss (the mean over each global batch's targets) does not depend on that layout (runtime/run/resume.py)."""


def refuse_changed(then: dict[str, Any], now: dict[str, Any], where: str, data: str | None = None
                   ) -> dict[str, tuple[Any, Any]]:
    """Compare a checkpoint's settings (``then``, by flag) with this run's: a changed setting outside
    :data:`LAYOUT` is refused, naming the flag (``data``: the --data path, named when the rows' content changed);
    returns the layout settings that changed, {flag: (then, now)}."""
    changed = {}
    for flag, value in now.items():
        if flag not in then or then[flag] == value:
            continue
        if flag in LAYOUT:
            changed[flag] = (then[flag], value)
        elif flag == "data-content":
            raise ValueError(f"{where} was trained on other rows: the tokens or labels of --data {data} differ from "
                             f"that run's (digest {value} vs {then[flag]}); resume with the same data")
        else:
            raise ValueError(f"{where} was made with --{flag} {then[flag]!r}, this run has {value!r}; resume with "
                             f"the same --{flag} (it changes what is trained; only --steps and the layout — "
                             f"{', '.join('--' + f for f in LAYOUT)} — may change)")
    return changed
