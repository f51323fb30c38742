"""One rank's share of one optimizer step: forward and backward every micro-batch of the plan, exactly weighted.

Every micro-batch runs through the one runner (runtime/runner.py) and the one attention backend
(runtime/varlen.py): whole documents as one varlen call per layer; a chunk chain (consecutive
micro-batches holding the pieces of one sample) runs through :func:`~longpack.runtime.chunked.run_chain` —
forward ascending, backward descending, recomputing the chunks the plan marks. A step with CP > 1 runs as
``cp_rank`` of the step's CP group in :mod:`~longpack.runtime.context_parallel` (local pieces whole, zigzag
shares of sharded pieces, K/V all-gathered and overlapped with local attention); a chain there is sharded over
the group (:mod:`~longpack.runtime.sharded_chain`). A micro-batch's ``ckpt_layers`` checkpoints that many decoder
layers (runtime/engine.py). :func:`check_step` refuses a step these rules cannot run, before it trains
(as it is planned, runtime/ahead.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan import MicroBatch, Plan
from . import varlen
from .chunked import drive_chain, run_chain
from .context_parallel import CPAttention, rank_pieces
from .data import Source
from .engine import num_layers
from .loss import step_targets, token_weights
from .passes import NO_CLOCK
from .runner import forward_loss, model_device, prepare
from .sharded_chain import ShardedChainPass, ShardedKVStore

__all__ = ["run_micro_batches", "check_runnable", "check_step", "chain_segments"]


def _documents(cu: list[int]):  # noqa: ANN202
    """The model's ``attend`` callback for one packed micro-batch of whole documents (offsets made once)."""
    seqs = varlen.Seqs.of_offsets(cu)
    return lambda _layer, q, k, v: varlen.attention(q, k, v, seqs)


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


def chain_segments(plan: Plan, mbs: tuple[MicroBatch, ...]) -> dict[int, tuple[int, int]]:
    """{first index: (last index, sample)} of every chunk chain in a replica's micro-batches, walked as the runtime
    runs them (a chain from its first chunk to its last, whole documents one at a time); a ValueError names the
    micro-batch where the walk breaks."""
    out: dict[int, tuple[int, int]] = {}
    i = 0
    while i < len(mbs):
        seg = _chain_segment(plan, mbs, i) if mbs[i].pieces else None
        if seg is not None:
            out[i] = (seg[1], seg[0])
            i = seg[1]
        i += 1
    return out


def _cp_one(model: Any, plan: Plan, mb: MicroBatch, corpus: Source, weights_of, cp: int, cp_rank: int, group,
            overlap: bool, device: torch.device, clock: Any) -> tuple[torch.Tensor | None, int, int]:  # noqa: ANN001
    """One micro-batch on one rank of a CP group of ``cp``: local pieces whole, a zigzag share of every sharded
    piece, K/V all-gathered."""
    rows, sharded = rank_pieces(mb, cp, cp_rank)
    if not rows:  # this rank holds nothing of the micro-batch and takes part in no exchange (check_runnable)
        clock.take("F", empty=True)
        clock.take("B", empty=True)
        return None, 0, 0
    batch = prepare(mb, corpus, plan.effective_length, weights_of, device, pieces=rows)
    clock.take("F")
    loss = forward_loss(model, batch, CPAttention(mb, cp, cp_rank, group, rows, sharded, overlap=overlap),
                        mb.ckpt_layers)
    clock.take("B")
    loss.backward()
    return loss.detach(), batch.tokens, batch.targets


def _one(model: Any, plan: Plan, mb: MicroBatch, corpus: Source, weights_of, device: torch.device,
         clock: Any) -> tuple[torch.Tensor | None, int, int]:  # noqa: ANN001
    """One micro-batch of whole documents on one rank (CP degree 1)."""
    batch = prepare(mb, corpus, plan.effective_length, weights_of, device)
    clock.take("F")
    loss = forward_loss(model, batch, _documents(batch.cu_seqlens), mb.ckpt_layers)
    clock.take("B")
    loss.backward()
    return loss.detach(), batch.tokens, batch.targets


def _cp_chain(model: Any, plan: Plan, seg: list[MicroBatch], sample: int, corpus: Source, weights_of, cp: int,
              cp_rank: int, group, overlap: bool, device: torch.device, clock: Any
              ) -> tuple[torch.Tensor | None, int, int]:  # noqa: ANN001
    """One chain of chunks sharded over the CP group, on this rank."""
    store = ShardedKVStore(num_layers(model), group, cp, cp_rank)
    parts = [rank_pieces(mb, cp, cp_rank) for mb in seg]
    batches = [prepare(mb, corpus, plan.effective_length, weights_of, device, pieces=rows)
               for mb, (rows, _) in zip(seg, parts, strict=True)]
    return drive_chain(model, seg, batches, lambda j: ShardedChainPass(seg[j], cp, cp_rank, group, *parts[j],
                                                                       sample, j, store, overlap), store, clock)


def check_runnable(plan: Plan) -> None:
    """Refuse, before any step trains, a plan this runtime cannot execute (:func:`check_step` on every step)."""
    for s in range(len(plan.steps)):
        check_step(plan, s)


