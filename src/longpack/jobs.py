"""The jobs behind the CLI, as plain functions returning plain data (the CLI only parses and prints).

* :func:`load_workload` - lengths from a built-in workload or a file, checked;
* :func:`build_cost` - the cost model for a (model, hardware, layout), with the layout checked;
* :func:`run_plan` - one planner over the run's global batches, timed, validated;
* :func:`plan_stream` - the same, one step at a time (training plans ahead: runtime/run/ahead.py);
* :func:`compare` - several planners on the same global batches, simulated, with metrics and speedups;
* :func:`length_stats` - quantiles, shares below the papers' thresholds, and a log2 histogram;
* :func:`bench_planning` - seconds and peak memory of planning a full epoch.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cost import CostModel
from .plan import Plan
from .planners import PlanContext, check_options, get_planner, global_batches
from .progress import meter
from .runspec import RunSpec, build_cost, check_batch, load_workload, plan_stream, request, say
from .sim import SimReport, plan_metrics, simulate

__all__ = ["RunSpec", "load_workload", "build_cost", "check_batch", "run_plan", "plan_stream", "say", "compare",
           "compare_plans", "Comparison", "oom_note", "epoch_steps", "length_stats", "bench_planning"]


PLAN_BYTES_PER_JSON_BYTE = 13  # peak growth per JSON byte, read and simulated: 12.4 (bench/plan_file_memory.py)


def load_plan_file(path: Path) -> Plan:
    """A Plan JSON file, read and validated; one line for a file that is missing, not a plan, or too large for the
    memory this process may take (refused by its size before it is read; a MemoryError while reading is said the
    same way)."""
    if not path.is_file():
        raise ValueError(f"plan file {path}: no such file")
    from .hostmem import available_bytes

    size = path.stat().st_size
    free = available_bytes()
    need = size * PLAN_BYTES_PER_JSON_BYTE
    too_big = (f"plan file {path}: {size / 2**20:,.0f} MiB of JSON takes about {need / 2**30:.1f} GiB to read and "
               f"simulate, more than the {{free}} this process may use; simulate fewer steps (`longpack plan "
               "--steps N`), or on a machine with more memory")
    if free is not None and need > free:
        raise ValueError(too_big.format(free=f"{free / 2**30:.1f} GiB"))
    try:
        p = Plan.from_json(path.read_text(encoding="utf-8"))
        p.validate()
    except MemoryError:
        raise ValueError(too_big.format(free="memory")) from None
    except (UnicodeDecodeError, ValueError) as exc:
        why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc).splitlines()[0]
        raise ValueError(f"plan file {path}: {why}; give a Plan JSON written by `longpack plan --out`") from None
    return p


def run_plan(planner: str, lengths: np.ndarray, spec: RunSpec, cost: CostModel,
             default_max_len: int | None = None, *, check: bool = True,
             note: Callable[[str], None] | None = say) -> tuple[Plan, float]:
    """(validated plan, planning seconds) of ``planner`` over the run's global batches; ``check``: refuse an
    ``--opt`` key the planner does not read (compare checks against all its planners instead); ``note``: where a
    note for the user goes (None: nowhere)."""
    p, batches, ctx, max_len = request(planner, lengths, spec, cost, default_max_len, check, note)
    lengths = np.tile(lengths, spec.epochs)  # epoch e's copy of sample i is sample e * n + i
    t0 = time.perf_counter()
    plan = p.plan(lengths, batches, ctx, max_len=max_len, overlong=spec.overlong)
    seconds = time.perf_counter() - t0
    plan.validate()
    return plan, seconds


def summarize(plan: Plan, cost: CostModel, report: SimReport | None = None) -> dict[str, Any]:
    """Simulated time, efficiency, metrics and memory of one plan (``report``: its simulation, if already run)."""
    report = report or simulate(plan, cost)
    m = plan_metrics(plan)
    return {"step_time_s": report.mean_step_s, "total_s": report.total_s, "efficiency": report.efficiency,
            "gap_to_bound": 1.0 / report.efficiency - 1.0 if report.efficiency > 0 else float("inf"),
            "dbr": m.dbr, "pr": m.pr,
            "abr": m.abr, "cr": m.cr, "ave_t": m.ave_t, "peak_mem_gib": report.peak_mem_gib,
            "oom_steps": report.oom_steps, "steps": len(report.steps), "empty_slots": empty_slots(plan),
            "cp_degrees": sorted({d for st in plan.steps for d in (st.degrees or (st.cp,))})}


def empty_slots(plan: Plan) -> float:
    """Share of micro-batch slots (replicas x micro-batches, over every step) that hold no piece: ranks idle while
    their peers compute, since every replica of a step runs the same number of micro-batches."""
    slots = empty = 0
    for step in plan.steps:
        for rep in step.replicas:
            slots += len(rep.micro_batches)
            empty += sum(1 for mb in rep.micro_batches if not mb.pieces)
    return empty / slots if slots else 0.0


def oom_note(name: str, report: SimReport, cost: CostModel) -> str | None:
    """One line for a plan that runs out of memory: how many steps, the first such step, its need and the
    device's capacity; None when every step fits."""
    bad = [s for s in report.steps if s.oom]
    if not bad:
        return None
    first = bad[0]
    rank = int(np.argmax(first.peak_mem_bytes))
    need = max(first.peak_mem_bytes) / 2**30
    return (f"{name} runs out of memory on {len(bad)} of {len(report.steps)} steps: step {first.step} needs "
            f"{need:.1f} GiB on rank {rank}, {cost.hw.name} has {cost.hw.memory_gib:g} GiB (lower --token-cap, "
            "raise --ckpt-layers or --cp; unified keeps every micro-batch under the memory model's cap)")


