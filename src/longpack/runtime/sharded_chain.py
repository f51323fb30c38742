"""A chunk chain whose pieces are sharded over a CP group: ChunkFlow's chained execution with context parallelism.

Each chunk [s0, s1) of the chain's sample is a sharded piece: CP rank r computes its zigzag rows (blocks r and
2c−1−r of the chunk) and the chunk's K/V is all-gathered as for any sharded piece (runtime/context_parallel.py).
What the chain adds is the state of the earlier chunks:

* **Sharded store.** Per layer, each rank keeps only *its* rows' K/V of every finished chunk (1/c of the prefix),
  with a gradient accumulator beside each.
* **Prefix exchange.** Chunk j's attention all-gathers, per layer, every rank's stored rows of chunks < j into one
  fully visible key block (key order is irrelevant to a fully visible block, so the rank-ordered concatenation is
  used as it arrives). The block is not kept for backward: backward gathers it again, takes the flash backward of
  the rank's queries against it, all-reduces the block's dK/dV over the group and adds each rank's own rows into
  its accumulators. So no rank ever holds more than one layer's full prefix at a time.
* **Own chunk.** Query block [a, b) of the chunk sees the chunk's keys [s0, a) fully and [a, b) causally; both
  parts are merged with the prefix by log-sum-exp (runtime/blockwise.py), and their gradients go back through the
  chunk's all-gather.
* **Order.** runtime/chunked.py drives the chain: forward ascending, backward descending, the last K chunks kept
  and the rest recomputed; a chunk's backward injects its accumulators into its own rows' K/V.

Every rank of the group runs the same chunks, layers and recomputations in the same order, so the collectives
inside forward and backward match. Communication per chunk and layer: the chunk's own K/V exchange plus three
passes over the prefix's K/V (gather forward, gather and all-reduce backward; one more gather per recomputed
forward). Memory: prefix/c stored per rank plus one layer's gathered prefix. Exact: float64 parity tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import MicroBatch
from .blockwise import _block_backward, _merged
from .context_parallel import CPAttention, zigzag_blocks

__all__ = ["ShardedKVStore", "ShardedChainPass"]


def _bhsd(x_thd: torch.Tensor) -> torch.Tensor:
    return x_thd.transpose(0, 1)[None].contiguous()


def _thd(x_bhsd: torch.Tensor) -> torch.Tensor:
    return x_bhsd[0].transpose(0, 1).contiguous()


class ShardedKVStore:
    """This rank's rows of every finished chunk's K/V, per layer ([n, kv_heads, D], detached), their gradient
    accumulators, and every rank's row count per chunk (the layout of the gathered prefix)."""

    def __init__(self, layers: int, group: dist.ProcessGroup | None, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.blocks: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(layers)]
        self.sizes: dict[int, list[int]] = {}  # chunk -> rows per CP rank

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.detach(), v.detach()
        self.blocks[layer].append((k, v, torch.zeros_like(k), torch.zeros_like(v)))

    def grads(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, dk, dv = self.blocks[layer][chunk]
        return dk, dv

    def _totals(self, chunk: int) -> list[int]:
        return [sum(self.sizes[c][r] for c in range(chunk)) for r in range(self.cp)]

    def gather(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every rank's stored K/V of chunks < ``chunk`` as one [1, kv_heads, n, D] block each (collective)."""
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
        return _bhsd(full[..., :d]), _bhsd(full[..., d:])

    def reduce(self, layer: int, chunk: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Sum the gathered prefix's gradient over the group and add this rank's rows into its accumulators."""
        grad = torch.cat([_thd(dk), _thd(dv)], -1)
        dist.all_reduce(grad, group=self.group)
        totals = self._totals(chunk)
        offset = sum(totals[: self.rank])
        d = grad.shape[-1] // 2
        for _, _, acc_k, acc_v in self.blocks[layer][:chunk]:
            n = acc_k.shape[0]
            acc_k.add_(grad[offset:offset + n, :, :d])
            acc_v.add_(grad[offset:offset + n, :, d:])
            offset += n


class _ChainAttention(torch.autograd.Function):
    """This rank's query rows of the chain's chunk over the chunk's gathered keys (per span: [0, ka) visible,
    [ka, kb) causal) and the gathered prefix of earlier chunks."""

    @staticmethod
    def forward(ctx, q, k_chunk, v_chunk, spans, store, layer, chunk):  # type: ignore[override]
        qb, kc, vc = _bhsd(q), _bhsd(k_chunk), _bhsd(v_chunk)
        prefix = store.gather(layer, chunk)
        outs, lses = [], []
        for qa, qz, ka, kz in spans:
            blocks = [(kc[:, :, :ka].contiguous(), vc[:, :, :ka].contiguous(), None, None)] if ka else []
            if prefix is not None:
                blocks.append((*prefix, None, None))
            o, lse = _merged(qb[:, :, qa:qz].contiguous(), kc[:, :, ka:kz].contiguous(),
                             vc[:, :, ka:kz].contiguous(), blocks, True, None)
            outs.append(o)
            lses.append(lse)
        if not spans:  # this rank holds no token of a short chunk; it still takes part in the prefix exchange
            outs, lses = [qb[:, :, :0]], [qb.new_zeros(qb.shape[:3], dtype=torch.float32)]
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(qb, kc, vc, out, lse)
        ctx.spans, ctx.store, ctx.layer, ctx.chunk = spans, store, layer, chunk
        return _thd(out)

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        qb, kc, vc, out, lse = ctx.saved_tensors
        do = _bhsd(do.to(qb.dtype))
        dq, dk, dv = torch.zeros_like(qb), torch.zeros_like(kc), torch.zeros_like(vc)
        prefix = ctx.store.gather(ctx.layer, ctx.chunk)
        dkp = dvp = None
        for qa, qz, ka, kz in ctx.spans:
            part = [t[:, :, qa:qz].contiguous() for t in (do, qb, out)]
            lse_s = lse[:, :, qa:qz].contiguous()
            g = _block_backward(*part[:2], kc[:, :, ka:kz].contiguous(), vc[:, :, ka:kz].contiguous(), part[2],
                                lse_s, True, None)
            dq[:, :, qa:qz] += g[0]
            dk[:, :, ka:kz] += g[1]
            dv[:, :, ka:kz] += g[2]
            if ka:
                g = _block_backward(*part[:2], kc[:, :, :ka].contiguous(), vc[:, :, :ka].contiguous(), part[2],
                                    lse_s, False, None)
                dq[:, :, qa:qz] += g[0]
                dk[:, :, :ka] += g[1]
                dv[:, :, :ka] += g[2]
            if prefix is not None:
                g = _block_backward(*part[:2], *prefix, part[2], lse_s, False, None)
                dq[:, :, qa:qz] += g[0]
                dkp = g[1] if dkp is None else dkp + g[1]
                dvp = g[2] if dvp is None else dvp + g[2]
        if prefix is not None:
            zero = torch.zeros_like(prefix[0])
            ctx.store.reduce(ctx.layer, ctx.chunk, zero if dkp is None else dkp, zero if dvp is None else dvp)
        return _thd(dq), _thd(dk), _thd(dv), None, None, None, None


class ShardedChainPass(CPAttention):
    """The ``attend`` callback of one micro-batch holding chunk ``index`` of ``sample``'s chain, sharded over the
    CP group; the micro-batch's other pieces (local or sharded) attend as in :class:`CPAttention`."""

    def __init__(self, mb: MicroBatch, cp: int, rank: int, group: dist.ProcessGroup | None,
                 rows: list[tuple[int, int, int]], sharded: list[bool], sample: int, index: int,
                 store: ShardedKVStore, overlap: bool = True) -> None:
        super().__init__(mb, cp, rank, group, rows, sharded, overlap)
        self.sample, self.index, self.store = sample, index, store
        piece = next(p for p in self.pieces if p.sample == sample)
        store.sizes.setdefault(index, [sum(b - a for a, b in zigzag_blocks(piece.start, piece.stop, cp, r))
                                       for r in range(cp)])
        self.chain_rows = [i for i in self.shard_rows if rows[i][0] == sample]
        self.start = piece.start
        # per layer, this rank's rows of the chunk's K/V from the first forward (where later chunks' gradients go)
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _own_rows(self, t: torch.Tensor) -> torch.Tensor:
        if not self.chain_rows:
            return t[:0]
        return t[torch.cat([torch.arange(self.offs[i], self.offs[i + 1]) for i in self.chain_rows])]

    def _attend_sharded(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        keys: dict[int, torch.Tensor], vals: dict[int, torch.Tensor]) -> None:
        self.own.setdefault(layer, (self._own_rows(k), self._own_rows(v)))
        others = [i for i in self.shard_rows if i not in self.chain_rows]
        self._attend_rows(others, q, out, keys, vals)
        spans, at = [], 0
        for i in self.chain_rows:
            _, a, b = self.rows[i]
            spans.append((at, at + b - a, a - self.start, b - self.start))
            at += b - a
        o = _ChainAttention.apply(self._own_rows(q), keys[self.sample], vals[self.sample], spans, self.store,
                                  layer, self.index)
        for (qa, qz, _, _), i in zip(spans, self.chain_rows, strict=True):
            out[self.offs[i]:self.offs[i + 1]] = o[qa:qz]
        if not spans:
            out[:0] = o  # keeps the (empty) output in the graph: its backward takes part in the prefix exchange
