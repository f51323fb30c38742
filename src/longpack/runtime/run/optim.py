"""The optimizer step of `longpack train`: AdamW, the learning-rate schedule and gradient clipping.

* AdamW: torch's fused kernel (one kernel over every parameter of a device, FSDP2's DTensor shards included) where
  the parameters' device has one — the Trainer's default, ``adamw_torch_fused``; else torch's default choice. The
  update is AdamW's either way; only the order of floating-point operations differs.

* Schedule: torch's own schedulers, stepped once per optimizer step. Warmup is ``LinearLR`` from 1/(w+1) of the
  rate to the rate over ``w`` steps (step 0 trains at lr/(w+1), step w at lr); then ``CosineAnnealingLR`` (to
  ``min_lr`` at the last step), ``LinearLR`` (to ``min_lr``) or a constant rate, chained by ``SequentialLR``. The
  scheduler's state is plain numbers (JSON), kept with each checkpoint so a resumed run continues the same curve.
* Clipping: the global L2 norm of the step's gradients — over every rank's FSDP2 shard (DTensor gradients, reduced
  by torch), and over pipeline stages (their squared norms summed over ``group``; a tied LM head counted once) —
  and the gradients scaled by ``max_norm / norm`` when it is larger (torch's ``clip_grads_with_norm_``). The
  gradients are the step's exact global-mean-loss gradients, so the norm is plain training's. Cost: one pass over
  the gradients and, under pipeline parallelism, one scalar all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a scheduler is built or gradients clipped: the checks need none
    import torch

__all__ = ["SCHEDULERS", "adamw", "check_schedule", "build_scheduler", "warmup_of", "clip_gradients"]

SCHEDULERS = ("constant", "linear", "cosine")


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters, fused where every parameter's device has the fused kernel."""
    import torch
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    params = list(model.parameters())
    fused = bool(params) and all(p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
                                 for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def warmup_of(total: int, steps: int, ratio: float) -> int:
    """Warmup steps from ``--warmup-steps`` or, when that is 0, ``--warmup-ratio`` of the run's ``total`` steps."""
    if steps < 0 or not 0.0 <= ratio < 1.0:
        raise ValueError(f"--warmup-steps {steps} / --warmup-ratio {ratio}: give steps >= 0 and a ratio in [0, 1)")
    return steps if steps else int(ratio * total)


def check_schedule(kind: str, lr: float, min_lr: float, warmup_steps: int, warmup_ratio: float) -> None:
    """Refuse a schedule that cannot be built, naming the flag."""
    if kind not in SCHEDULERS:
        raise ValueError(f"--lr-scheduler {kind!r}: choose one of {', '.join(SCHEDULERS)}")
    if not 0.0 <= min_lr <= lr:
        raise ValueError(f"--min-lr {min_lr:g}: must be in [0, --lr {lr:g}]")
    warmup_of(1, warmup_steps, warmup_ratio)


def build_scheduler(opt: torch.optim.Optimizer, kind: str, total: int, warmup: int, min_lr: float) -> Any:
    """The schedule of ``total`` optimizer steps (see the module docstring)."""
    from torch.optim import lr_scheduler as sched

    lr = float(opt.param_groups[0]["lr"])
    check_schedule(kind, lr, min_lr, warmup, 0.0)
    warmup = min(warmup, max(total - 1, 0))
    rest = max(total - warmup, 1)
    if kind == "cosine":
        main: Any = sched.CosineAnnealingLR(opt, T_max=max(rest - 1, 1), eta_min=min_lr)
    elif kind == "linear":
        main = sched.LinearLR(opt, start_factor=1.0, end_factor=min_lr / lr if lr else 1.0,
                              total_iters=max(rest - 1, 1))
    else:
        main = sched.ConstantLR(opt, factor=1.0, total_iters=0)
    if not warmup:
        return main
    warm = sched.LinearLR(opt, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    return sched.SequentialLR(opt, [warm, main], milestones=[warmup])


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float, group: Any = None,
                   skip: Iterable[torch.nn.Parameter] = ()) -> torch.Tensor:
    """The gradients' global L2 norm (a device tensor), after scaling them to ``max_norm`` when above it
    (``max_norm`` <= 0: measured only). ``group``: the ranks whose squared norms add up (one per pipeline stage);
    ``skip``: parameters whose gradient another stage holds too (counted there), scaled but not counted."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    skipped = {id(p) for p in skip}
    counted = [p.grad for p in params if id(p) not in skipped]
    if counted:
        norm = torch.nn.utils.get_total_norm(counted, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    else:
        norm = torch.zeros((), device=params[0].grad.device if params else "cpu")
    if group is not None:
        square = norm.double().square()
        dist.all_reduce(square, group=group)
        norm = square.sqrt().to(norm.dtype)
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
