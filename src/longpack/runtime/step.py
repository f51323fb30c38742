"""One rank's share of one optimizer step: forward and backward every micro-batch of the plan, exactly weighted.

Whole documents run through :func:`~longpack.runtime.attention.document_attention`; a chunk chain (consecutive
micro-batches holding the pieces of one sample) runs through :func:`~longpack.runtime.chunked.run_chain` —
forward ascending, backward descending, recomputing the chunks the plan marks. A step with CP > 1 runs as
``cp_rank`` of the step's CP group in :mod:`~longpack.runtime.context_parallel` (local pieces whole, zigzag
shares of sharded pieces, K/V all-gathered and overlapped with local attention). A micro-batch's ``ckpt_layers``
checkpoints that many decoder layers (runtime/engine.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan import MicroBatch, Plan
from .attention import document_attention
from .chunked import run_chain
from .context_parallel import CPAttention, rank_pieces
from .data import Source, collate
from .engine import checkpointing, forward_logits
from .loss import step_targets, token_weights, weighted_loss

__all__ = ["run_micro_batches"]


def _documents(cu: list[int]):  # noqa: ANN202
    """The model's ``attend`` callback for one packed micro-batch of whole documents."""
    return lambda _layer, q, k, v: document_attention(q, k, v, cu)


def _chain_segment(plan: Plan, mbs: tuple[MicroBatch, ...], i: int) -> tuple[int, int] | None:
    """(sample, last index) when micro-batch ``i`` starts a chunk chain; None for whole documents only."""
    starts = [p for p in mbs[i].pieces if p.start == 0 and plan.is_chunk(p)]
    if any(p.start > 0 for p in mbs[i].pieces):
        raise ValueError(f"micro-batch {i} continues a chunk chain whose first chunk is not on this replica")
    if not starts:
        return None
    if len(starts) > 1:
        raise ValueError(f"micro-batch {i} starts {len(starts)} chunk chains; the runtime runs one at a time")
    sample, pos, j = starts[0].sample, starts[0].stop, i
    while pos < plan.effective_length(sample):
        j += 1
        nxt = [p for p in mbs[j].pieces if p.sample == sample] if j < len(mbs) else []
        if not nxt or nxt[0].start != pos:
            raise ValueError(f"chunk chain of sample {sample} is not contiguous at micro-batch {j}")
        pos = nxt[0].stop
    return sample, j


def _run_cp(model: Any, plan: Plan, step: int, mbs: tuple[MicroBatch, ...], corpus: Source,
            weights_of, cp: int, cp_rank: int, group, overlap: bool) -> tuple[float, int, int]:  # noqa: ANN001
    """A CP step on one rank of a group of ``cp``: local pieces whole, a zigzag share of every sharded piece, K/V
    all-gathered."""
    loss_sum, tokens, n_targets = 0.0, 0, 0
    for i, mb in enumerate(mbs):
        if not mb.pieces:
            continue
        if any(p.cp_rank is None and plan.is_chunk(p) for p in mb.pieces):
            raise NotImplementedError(f"step {step}, micro-batch {i}: a chunk of a split sample sharded over CP; "
                                      "chunk chains run only at cp=1 in this version")
        rows, sharded = rank_pieces(mb, cp, cp_rank)
        if not rows:
            if any(p.cp_rank is None for p in mb.pieces):
                raise ValueError(f"step {step}, micro-batch {i}: a sharded piece too short to give CP rank "
                                 f"{cp_rank} any token (fewer than {2 * cp} tokens over CP {cp})")
            continue  # this rank holds nothing of the micro-batch and takes part in no exchange
        batch = collate(mb, corpus, plan.effective_length, pieces=rows)
        attend = CPAttention(mb, cp, cp_rank, group, rows, sharded, overlap=overlap)
        with checkpointing(model, mb.ckpt_layers):
            logits = forward_logits(model, batch.input_ids, batch.position_ids, attend)
        loss = weighted_loss(logits, batch, weights_of(batch))
        loss.backward()
        loss_sum += float(loss.detach())
        tokens += batch.tokens
        n_targets += batch.targets
    return loss_sum, tokens, n_targets


def run_micro_batches(model: Any, plan: Plan, step: int, mbs: tuple[MicroBatch, ...], corpus: Source,
                      *, mode: str = "token_mean", device: torch.device | None = None, cp_rank: int = 0,
                      cp_group=None, overlap: bool = True, cp: int | None = None) -> tuple[float, int, int]:  # noqa: ANN001
    """Backpropagate this rank's micro-batches of ``step``; returns (its share of the step loss, its tokens, its
    real targets).
    In a step with CP degree > 1, ``cp_rank`` and ``cp_group`` say which share this rank runs and with whom;
    ``cp``: the degree of this rank's group (default the step's; a step on groups of several sizes has one per
    replica, :meth:`Step.position`)."""
    targets = step_targets(plan, plan.steps[step], corpus)
    total = sum(targets.values())
    cp = plan.steps[step].cp if cp is None else cp
    if cp > 1:
        return _run_cp(model, plan, step, mbs, corpus, lambda b: token_weights(b, targets, mode, total), cp,
                       cp_rank, cp_group, overlap)
    loss_sum, tokens, n_targets = 0.0, 0, 0
    i = 0
    while i < len(mbs):
        mb = mbs[i]
        chain = _chain_segment(plan, mbs, i) if mb.pieces else None
        if chain is not None:
            sample, last = chain
            part, n, t = run_chain(model, plan, list(mbs[i:last + 1]), sample, corpus,
                                   lambda b: token_weights(b, targets, mode, total))
            loss_sum, tokens, n_targets, i = loss_sum + part, tokens + n, n_targets + t, last + 1
            continue
        i += 1
        if not mb.pieces:
            continue
        batch = collate(mb, corpus, plan.effective_length)
        if device is not None and device.type != "cpu":
            batch.input_ids, batch.labels = batch.input_ids.to(device), batch.labels.to(device)
            batch.position_ids = batch.position_ids.to(device)
        with checkpointing(model, mb.ckpt_layers):
            logits = forward_logits(model, batch.input_ids, batch.position_ids, _documents(batch.cu_seqlens))
        weights = token_weights(batch, targets, mode, total).to(logits.device)
        loss = weighted_loss(logits, batch, weights)
        loss.backward()
        loss_sum += float(loss.detach())
        tokens += batch.tokens
        n_targets += batch.targets
    return loss_sum, tokens, n_targets
