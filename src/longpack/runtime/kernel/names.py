"""Names of the kernel's choices that the run checks before torch is imported (this module imports nothing)."""

LOSS_MODES = ("token_mean", "sequence_mean")  # runtime/kernel/loss.py: how a step's targets are weighed
KERNELS = ("auto", "compile", "eager")  # runtime/kernel/kernels.py: how a decoder layer's own work runs
HEAD_LOSSES = ("auto", "longpack", "liger")  # runtime/kernel/head_loss.py: which fused linear cross-entropy runs


def check_kernels(kind: str) -> None:
    """Refuse a ``--kernels`` choice that is not one of :data:`KERNELS`, naming them."""
    if kind not in KERNELS:
        raise ValueError(f"--kernels {kind!r}: choose one of {', '.join(KERNELS)}")


def check_head_loss(kind: str) -> None:
    """Refuse a ``--head-loss`` choice that is not one of :data:`HEAD_LOSSES`, naming them."""
    if kind not in HEAD_LOSSES:
        raise ValueError(f"--head-loss {kind!r}: choose one of {', '.join(HEAD_LOSSES)}")