def check_step(plan: Plan, s: int) -> None:
    """Refuse step ``s`` of ``plan`` when this runtime cannot execute it; the message names the step, replica,
    micro-batch and piece. Checks: chunk chains well formed (each starts at token 0 on its replica, contiguous,
    one started per micro-batch); at CP degree > 1 a chain's pieces sharded over the group; every CP rank holding
    some token of a micro-batch that has sharded pieces. Cost: one pass over the step's pieces."""
    st = plan.steps[s]
    for r, rep in enumerate(st.replicas):
        cp, mbs = st.replica_cp(r), rep.micro_batches
        try:
            chains = chain_segments(plan, mbs)
        except ValueError as exc:
            raise ValueError(f"step {s}, replica {r}: {exc}; the runtime cannot run this plan") from None
        for first, (last, sample) in chains.items():
            for j in range(first, last + 1):
                other = next((p for p in mbs[j].pieces if plan.is_chunk(p) and p.sample != sample), None)
                if other is not None:
                    raise ValueError(f"step {s}, replica {r}, micro-batch {j}: a chunk of sample {other.sample} "
                                     f"(tokens {other.start}-{other.stop}) inside the chain of sample {sample}; "
                                     "the runtime runs one chain at a time")
        if cp > 1:
            for j, mb in enumerate(mbs):
                _check_cp_micro_batch(plan, mb, cp, f"step {s}, replica {r}, micro-batch {j}")


def _check_cp_micro_batch(plan: Plan, mb: MicroBatch, cp: int, where: str) -> None:
    for p in mb.pieces:
        if p.cp_rank is not None and plan.is_chunk(p):
            raise ValueError(f"{where}: piece of sample {p.sample} (tokens {p.start}-{p.stop}) is a chunk held by CP "
                             f"rank {p.cp_rank} alone in a group of {cp}; the runtime runs chains at CP > 1 only "
                             "sharded over the group (cp_rank null)")
    if any(p.cp_rank is None and p.stop - p.start < 2 * cp for p in mb.pieces):
        for rank in range(cp):
            if not rank_pieces(mb, cp, rank)[0]:
                p = next(p for p in mb.pieces if p.cp_rank is None)
                raise ValueError(f"{where}: sharded piece of sample {p.sample} (tokens {p.start}-{p.stop}) gives CP "
                                 f"rank {rank} of {cp} no token and it holds nothing else of the micro-batch; "
                                 f"shard only pieces of at least {2 * cp} tokens")


def run_micro_batches(model: Any, plan: Plan, step: int, mbs: tuple[MicroBatch, ...], corpus: Source,
                      *, mode: str = "token_mean", device: torch.device | None = None, cp_rank: int = 0,
                      cp_group=None, overlap: bool = True, cp: int | None = None, clock: Any = NO_CLOCK
                      ) -> tuple[torch.Tensor, int, int]:  # noqa: ANN001
    """Backpropagate this rank's micro-batches of ``step``; returns (its share of the step loss, a device scalar
    summed over the micro-batches and read by the caller once per step; its tokens; its real targets).
    In a step with CP degree > 1, ``cp_rank`` and ``cp_group`` say which share this rank runs and with whom;
    ``cp``: the degree of this rank's group (default the step's; a step on groups of several sizes has one per
    replica, :meth:`Step.position`). ``device``: where the batches go (default: the model's). ``clock``: this rank's
    row of the step's pass schedule under per-layer sharding (runtime/passes.py), told before every pass."""
    targets = step_targets(plan, plan.steps[step], corpus)
    total = sum(targets.values())
    cp = plan.steps[step].cp if cp is None else cp
    dev = model_device(model) if device is None else device

    def weights_of(b: Any) -> torch.Tensor:
        return token_weights(b, targets, mode, total)

    if cp > 1:
        def chain_of(seg: list[MicroBatch], sample: int) -> tuple[torch.Tensor | None, int, int]:
            return _cp_chain(model, plan, seg, sample, corpus, weights_of, cp, cp_rank, cp_group, overlap, dev,
                             clock)

        def one(mb: MicroBatch) -> tuple[torch.Tensor | None, int, int]:
            return _cp_one(model, plan, mb, corpus, weights_of, cp, cp_rank, cp_group, overlap, dev, clock)
    else:
        def chain_of(seg: list[MicroBatch], sample: int) -> tuple[torch.Tensor | None, int, int]:
            return run_chain(model, plan, seg, sample, corpus, weights_of, dev, clock)

        def one(mb: MicroBatch) -> tuple[torch.Tensor | None, int, int]:
            return _one(model, plan, mb, corpus, weights_of, dev, clock)
    loss_sum, tokens, n_targets = torch.zeros((), dtype=torch.float64, device=dev), 0, 0
    chains = chain_segments(plan, mbs)
    i = 0
    while i < len(mbs):
        if i in chains:
            last, sample = chains[i]
            part = chain_of(list(mbs[i:last + 1]), sample)
            i = last + 1
        else:
            part = one(mbs[i]) if mbs[i].pieces else (None, 0, 0)
            i += 1
        if part[0] is not None:
            loss_sum += part[0]
        tokens, n_targets = tokens + part[1], n_targets + part[2]
    return loss_sum, tokens, n_targets
