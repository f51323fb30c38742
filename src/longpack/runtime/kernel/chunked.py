"""ChunkFlow's state-aware chunked execution (ChunkFlow Algorithm 2): a long sample as a chain of chunks whose memory is
set by the chunk size, with gradients identical to running it whole.

A chain is a run of consecutive micro-batches of one replica that hold the pieces [a_0, a_1), [a_1, a_2), ... of
one sample (other, whole documents may share those micro-batches: ChunkFlow fills the last chunk). Execution:

1. **Forward, ascending.** Chunk i's queries attend causally to its own tokens and to every key of chunks < i
   (bottom-right aligned: query t of the chunk sees prefix + t + 1 keys; positions continue across chunks). Each
   layer's K and V of the chunk go into a per-sample store (detached). A chunk marked ``recompute`` runs this
   forward without autograd — only its K/V survive; the other (last K) chunks keep their graphs.
2. **Backward, descending.** For i = N−1 .. 0: a dropped chunk first re-runs its forward with autograd (using the
   stored prefix K/V); then backward runs on its loss *plus* the accumulated dK_i, dV_i that later chunks sent
   to its keys and values, injected as upstream gradients on the chunk's own K/V outputs. The gradients that
   reach the prefix K/V (leaf tensors) are added to the store's accumulators of chunks < i. Chunk i's dK/dV is
   complete only after every later chunk's backward, hence descending order.

Memory: at most K chunks of activations plus the store (2 · layers · S · kv_heads · head_dim numbers, and as many
fp32 gradient accumulators); a chunk's entries leave the store when its backward starts (its summed gradients kept
in the K/V dtype), so the backward of chunk i holds the store of chunks < i only, as the simulator prices it. Time:
one extra forward per recomputed chunk. Exact: the same sums in a different order (float64 parity tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...plan import MicroBatch
from . import varlen
from .data import Packed
from .passes import NO_CLOCK
from .runner import forward_loss

__all__ = ["ChainLink", "ChunkPass", "drive_chain", "injected", "with_prefix"]


@dataclass(frozen=True)
class ChainLink:
    """Chunk ``index`` of ``sample``'s chain and the chain's K/V store (runtime/kernel/kv_store.py)."""

    sample: int
    index: int
    store: Any


def _stacked(blocks: list, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[the stored blocks' keys | own keys] and the same for values."""
    return torch.cat([b[0] for b in blocks] + [k]), torch.cat([b[1] for b in blocks] + [v])


