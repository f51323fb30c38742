"""The training loop of one rank (:class:`Loop`): per step, the kernel's step runner forwards and backpropagates
this rank's micro-batches (gradients summed over ranks), the gradients are clipped to the global norm, AdamW and
the schedule step, the held-out rows are evaluated when due, the step's figures are read from the device once,
logged (step_log.py, metrics.py) and, every --checkpoint-every steps, checkpointed (checkpoint.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ...cost import CostModel
from ...model import ModelSpec
from ...progress import Meter
from ..dist import DistContext, all_reduce_sum
from ..kernel.data import Source
from ..kernel.host import to_device
from . import checkpoint
from .accounting import chained_samples, step_samples
from .ahead import PlanAhead
from .evaluate import Evaluation
from .failure import heartbeat, step_failure
from .metrics import MetricsLog
from .optim import clip_gradients
from .parts import RunParts
from .resume import record as resume_record
from .startup import Phases
from .step_log import emit, rank_fields, rank_rows
from .train_args import TrainArgs

__all__ = ["Setup", "Loop", "share", "read_once"]


def share(table: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Every rank's columns of a host ``table`` summed over the ranks, on the device (NCCL takes no host tensor;
    the copy does not block: runtime/kernel/host.py), to be read in the step's one read; one collective, none in
    one process."""
    table = to_device(table, ctx.device)
    all_reduce_sum([table])
    return table


def read_once(parts: list[torch.Tensor]) -> list[float]:
    """A step's figures on the device (its loss, tokens and targets; the gradient norm; a held-out loss; every
    rank's memory and compute seconds) read to the host in one copy: the step's one host read, after which the
    host waits for the device only at the next step's."""
    first = parts[0]
    return torch.cat([t.reshape(-1).to(first.dtype) for t in parts]).cpu().tolist()


@dataclass
class Setup:
    """What a rank made before its loop: the model's shapes, the rows, the plan (planned ahead), its cost model,
    the seconds of the plan's header, the held-out evaluation and the start-up clock."""

    spec: ModelSpec
    source: Source
    ahead: PlanAhead
    cost: CostModel
    header: float
    evaluation: Evaluation | None
    clock: Phases