def epoch_steps(samples: int, global_batch: int) -> int:
    """Optimizer steps in one epoch of ``samples`` (the last, smaller batch counted)."""
    return -(-samples // global_batch)


@dataclass(frozen=True)
class Comparison:
    """:func:`compare_plans`' result: the ``compare --json`` object, each planner's (plan, simulation), and the
    lengths and cost model they were made from."""

    result: dict[str, Any]
    plans: dict[str, tuple[Plan, SimReport]]
    lengths: np.ndarray
    cost: CostModel


def compare(spec: RunSpec, planners: list[str], baseline: str,
            note: Callable[[str], None] | None = say) -> dict[str, Any]:
    """Every planner on the same global batches; the result is the ``compare --json`` object."""
    return compare_plans(spec, planners, baseline, note).result


def compare_plans(spec: RunSpec, planners: list[str], baseline: str, note: Callable[[str], None] | None = say
                  ) -> Comparison:
    """:func:`compare`, with each planner's plan and simulation and the inputs they share (for pictures of them).
    A plan that runs out of memory is said once (``note``) with its first such step and that step's need."""
    if not planners:
        raise ValueError("--planners is empty; name at least one planner")
    names = list(dict.fromkeys(planners + ([baseline] if baseline not in planners else [])))
    check_options(names, spec.options)  # fail fast on a typo in a planner or an option, before any work
    lengths, default_max_len = load_workload(spec)
    spec = check_batch(spec, len(lengths))
    cost = build_cost(spec)
    results: dict[str, dict[str, Any]] = {}
    overlong: dict[str, Any] = {}
    plans: dict[str, tuple[Plan, SimReport]] = {}
    epoch = epoch_steps(len(lengths), spec.global_batch)
    n = min(spec.steps, epoch) if spec.steps is not None else epoch
    with meter("compare", 2 * n * len(names), ("planned", "simulated"), "steps planned and simulated",
               "--steps N for fewer"):
        for name in names:
            plan, seconds = run_plan(name, lengths, spec, cost, default_max_len, check=False)
            report = simulate(plan, cost)
            results[name] = summarize(plan, cost, report) | {"plan_seconds": seconds}
            plans[name] = (plan, report)
            overlong = dict(plan.meta["overlong"])
            overlong["scheduled_samples"] = len(plan.lengths)
            line = oom_note(name, report, cost)
            if line is not None and note is not None:
                note(line)
    # speedup = time to train the same samples (HBP regroups them into its own, more numerous steps, so a ratio of
    # mean step times would flatter it)
    base = results[baseline]["total_s"]
    base_oom = int(results[baseline]["oom_steps"])
    for r in results.values():
        r["speedup"] = base / r["total_s"] if r["total_s"] > 0 else float("nan")
        # a baseline that runs out of memory has no real time to be faster than: the speedup is marked
        r["speedup_valid"] = base_oom == 0
    exact = _exact_gaps(lengths, spec, cost, results, plans, default_max_len)
    setup = spec.describe() | {"token_cap": cost.token_cap(), "samples": int(len(lengths)),
                               "max_len": spec.max_len if spec.max_len is not None else default_max_len,
                               "steps": n, "epoch_steps": epoch}
    result = {"setup": setup, "baseline": baseline, "baseline_oom_steps": base_oom, "samples": overlong,
              "planners": results, "exact": exact}
    return Comparison(result, plans, lengths, cost)


EXACT_STEPS = 4


def _exact_gaps(lengths: np.ndarray, spec: RunSpec, cost: CostModel, results: dict[str, dict[str, Any]],
                plans: dict[str, tuple[Plan, SimReport]], default_max_len: int | None) -> dict[str, Any]:
    """Optimal step times (sim/exact.py) of the first few steps small enough for the MILP, and each planner's
    ``gap_to_optimum`` on them: Σ its step times / Σ optimal − 1. None where no step qualifies."""
    from .sim.exact import EXACT_LIMIT, optimal_step

    for r in results.values():
        r["gap_to_optimum"] = None
    batches = global_batches(len(lengths), spec.global_batch, seed=spec.seed, steps=spec.steps)
    max_len = spec.max_len if spec.max_len is not None else default_max_len
    cap = cost.token_cap()
    limit = min(cap * cost.cfg.cp, max_len) if max_len is not None else cap * cost.cfg.cp
    chosen: list[tuple[int, float]] = []
    why = f"no global batch of <= {EXACT_LIMIT} samples without chunk chains"
    if cost.cfg.pp > 1:
        why = "pipeline parallelism (--pp > 1) is outside the exact program's scope"
    else:
        for i, ids in enumerate(batches):
            eff = lengths[ids]
            if eff.size <= EXACT_LIMIT and eff.max() <= limit:
                res = optimal_step(eff, cost)
                if res.status == "optimal":
                    chosen.append((i, res.time_s))
            if len(chosen) == EXACT_STEPS:
                break
    if not chosen:
        return {"steps": 0, "note": why}
    opt = sum(t for _, t in chosen)
    for name, (plan, rep) in plans.items():
        # a planner that regroups samples into its own steps (HBP) did not run these batches: no gap
        if any(i >= len(plan.steps) or {p.sample for r in plan.steps[i].replicas for mb in r.micro_batches
                                        for p in mb.pieces} != set(batches[i].tolist()) for i, _ in chosen):
            continue
        mine = sum(rep.steps[i].time_s for i, _ in chosen)
        results[name]["gap_to_optimum"] = mine / opt - 1.0
    return {"steps": len(chosen), "optimal_step_s": opt / len(chosen),
            "scope": "one step at the configured CP degree and checkpointing, no chunk chains, at most the fewest "
                     "micro-batches memory allows + 1 per replica (sim/exact.py)"}


def length_stats(lengths: np.ndarray) -> dict[str, Any]:
    """Count, mean, quantiles, shares below 1K..128K and a log2 histogram of ``lengths``."""
    x = np.asarray(lengths)
    q = {f"p{p:g}": float(np.percentile(x, p)) for p in (50, 90, 99, 99.9)}
    below = {f"<{k}K": float((x < k * 1024).mean()) for k in (1, 4, 8, 32, 128)}
    edges = 2 ** np.arange(0, int(np.ceil(np.log2(x.max() + 1))) + 1)
    counts, _ = np.histogram(x, bins=edges)
    rows = zip(edges[:-1], edges[1:], counts, strict=True)
    hist = [{"from": int(a), "to": int(b), "count": int(c)} for a, b, c in rows if c]
    return {"samples": int(x.size), "tokens": int(x.sum()), "mean": float(x.mean()), "min": int(x.min()),
            "max": int(x.max()), "quantiles": q, "share_below": below, "histogram": hist}


def bench_planning(planner: str, spec: RunSpec) -> dict[str, Any]:
    """Plan a full epoch of the workload: wall seconds (untraced run), the same in units of ``numpy.sort`` of the
    same lengths timed in the same process just before (``vs_numpy_sort``, steadier than seconds on a loaded
    machine), and peak traced MiB (second run)."""
    lengths, default_max_len = load_workload(spec)
    cost = build_cost(spec)
    spec = check_batch(spec, len(lengths))
    batches = global_batches(len(lengths), spec.global_batch, seed=spec.seed)
    p = get_planner(planner)
    check_options([planner], spec.options)
    ctx = PlanContext(cost=cost, seed=spec.seed, options=dict(spec.options))
    max_len = spec.max_len if spec.max_len is not None else default_max_len
    t0 = time.perf_counter()
    np.sort(lengths)
    sort_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = p.plan(lengths, batches, ctx, max_len=max_len, overlong=spec.overlong)
    seconds = time.perf_counter() - t0
    del plan
    tracemalloc.start()
    p.plan(lengths, batches, ctx, max_len=max_len, overlong=spec.overlong)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"planner": planner, "samples": int(len(lengths)), "seconds": seconds, "peak_mib": peak / 2**20,
            "numpy_sort_seconds": sort_seconds, "vs_numpy_sort": seconds / max(sort_seconds, 1e-9)}
