"""Names of the kernel's choices that the run checks before torch is imported (this module imports nothing)."""

LOSS_MODES = ("token_mean", "sequence_mean")  # runtime/kernel/loss.py: how a step's targets are weighed
KERNELS = ("auto", "compile", "eager")  # runtime/kernel/kernels.py: how a decoder layer's own work runs


def check_kernels(kind: str) -> None:
    """Refuse a ``--kernels`` choice that is not one of :data:`KERNELS`, naming them."""
    if kind not in KERNELS:
        raise ValueError(f"--kernels {kind!r}: choose one of {', '.join(KERNELS)}")
