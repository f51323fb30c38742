"""Pipeline parallelism: the decoder split into P stage processes, each step's micro-batches run in ChunkFlow's
state-aware 1F1B order (sim/pipeline.py), activations and their gradients sent point to point.

Each stage executes its op list from :func:`~longpack.sim.pipeline.schedule` in order: F receives its input (stage 0
embeds tokens), runs its layers and sends the output on (the last stage computes the loss); B receives the output's
gradient, backpropagates (injecting a chain's later chunks' dK/dV as runtime/chunked.py does) and sends the input's
gradient back; R re-runs a dropped chunk's forward from its kept input. Chains keep one K/V store per stage; CP
pieces use the same attention callbacks as without PP, inside the stage's CP group. Shapes never travel: every
stage runs the same plan. Sends are asynchronous, receives blocking and tagged by item, so a valid schedule cannot
deadlock. Gradients are summed within the stage (FSDP2 or one all-reduce), and a tied embedding's between the
first and last stage. Measured: each op's wall time (busy), and the makespan − busy (idle), per stage.

Guarantee: the same gradients as one process (tests/test_pipeline.py). Layout: runtime/stages.py. Why the stage
loop is written here rather than on ``torch.distributed.pipelining``: docs/EXECUTION.md, "Pipeline stages".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..plan import MicroBatch, Plan
from ..sim.pipeline import schedule
from ..sim.simulate import kept_chunks, pipeline_items
from .chunked import KVStore, _ChunkPass
from .context_parallel import CPAttention, rank_pieces
from .data import Packed, Source
from .dist import all_reduce_sum
from .loss import step_targets, token_weights
from .runner import forward_loss, model_device, prepare
from .sharded_chain import ShardedChainPass, ShardedKVStore
from .stages import Layout, pipeline_phrase, split_model, stage_bounds
from .step import _documents, chain_segments

__all__ = ["stage_bounds", "split_model", "Layout", "PipelineStage",
           "forward_estimates", "pipeline_phrase"]


def forward_estimates(mbs: tuple[MicroBatch, ...], cp: int, cost: Any) -> list[float]:
    """Per micro-batch forward seconds of one stage by the cost model, as the simulator counts them: what the
    schedule is made with, the same on every rank."""
    from ..sim.simulate import forward_seconds, micro_batch_times

    return forward_seconds(mbs, [float(micro_batch_times(mb, cp, cost)[0].max()) if mb.pieces else 0.0
                                 for mb in mbs])


@dataclass
class _Live:
    """What a stage keeps of one item between its forward and backward."""

    x: torch.Tensor | None  # the received input (None on stage 0)
    out: torch.Tensor | None = None  # the stage output (the loss on the last stage); None after a dropped forward
    attend: Any = None


@dataclass
class _StepRun:
    """One step's state on one stage: its inputs, the chains' K/V stores, live items, pending sends, totals."""

    plan: Plan
    mbs: tuple[MicroBatch, ...]
    corpus: Source
    targets_of: dict[int, int]
    total: int
    mode: str
    cp: int
    cp_rank: int
    group: Any
    overlap: bool
    chains: dict[int, tuple[int, int, int]]
    parts: dict[int, tuple[list, list]] = field(default_factory=dict)  # this CP rank's rows of each micro-batch
    batches: dict[int, Packed] = field(default_factory=dict)  # each micro-batch collated once (F, then R)
    stores: dict[int, Any] = field(default_factory=dict)
    live: dict[int, _Live] = field(default_factory=dict)
    sends: list[Any] = field(default_factory=list)
    weigh: Any = None  # a micro-batch's token weights (runtime/loss.py)
    loss: torch.Tensor | None = None  # the last stage's loss share, summed on the device
    tokens: int = 0
    targets: int = 0


@dataclass
class PipelineStage:
    """One rank's stage of the pipeline (see the module docstring)."""

    model: Any
    layout: Layout
    rank: int  # global rank
    hidden: int
    dtype: torch.dtype
    cost: Any = None  # the planning cost model: forward estimates for the schedule when none are given
    busy: float = 0.0
    ops: list[tuple[str, int, float, float]] = field(default_factory=list)
    simulated_bubble: float = 0.0
    simulated_busy: float = 0.0  # this stage's busy time in the schedule (the estimates' unit: seconds by default)

    @property
    def useful(self) -> float:
        """Seconds of this step's forwards and backwards (recomputation excluded, as in the simulator)."""
        return sum(end - start for kind, _, start, end in self.ops if kind != "R")

    @property
    def span(self) -> float:
        """Seconds from the step's start to this stage's last op's end."""
        return max((end for *_, end in self.ops), default=0.0)

    @property
    def stage(self) -> int:
        return self.layout.stage

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def first_layer(self) -> int:
        """The global index of this stage's first decoder layer."""
        return stage_bounds(self.model.config.num_hidden_layers, self.pp)[self.stage][0]

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The embedding matrix a tied LM head shares: on the first stage the embeddings', on the last the head's."""
        if not getattr(self.model.config, "tie_word_embeddings", False) or self.pp == 1:
            return None
        if self.stage == 0:
            return self.model.model.embed_tokens.weight
        return self.model.lm_head.weight if self.last else None

    def run_step(self, plan: Plan, step: int, mbs: tuple[MicroBatch, ...], corpus: Source,
                 fwd_s: list[float] | None, mode: str, cp: int, cp_rank: int, cp_group: Any,
                 overlap: bool = True) -> tuple[torch.Tensor, int, int]:
        """Execute this stage's ops of ``step``; returns (loss share as a device scalar, tokens, targets) — nonzero
        on the last stage only. ``fwd_s``: per micro-batch forward seconds the schedule is made with (any positive
        estimate; None: the cost model's, :func:`forward_estimates`)."""
        keep = [i for i, mb in enumerate(mbs) if mb.pieces]
        items = pipeline_items(mbs, fwd_s if fwd_s is not None else forward_estimates(mbs, cp, self.cost), plan)
        sched = schedule(items, self.pp, k=kept_chunks(mbs, plan))
        _check_message_order(sched.ops)
        self.simulated_bubble = sched.bubble_ratio
        self.simulated_busy = sum(end - start for *_, start, end in sched.ops[self.stage])
        targets = step_targets(plan, plan.steps[step], corpus)
        run = _StepRun(plan, mbs, corpus, targets, sum(targets.values()), mode, cp, cp_rank, cp_group, overlap,
                       self._chains(plan, mbs))
        run.weigh = lambda b: token_weights(b, run.targets_of, run.mode, run.total)
        self.busy, self.ops, t0 = 0.0, [], time.perf_counter()
        run.parts = {i: rank_pieces(mbs[i], cp, cp_rank) if cp > 1 else ([], []) for i in keep}
        for kind, j, _, _ in sched.ops[self.stage]:
            i = keep[j]
            rows, sharded = run.parts[i]
            if cp > 1 and not rows:
                continue  # this CP rank holds nothing of the micro-batch (check_runnable: no sharded piece)
            if kind == "B":
                start = self._backward(run, i, j)
            else:
                x = None
                if kind == "F" and self.stage > 0:
                    n = sum(b - a for _, a, b in rows) if cp > 1 else sum(p.stop - p.start for p in mbs[i].pieces)
                    x = self._recv((n, self.hidden), self.rank - self.n, 2 * j).requires_grad_()
                start = time.perf_counter()
                self._forward_op(run, kind, i, j, x, rows, sharded)
            end = time.perf_counter()
            self.busy += end - start
            self.ops.append((kind, j, start - t0, end - t0))
        for handle, _ in run.sends:
            handle.wait()
        loss = run.loss if run.loss is not None else torch.zeros((), dtype=torch.float64, device=self.device)
        return loss, run.tokens, run.targets

    def _forward_op(self, run: _StepRun, kind: str, i: int, j: int, x: torch.Tensor | None, rows: list,
                    sharded: list) -> None:
        """F (first forward; ``x`` the received input) or R (recompute from the kept input) of micro-batch ``i``."""
        mb = run.mbs[i]
        if kind == "R":
            kept = run.live[j].x
            x = kept.detach().requires_grad_() if kept is not None else None
        batch = run.batches.get(i)
        if batch is None:
            batch = prepare(mb, run.corpus, run.plan.effective_length, run.weigh, self.device,
                            pieces=rows if run.cp > 1 else None)
            run.batches[i] = batch
        chain = run.chains.get(i)
        attend = self._attend(mb, batch, chain, run.stores, run.cp, run.cp_rank, run.group, rows, sharded,
                              run.overlap)
        grad_on = kind == "R" or not mb.recompute
        with torch.set_grad_enabled(grad_on):
            out = forward_loss(self.model, batch, attend, mb.ckpt_layers, hidden=x, head=self.last)
        if kind == "F":
            if chain is not None:
                for layer, (kk, vv) in sorted(attend.own.items()):
                    run.stores[chain[0]].append(layer, kk, vv)
            if self.last:
                run.loss = out.detach() if run.loss is None else run.loss + out.detach()
                run.tokens += batch.tokens
                run.targets += batch.targets
            else:
                run.sends.append(self._send(out.detach(), self.rank + self.n, 2 * j))
        run.live[j] = _Live(x, out if grad_on else None, attend if grad_on else None)

    def _backward(self, run: _StepRun, i: int, j: int) -> float:
        """B of micro-batch ``i``: the output's gradient received (ones on the last stage), backward with a chain's
        injected dK/dV, the input's gradient sent back; returns the time compute started (after the receive)."""
        entry = run.live.pop(j)
        run.batches.pop(i, None)  # its last op
        out = entry.out
        assert out is not None, f"micro-batch {i}: backward before its forward or recompute"
        grad = torch.ones_like(out) if self.last else self._recv(out.shape, self.rank + self.n, 2 * j + 1)
        start = time.perf_counter()
        tensors, grads = [out], [grad]
        chain = run.chains.get(i)
        if chain is not None and chain[1] < chain[2] - 1:  # later chunks' dK/dV to this chunk's K/V
            for layer, (kk, vv) in sorted(entry.attend.own.items()):
                dk, dv = run.stores[chain[0]].grads(layer, chain[1])
                tensors += [kk, vv]
                grads += [dk, dv]
        torch.autograd.backward(tensors, grads)
        if entry.x is not None and entry.x.grad is not None:
            run.sends.append(self._send(entry.x.grad, self.rank - self.n, 2 * j + 1))
        return start

    def record(self, world: int, rank: int) -> dict[str, Any]:
        """Per rank: stage, busy and idle seconds of the step (measured) and busy seconds in the simulated schedule
        (cost model); per pipeline (plan rank): the measured bubble ratio, 1 − useful / (pp · makespan), beside the
        simulator's for the same micro-batches."""
        vals = torch.zeros((5, world), dtype=torch.float64)
        vals[:, rank] = torch.tensor([self.busy, self.useful, self.span, self.simulated_bubble, self.simulated_busy])
        vals = vals.to(self.device)  # a collective of the step's backend: on the device (NCCL takes no host tensor)
        all_reduce_sum([vals])
        busy, useful, span, sim, sim_busy = vals.cpu().tolist()  # one read of the device
        n, pp = self.layout.n, self.layout.pp
        makespan = [max(span[s * n + r] for s in range(pp)) for r in range(n)]
        measured = [1.0 - sum(useful[s * n + r] for s in range(pp)) / (pp * makespan[r]) if makespan[r] > 0 else 0.0
                    for r in range(n)]
        return {"stage": [x // n for x in range(world)], "busy_seconds": busy,
                "idle_seconds": [makespan[x % n] - busy[x] for x in range(world)],
                "simulated_busy_seconds": sim_busy, "measured_bubble": measured, "simulated_bubble": sim[:n]}

    # --- helpers ------------------------------------------------------------------------------------------------
    @staticmethod
    def _chains(plan: Plan, mbs: tuple[MicroBatch, ...]) -> dict[int, tuple[int, int, int]]:
        """Micro-batch index -> (sample, chunk index, chunks) for every micro-batch of a chain."""
        return {m: (sample, c, last + 1 - first) for first, (last, sample) in chain_segments(plan, mbs).items()
                for c, m in enumerate(range(first, last + 1))}

    def _attend(self, mb: MicroBatch, batch: Packed, chain: tuple[int, int, int] | None, stores: dict[int, Any],
                cp: int, cp_rank: int, group: Any, rows: list, sharded: list, overlap: bool) -> Any:
        if chain is None:
            return CPAttention(mb, cp, cp_rank, group, rows, sharded, overlap) if cp > 1 else \
                _documents(batch.cu_seqlens)
        sample, index, _ = chain
        layers = self.model.config.num_hidden_layers  # a store is indexed by global layer
        if sample not in stores:
            stores[sample] = ShardedKVStore(layers, group, cp, cp_rank) if cp > 1 else KVStore(layers)
        if cp > 1:
            return ShardedChainPass(mb, cp, cp_rank, group, rows, sharded, sample, index, stores[sample], overlap)
        return _ChunkPass(batch, sample, index, stores[sample])

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def _recv(self, shape: Any, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=src, tag=_tag(tag))
        return buf

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> tuple[Any, torch.Tensor]:
        t = t.contiguous()
        return dist.isend(t, dst=dst, tag=_tag(tag)), t


def _tag(tag: int) -> int:
    """The message tag where the backend matches by it (gloo); NCCL ignores tags and matches a pair's messages in
    the order they are posted, which :func:`_check_message_order` guarantees."""
    return tag if dist.get_backend() == "gloo" else 0


def _check_message_order(ops: list[list[tuple[str, int, float, float]]]) -> None:
    """Refuse a schedule whose stages run their forwards, or their backwards, in different item orders: a stage's
    sends to the next (activations) and to the previous (gradients) must arrive in the order the peer receives
    them, because NCCL pairs point-to-point messages by order, not by tag."""
    for kind in ("F", "B"):
        orders = {tuple(j for k, j, *_ in stage if k == kind) for stage in ops}
        if len(orders) > 1:
            raise ValueError(f"the pipeline schedule runs its {kind} ops in different item orders on different "
                             f"stages ({sorted(orders)[:2]}); point-to-point messages would cross")
