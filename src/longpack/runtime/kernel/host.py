"""Host-to-device copies that do not stop the host. On CUDA the host tensor is staged in pinned (page-locked)
memory and copied with ``non_blocking=True``: the copy is queued on the current stream, ahead of the kernels that
read it, and the host goes on (collating the next micro-batch) while the device computes. torch's caching host
allocator keeps a pinned block until the copies queued from it have run, so the staging tensor may be dropped at
once. Elsewhere (the host itself, a fake-tensor dry run on a 'cpu' mesh) it is a plain ``.to``. Cost: one host
memcpy into the pinned block per copy."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the host to CUDA through pinned memory without blocking (module docstring)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
