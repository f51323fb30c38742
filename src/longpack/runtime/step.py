"""One rank's share of one optimizer step: forward and backward every micro-batch of the plan, exactly weighted.

Whole documents run through :func:`~longpack.runtime.attention.document_attention`. Steps with chunk chains or
with CP > 1 are refused with a clear message until the chunked and context-parallel paths exist.
"""

from __future__ import annotations

import torch

from ..plan import MicroBatch, Plan
from .attention import document_attention
from .data import SyntheticCorpus, collate
from .loss import step_targets, token_weights, weighted_loss
from .model import Decoder

__all__ = ["run_micro_batches"]


def _documents(cu: list[int]):  # noqa: ANN202
    """The model's ``attend`` callback for one packed micro-batch of whole documents."""
    return lambda _layer, q, k, v: document_attention(q, k, v, cu)


def _is_chunk(plan: Plan, mb: MicroBatch) -> bool:
    return any(p.start > 0 or p.stop < plan.effective_length(p.sample) for p in mb.pieces)


def run_micro_batches(model: Decoder, plan: Plan, step: int, mbs: tuple[MicroBatch, ...], corpus: SyntheticCorpus,
                      *, mode: str = "token_mean", device: torch.device | None = None) -> tuple[float, int]:
    """Backpropagate this rank's micro-batches of ``step``; returns (its share of the step loss, its tokens)."""
    targets = step_targets(plan, plan.steps[step])
    total = sum(targets.values())
    if plan.steps[step].cp > 1:
        raise NotImplementedError(f"step {step} has cp={plan.steps[step].cp}: run it with the context-parallel "
                                  "runtime (longpack train --cp)")
    loss_sum, tokens = 0.0, 0
    for mb in mbs:
        if not mb.pieces:
            continue
        if _is_chunk(plan, mb):
            raise NotImplementedError(f"step {step} holds a chunk of a split sample; plans with chunk chains need "
                                      "the chunked runtime, which this version does not have yet")
        batch = collate(mb, corpus, plan.effective_length)
        if device is not None and device.type != "cpu":
            batch.input_ids, batch.labels = batch.input_ids.to(device), batch.labels.to(device)
            batch.position_ids = batch.position_ids.to(device)
        logits = model(batch.input_ids, batch.position_ids, _documents(batch.cu_seqlens))
        weights = token_weights(batch, targets, mode, total).to(logits.device)
        loss = weighted_loss(logits, batch, weights)
        loss.backward()
        loss_sum += float(loss.detach())
        tokens += batch.tokens
    return loss_sum, tokens
