"""Shared machinery of the reproductions: a cost model calibrated to a paper's token cap (Skrull's BucketSize),
and timed runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..cost import CostModel, TrainConfig
from ..hardware import get_hardware
from ..model import get_model
from ..planners import PlanContext, get_planner, global_batches
from ..progress import tick
from ..sim import simulate

__all__ = ["calibrated_cost", "run_planner"]


def calibrated_cost(model: str, hardware: str, *, token_cap: int, **cfg: Any) -> CostModel:
    """A cost model whose memory limit falls at ``token_cap`` tokens per rank, as the paper profiled it.

    The paper's BucketSize C is its measured maximum token count per rank (with its own safety margin), so the
    activation bytes per token are scaled (via the hardware's fragmentation factor) until the memory model's cap
    equals C; where our estimate is already above C's share of memory, the runtime reserve shrinks instead.
    Plans that exceed C then run out of memory in the simulator, as they did for the authors.
    """
    m, hw = get_model(model), get_hardware(hardware)
    probe = CostModel(m, hw, TrainConfig(**cfg))
    act = (token_cap + 0.5) * probe.act_bytes_per_token()
    free = hw.memory_bytes - hw.reserve_gib * 2**30 - probe.static_bytes
    if free >= act:
        hw = replace(hw, fragmentation=free / act)
    else:  # the paper fits more than our activation estimate allows: take it out of the runtime reserve
        hw = replace(hw, fragmentation=1.0, reserve_gib=max(0.0, (hw.memory_bytes - probe.static_bytes - act) / 2**30))
    return CostModel(m, hw, TrainConfig(token_cap=token_cap, **cfg))


def run_planner(name: str, lengths: np.ndarray, cost: CostModel, *, batch: int, steps: int, seed: int,
                max_len: int | None = None, validate: bool = True, bounds: bool = True, unit: str = "run",
                **options: Any) -> dict[str, Any]:
    """Plan ``steps`` global batches with ``name`` and simulate them; an over-cap plan is reported as OOM.
    ``bounds=False``: no per-step lower bound (its MILPs can take most of a run), so no efficiency. ``unit``: the
    progress unit the run counts as (a meter may weigh kinds of runs by their cost)."""
    batches = global_batches(len(lengths), batch, seed=seed, steps=steps)
    plan = get_planner(name).plan(lengths, batches, PlanContext(cost=cost, seed=seed, options=options),
                                  max_len=max_len)
    if validate and options.get("rollback") != "none":
        plan.validate()
    report = simulate(plan, cost, bounds=bounds)
    tick(unit)
    return {"step_time_s": report.mean_step_s, "oom_steps": report.oom_steps,
            "peak_mem_gib": report.peak_mem_gib, "efficiency": report.efficiency}
