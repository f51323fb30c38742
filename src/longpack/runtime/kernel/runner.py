"""The one micro-batch runner: collate -> the model's device -> attention callback -> forward -> loss.

Every execution path runs its micro-batches through these two functions — whole documents (runtime/kernel/step.py), a
CP rank's share (runtime/kernel/context_parallel.py), a chunk of a chain at CP 1 or sharded
(runtime/kernel/chunked.py, runtime/kernel/sharded_chain.py), a pipeline stage (runtime/kernel/pipeline.py) and so the
Trainer (longpack.hf) — and they differ only in the ``attend`` callback they pass:

* :func:`prepare` collates the pieces on the host (ids, next-token targets, positions, document offsets), weighs
  every target there (runtime/kernel/loss.py: the step's exact normaliser, known from the plan), and moves the tensors
  the model and the loss read to the model's device in two copies. Nothing of the micro-batch is left on the host
  for the device to read later, and the host keeps what it needs (counts, offsets) as ints.
* :func:`forward_loss` runs the model with the callback and the micro-batch's checkpointed layers and returns
  Σ weight · cross-entropy as a device scalar, the head and its loss in chunks of tokens (runtime/kernel/head_loss.py),
  or, on a pipeline stage without the head, the hidden states.

Host syncs: none here; a step's losses are summed on the device and read once per step (runtime/run/train.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ...plan import MicroBatch
from . import varlen
from .data import Packed, Source, collate
from .engine import checkpointing, forward_logits
from .head_loss import LossHead, loss_head
from .loss import weighted_loss

__all__ = ["prepare", "forward_loss", "empty_loss", "model_device"]


def model_device(model: Any) -> torch.device:
    """The device of the model's parameters (a stage model's first parameter; CPU for a model with none)."""
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def prepare(mb: MicroBatch, source: Source, effective_length: Callable[[int], int],
            weigh: Callable[[Packed], torch.Tensor], device: torch.device,
            pieces: list[tuple[int, int, int]] | None = None) -> Packed:
    """``mb`` (or this rank's ``pieces`` of it) as tensors on ``device``, each target weighed by ``weigh``. The host
    work runs on real tensors even under a fake-tensor dry run (runtime/run/dry_run.py)."""
    with unset_fake_temporarily():
        batch = collate(mb, source, effective_length, pieces=pieces)
        batch.weights = weigh(batch)
        batch.uniform = _one_value(batch.weights)
    return batch.to(device)


def _one_value(weights: torch.Tensor) -> float | None:
    """The one nonzero value of the host's ``weights``, or None (several values, or none)."""
    nonzero = weights[weights != 0]
    if not nonzero.numel() or not bool((nonzero == nonzero[0]).all()):
        return None
    return float(nonzero[0])


@contextmanager
def _targets(head: LossHead | None, labels: torch.Tensor, weights: torch.Tensor,
             uniform: float | None = None) -> Iterator[None]:
    if head is None:
        yield
        return
    head.target = (labels, weights, uniform)
    try:
        yield
    finally:
        head.target = None


def forward_loss(model: Any, batch: Packed, attend: Any, ckpt_layers: int = 0, hidden: torch.Tensor | None = None,
                 head: bool = True) -> torch.Tensor:
    """This micro-batch's Σ weight · cross-entropy (a device scalar, with its graph when grad is on); ``hidden``:
    a later pipeline stage's input; ``head=False``: return the stage's output hidden states instead. A linear head
    without bias computes the loss itself, in chunks (runtime/kernel/head_loss.LossHead): no [tokens, vocab] logits are
    held."""
    lm = loss_head(model) if head else None
    with checkpointing(model, ckpt_layers), _targets(lm, batch.labels.clamp_min(0), batch.weights, batch.uniform):
        out = forward_logits(model, batch.input_ids, batch.position_ids, attend, hidden=hidden)
    if not head or lm is not None:
        return out
    return weighted_loss(out, batch)


def empty_loss(model: Any, device: torch.device) -> torch.Tensor:
    """An empty pass (runtime/kernel/passes.py, and the closing pass of runtime/kernel/parallelize.StepSync): one
    token through the whole model — a later pipeline stage's (no embeddings) from a zero hidden state — its loss
    times zero, with its graph; its backward adds zero to every gradient."""
    one = torch.zeros(1, dtype=torch.long, device=device)
    seqs = varlen.Seqs([1])
    attend = lambda _l, q, k, v: varlen.attention(q, k, v, seqs)  # noqa: E731
    hidden = None
    if getattr(getattr(model, "model", None), "embed_tokens", True) is None:  # a later pipeline stage
        hidden = torch.zeros((1, int(model.config.hidden_size)), device=device,
                             dtype=next(model.parameters()).dtype)
    lm = loss_head(model)
    with _targets(lm, one, torch.zeros(1, dtype=torch.float32, device=device)):
        out = forward_logits(model, one, one, attend, hidden=hidden)
    return out * 0.0 if lm is not None else out.sum() * 0.0
