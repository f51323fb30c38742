"""HBP's experiments in the simulator: Table 6 components, group selection, Table 13 packers.

Setup as published: LLaMA3.1-8B on 32 H100, Tulu3 + LongCite at 128K. Baseline ISF: one 128K group at SP 8
(DP 4) with the fewest checkpointed layers that fit. "+hierarchical": the auto-selected groups with GreedyFill,
packs in random order; "+hierarchical +balance": packs sorted by attention and dealt in snake order. Speedup is the
ratio of simulated time to train on the same samples (the paper's GPU-days ratio). Unpublished settings (global
batch, group interleaving) are HBP's documented defaults (planners/hbp.py). HBP chooses each group's SP degree
among all those of the 32 GPUs, so both HBP's group selection and ``unified`` run with ``widen=1`` (CP groups wider
than the nominal CP 8 allowed, up to 16 for HBP, the world for unified). ``unified`` trains the same samples in as
many optimizer steps as HBP's full configuration.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cost import CostModel, TrainConfig
from ..hardware import get_hardware
from ..model import get_model
from ..planners import PlanContext, get_planner
from ..planners.hbp_groups import select_groups
from ..progress import meter, tick
from ..sim import plan_metrics, simulate
from ..workloads import K, generate

__all__ = ["PAPER", "reproduce"]

WORLD = 32
PAPER: dict[str, Any] = {
    "table6": {"isf": {"abr": 0.506, "cr": 1.0, "speedup": 1.0},
               "hierarchical": {"abr": 0.288, "cr": 0.173, "speedup": 1.2},
               "hierarchical+balance": {"abr": 0.002, "cr": 0.173, "speedup": 1.40}},
    "groups": ["16K/sp1/ckpt28", "128K/sp8/ckpt29"],
    # Table 19: best (sp, gc) and iteration time per packing length on the hybrid data (H100, 8B)
    "table19": [{"length": 8 * K, "sp": 2, "ckpt": 8, "time": 2.69, "memory": 77},
                {"length": 16 * K, "sp": 1, "ckpt": 28, "time": 2.65, "memory": 76},
                {"length": 32 * K, "sp": 8, "ckpt": 8, "time": 2.83, "memory": 76},
                {"length": 64 * K, "sp": 4, "ckpt": 28, "time": 3.01, "memory": 78},
                {"length": 128 * K, "sp": 8, "ckpt": 28, "time": 3.05, "memory": 79}],
    "table13_speedup_vs_none": {"random": 6.87, "isf": 7.33, "ffd": 6.98, "bfd": 7.30, "spfhp": 7.10},
}


# Table 13's packers: (label, planner, options)
_PACKERS = (("none", "one_seq", {}), ("random", "isf", {"isf_iters": 0}), ("isf", "isf", {}), ("ffd", "ffd", {}),
            ("bfd", "bfd", {}), ("spfhp", "spfhp", {}))
_QUICKER = "quicker: fewer samples, --samples N (--hbp-samples N in `reproduce all`)"
# what the time-left estimate weighs each part by, in HBP runs of the pool: a Table 13 packer (a 50,000-sample
# subset) and unified planning and simulating every step of the pool (their ratios at the default 200,000 samples)
PACKER_COST, UNIFIED_COST = 0.3, 11.0


def _cost(**cfg: Any) -> CostModel:
    return CostModel(get_model("llama3.1-8b"), get_hardware("h100"), TrainConfig(**cfg))


def _run(lengths: np.ndarray, options: dict[str, Any], planner: str = "hbp", cp: int = 8,
         ckpt: int = 0) -> dict[str, Any]:
    cost = _cost(dp=WORLD // cp, cp=cp, ckpt_layers=ckpt)
    plan = get_planner(planner).plan(lengths, [np.arange(len(lengths))], PlanContext(cost=cost, options=options),
                                     max_len=128 * K)
    plan.validate()
    r, m = simulate(plan, cost, bounds=False), plan_metrics(plan)  # times only: no efficiency reported
    tick("run")
    return {"total_s": r.total_s, "abr": m.abr, "cr": m.cr, "dbr": m.dbr, "pr": m.pr, "ave_t": m.ave_t,
            "oom_steps": r.oom_steps, "steps": len(plan.steps), "groups": plan.meta.get("hbp", {}).get("groups")}


def _run_unified(lengths: np.ndarray, steps: int, seed: int) -> dict[str, Any]:
    """``unified`` on the same samples in as many optimizer steps as HBP took (HBP groups the whole pool into its
    own steps; unified plans seeded global batches of len/steps samples): total simulated time and metrics."""
    import math

    from ..planners import global_batches

    cost = _cost(dp=WORLD // 8, cp=8)
    batches = global_batches(len(lengths), math.ceil(len(lengths) / steps), seed=seed)
    with meter("reproduce hbp: unified on the same samples", 2 * len(batches), ("planned", "simulated"),
               "steps planned and simulated",
               _QUICKER):
        plan = get_planner("unified").plan(lengths, batches, PlanContext(cost=cost, seed=seed, options={"widen": 1}),
                                           max_len=128 * K)
        plan.validate()
        r, m = simulate(plan, cost), plan_metrics(plan)
    return {"total_s": r.total_s, "efficiency": r.efficiency, "abr": m.abr, "cr": m.cr, "dbr": m.dbr,
            "oom_steps": r.oom_steps, "steps": len(plan.steps)}


def _paper_profiles(tmp: str) -> str:
    import json
    import os

    path = os.path.join(tmp, "hbp_table19.json")
    with open(path, "w") as f:
        json.dump(PAPER["table19"], f)
    return path


def reproduce(*, samples: int = 200_000, seed: int = 0, packers: bool = True, unified: bool = True
              ) -> dict[str, Any]:
    """Table 6 (ISF, hierarchical, hierarchical + balance, the paper's groups), group selection, Table 13 when
    ``packers``, and ``unified`` on the same samples when ``unified`` (the slowest part: it plans every step)."""
    runs, small = 4, len(_PACKERS) if packers else 0
    weights = {"run": 1.0, "packer": PACKER_COST, "unified": UNIFIED_COST}
    with meter("reproduce hbp", runs + small + unified, ("run", "packer", "unified"), "planner runs", _QUICKER,
               weights=weights, work=runs + small * PACKER_COST + unified * UNIFIED_COST):
        return _reproduce(samples, seed, packers, unified)


def _reproduce(samples: int, seed: int, packers: bool, unified: bool) -> dict[str, Any]:
    import tempfile

    lengths = generate("tulu3-longcite", samples, seed=seed)
    isf_ckpt = _cost(dp=4, cp=8).min_ckpt_for(128 * K // 8)
    if isf_ckpt is None:
        raise ValueError("HBP reproduction: a 128K pack at SP 8 does not fit the H100 memory model")
    isf_groups = f"{128 * K}:8:{isf_ckpt}"
    base = _run(lengths, {"groups": isf_groups, "greedy_fill": False, "balance": False, "curriculum": 0})
    hier = _run(lengths, {"balance": False, "seed": seed, "widen": 1})
    both = _run(lengths, {"widen": 1})
    with tempfile.TemporaryDirectory() as tmp:
        _, paper_sel = select_groups(lengths, _cost(dp=4, cp=8), WORLD, profiles=_paper_profiles(tmp))
    _, auto_sel = select_groups(lengths, _cost(dp=4, cp=8), WORLD)
    paper_groups = _run(lengths, {"groups": f"{16 * K}:1:28,{128 * K}:8:29"})
    table6 = {name: r | {"speedup": base["total_s"] / r["total_s"]}
              for name, r in (("isf", base), ("hierarchical", hier), ("hierarchical+balance", both),
                              ("hierarchical+balance, paper's groups", paper_groups))}
    uni: dict[str, Any] | None = None
    if unified:
        uni = _run_unified(lengths, both["steps"], seed)
        tick("unified")
        uni |= {"speedup": base["total_s"] / uni["total_s"], "vs_hbp": both["total_s"] / uni["total_s"]}
    return {"table6": table6, "unified": uni, "paper": PAPER["table6"],
            "selection": {"auto": auto_sel, "from_table19": paper_sel,
                                                                     "paper": PAPER["groups"]},
            "table13": _table13(lengths, isf_ckpt) if packers else None}


def _table13(lengths: np.ndarray, ckpt: int) -> dict[str, Any]:
    """Packers at 128K, SP 8, one group: simulated time relative to no packing (one sequence per micro-batch)."""
    sub = lengths[:50_000]
    cost = _cost(dp=4, cp=8, ckpt_layers=ckpt)
    from ..planners import global_batches

    batches = global_batches(len(sub), len(sub), seed=0)  # the whole subset as one pool, as offline packing does
    out = {}
    for label, planner, opts in _PACKERS:
        plan = get_planner(planner).plan(sub, batches, PlanContext(cost=cost, options=opts | {"pack_len": 128 * K}),
                                         max_len=128 * K)
        r, m = simulate(plan, cost, bounds=False), plan_metrics(plan)
        out[label] = {"total_s": r.total_s, "dbr": m.dbr, "abr": m.abr, "pr": m.pr}
        tick("packer")
    none = out["none"]["total_s"]
    for v in out.values():
        v["speedup_vs_none"] = none / v["total_s"]
    return {"ours": out, "paper_speedup_vs_none": PAPER["table13_speedup_vs_none"]}
