"""Context parallelism for a micro-batch that mixes sharded and local pieces (Skrull's DACP, Fig. 2c-d).

Within one step's CP group of c ranks, a piece with ``cp_rank = j`` is held whole by rank j and attends locally;
a piece with ``cp_rank = None`` is sharded:

* **Zigzag split.** The piece's tokens are cut into 2c near-equal blocks; rank r holds blocks r and 2c−1−r, so every
  rank gets the same causal attention work (an early and a late block) — the condition under which one rank's
  share is FLOPs(S)/c (Skrull's DACP). Blocks keep their global positions (RoPE) and next-token targets.
* **K/V exchange by all-gather** (chosen over a ring: one collective per layer, simple and exact, and on CPU/gloo
  the ring's per-step latency dominates; memory is the full K/V of the sharded pieces, which the token cap already
  bounds). The all-gather is an autograd function whose backward reduce-scatters the gathered gradient, so dK/dV
  from every rank's queries reach the owner, and each rank receives only its own rows' sum.
* **Overlap.** The all-gather is issued asynchronously before the local pieces' attention and waited for after it
  (Fig. 2d), so communication hides behind local work in the forward pass. ``overlap=False`` waits first.
* Each rank's query block [a, b) of a sharded piece attends to keys [0, b) of the gathered sequence, bottom-right
  causal, through the attention backend (runtime/kernel/varlen.py: FlashAttention varlen on CUDA; no mask anywhere).

Gradients: CP ranks share parameters, so the step's gradient all-reduce spans every rank (runtime/run/train.py);
the loss stays the global token mean because every rank weighs its tokens by the step's global count.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ...plan import MicroBatch
from . import varlen
from .cp import CPContext
from .host import to_device
from .uneven import reduce_rows

__all__ = ["zigzag_blocks", "rank_pieces", "CPAttention", "all_gather_seq"]


def zigzag_blocks(start: int, stop: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The token ranges of [start, stop) that CP rank ``rank`` holds: blocks r and 2c−1−r of 2c near-equal blocks.

    >>> zigzag_blocks(0, 10, 2, 0), zigzag_blocks(0, 10, 2, 1)
    ([(0, 2), (8, 10)], [(2, 5), (5, 8)])
    """
    edges = np.linspace(start, stop, 2 * cp + 1).round().astype(int)
    out = []
    for b in (rank, 2 * cp - 1 - rank):
        if edges[b + 1] > edges[b]:
            out.append((int(edges[b]), int(edges[b + 1])))
    return out


def rank_pieces(mb: MicroBatch, cp: int, rank: int) -> tuple[list[tuple[int, int, int]], list[bool]]:
    """(sample, start, stop) rows this CP rank computes, and whether each row belongs to a sharded piece."""
    rows, sharded = [], []
    for p in mb.pieces:
        if p.cp_rank is None and cp > 1:
            for a, b in zigzag_blocks(p.start, p.stop, cp, rank):
                rows.append((p.sample, a, b))
                sharded.append(True)
        elif (p.cp_rank or 0) == rank:
            rows.append((p.sample, p.start, p.stop))
            sharded.append(False)
    return rows, sharded


class _AllGather(torch.autograd.Function):
    """Concatenate every CP rank's rows (rank order); backward: each rank's rows of the gradient summed over the
    group and sent to it (a reduce-scatter, runtime/kernel/uneven.py)."""

    @staticmethod
    def forward(ctx, x, group, sizes, rank, handle_box):  # type: ignore[override]
        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        return _gathered(x, group, sizes, handle_box)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return reduce_rows(grad, ctx.group, ctx.sizes, ctx.rank), None, None, None, None


def _gathered(x: torch.Tensor, group: dist.ProcessGroup | None, sizes: list[int], handle_box: list) -> torch.Tensor:
    """all_gather with uneven sizes (padded to the largest); waits on an async handle stored in ``handle_box``."""
    if handle_box and handle_box[0] is not None:
        handle, bufs = handle_box[0]
        handle.wait()
    else:
        bufs = _start_gather(x, group, sizes)[1]
    return torch.cat([b[:n] for b, n in zip(bufs, sizes, strict=True)])


def _start_gather(x: torch.Tensor, group: dist.ProcessGroup | None, sizes: list[int], async_op: bool = False):
    top = max(sizes)
    pad = x.new_zeros((top - x.shape[0], *x.shape[1:]))
    send = torch.cat([x.detach(), pad]) if top > x.shape[0] else x.detach().contiguous()
    bufs = [torch.empty_like(send) for _ in sizes]
    handle = dist.all_gather(bufs, send, group=group, async_op=async_op)
    return handle, bufs


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup | None, sizes: list[int], rank: int,
                   pending: tuple | None = None) -> torch.Tensor:
    """Autograd-correct all-gather along dim 0 of rows of unequal counts ``sizes`` (one per CP rank)."""
    return _AllGather.apply(x, group, sizes, rank, [pending])


