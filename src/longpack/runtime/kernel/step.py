"""One rank's share of one optimizer step: forward and backward every micro-batch of the plan, exactly weighted.

Every micro-batch runs through the one runner (runtime/kernel/runner.py) and the one attention backend
(runtime/kernel/varlen.py): whole documents as one varlen call per layer; a chunk chain (consecutive
micro-batches holding the pieces of one sample) runs through :func:`~longpack.runtime.kernel.chunked.run_chain` —
forward ascending, backward descending, recomputing the chunks the plan marks. A step with CP > 1 runs as
``cp_rank`` of the step's CP group in :mod:`~longpack.runtime.kernel.context_parallel` (local pieces whole, zigzag
shares of sharded pieces, K/V all-gathered and overlapped with local attention); a chain there is sharded over
the group (:mod:`~longpack.runtime.kernel.sharded_chain`). A micro-batch's ``ckpt_layers`` checkpoints that many decoder
layers (runtime/kernel/engine.py). :func:`check_step` refuses a step these rules cannot run, before it trains
(as it is planned, runtime/run/ahead.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ...plan import MicroBatch, Plan
from .context_parallel import rank_pieces
from .cp import CPContext
from .data import Source
from .dispatch import StepWork, run_chain, run_one

__all__ = ["run_micro_batches", "check_runnable", "check_step", "chain_segments"]


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


def run_micro_batches(model: Any, plan: Plan, step: int, mbs: tuple[MicroBatch, ...], source: Source,
                      cp: CPContext | None = None, mode: str = "token_mean") -> tuple[torch.Tensor, int, int]:
    """Backpropagate this rank's micro-batches of ``step``; returns (its share of the step loss, a device scalar
    summed over the micro-batches and read by the caller once per step; its tokens; its real targets). ``cp``:
    this rank's place in its CP group for the step (runtime/kernel/cp.py; default: degree 1, the model's device);
    each micro-batch or chain goes through the one dispatch (runtime/kernel/dispatch.py)."""
    work = StepWork.of(plan, step, source, mode, cp or CPContext()).on(model)
    loss_sum, tokens, n_targets = torch.zeros((), dtype=torch.float64, device=work.cp.device), 0, 0
    chains = chain_segments(plan, mbs)
    i = 0
    while i < len(mbs):
        if i in chains:
            last, sample = chains[i]
            part = run_chain(model, work, list(mbs[i:last + 1]), sample)
            i = last + 1
        else:
            part = run_one(model, work, mbs[i]) if mbs[i].pieces else (None, 0, 0)
            i += 1
        if part[0] is not None:
            loss_sum += part[0]
        tokens, n_targets = tokens + part[1], n_targets + part[2]
    return loss_sum, tokens, n_targets
