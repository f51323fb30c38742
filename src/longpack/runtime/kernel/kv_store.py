"""The K/V store of a chunk chain (ChunkFlow Algorithm 2): per layer, every finished chunk's K and V and the
gradients later chunks send to them; :class:`ShardedKVStore` keeps one CP rank's rows of a chain sharded over its
group and exchanges the prefix with the group.

An entry is (k, v, grad_k, grad_v): k / v [n, kv_heads, D] detached, the accumulators in fp32 (fp64 stays fp64)
whatever the K/V dtype, since the gradients of many later chunks add up there (priced by
``CostModel.kv_store_bytes``). A chunk's entries leave the store when its backward starts (:meth:`KVStore.drop`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .uneven import start_reduce_rows

__all__ = ["KVStore", "ShardedKVStore"]

Entry = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class KVStore:
    """One rank's store of a chain run on that rank alone (see the module docstring)."""

    def __init__(self, layers: int) -> None:
        self.blocks: list[list[Entry]] = [[] for _ in range(layers)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.detach(), v.detach()
        wide = torch.promote_types(k.dtype, torch.float32)  # the gradients of many later chunks add up here
        self.blocks[layer].append((k, v, torch.zeros_like(k, dtype=wide), torch.zeros_like(v, dtype=wide)))

    def before(self, layer: int, chunk: int) -> list[Entry]:
        return self.blocks[layer][:chunk]

    def grads(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed gradient of chunk ``chunk``'s K and V, in their dtype."""
        k, v, dk, dv = self.blocks[layer][chunk]
        return dk.to(k.dtype), dv.to(v.dtype)

    def sent(self, chunk: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer this store holds (a pipeline stage holds its own layers only), what every later chunk sent to
        chunk ``chunk``'s K/V (read before :meth:`drop`)."""
        return {layer: self.grads(layer, chunk) for layer, blocks in enumerate(self.blocks) if len(blocks) > chunk}

    def drop(self, chunk: int) -> None:
        """Forget chunks ``chunk`` and later (their backward is done: no chunk reads them again)."""
        for blocks in self.blocks:
            del blocks[chunk:]


class ShardedKVStore(KVStore):
    """This CP rank's rows of every finished chunk's K/V of a chain sharded over ``group`` (of ``cp`` ranks, this
    one ``rank``), and every rank's row count per chunk (the layout of the gathered prefix)."""

    def __init__(self, layers: int, group: Any, cp: int, rank: int) -> None:
        super().__init__(layers)
        self.group, self.cp, self.rank = group, cp, rank
        self.sizes: dict[int, list[int]] = {}  # chunk -> rows per CP rank
        self.pending: list[tuple[tuple[Any, torch.Tensor], torch.Tensor, int, int]] = []  # reductions in flight

    def _totals(self, chunk: int) -> list[int]:
        return [sum(self.sizes[c][r] for c in range(chunk)) for r in range(self.cp)]

    def gather(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every rank's stored K/V of chunks < ``chunk`` as one [n, kv_heads, D] block each (collective)."""
        if chunk == 0:
            return None
        mine = torch.cat([torch.cat([k, v], -1) for k, v, _, _ in self.blocks[layer][:chunk]])
        totals = self._totals(chunk)
        top = max(totals)
        send = torch.cat([mine, mine.new_zeros((top - mine.shape[0], *mine.shape[1:]))]) if top > len(mine) else mine
        bufs = [torch.empty_like(send) for _ in totals]
        dist.all_gather(bufs, send.contiguous(), group=self.group)
        full = torch.cat([b[:n] for b, n in zip(bufs, totals, strict=True)])
        d = full.shape[-1] // 2
        return full[..., :d], full[..., d:]

    def reduce(self, layer: int, chunk: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Sum the gathered prefix's gradient over the group, each rank receiving its own rows (a reduce-scatter,
        runtime/kernel/uneven.py), into this rank's accumulators. Issued without waiting: the next layer's backward
        does not read the accumulators, so the exchange runs beside it and the sum lands when they are next read
        (:meth:`grads`, :meth:`drop`)."""
        grad = torch.cat([dk, dv], -1)
        self.pending.append((start_reduce_rows(grad, self.group, self._totals(chunk), self.rank), grad, layer, chunk))

    def _settle(self) -> None:
        """Wait for the reductions issued and add them into the accumulators, in the order they were issued."""
        for (work, rows), _, layer, chunk in self.pending:
            work.wait()
            offset, d = 0, rows.shape[-1] // 2
            for _, _, acc_k, acc_v in self.blocks[layer][:chunk]:
                n = acc_k.shape[0]
                acc_k.add_(rows[offset:offset + n, :, :d])
                acc_v.add_(rows[offset:offset + n, :, d:])
                offset += n
        self.pending.clear()

    def grads(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._settle()
        return super().grads(layer, chunk)

    def drop(self, chunk: int) -> None:
        self._settle()
        super().drop(chunk)
