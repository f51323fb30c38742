"""Collectives over rows that CP ranks hold in unequal counts (a sharded piece's zigzag shares, a chain's stored
prefix): every rank's rows laid out rank after rank, ``sizes`` rows each.

:func:`reduce_rows` is the backward of gathering them: the gradient of the gathered rows summed over the group,
each rank keeping its own rows — a reduce-scatter of the rows padded to the largest share. On a ring it moves
(c−1)/c of the padded gradient per rank, half of what an all-reduce of the whole moves, and each rank receives
only its own sum. Both NCCL and gloo (torch ≥ 2.13) have it, so the host runs the code the GPU runs.
:func:`start_reduce_rows` issues it without waiting, for a caller that needs the sum only later.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["reduce_rows", "start_reduce_rows"]


def reduce_rows(grad: torch.Tensor, group: Any, sizes: list[int], rank: int) -> torch.Tensor:
    """This rank's ``sizes[rank]`` rows of ``grad`` (every rank's rows, rank after rank) summed over ``group``."""
    work, out = start_reduce_rows(grad, group, sizes, rank)
    work.wait()
    return out


def start_reduce_rows(grad: torch.Tensor, group: Any, sizes: list[int], rank: int) -> tuple[Any, torch.Tensor]:
    """:func:`reduce_rows` issued without waiting: (its work handle, the rows it fills once waited for)."""
    top = max(sizes)
    if any(n != top for n in sizes):  # each rank's share padded to the largest: one fixed stride per rank
        parts, at = [], 0
        for n in sizes:
            parts.append(grad[at:at + n])
            if top > n:
                parts.append(grad.new_zeros((top - n, *grad.shape[1:])))
            at += n
        grad = torch.cat(parts)
    out = grad.new_empty((top, *grad.shape[1:]))
    work = dist.reduce_scatter_single(out, grad.contiguous(), group=group, async_op=True)
    return work, out[:sizes[rank]]
