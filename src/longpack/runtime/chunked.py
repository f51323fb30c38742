"""ChunkFlow's state-aware chunked execution (PAPERS.md §3.3): a long sample as a chain of chunks whose memory is
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

Memory: at most K chunks of activations plus the store (2 · layers · S · kv_heads · head_dim numbers). Time: one
extra forward per recomputed chunk. Exact: the same sums in a different order (float64 parity tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..plan import MicroBatch, Plan
from .attention import document_attention
from .blockwise import attention_with_blocks
from .data import Packed, Source, collate
from .engine import checkpointing, forward_logits, num_layers
from .loss import weighted_loss

__all__ = ["KVStore", "run_chain", "drive_chain"]


class KVStore:
    """Per layer, the K/V of every finished chunk of one sample ([1, kv_heads, n, D], detached) and the gradients
    later chunks send to them (accumulated in place by the blockwise attention's backward)."""

    def __init__(self, layers: int) -> None:
        self.blocks: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(layers)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.detach(), v.detach()
        self.blocks[layer].append((k, v, torch.zeros_like(k), torch.zeros_like(v)))

    def before(self, layer: int, chunk: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        return self.blocks[layer][:chunk]

    def grads(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, dk, dv = self.blocks[layer][chunk]
        return dk, dv


def _bhsd(x_thd: torch.Tensor) -> torch.Tensor:
    return x_thd.transpose(0, 1)[None].contiguous()


class _ChunkPass:
    """The model's ``attend`` callback for one micro-batch holding chunk ``index`` of the chain's sample: the
    chain's row attends over the store's earlier chunks plus itself; the other documents attend to themselves."""

    def __init__(self, batch: Packed, sample: int, index: int, store: KVStore) -> None:
        self.store, self.index = store, index
        row = next(r for r, d in enumerate(batch.docs) if d[0] == sample)
        self.span = (batch.cu_seqlens[row], batch.cu_seqlens[row + 1])
        cu = batch.cu_seqlens
        self.others = [(a, b) for r, (a, b) in enumerate(zip(cu, cu[1:], strict=False)) if r != row]
        # per layer, this chunk's own K/V from its first forward (the tensors later chunks' gradients go into); a
        # checkpointed layer's recomputation during backward calls this again and must not replace them
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a, b = self.span
        k_own, v_own = _bhsd(k[a:b]), _bhsd(v[a:b])
        self.own.setdefault(layer, (k_own, v_own))
        o = attention_with_blocks(_bhsd(q[a:b]), k_own, v_own, self.store.before(layer, self.index))
        out = torch.empty_like(q)
        out[a:b] = o[0].transpose(0, 1)
        for c, d in self.others:
            out[c:d] = document_attention(q[c:d], k[c:d], v[c:d], [0, d - c])
        return out


def run_chain(model: Any, plan: Plan, mbs: list[MicroBatch], sample: int, corpus: Source,
              weights_of: Callable[[Packed], torch.Tensor]) -> tuple[float, int, int]:
    """A chain on one rank (CP degree 1); returns (loss share, tokens, targets)."""
    store = KVStore(num_layers(model))
    batches = [collate(mb, corpus, plan.effective_length) for mb in mbs]
    return drive_chain(model, mbs, batches, lambda i: _ChunkPass(batches[i], sample, i, store), store, weights_of)


def drive_chain(model: Any, mbs: list[MicroBatch], batches: list[Packed], make_pass: Callable[[int], Any],
                store: Any, weights_of: Callable[[Packed], torch.Tensor]) -> tuple[float, int, int]:
    """Forward ascending, backward descending over the chain's micro-batches; returns (loss share, tokens,
    targets). ``make_pass(i)`` builds chunk i's ``attend`` callback, whose ``own`` maps a layer to the chunk's
    K/V tensors that enter ``store`` (``append``) and receive later chunks' gradients (``grads``)."""
    kept: dict[int, tuple[torch.Tensor, Any]] = {}
    loss_sum = 0.0
    for i, (mb, batch) in enumerate(zip(mbs, batches, strict=True)):
        with torch.set_grad_enabled(not mb.recompute):
            attend = make_pass(i)
            with checkpointing(model, mb.ckpt_layers if not mb.recompute else 0):
                logits = forward_logits(model, batch.input_ids, batch.position_ids, attend)
            loss = weighted_loss(logits, batch, weights_of(batch))
        for layer, (k, v) in sorted(attend.own.items()):
            store.append(layer, k, v)
        loss_sum += float(loss.detach())
        if not mb.recompute:
            kept[i] = (loss, attend)
    for i in range(len(mbs) - 1, -1, -1):
        if i in kept:
            loss, attend = kept.pop(i)
        else:  # recompute: the same forward again, now recording the graph
            batch = batches[i]
            attend = make_pass(i)
            with checkpointing(model, mbs[i].ckpt_layers):
                logits = forward_logits(model, batch.input_ids, batch.position_ids, attend)
            loss = weighted_loss(logits, batch, weights_of(batch))
        tensors, grads = [loss], [torch.ones_like(loss)]
        if i < len(mbs) - 1:  # later chunks sent gradients to this chunk's keys and values: inject them
            for layer, (k, v) in sorted(attend.own.items()):
                dk, dv = store.grads(layer, i)
                tensors += [k, v]
                grads += [dk, dv]
        torch.autograd.backward(tensors, grads)
    return loss_sum, sum(b.tokens for b in batches), sum(b.targets for b in batches)
