"""Pipeline parallelism: the decoder split into P stage processes, each step's micro-batches run in ChunkFlow's
state-aware 1F1B order (sim/pipeline.py), activations and their gradients sent point to point.

Each stage executes its op list from :func:`~longpack.sim.pipeline.schedule` in order: F receives its input (stage 0
embeds tokens), runs its layers and sends the output on (the last stage computes the loss); B receives the output's
gradient, backpropagates (injecting a chain's later chunks' dK/dV as runtime/kernel/chunked.py does) and sends the
input's gradient back; R re-runs a dropped chunk's forward from its kept input. Chains keep one K/V store per stage;
CP pieces use the same attention callbacks as without PP, inside the stage's CP group. Shapes never travel: every
stage runs the same plan. Sends are asynchronous, receives blocking and tagged by item, so a valid schedule cannot
deadlock. Gradients are summed within the stage (FSDP2 or one all-reduce), and a tied embedding's between the first
and last stage. Measured: each op's wall time (busy), and the makespan − busy (idle), per stage.

Guarantee: the same gradients as one process (tests/test_pipeline.py). Layout: runtime/kernel/stages.py. Why the stage
loop is written here rather than on ``torch.distributed.pipelining``: docs/EXECUTION.md, "Pipeline stages".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...plan import MicroBatch, Plan
from ...sim.pipeline import schedule
from ...sim.simulate import kept_chunks, pipeline_items
from .chunked import ChainLink, injected
from .cp import CPContext
from .data import Packed, Source
from .dispatch import Rows, StepWork, attend_for, new_store, prepare_mb, rows_of
from .runner import forward_loss, model_device
from .stages import Layout, pipeline_phrase, split_model, stage_bounds
from .step import chain_segments

__all__ = ["stage_bounds", "split_model", "Layout", "PipelineStage",
           "forward_estimates", "pipeline_phrase"]


def forward_estimates(mbs: tuple[MicroBatch, ...], cp: int, cost: Any) -> list[float]:
    """Per micro-batch forward seconds of one stage by the cost model, as the simulator counts them: what the
    schedule is made with, the same on every rank."""
    from ...sim.simulate import forward_seconds, micro_batch_times

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
    """One step's state on one stage: the step's work (runtime/kernel/dispatch.py), each micro-batch's rows and
    tensors, the chains' K/V stores, live items, pending sends, totals."""

    work: StepWork
    mbs: tuple[MicroBatch, ...]
    chains: dict[int, tuple[int, int, int]]
    parts: dict[int, Rows] = field(default_factory=dict)  # this CP rank's rows of each micro-batch
    batches: dict[int, Packed] = field(default_factory=dict)  # each micro-batch collated once (F, then R)
    stores: dict[int, Any] = field(default_factory=dict)
    live: dict[int, _Live] = field(default_factory=dict)
    sends: list[Any] = field(default_factory=list)
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

    def run_step(self, plan: Plan, step: int, mbs: tuple[MicroBatch, ...], source: Source,
                 cp: CPContext | None = None, fwd_s: list[float] | None = None, mode: str = "token_mean"
                 ) -> tuple[torch.Tensor, int, int]:
        """Execute this stage's ops of ``step``; returns (loss share as a device scalar, tokens, targets) — nonzero
        on the last stage only. ``cp``: this rank's place in its CP group inside the stage (default degree 1);
        ``fwd_s``: per micro-batch forward seconds the schedule is made with (any positive estimate; None: the cost
        model's, :func:`forward_estimates`). Each micro-batch runs through the one dispatch; this stage decides
        when (the 1F1B order) and what crosses its boundary."""
        cp = cp or CPContext()
        keep = [i for i, mb in enumerate(mbs) if mb.pieces]
        items = pipeline_items(mbs, fwd_s if fwd_s is not None else forward_estimates(mbs, cp.degree, self.cost),
                               plan)
        sched = schedule(items, self.pp, k=kept_chunks(mbs, plan))
        _check_message_order(sched.ops)
        self.simulated_bubble = sched.bubble_ratio
        self.simulated_busy = sum(end - start for *_, start, end in sched.ops[self.stage])
        run = _StepRun(StepWork.of(plan, step, source, mode, cp).on(self.model), mbs, self._chains(plan, mbs))
        run.parts = {i: rows_of(run.work, mbs[i]) for i in keep}
        self.busy, self.ops, t0 = 0.0, [], time.perf_counter()
        for kind, j, _, _ in sched.ops[self.stage]:
            i = keep[j]
            if not run.parts[i][0]:  # this CP rank holds nothing of the micro-batch (check_step: no sharded piece)
                if kind == "B":
                    cp.clock.take("B", empty=True)  # counted: the clock may sync gradients at the last backward
                continue
            start = self._backward(run, i, j) if kind == "B" else self._forward_op(run, kind, i, j)
            end = time.perf_counter()
            self.busy += end - start
            self.ops.append((kind, j, start - t0, end - t0))
        for handle, _ in run.sends:
            handle.wait()
        loss = run.loss if run.loss is not None else torch.zeros((), dtype=torch.float64, device=self.device)
        return loss, run.tokens, run.targets

    def _forward_op(self, run: _StepRun, kind: str, i: int, j: int) -> float:
        """F (first forward, its input received) or R (recompute from the kept input) of micro-batch ``i``;
        returns the time compute started (after the receive)."""
        mb, rows = run.mbs[i], run.parts[i]
        if kind == "R":
            kept = run.live[j].x
            x = kept.detach().requires_grad_() if kept is not None else None
        else:
            n = sum(b - a for _, a, b in rows[0])
            x = self._recv((n, self.hidden), self.rank - self.n, 2 * j).requires_grad_() if self.stage > 0 else None
        start = time.perf_counter()
        batch = run.batches.get(i)
        if batch is None:
            batch = run.batches[i] = prepare_mb(run.work, mb, rows)
        chain = run.chains.get(i)
        link = None if chain is None else ChainLink(chain[0], chain[1], self._store(run, chain[0]))
        attend = attend_for(run.work, mb, batch, rows, link)
        grad_on = kind == "R" or not mb.recompute
        with torch.set_grad_enabled(grad_on):
            out = forward_loss(self.model, batch, attend, mb.ckpt_layers, hidden=x, head=self.last)
        if kind == "F":
            if link is not None:
                for layer, (kk, vv) in sorted(attend.own.items()):
                    link.store.append(layer, kk, vv)
            if self.last:
                run.loss = out.detach() if run.loss is None else run.loss + out.detach()
                run.tokens += batch.tokens
                run.targets += batch.targets
            else:
                run.sends.append(self._send(out.detach(), self.rank + self.n, 2 * j))
        run.live[j] = _Live(x, out if grad_on else None, attend if grad_on else None)
        return start

    def _backward(self, run: _StepRun, i: int, j: int) -> float:
        """B of micro-batch ``i``: the output's gradient received (ones on the last stage), backward with a chain's
        injected dK/dV, the input's gradient sent back; returns the time compute started (after the receive)."""
        entry = run.live.pop(j)
        run.batches.pop(i, None)  # its last op
        out = entry.out
        assert out is not None, f"micro-batch {i}: backward before its forward or recompute"
        grad = torch.ones_like(out) if self.last else self._recv(out.shape, self.rank + self.n, 2 * j + 1)
        start = time.perf_counter()
        chain = run.chains.get(i)
        later = chain is not None and chain[1] < chain[2] - 1  # later chunks sent dK/dV to this chunk's K/V
        sent = run.stores[chain[0]].sent(chain[1]) if chain is not None and later else {}
        run.work.cp.clock.take("B")
        torch.autograd.backward(*injected(out, grad, entry.attend, sent))
        if entry.x is not None and entry.x.grad is not None:
            run.sends.append(self._send(entry.x.grad, self.rank - self.n, 2 * j + 1))
        return start

    def columns(self, world: int, rank: int) -> torch.Tensor:
        """This rank's column of every rank's pipeline figures of the step (host, [5, world], zero elsewhere):
        summed over the ranks with the step's other figures and read in its one read (runtime/run/loop.py)."""
        vals = torch.zeros((5, world), dtype=torch.float64)
        vals[:, rank] = torch.tensor([self.busy, self.useful, self.span, self.simulated_bubble, self.simulated_busy])
        return vals

    def record(self, values: list[float], world: int) -> dict[str, Any]:
        """From :meth:`columns` summed over the ranks: per rank, stage, busy and idle seconds of the step
        (measured) and busy seconds in the simulated schedule (cost model); per pipeline (plan rank): the measured
        bubble ratio, 1 − useful / (pp · makespan), beside the simulator's for the same micro-batches."""
        busy, useful, span, sim, sim_busy = (values[i * world:(i + 1) * world] for i in range(5))
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

    def _store(self, run: _StepRun, sample: int) -> Any:
        """The K/V store of ``sample``'s chain on this stage (indexed by global layer), made at its first chunk."""
        if sample not in run.stores:
            run.stores[sample] = new_store(run.work, self.model.config.num_hidden_layers)
        return run.stores[sample]

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def _recv(self, shape: Any, src: int, tag: int) -> torch.Tensor:
        """The tensor ``src`` sends with ``tag``, waited for (the op that reads it is next)."""
        buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, src, tag=_tag(tag))]):
            work.wait()
        return buf

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> tuple[Any, torch.Tensor]:
        """``t`` posted to ``dst`` at once and not waited for (the step waits for its sends at its end); the
        tensor is kept with the handle until then."""
        t = t.contiguous()
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, t, dst, tag=_tag(tag))])[0], t


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
