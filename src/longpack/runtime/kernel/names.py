"""Names of the kernel's choices that the run checks before torch is imported (this module imports nothing)."""

LOSS_MODES = ("token_mean", "sequence_mean")  # runtime/kernel/loss.py: how a step's targets are weighed
KERNELS = ("auto", "compile", "eager")  # runtime/kernel/kernels.py: how a decoder layer's own work runs
