"""Process groups and collectives of the runtime, passed around explicitly (no module-level globals).

:class:`DistContext` is built once per process from torchrun's environment (or given explicitly for spawned
tests): rank, world size, backend (gloo on CPU, nccl on GPU) and the device. ``all_reduce_sum`` sums every
gradient across the ranks that share parameters in one flat bucket per dtype.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DistContext", "init_distributed", "all_reduce_sum", "free_port", "leave"]


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world > 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device: str | None = None, timeout: float | None = None) -> DistContext:
    """Join the process group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun sets them);
    a plain single process when they are absent. ``timeout``: seconds any collective may wait for its peers before
    it fails (every group inherits it), so a dead or frozen rank ends the run instead of hanging it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        # on NCCL, bound to the device: the communicator is made now, and every group made later (the CP groups,
        # before step 0) is split from it at once rather than at its first collective inside a step
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout) if timeout else None,
                                device_id=dev if use_cuda else None)
    return DistContext(rank=rank, world=world, device=dev)


def all_reduce_sum(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum ``tensors`` in place across the group: one flattened all-reduce per dtype, so each tensor travels in its
    own dtype (bf16 or fp32 gradients are not promoted to the fp64 of the step's statistics beside them)."""
    if not tensors or not (dist.is_available() and dist.is_initialized()):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def leave() -> None:
    """End a finished process of a multi-process run: leave the process groups together (barrier, destroy), flush,
    and exit without interpreter teardown. torch 2.13's gloo can deadlock or abort there: the last reference to a
    group (e.g. a DDP reducer's) joins the group's worker thread while that thread waits for the GIL to free a
    finished collective's tensors."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