class Loop:
    """The steps of one rank (module docstring); ``records`` each step's figures, as ``--json`` prints them."""

    def __init__(self, args: TrainArgs, ctx: DistContext, setup: Setup, parts: RunParts) -> None:
        self.args, self.ctx, self.s, self.p = args, ctx, setup, parts
        self.records: list[dict[str, Any]] = []
        self.chained: set[int] = set()
        self.cache: list[dict[str, Any]] = []  # a whole-run plan's steps as JSON, for checkpoint fingerprints
        pipe = parts.pipe
        self.norm_group = pipe.layout.cross_group if pipe is not None else None  # stages' squared norms add up
        self.tied = [pipe.tied_weight] if pipe is not None and pipe.last and pipe.tied_weight is not None else []
        self.progress: Meter | None = None  # rank 0's line on stderr: steps done, tokens/s, time left
        self.log: MetricsLog | None = None
        self.t_start = time.perf_counter()

    def run(self, log: MetricsLog | None) -> None:
        self.log = log
        self.t_start = time.perf_counter()
        for step, mbs in self.p.sampler:
            heartbeat(step)
            if self.ctx.rank == 0 and self.progress is None:  # from the first step this run trains
                self.progress = Meter("train", len(self.s.ahead) - step, ("step",), "steps")
            rec = self._step(step, mbs)
            self._after(step, rec)
        for done in (self.log, self.progress):
            if done is not None:
                done.close()

    def _step(self, step: int, mbs: Any) -> dict[str, Any]:
        """One step trained and its record; every collective of it inside the failure handler, so a peer that
        stops answering in any of them is said as such."""
        p, ctx, plan = self.p, self.ctx, self.s.ahead.plan
        t0, c0 = time.perf_counter(), time.thread_time()
        self.chained |= chained_samples(plan, step)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        lr = float(p.opt.param_groups[0]["lr"])
        try:
            stats, peak = p.runner.run(p.model, plan, step, mbs, self.s.source)
            norm = clip_gradients(p.model.parameters(), self.args.optim.max_grad_norm, self.norm_group,
                                  skip=self.tied)
            p.opt.step()
            p.sched.step()
            p.opt.zero_grad(set_to_none=True)
            table = rank_rows(plan, step, p.mem_cost, ctx, peak, p.prank, time.thread_time() - c0)
            if p.pipe is not None:
                table = torch.cat([table, p.pipe.columns(ctx.world, ctx.rank)])
            evaluated = []
            if self._evaluates(step):
                assert self.s.evaluation is not None
                evaluated.append(self.s.evaluation.run(p.model, p.runner)[:1])
            loss_v, tokens_v, targets_v, norm_v, *rest = read_once([stats, norm, share(table, ctx), *evaluated])
            step_s = time.perf_counter() - t0
        except Exception as exc:
            raise step_failure(exc, step, ctx, self.args.parallel.timeout) from None
        w = ctx.world
        rec = {"step": step, "loss": loss_v, "tokens": int(tokens_v), "targets": int(targets_v), "lr": lr,
               "grad_norm": norm_v, "step_seconds": step_s, "samples": step_samples(plan, step),
               "planner_wait_seconds": p.sampler.waited + (self.s.header if not self.records else 0.0),
               **rank_fields(rest[:3 * w], w, ctx.device.type == "cuda")}
        rec.update({"pipeline": p.pipe.record(rest[3 * w:8 * w], w)} if p.pipe is not None else {})
        held = rest[table.numel():]
        rec.update({"eval_loss": held[0]} if held else {})
        return rec

    def _evaluates(self, step: int) -> bool:
        every = self.args.data.eval_every
        return self.s.evaluation is not None and (step == len(self.s.ahead) - 1 or bool(every)
                                                  and (step + 1) % every == 0)

    def _after(self, step: int, rec: dict[str, Any]) -> None:
        """The step said, logged, counted on the progress line and checkpointed when due."""
        args, ctx, p = self.args, self.ctx, self.p
        self.records.append(rec)
        emit(ctx, args, rec)
        if len(self.records) == 1:  # the first step this run trained: the start-up is over
            self.s.clock.mark("first_step")
            emit(ctx, args, {"startup": self.s.clock.record()})
        if self.log is not None:
            self.log.step(rec)
        if self.progress is not None:
            done = sum(r["tokens"] for r in self.records) / (time.perf_counter() - self.t_start)
            self.progress.hint = f"{done:,.0f} tokens/s"
            self.progress.tick()
        if args.out.checkpoint_dir and args.out.checkpoint_every and (step + 1) % args.out.checkpoint_every == 0:
            record = {"sampler": p.sampler.state_dict(), "scheduler": p.sched.state_dict(),
                      **resume_record(args, ctx.world, self.s.ahead.stream, step + 1, self.cache)}
            checkpoint.save(args.out.checkpoint_dir, step + 1, p.model, p.opt, record, ctx.rank, p.first_layer)

    def summary(self, report: dict[str, Any]) -> dict[str, Any]:
        records, elapsed = self.records, time.perf_counter() - self.t_start
        total = sum(r["tokens"] for r in records)
        return {"tokens_per_second": total / elapsed if elapsed > 0 else 0.0,
                "final_loss": records[-1]["loss"] if records else float("nan"), "steps": len(records),
                "dropped_samples": report["dropped_samples"], "truncated_samples": report["truncated_samples"],
                "empty_rows_dropped": report["empty_rows_dropped"], "chained_samples": len(self.chained),
                "output_dir": self.args.out.output_dir, "threads": torch.get_num_threads(),
                "planning_seconds": self.s.header + self.s.ahead.planning_seconds,
                "planner_wait_seconds": sum(r["planner_wait_seconds"] for r in records)}