class _WithPrefix(torch.autograd.Function):
    """A chunk's queries over [the stored earlier chunks' keys | its own keys], bottom-right causal, in one call of
    the attention backend; the stored keys' gradients go into their accumulators, the own keys' back to autograd.
    The concatenated keys are rebuilt in backward rather than saved (one layer's prefix alive at a time)."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, seqs):  # type: ignore[override]
        o, lse = varlen.forward(q, *_stacked(blocks, k, v), seqs)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.blocks, ctx.seqs = blocks, seqs
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = varlen.backward(do.to(q.dtype), q, *_stacked(ctx.blocks, k, v), o, lse, ctx.seqs)
        at = 0
        for kb, _, acc_k, acc_v in ctx.blocks:
            n = kb.shape[0]
            acc_k.add_(dk[at:at + n])
            acc_v.add_(dv[at:at + n])
            at += n
        ctx.blocks = None  # the graph may outlive this backward; the store's blocks must not (KVStore.drop)
        return dq, dk[at:], dv[at:], None, None


def with_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list,
                memo: dict[tuple[int, int], varlen.Seqs] | None = None) -> torch.Tensor:
    """Queries ``q`` [s, H, D] over fully visible stored ``blocks`` [(k, v, grad_k acc, grad_v acc)] and their own
    keys ``k`` / ``v`` [s, Hkv, D] (causal); exact, with the stored keys' gradients added to the accumulators.
    ``memo``: the backend's lengths by (queries, keys), kept by the caller so that every layer of a pass reuses
    one copy of them on the device."""
    n = q.shape[0]
    key = (n, n + sum(b[0].shape[0] for b in blocks))
    seqs = memo.get(key) if memo is not None else None
    if seqs is None:
        seqs = varlen.Seqs([key[0]], [key[1]])
        if memo is not None:
            memo[key] = seqs
    if not blocks:
        return varlen.attention(q, k, v, seqs)
    return _WithPrefix.apply(q, k, v, blocks, seqs)


class ChunkPass:
    """The model's ``attend`` callback for one micro-batch holding chunk ``link.index`` of the chain's sample: the
    chain's row attends over the store's earlier chunks plus itself; the other documents attend to themselves
    (one backend call for all of them, their offsets made once here)."""

    def __init__(self, batch: Packed, link: ChainLink) -> None:
        self.store, self.index = link.store, link.index
        row = next(r for r, d in enumerate(batch.docs) if d[0] == link.sample)
        self.span = (batch.cu_seqlens[row], batch.cu_seqlens[row + 1])
        lens = [b - a for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:], strict=False)]
        self.others = varlen.Seqs(lens[:row] + lens[row + 1:])
        # per layer, this chunk's own K/V from its first forward (the tensors later chunks' gradients go into); a
        # checkpointed layer's recomputation during backward calls this again and must not replace them
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.memo: dict[tuple[int, int], varlen.Seqs] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a, b = self.span
        self.own.setdefault(layer, (k[a:b], v[a:b]))
        o = with_prefix(q[a:b], k[a:b], v[a:b], self.store.before(layer, self.index), self.memo)
        if not self.others.q_lens:
            return o
        rest = varlen.attention(*(torch.cat([t[:a], t[b:]]) for t in (q, k, v)), self.others)
        return torch.cat([rest[:a], o, rest[a:]])


def injected(out: torch.Tensor, grad: torch.Tensor, attend: Any, sent: dict[int, tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tensors, gradients) of a chain chunk's backward: its output with ``grad``, and its own K/V per layer
    (``attend.own``) with what later chunks ``sent`` them (none for the last chunk)."""
    tensors, grads = [out], [grad]
    for layer, (k, v) in sorted(attend.own.items()) if sent else ():
        tensors += [k, v]
        grads += list(sent[layer])
    return tensors, grads


def drive_chain(model: Any, mbs: list[MicroBatch], batches: list[Packed], make_pass: Callable[[int], Any],
                store: Any, clock: Any = NO_CLOCK) -> tuple[torch.Tensor | None, int, int]:
    """Forward ascending, backward descending over the chain's micro-batches (already on the model's device:
    runtime/kernel/runner.prepare); returns (loss share as a device scalar, tokens, targets). ``make_pass(i)`` builds
    chunk i's ``attend`` callback, whose ``own`` maps a layer to the chunk's K/V tensors that enter ``store``
    (``append``) and receive later chunks' gradients (``grads``); ``clock`` is told before every pass
    (runtime/kernel/passes.py)."""
    kept: dict[int, tuple[torch.Tensor, Any]] = {}
    loss_sum = None
    for i, (mb, batch) in enumerate(zip(mbs, batches, strict=True)):
        clock.take("F")
        with torch.set_grad_enabled(not mb.recompute):
            attend = make_pass(i)
            loss = forward_loss(model, batch, attend, mb.ckpt_layers if not mb.recompute else 0)
        for layer, (k, v) in sorted(attend.own.items()):
            store.append(layer, k, v)
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        if not mb.recompute:
            kept[i] = (loss, attend)
    for i in range(len(mbs) - 1, -1, -1):
        # what later chunks sent to this chunk's keys and values (their backward is done), in the K/V dtype; then
        # the chunk leaves the store: no chunk reads it again, and a recomputed chunk makes its K/V anew
        sent = store.sent(i) if i < len(mbs) - 1 else {}
        store.drop(i)
        if i in kept:
            loss, attend = kept.pop(i)
        else:  # recompute: the same forward again, now recording the graph
            clock.take("F")
            attend = make_pass(i)
            loss = forward_loss(model, batches[i], attend, mbs[i].ckpt_layers)
        clock.take("B")
        torch.autograd.backward(*injected(loss, torch.ones_like(loss), attend, sent))
        del loss, attend, sent  # nothing of chunk i outlives its backward (the next may recompute)
    return loss_sum, sum(b.tokens for b in batches), sum(b.targets for b in batches)
