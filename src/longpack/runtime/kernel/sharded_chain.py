"""A chunk chain whose pieces are sharded over a CP group: ChunkFlow's chained execution with context parallelism.

Each chunk [s0, s1) of the chain's sample is a sharded piece: CP rank r computes its zigzag rows (blocks r and
2c−1−r of the chunk) and the chunk's K/V is all-gathered as for any sharded piece (runtime/kernel/context_parallel.py).
What the chain adds is the state of the earlier chunks:

* **Sharded store.** Per layer, each rank keeps only *its* rows' K/V of every finished chunk (1/c of the prefix),
  with a gradient accumulator beside each.
* **Prefix exchange.** Chunk j's attention all-gathers, per layer, every rank's stored rows of chunks < j into one
  fully visible key block (key order is irrelevant to a fully visible block, so the rank-ordered concatenation is
  used as it arrives). The block is not kept for backward: backward gathers it again, takes the flash backward of
  the rank's queries against it, all-reduces the block's dK/dV over the group and adds each rank's own rows into
  its accumulators. So no rank ever holds more than one layer's full prefix at a time.
* **Own chunk.** Query block [a, b) of the chunk sees [the gathered prefix | the chunk's keys [s0, b)],
  bottom-right causal: one sequence of the attention backend (runtime/kernel/varlen.py) per block, both blocks in one
  call; the chunk keys' gradients go back through the chunk's all-gather.
* **Order.** runtime/kernel/chunked.py drives the chain: forward ascending, backward descending, the last K chunks kept
  and the rest recomputed; a chunk's backward injects its accumulators into its own rows' K/V.

Every rank of the group runs the same chunks, layers and recomputations in the same order, so the collectives
inside forward and backward match. Communication per chunk and layer: the chunk's own K/V exchange plus three
passes over the prefix's K/V (gather forward, gather and all-reduce backward; one more gather per recomputed
forward). Memory: prefix/c stored per rank plus one layer's gathered prefix. Exact: float64 parity tests.
"""

from __future__ import annotations

import torch

from ...plan import MicroBatch
from . import varlen
from .chunked import ChainLink
from .context_parallel import CPAttention, zigzag_blocks
from .cp import CPContext

__all__ = ["ShardedChainPass"]


def _keys(prefix: tuple[torch.Tensor, torch.Tensor] | None, kc: torch.Tensor, vc: torch.Tensor,
          spans: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per span, [the gathered prefix | the chunk's keys up to the span's last query], concatenated."""
    ks, vs = [], []
    for _, _, _, kz in spans:
        ks += ([prefix[0]] if prefix is not None else []) + [kc[:kz]]
        vs += ([prefix[1]] if prefix is not None else []) + [vc[:kz]]
    return torch.cat(ks), torch.cat(vs)


def _seqs(prefix: tuple[torch.Tensor, torch.Tensor] | None, spans: list[tuple[int, int, int, int]]) -> varlen.Seqs:
    p = prefix[0].shape[0] if prefix is not None else 0
    return varlen.Seqs([qz - qa for qa, qz, _, _ in spans], [p + kz for _, _, _, kz in spans])


class _ChainAttention(torch.autograd.Function):
    """This rank's query rows of the chain's chunk over the gathered prefix of earlier chunks and the chunk's
    gathered keys up to each row's end: one span a sequence of the attention backend, bottom-right causal. The
    prefix is gathered again in backward rather than kept."""

    @staticmethod
    def forward(ctx, q, k_chunk, v_chunk, spans, store, layer, chunk):  # type: ignore[override]
        prefix = store.gather(layer, chunk)
        if spans:
            seqs = _seqs(prefix, spans)
            out, lse = varlen.forward(q, *_keys(prefix, k_chunk, v_chunk, spans), seqs)
        else:  # this rank holds no token of a short chunk; it still takes part in the prefix exchange
            out, lse = q[:0].clone(), q.new_zeros((q.shape[1], 0), dtype=torch.float32)
        ctx.save_for_backward(q, k_chunk, v_chunk, out, lse)
        ctx.spans, ctx.store, ctx.layer, ctx.chunk = spans, store, layer, chunk
        return out

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, kc, vc, out, lse = ctx.saved_tensors
        prefix = ctx.store.gather(ctx.layer, ctx.chunk)
        dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
        dq = torch.zeros_like(q)
        dkp = dvp = None
        if prefix is not None:
            dkp, dvp = torch.zeros_like(prefix[0]), torch.zeros_like(prefix[1])
        if ctx.spans:
            seqs = _seqs(prefix, ctx.spans)
            dq, dks, dvs = varlen.backward(do.to(q.dtype), q, *_keys(prefix, kc, vc, ctx.spans), out, lse, seqs)
            at, p = 0, 0 if prefix is None else prefix[0].shape[0]
            for _, _, _, kz in ctx.spans:
                if prefix is not None:
                    dkp += dks[at:at + p]
                    dvp += dvs[at:at + p]
                dk[:kz] += dks[at + p:at + p + kz]
                dv[:kz] += dvs[at + p:at + p + kz]
                at += p + kz
        if prefix is not None:
            ctx.store.reduce(ctx.layer, ctx.chunk, dkp, dvp)
        return dq, dk, dv, None, None, None, None


class ShardedChainPass(CPAttention):
    """The ``attend`` callback of one micro-batch holding chunk ``link.index`` of ``link.sample``'s chain, sharded
    over the CP group; the micro-batch's other pieces (local or sharded) attend as in :class:`CPAttention`."""

    def __init__(self, mb: MicroBatch, ctx: CPContext, rows: list[tuple[int, int, int]], sharded: list[bool],
                 link: ChainLink) -> None:
        super().__init__(mb, ctx, rows, sharded)
        sample, index, store, cp = link.sample, link.index, link.store, ctx.degree
        self.sample, self.index, self.store = sample, index, store
        piece = next(p for p in self.pieces if p.sample == sample)
        store.sizes.setdefault(index, [sum(b - a for a, b in zigzag_blocks(piece.start, piece.stop, cp, r))
                                       for r in range(cp)])
        # the chain's rows are consecutive in the compact sharded order (rank_pieces keeps a piece's blocks
        # together): [lo, hi) there; each row a span (query rows, first and last key of the chunk it sees)
        chain = [(at, end, rows[i][1], rows[i][2]) for i, (smp, at, end, _) in zip(self.shard_rows, self.compact,
                                                                                   strict=True) if smp == sample]
        self.lo = chain[0][0] if chain else 0
        self.hi = chain[-1][1] if chain else 0
        self.spans = [(at - self.lo, end - self.lo, a - piece.start, b - piece.start) for at, end, a, b in chain]
        self.others = [row for row in self.compact if row[0] != sample]
        # per layer, this rank's rows of the chunk's K/V from the first forward (where later chunks' gradients go)
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _attend_sharded(self, layer: int, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                        keys: dict[int, torch.Tensor], vals: dict[int, torch.Tensor]) -> torch.Tensor:
        lo, hi = self.lo, self.hi
        self.own.setdefault(layer, (ks[lo:hi], vs[lo:hi]))
        o = _ChainAttention.apply(qs[lo:hi], keys[self.sample], vals[self.sample], self.spans, self.store, layer,
                                  self.index)
        before = [row for row in self.others if row[2] <= lo]
        after = [row for row in self.others if row[1] >= hi]
        parts = [self._attend_rows(before, qs, keys, vals), o, self._attend_rows(after, qs, keys, vals)]
        return torch.cat(parts)
