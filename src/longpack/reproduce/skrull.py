"""Skrull's experiments in the simulator: Fig. 3 speedups, Table 3, Fig. 4a.

Setup as published: H100, qwen2.5-0.5b and qwen2.5-7b, DP4 x CP8 with BatchSize 64 per DP rank (global batch 256),
BucketSize 26K (0.5B) and 13K (7B); 7B on ChatQA2 at DP2 x CP16, BatchSize 40. Baselines:

* ``fixed_cp`` as DeepSpeed ran it for the paper: every sequence sharded over the CP group, one sequence per
  micro-batch (DeepSpeed's default micro-batch with gradient accumulation; it has no packing);
* ``sorted`` (LongAlign): length-sorted padded micro-batches inside each global batch;
* ``fixed_cp`` packed to the cap is reported too, as an extra column the paper does not have;
* ``unified`` (planners/unified/) on the same batches, beside Skrull (``unified_vs_skrull``).

Memory is calibrated so that the cap is the published BucketSize (see ``calibrated_cost``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..progress import meter
from ..workloads import K, generate, get_workload
from ._common import calibrated_cost, run_planner

__all__ = ["PAPER", "reproduce", "runs"]

# Skrull Fig. 3, read off the figure: (vs DeepSpeed, vs sorted batching)
PAPER = {
    ("qwen2.5-0.5b", "wikipedia-cn"): (7.54, 6.85), ("qwen2.5-0.5b", "lmsys-chat-1m"): (6.17, 5.40),
    ("qwen2.5-0.5b", "chatqa2-long-sft"): (2.79, 1.86), ("qwen2.5-7b", "wikipedia-cn"): (2.60, 2.30),
    ("qwen2.5-7b", "lmsys-chat-1m"): (2.14, 1.90), ("qwen2.5-7b", "chatqa2-long-sft"): (1.35, 1.20),
}
PAPER_TABLE3 = {"skrull_rr+rollback": 1.17, "skrull_rr-rollback": "OOM", "skrull+rollback": 1.40,
                "skrull-rollback": "OOM"}
TOKEN_CAP = {"qwen2.5-0.5b": 26 * K, "qwen2.5-7b": 13 * K}
# Each kind of planner run's cost beside a Fig. 3 baseline run's (1), for the time left: Skrull's own run in a Fig. 3
# cell of short samples (hundreds a step: planned, simulated and bounded), and a Table 3 / Fig. 4a run (times only).
WEIGHTS = {"skrull": 19.0, "sweep": 0.15}
SHORT = ("wikipedia-cn", "lmsys-chat-1m")


def _layout(model: str, dataset: str) -> tuple[int, int, int]:
    return (2, 16, 40) if (model, dataset) == ("qwen2.5-7b", "chatqa2-long-sft") else (4, 8, 64)


def _cell(model: str, dataset: str, lengths: np.ndarray, steps: int, seed: int) -> dict[str, Any]:
    dp, cp, bs = _layout(model, dataset)
    cost = calibrated_cost(model, "h100", token_cap=TOKEN_CAP[model], dp=dp, cp=cp)
    run: dict[str, Any] = dict(batch=dp * bs, steps=steps, seed=seed, max_len=get_workload(dataset).default_max_len)
    heavy = dataset in SHORT  # hundreds of samples a step
    res = {"skrull": run_planner("skrull", lengths, cost, unit="skrull" if heavy else "run", **run),
           "fixed_cp": run_planner("fixed_cp", lengths, cost, micro_batch_size=1, **run),
           "sorted": run_planner("sorted", lengths, cost, **run),
           "fixed_cp_packed": run_planner("fixed_cp", lengths, cost, **run),
           "unified": run_planner("unified", lengths, cost, **run)}
    t = {k: v["step_time_s"] for k, v in res.items()}
    paper = PAPER[(model, dataset)]
    return {"model": model, "dataset": dataset, "dp": dp, "cp": cp, "batch_size": bs, "token_cap": TOKEN_CAP[model],
            "speedup_vs_fixed_cp": t["fixed_cp"] / t["skrull"], "paper_vs_fixed_cp": paper[0],
            "speedup_vs_sorted": t["sorted"] / t["skrull"], "paper_vs_sorted": paper[1],
            "speedup_vs_fixed_cp_packed": t["fixed_cp_packed"] / t["skrull"], "step_time_s": t,
            "oom_steps": {k: v["oom_steps"] for k, v in res.items()},
            "skrull_efficiency": res["skrull"]["efficiency"],
            "unified_vs_skrull": t["skrull"] / t["unified"], "unified_efficiency": res["unified"]["efficiency"]}


def _speedup_or_oom(name: str, lengths: np.ndarray, cost, base: float, **run: Any) -> float | str:
    r = run_planner(name, lengths, cost, validate=False, bounds=False, unit="sweep", **run)
    return "OOM" if r["oom_steps"] else base / r["step_time_s"]


def _table3(lengths: np.ndarray, steps: int, seed: int) -> dict[str, Any]:
    """0.5B, ChatQA2, DP1 x CP8, BatchSize 64, BucketSize 26K: placement strategies with and without rollback."""
    cost = calibrated_cost("qwen2.5-0.5b", "h100", token_cap=26 * K, dp=1, cp=8)
    run: dict[str, Any] = dict(batch=64, steps=steps, seed=seed)
    base = run_planner("fixed_cp", lengths, cost, micro_batch_size=1, bounds=False, unit="sweep",
                           **run)["step_time_s"]
    out: dict[str, Any] = {}
    for name in ("skrull_rr", "skrull"):
        for rb, label in (("shortest", "+rollback"), ("none", "-rollback")):
            out[name + label] = _speedup_or_oom(name, lengths, cost, base, rollback=rb, **run)
    out["skrull+rollback(longest)"] = _speedup_or_oom("skrull", lengths, cost, base, rollback="longest", **run)
    return {"ours": out, "paper": PAPER_TABLE3}


def _fig4a(lengths: np.ndarray, steps: int, seed: int) -> dict[str, Any]:
    """Speedup vs DeepSpeed on 0.5B/ChatQA2 at DP1 x CP8: BatchSize 8..64 (C = 26K), BucketSize 8K..32K (BS 64).
    Memory stays calibrated to 26K, so larger caps run out of memory as in the paper."""
    by_batch = {}
    cost = calibrated_cost("qwen2.5-0.5b", "h100", token_cap=26 * K, dp=1, cp=8)
    for bs in (8, 16, 24, 32, 40, 48, 56, 64):
        # the same samples at every point: steps x 64 of them, cut into batches of bs
        run: dict[str, Any] = dict(batch=bs, steps=steps * 64 // bs, seed=seed)
        base = run_planner("fixed_cp", lengths, cost, micro_batch_size=1, bounds=False, unit="sweep",
                           **run)["step_time_s"]
        by_batch[bs] = _speedup_or_oom("skrull", lengths, cost, base, **run)
    by_cap = {}
    for kb in (8, 12, 16, 20, 24, 28, 32):
        mem = calibrated_cost("qwen2.5-0.5b", "h100", token_cap=26 * K, dp=1, cp=8)
        cost = type(mem)(mem.model, mem.hw, type(mem.cfg)(dp=1, cp=8, token_cap=kb * K))
        run = dict(batch=64, steps=steps, seed=seed)
        base = run_planner("fixed_cp", lengths, cost, micro_batch_size=1, bounds=False, unit="sweep",
                           **run)["step_time_s"]
        by_cap[kb * K] = _speedup_or_oom("skrull", lengths, cost, base, **run)
    return {"batch_size": by_batch, "token_cap": by_cap,
            "paper": "speedup rises with BatchSize 8->54 then saturates; rises with BucketSize 8K->32K until OOM"}


def reproduce(*, steps: int = 16, samples: int = 50_000, seed: int = 0, sweeps: bool = True) -> dict[str, Any]:
    """All of Skrull's simulated experiments; ``steps`` global batches per configuration."""
    data = {d: generate(d, samples, seed=seed) for d in ("wikipedia-cn", "lmsys-chat-1m", "chatqa2-long-sft")}
    n = runs(sweeps)
    sweeps_n = n - 5 * len(PAPER)
    with meter("reproduce skrull", n, ("run", "skrull", "sweep"), "planner runs",
               "quicker: --steps 4 --samples 10000 --no-sweeps (--steps 2 --samples 5000 in `reproduce all`)",
               weights=WEIGHTS,
               work=5 * len(PAPER) + sum(d in SHORT for _, d in PAPER) * (WEIGHTS["skrull"] - 1)
               + sweeps_n * WEIGHTS["sweep"]):
        cells = [_cell(m, d, data[d], steps, seed) for m in TOKEN_CAP for d in data]
        avg = float(np.mean([c["speedup_vs_fixed_cp"] for c in cells]))
        out: dict[str, Any] = {
            "cells": cells, "average_vs_fixed_cp": avg, "paper_average_vs_fixed_cp": 3.76,
            "average_vs_sorted": float(np.mean([c["speedup_vs_sorted"] for c in cells])),
            "paper_average_vs_sorted": 3.45, "table3": _table3(data["chatqa2-long-sft"], steps, seed)}
        if sweeps:
            out["fig4a"] = _fig4a(data["chatqa2-long-sft"], steps, seed)
    return out


def runs(sweeps: bool) -> int:
    """Planner runs of :func:`reproduce`: 5 per Fig. 3 cell (6 cells), 6 for Table 3, 2 per Fig. 4a point (15)."""
    return 5 * len(PAPER) + 6 + (2 * 15 if sweeps else 0)
