"""What fixes a planning run and what every user of it derives the same way: :class:`RunSpec` (the CLI's common
flags, field for field), its lengths (:func:`load_workload`), its cost model (:func:`build_cost`), its global
batches and planner (:func:`request`), and its plan as a stream (:func:`plan_stream`). The CLI's jobs
(longpack/jobs.py) and the runtime's run (runtime/run/) both start here; numpy only."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .cost import CostModel, TrainConfig
from .hardware import load_hardware
from .model import ModelSpec, get_model
from .planners import PlanContext, check_options, get_planner, global_batches
from .planners.stream import PlanStream
from .sources import load_lengths
from .workloads import generate, get_workload

__all__ = ["RunSpec", "load_workload", "build_cost", "say", "check_batch", "request", "plan_stream"]


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything that fixes a planning run; the CLI's common flags map one to one onto these fields."""

    workload: str | None = None
    lengths_file: str | None = None
    column: str = "length"
    tokenizer: str | None = None
    samples: int | None = None
    model: str = "qwen2.5-0.5b"
    hardware: str = "h100"
    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world: int | None = None
    zero_stage: int = 2
    ckpt_layers: int = 0
    token_cap: int | None = None
    global_batch: int = 256
    steps: int | None = None
    epochs: int = 1  # passes over the samples, each its own permutation (planners.global_batches)
    seed: int = 0
    max_len: int | None = None
    overlong: str = "split"
    options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"workload": self.workload or self.lengths_file, "model": self.model, "hardware": self.hardware,
                "dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp, "global_batch": self.global_batch,
                "steps": self.steps, "seed": self.seed, "max_len": self.max_len, "overlong": self.overlong,
                "zero_stage": self.zero_stage, "ckpt_layers": self.ckpt_layers}


def load_workload(spec: RunSpec) -> tuple[np.ndarray, int | None]:
    """(lengths, default max_len) from ``--workload`` or ``--lengths``; exactly one must be given."""
    if (spec.workload is None) == (spec.lengths_file is None):
        raise ValueError("give exactly one of --workload NAME or --lengths FILE")
    if spec.workload is not None:
        w = get_workload(spec.workload)
        return generate(spec.workload, spec.samples, seed=spec.seed), w.default_max_len
    assert spec.lengths_file is not None
    if spec.tokenizer and not spec.lengths_file.endswith((".txt", ".npy")):
        from .rows import load_rows  # rows of text or chats, through the token store's cache as training reads them

        rows = load_rows(spec.lengths_file, tokenizer=spec.tokenizer, keep_untargeted=True, say=say,
                         flag="--lengths")
        lengths = rows.lengths
        if rows.empty:
            say(f"--lengths {spec.lengths_file}: {len(rows.empty)} empty rows left out ({rows.where(rows.empty[0])}"
                f"{', ...' if len(rows.empty) > 1 else ''})")
    else:
        lengths = load_lengths(spec.lengths_file, column=spec.column)
    if spec.samples is not None:
        if spec.samples < 1:
            raise ValueError(f"--samples {spec.samples}: must be >= 1")
        lengths = lengths[: spec.samples]
    return lengths, None


def build_cost(spec: RunSpec, model: ModelSpec | None = None, runtime: bool = False) -> CostModel:
    """The cost model of ``spec`` (``model``: shapes read from a checkpoint instead of the preset; ``runtime``:
    priced as longpack's own runtime executes it, :attr:`TrainConfig.runtime`); a layout that does not match
    ``--world`` or a model that cannot fit raises."""
    cfg = TrainConfig(dp=spec.dp, cp=spec.cp, tp=spec.tp, pp=spec.pp, zero_stage=spec.zero_stage,
                      ckpt_layers=spec.ckpt_layers, token_cap=spec.token_cap, runtime=runtime)
    if spec.world is not None and spec.world != cfg.world:
        raise ValueError(f"--world {spec.world} != dp {spec.dp} x tp {spec.tp} x pp {spec.pp} x cp {spec.cp} "
                         f"= {cfg.world}; make the degrees multiply to the world size")
    hw = load_hardware(spec.hardware)
    cost = CostModel(model or get_model(spec.model), hw.for_runtime() if runtime else hw, cfg)
    if cost.token_cap() < 1:
        raise ValueError(f"model {spec.model} on {spec.hardware}: {cost.hw.memory_gib:g} GiB per GPU leaves no room "
                         f"for activations after {cost.static_bytes / 2**30:.1f} GiB of weights and optimizer state "
                         "(ZeRO over dp x cp); raise --dp/--cp/--tp/--pp or --zero-stage, or use larger hardware")
    return cost


def say(line: str) -> None:
    """A note for the person at the terminal (stderr, so --json output stays clean)."""
    print(f"longpack: note: {line}", file=sys.stderr, flush=True)


def check_batch(spec: RunSpec, samples: int, note: Callable[[str], None] | None = say) -> RunSpec:
    """``spec`` with a global batch of at most the data: a larger one is one step of every sample, said once."""
    if spec.global_batch <= samples:
        return spec
    if note is not None:
        source = spec.workload or spec.lengths_file or "the data"
        note(f"--global-batch {spec.global_batch} is more than the {samples} samples of {source}: one step of all "
             f"{samples}")
    return replace(spec, global_batch=samples)


def request(planner: str, lengths: np.ndarray, spec: RunSpec, cost: CostModel, default_max_len: int | None,
             check: bool, note: Callable[[str], None] | None) -> tuple[Any, list[np.ndarray], PlanContext, Any]:
    """(planner, global batches, context, max_len) of a run, its options checked."""
    p = get_planner(planner)
    spec = check_batch(spec, len(lengths), note)
    if check:
        check_options([planner], spec.options)
    batches = global_batches(len(lengths), spec.global_batch, seed=spec.seed, steps=spec.steps, epochs=spec.epochs)
    ctx = PlanContext(cost=cost, seed=spec.seed, options=dict(spec.options))
    return p, batches, ctx, spec.max_len if spec.max_len is not None else default_max_len


def plan_stream(planner: str, lengths: np.ndarray, spec: RunSpec, cost: CostModel,
                default_max_len: int | None = None, *, note: Callable[[str], None] | None = say) -> PlanStream:
    """The run's plan as a :class:`~longpack.planners.stream.PlanStream`: its header now, each step validated as
    it is planned."""
    p, batches, ctx, max_len = request(planner, lengths, spec, cost, default_max_len, True, note)
    return PlanStream(p, np.tile(lengths, spec.epochs), batches, ctx, max_len=max_len, overlong=spec.overlong)
