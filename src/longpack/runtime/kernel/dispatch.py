"""The one dispatch: how a micro-batch of a planned step runs on this rank, whoever drives it (the step loop of
runtime/kernel/step.py, a pipeline stage of runtime/kernel/pipeline.py).

* :class:`StepWork` — what every micro-batch of one step shares on this rank: the plan, the rows, each target's
  weight in the step objective (the step's exact normaliser, runtime/kernel/loss.py) and the CP context.
* :func:`rows_of` / :func:`prepare_mb` — the micro-batch's pieces this CP rank computes (all of them at degree 1,
  its zigzag share of each sharded piece) as tensors on the device.
* :func:`attend_for` — its attention: whole documents; CP-sharded pieces beside local ones (CPAttention); a chunk
  of a chain (ChunkPass, over the chain's K/V store); a chunk of a chain sharded over the group
  (ShardedChainPass). :func:`new_store` makes a chain's store, sharded or not.
* :func:`run_one` / :func:`run_chain` — a micro-batch forward and backward, or a chain of them (forward
  ascending, backward descending, later chunks' dK/dV injected: runtime/kernel/chunked.drive_chain).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...plan import MicroBatch, Plan
from . import varlen
from .chunked import ChainLink, ChunkPass, drive_chain
from .context_parallel import CPAttention, rank_pieces
from .cp import CPContext
from .data import Packed, Source
from .engine import num_layers
from .kv_store import KVStore, ShardedKVStore
from .loss import step_targets, token_weights
from .runner import forward_loss, model_device, prepare
from .sharded_chain import ShardedChainPass

__all__ = ["StepWork", "rows_of", "prepare_mb", "attend_for", "new_store", "run_one", "run_chain"]

Part = tuple[torch.Tensor | None, int, int]  # (loss share as a device scalar, tokens, targets)
Rows = tuple[list[tuple[int, int, int]], list[bool]]


@dataclass(frozen=True)
class StepWork:
    """One step on this rank (module docstring); ``weigh(batch)``: its tokens' weights."""

    plan: Plan
    source: Source
    weigh: Callable[[Packed], torch.Tensor]
    cp: CPContext

    @classmethod
    def of(cls, plan: Plan, step: int, source: Source, mode: str, cp: CPContext) -> StepWork:
        targets = step_targets(plan, plan.steps[step], source)
        total = sum(targets.values())
        return cls(plan, source, lambda b: token_weights(b, targets, mode, total), cp)

    def on(self, model: Any) -> StepWork:
        """This work with its device set (the model's, unless the context names one)."""
        if self.cp.device is not None:
            return self
        from dataclasses import replace

        return replace(self, cp=replace(self.cp, device=model_device(model)))


def rows_of(work: StepWork, mb: MicroBatch) -> Rows:
    """The (sample, start, stop) rows this CP rank computes of ``mb``, and which belong to sharded pieces."""
    if work.cp.degree > 1:
        return rank_pieces(mb, work.cp.degree, work.cp.rank)
    return [(p.sample, p.start, p.stop) for p in mb.pieces], [False] * len(mb.pieces)


def prepare_mb(work: StepWork, mb: MicroBatch, rows: Rows) -> Packed:
    """``mb``'s rows on the device, weighed (runtime/kernel/runner.prepare)."""
    pieces = rows[0] if work.cp.degree > 1 else None
    assert work.cp.device is not None, "StepWork.on(model) sets the device before a micro-batch is prepared"
    return prepare(mb, work.source, work.plan.effective_length, work.weigh, work.cp.device, pieces=pieces)


def attend_for(work: StepWork, mb: MicroBatch, batch: Packed, rows: Rows, link: ChainLink | None = None) -> Any:
    """The model's ``attend`` callback for ``mb`` (module docstring); ``link``: the chain chunk it holds."""
    if link is None:
        if work.cp.degree > 1:
            return CPAttention(mb, work.cp, *rows)
        seqs = varlen.Seqs.of_offsets(batch.cu_seqlens).placed(batch.cu_device)
        return lambda _layer, q, k, v: varlen.attention(q, k, v, seqs)
    if work.cp.degree > 1:
        return ShardedChainPass(mb, work.cp, *rows, link)
    return ChunkPass(batch, link)


def new_store(work: StepWork, layers: int) -> KVStore:
    """An empty K/V store for a chain of ``layers`` decoder layers, sharded over the CP group at degree > 1."""
    if work.cp.degree > 1:
        return ShardedKVStore(layers, work.cp.group, work.cp.degree, work.cp.rank)
    return KVStore(layers)


def run_one(model: Any, work: StepWork, mb: MicroBatch) -> Part:
    """One micro-batch of whole documents (and sharded pieces at degree > 1), forward and backward."""
    rows = rows_of(work, mb)
    clock = work.cp.clock
    if not rows[0]:  # this CP rank holds nothing of it and takes part in no exchange (step.check_step)
        clock.take("F", empty=True)
        clock.take("B", empty=True)
        return None, 0, 0
    batch = prepare_mb(work, mb, rows)
    clock.take("F")
    loss = forward_loss(model, batch, attend_for(work, mb, batch, rows), mb.ckpt_layers)
    clock.take("B")
    loss.backward()
    return loss.detach(), batch.tokens, batch.targets


def run_chain(model: Any, work: StepWork, mbs: list[MicroBatch], sample: int) -> Part:
    """A chain of ``sample``'s chunks over consecutive micro-batches (sharded over the group at degree > 1)."""
    store = new_store(work, num_layers(model))
    rows = [rows_of(work, mb) for mb in mbs]
    batches = [prepare_mb(work, mb, r) for mb, r in zip(mbs, rows, strict=True)]

    def make_pass(j: int) -> Any:
        return attend_for(work, mbs[j], batches[j], rows[j], ChainLink(sample, j, store))

    return drive_chain(model, mbs, batches, make_pass, store, work.cp.clock)