class CPAttention:
    """The model's ``attend`` callback for one micro-batch on one CP rank (see the module docstring). Everything
    the layers reuse is made once per micro-batch: the row indices of the local and the sharded tokens (on the
    device at the first layer), the per-piece order of the gathered K/V, and the backend's sequence lengths."""

    def __init__(self, mb: MicroBatch, ctx: CPContext, rows: list[tuple[int, int, int]], sharded: list[bool]
                 ) -> None:
        cp = ctx.degree
        self.cp, self.rank, self.group, self.overlap = cp, ctx.rank, ctx.group, ctx.overlap
        offs = np.concatenate([[0], np.cumsum([b - a for _, a, b in rows])]).astype(int).tolist()
        self.offs, self.rows = offs, rows
        self.local_rows = [i for i, s in enumerate(sharded) if not s]
        self.shard_rows = [i for i, s in enumerate(sharded) if s]
        self.local_seqs = varlen.Seqs([offs[i + 1] - offs[i] for i in self.local_rows])
        # global layout of the gathered sharded tokens: for every CP rank, its zigzag blocks in piece order
        self.pieces = [p for p in mb.pieces if p.cp_rank is None and cp > 1]
        self.layout = [[blk for p in self.pieces for blk in zigzag_blocks(p.start, p.stop, cp, r)] for r in range(cp)]
        self.sizes = [sum(b - a for a, b in blocks) for blocks in self.layout]
        # each sharded row in the compact order of this rank's sharded tokens: (sample, start, stop, at, key count)
        start_of = {p.sample: p.start for p in self.pieces}
        self.compact, at = [], 0
        for i in self.shard_rows:
            sample, a, b = rows[i]
            self.compact.append((sample, at, at + b - a, varlen.Seqs([b - a], [b - start_of[sample]])))
            at += b - a
        self._index: dict[torch.device, tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]] = {}

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """(local row index, sharded row index, per piece the order of its gathered K/V) on ``device``, made
        once, in one host-to-device copy (runtime/kernel/host.py)."""
        got = self._index.get(device)
        if got is None:
            def rows_of(ids: list[int]) -> torch.Tensor:
                parts = [np.arange(self.offs[i], self.offs[i + 1]) for i in ids]
                return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))

            order = self._piece_order()
            host = [rows_of(self.local_rows), rows_of(self.shard_rows), *order.values()]
            moved = to_device(torch.cat(host), device).split([len(t) for t in host])
            got = self._index[device] = (moved[0], moved[1], dict(zip(order, moved[2:], strict=True)))
        return got

    def _piece_order(self) -> dict[int, torch.Tensor]:
        """Per sharded piece, the rows of the gathered (rank-ordered) K/V in token order."""
        spans: dict[int, list[tuple[int, int, int]]] = {p.sample: [] for p in self.pieces}
        offset = 0
        for r in range(self.cp):
            for p in self.pieces:
                for a, b in zigzag_blocks(p.start, p.stop, self.cp, r):
                    spans[p.sample].append((a, offset, offset + (b - a)))
                    offset += b - a
        return {sample: torch.from_numpy(np.concatenate([np.arange(lo, hi) for _, lo, hi in sorted(parts)]))
                for sample, parts in spans.items()}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.pieces:  # every row local: the stream is the local documents, in order
            return varlen.attention(q, k, v, self.local_seqs)
        local_idx, shard_idx, order = self._indices(q.device)
        qs, ks, vs = (t.index_select(0, shard_idx) for t in (q, k, v))
        kv = torch.cat([ks, vs], dim=-1)  # [n, kv_heads, 2D]
        pending = _start_gather(kv, self.group, self.sizes, async_op=True) if self.overlap else None
        out = torch.zeros_like(q)
        if self.local_rows:  # the local pieces' attention hides the K/V exchange
            lq, lk, lv = (t.index_select(0, local_idx) for t in (q, k, v))
            out = out.index_copy(0, local_idx, varlen.attention(lq, lk, lv, self.local_seqs))
        full = all_gather_seq(kv, self.group, self.sizes, self.rank, pending)
        d = k.shape[-1]
        keys = {sample: full.index_select(0, idx) for sample, idx in order.items()}
        o_shard = self._attend_sharded(layer, qs, ks, vs, {s: t[..., :d] for s, t in keys.items()},
                                       {s: t[..., d:] for s, t in keys.items()})
        return out.index_copy(0, shard_idx, o_shard)

    def _attend_sharded(self, layer: int, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                        keys: dict[int, torch.Tensor], vals: dict[int, torch.Tensor]) -> torch.Tensor:
        """The sharded rows' output (compact order) from the gathered per-piece ``keys`` / ``vals`` (a chain
        overrides)."""
        return self._attend_rows(self.compact, qs, keys, vals)

    @staticmethod
    def _attend_rows(rows: list, qs: torch.Tensor, keys: dict[int, torch.Tensor],
                     vals: dict[int, torch.Tensor]) -> torch.Tensor:
        """Each sharded row attends to its piece's keys [start, its last token], bottom-right causal: one backend
        call per row (two per sharded piece), no mask."""
        outs = [varlen.attention(qs[a:b], keys[sample][:seqs.max_k], vals[sample][:seqs.max_k], seqs)
                for sample, a, b, seqs in rows]
        return torch.cat(outs) if outs else qs[:0]
