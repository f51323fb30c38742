"""Context parallelism for a micro-batch that mixes sharded and local pieces (Skrull DACP, PAPERS.md §2.9).

Within one step's CP group of c ranks, a piece with ``cp_rank = j`` is held whole by rank j and attends locally;
a piece with ``cp_rank = None`` is sharded:

* **Zigzag split.** The piece's tokens are cut into 2c near-equal blocks; rank r holds blocks r and 2c−1−r, so every
  rank gets the same causal attention work (an early and a late block) — the condition under which one rank's
  share is FLOPs(S)/c (§2.9). Blocks keep their global positions (RoPE) and next-token targets.
* **K/V exchange by all-gather** (chosen over a ring: one collective per layer, simple and exact, and on CPU/gloo
  the ring's per-step latency dominates; memory is the full K/V of the sharded pieces, which the token cap already
  bounds). The all-gather is an autograd function whose backward all-reduces the gathered gradient and keeps the
  rank's own slice, so dK/dV from every rank's queries reach the owner.
* **Overlap.** The all-gather is issued asynchronously before the local pieces' attention and waited for after it
  (Fig. 2d), so communication hides behind local work in the forward pass. ``overlap=False`` waits first.
* Each rank's query block [a, b) of a sharded piece attends to keys [0, b) of the gathered sequence with a
  bottom-right causal mask (exact, any block sizes, any length, GQA).

Gradients: CP ranks share parameters, so the step's gradient all-reduce spans every rank (runtime/train.py);
the loss stays the global token mean because every rank weighs its tokens by the step's global count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..plan import MicroBatch, Plan, Step
from .attention import document_attention

__all__ = ["zigzag_blocks", "rank_pieces", "CPGroups", "CPAttention", "all_gather_seq"]


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


@dataclass(frozen=True)
class CPGroups:
    """Process groups of the CP degrees a plan's steps use, each made once, when a step first needs it (every rank
    makes every group, in the same order).
    Replica i of a step with CP degree c is ranks [i·c, (i+1)·c); in a step on groups of several sizes the groups
    follow one another (:meth:`Step.spans`), and each (first rank, size) gets its own group."""

    groups: dict[int, list[dist.ProcessGroup | None]]
    spans: dict[tuple[int, int], dist.ProcessGroup | None] = field(default_factory=dict)
    wait: timedelta | None = None  # how long a collective of these groups waits for its peers

    @classmethod
    def build(cls, degrees: set[int], world: int, spans: set[tuple[int, int]] | None = None,
              timeout: float | None = None) -> CPGroups:
        """``timeout``: seconds a collective of these groups waits for its peers (torch's default otherwise)."""
        out = cls({}, {}, timedelta(seconds=timeout) if timeout else None)
        out._make(degrees, world, spans or set())
        return out

    def _make(self, degrees: set[int], world: int, spans: set[tuple[int, int]]) -> None:
        """Create the groups not made yet (every rank calls this with the same arguments, in the same order)."""
        for c in sorted(degrees - set(self.groups)):
            if world % c:
                raise ValueError(f"CP degree {c} does not divide the world of {world} processes")
            self.groups[c] = [dist.new_group(list(range(i * c, (i + 1) * c)), timeout=self.wait) if c > 1 else None
                              for i in range(world // c)]
        for first, c in sorted(spans - set(self.spans)):
            if c > 1 and first % c:  # an aligned span already has its group above
                self.spans[(first, c)] = dist.new_group(list(range(first, first + c)), timeout=self.wait)

    @classmethod
    def for_plan(cls, plan: Plan, world: int, timeout: float | None = None, stages: int = 1) -> CPGroups:
        """The groups of every step of ``plan`` (:meth:`add` for each)."""
        out = cls.build(set(), world, timeout=timeout)
        for st in plan.steps:
            out.add(st, world, stages)
        return out

    def add(self, step: Step, world: int, stages: int = 1) -> None:
        """Make the groups ``step`` needs that do not exist yet: its degree's aligned groups, or the unaligned
        spans of a step on groups of several sizes; with ``stages`` pipeline stages of world/stages ranks each,
        every stage's. Every rank adds every step, in order (a step planned ahead adds its groups when it runs)."""
        n = world // stages
        spans = {(first + s * n, c) for first, c in step.spans() for s in range(stages)} if step.degrees else set()
        self._make({c for _, c in spans} if step.degrees else {step.cp}, world, spans)

    def group(self, cp: int, rank: int) -> dist.ProcessGroup | None:
        return self.groups[cp][rank // cp]

    def of(self, step: Step, rank: int, offset: int = 0) -> tuple[int, int, dist.ProcessGroup | None]:
        """(degree, CP rank, process group) of plan rank ``rank`` in its replica of ``step``; ``offset``: the
        global rank of the plan's rank 0 (a pipeline stage's first rank)."""
        replica, cp_rank = step.position(rank)
        cp = step.replica_cp(replica)
        first = rank - cp_rank + offset
        if cp <= 1:
            return cp, cp_rank, None
        return cp, cp_rank, self.spans[(first, cp)] if first % cp else self.groups[cp][first // cp]


class _AllGather(torch.autograd.Function):
    """Concatenate every CP rank's rows (rank order); backward: all-reduce the gradient, keep this rank's rows."""

    @staticmethod
    def forward(ctx, x, group, sizes, rank, handle_box):  # type: ignore[override]
        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        return _gathered(x, group, sizes, handle_box)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        offset = sum(ctx.sizes[: ctx.rank])
        return grad[offset:offset + ctx.sizes[ctx.rank]], None, None, None, None


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
    pad = torch.zeros((top - x.shape[0], *x.shape[1:]), dtype=x.dtype)
    send = torch.cat([x.detach(), pad]) if top > x.shape[0] else x.detach().contiguous()
    bufs = [torch.empty_like(send) for _ in sizes]
    handle = dist.all_gather(bufs, send, group=group, async_op=async_op)
    return handle, bufs


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup | None, sizes: list[int], rank: int,
                   pending: tuple | None = None) -> torch.Tensor:
    """Autograd-correct all-gather along dim 0 of rows of unequal counts ``sizes`` (one per CP rank)."""
    return _AllGather.apply(x, group, sizes, rank, [pending])


class CPAttention:
    """The model's ``attend`` callback for one micro-batch on one CP rank (see the module docstring)."""

    def __init__(self, mb: MicroBatch, cp: int, rank: int, group: dist.ProcessGroup | None,
                 rows: list[tuple[int, int, int]], sharded: list[bool], overlap: bool = True) -> None:
        self.cp, self.rank, self.group, self.overlap = cp, rank, group, overlap
        offs = np.concatenate([[0], np.cumsum([b - a for _, a, b in rows])]).astype(int).tolist()
        self.local = [(offs[i], offs[i + 1]) for i, s in enumerate(sharded) if not s]
        self.shard_rows = [i for i, s in enumerate(sharded) if s]
        self.offs, self.rows = offs, rows
        # global layout of the gathered sharded tokens: for every CP rank, its zigzag blocks in piece order
        self.pieces = [p for p in mb.pieces if p.cp_rank is None and cp > 1]
        self.layout = [[blk for p in self.pieces for blk in zigzag_blocks(p.start, p.stop, cp, r)] for r in range(cp)]
        self.sizes = [sum(b - a for a, b in blocks) for blocks in self.layout]

    def _local_rows(self, t: torch.Tensor) -> torch.Tensor:
        idx = [torch.arange(self.offs[i], self.offs[i + 1]) for i in self.shard_rows]
        return t[torch.cat(idx)] if idx else t[:0]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        if not self.pieces:
            for a, b in self.local:
                out[a:b] = document_attention(q[a:b], k[a:b], v[a:b], [0, b - a])
            return out
        kv = torch.cat([self._local_rows(k), self._local_rows(v)], dim=-1)  # [n, kv_heads, 2D]
        pending = _start_gather(kv, self.group, self.sizes, async_op=True) if self.overlap else None
        for a, b in self.local:  # local pieces' attention hides the K/V exchange
            out[a:b] = document_attention(q[a:b], k[a:b], v[a:b], [0, b - a])
        full = all_gather_seq(kv, self.group, self.sizes, self.rank, pending)
        keys, vals = self._per_piece(full, k.shape[-1])
        self._attend_sharded(layer, q, k, v, out, keys, vals)
        return out

    def _attend_sharded(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        keys: dict[int, torch.Tensor], vals: dict[int, torch.Tensor]) -> None:
        """Fill ``out`` for the sharded rows from the gathered per-piece ``keys`` / ``vals`` (a chain overrides)."""
        self._attend_rows(self.shard_rows, q, out, keys, vals)

    def _attend_rows(self, rows: list[int], q: torch.Tensor, out: torch.Tensor, keys: dict[int, torch.Tensor],
                     vals: dict[int, torch.Tensor]) -> None:
        """Each sharded row [a, b) of its piece attends to the piece's keys [start, b), bottom-right causal."""
        for i in rows:
            sample, a, b = self.rows[i]
            piece = next(p for p in self.pieces if p.sample == sample)
            kp, vp = keys[sample], vals[sample]
            qa, qb = self.offs[i], self.offs[i + 1]
            out[qa:qb] = _bottom_right(q[qa:qb], kp[: b - piece.start], vp[: b - piece.start])

    def _per_piece(self, full: torch.Tensor, d: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Reassemble each sharded piece's K and V in token order from the gathered rank-ordered rows."""
        spans: dict[int, list[tuple[int, int, int]]] = {p.sample: [] for p in self.pieces}
        offset = 0
        for r in range(self.cp):
            for p in self.pieces:
                for a, b in zigzag_blocks(p.start, p.stop, self.cp, r):
                    spans[p.sample].append((a, offset, offset + (b - a)))
                    offset += b - a
        keys, vals = {}, {}
        for sample, parts in spans.items():
            parts.sort()
            idx = torch.cat([torch.arange(lo, hi) for _, lo, hi in parts])
            rows = full[idx]
            keys[sample], vals[sample] = rows[..., :d], rows[..., d:]
        return keys, vals


def _bottom_right(q_thd: torch.Tensor, k_thd: torch.Tensor, v_thd: torch.Tensor) -> torch.Tensor:
    """Queries that are the last s positions of a [0, n) key range, causal (bottom-right aligned)."""
    s, n = q_thd.shape[0], k_thd.shape[0]
    mask = torch.arange(n)[None, :] <= (n - s + torch.arange(s))[:, None]
    o = F.scaled_dot_product_attention(q_thd.transpose(0, 1)[None], k_thd.transpose(0, 1)[None],
                                       v_thd.transpose(0, 1)[None], attn_mask=mask,
                                       enable_gqa=q_thd.shape[1] != k_thd.shape[1])
    return o[0].transpose(0, 1)
