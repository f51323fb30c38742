"""HBP group auto-selection (HBP Algorithm 1, App. I): packing lengths with their SP and checkpointing.

Stage 1, for each candidate packing length l and SP degree sp (sp divides the world):

* ``GreedyProfileCkpt``: the fewest checkpointed layers whose memory fits a pack of l tokens sharded over sp ranks
  (the cost model's ``min_ckpt_for``; the paper interpolates two measured memory points to the same end);
* ``ProfileTime``: time per token of naive packing at that (l, sp, ckpt) — the simulator runs ISF packs of length l
  over the samples that fit, the paper measures ~10 iterations. Per token, so that lengths compare fairly.

The fastest strategy per length gives P; ``l_best`` = argmin P with strategy ``s_best``, ``l_max`` the longest
candidate with ``s_max``. Stage 2 (communication-aware refinement): ``l1 = l_best / sp_best`` (the largest pack
that needs no SP communication at the same per-rank tokens) and ``l2 = l_max / sp_max``; l2 is dropped when it is
not above l_best (merged into the l_best group), and the hierarchy is sorted({l1, l_best, l2, l_max}). Lengths
that need no SP (l1, l2) run at SP 1 with the fewest checkpointed layers that fit; l_best and l_max keep their
profiled strategies.

Measured profiles may replace the cost model: a JSON list of {"length", "sp", "ckpt", "time", "memory"} (time per
token or per iteration of the same token count; memory in GiB; entries over the GPU's memory are infeasible).

Cost: |lengths| x |SP set| simulations of a few ISF packs each: well under a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..cost import CostModel
from ..workloads import K
from .packers import isf

__all__ = ["Group", "Strategy", "select_groups", "profile_strategies", "load_profiles"]


@dataclass(frozen=True)
class Strategy:
    sp: int
    ckpt: int
    time_per_token: float


@dataclass(frozen=True)
class Group:
    """One level of the hierarchy: samples of (previous length, length] packed to ``length`` on ``sp`` ranks."""

    length: int
    sp: int
    ckpt: int

    @property
    def tag(self) -> str:
        size = f"{self.length // K}K" if self.length % K == 0 else str(self.length)
        return f"{size}/sp{self.sp}/ckpt{self.ckpt}"


def _cost_for(cost: CostModel, sp: int, world: int) -> CostModel:
    """The cost model at SP ``sp``; a configured token cap (--token-cap) stays, else memory sets it."""
    return CostModel(cost.model, cost.hw, replace(cost.cfg, cp=sp, dp=world // sp))


def _time_per_token(lengths: np.ndarray, length: int, sp: int, ckpt: int, cost: CostModel) -> float:
    """Simulated seconds per token of ISF packs of ``length`` tokens sharded over ``sp`` ranks."""
    fit = lengths[lengths <= length][:4000]
    if fit.size == 0:
        return float("inf")
    bins = isf(-(-fit // sp), max(1, length // sp), iters=3)
    total = tokens = 0.0
    for b in bins[:16]:
        total += cost.sharded_pack_s(fit[b], ckpt) * sp  # GPU-seconds: sp ranks work on this pack
        tokens += float(fit[b].sum())
    return total / tokens


def profile_strategies(lengths: np.ndarray, candidates: list[int], sp_set: list[int], cost: CostModel,
                       world: int) -> dict[int, list[Strategy]]:
    """Every feasible (sp, ckpt) per candidate length with its time per token (cost-model profiling)."""
    out: dict[int, list[Strategy]] = {}
    for length in candidates:
        rows = []
        for sp in sp_set:
            if world % sp:
                continue
            c = _cost_for(cost, sp, world)
            ckpt = c.min_ckpt_for(-(-length // sp))
            if ckpt is not None:
                rows.append(Strategy(sp, ckpt, _time_per_token(lengths, length, sp, ckpt, c)))
        out[length] = rows
    return out


def load_profiles(path: str, memory_gib: float) -> dict[int, list[Strategy]]:
    """Measured profiles from JSON: [{"length", "sp", "ckpt", "time", "memory"}, ...]."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--opt profiles={path}: no such file")
    try:
        rows = json.loads(p.read_text())
        out: dict[int, list[Strategy]] = {}
        for r in rows:
            if float(r["memory"]) <= memory_gib:
                out.setdefault(int(r["length"]), []).append(Strategy(int(r["sp"]), int(r["ckpt"]), float(r["time"])))
            else:
                out.setdefault(int(r["length"]), [])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--opt profiles={path}: expected a list of {{length, sp, ckpt, time, memory}} ({exc})"
                         ) from None
    return out


def select_groups(lengths: np.ndarray, cost: CostModel, world: int, *, candidates: list[int] | None = None,
                  sp_set: list[int] | None = None, profiles: str | None = None) -> tuple[list[Group], dict[str, Any]]:
    """The hierarchy of packing lengths with (sp, ckpt), and a report of the selection."""
    candidates = sorted(candidates or [8 * K, 16 * K, 32 * K, 64 * K, 128 * K])
    sp_set = sorted(sp_set or [1, 2, 4, 8, 16])
    table = (load_profiles(profiles, cost.hw.memory_gib) if profiles
             else profile_strategies(lengths, candidates, sp_set, cost, world))
    cap = cost.cfg.token_cap
    if not profiles:  # keep the packing lengths some SP degree fits (the cap, memory); longer samples run as chains
        fitting = [c for c in candidates if table.get(c)]
        if not fitting:
            room = f"--token-cap {cap} tokens per rank" if cap is not None else "memory"
            raise ValueError(f"HBP: no packing length of {candidates} fits {room} at SP <= "
                             f"{max(s for s in sp_set if world % s == 0)}; give --opt groups=LEN:SP:CKPT,..., a "
                             "larger --cp, or a larger --token-cap")
        candidates = fitting
    best: dict[int, Strategy] = {}
    for length in candidates:
        rows = table.get(length, [])
        if not rows:
            raise ValueError(f"HBP: packing length {length} fits no SP degree in {sp_set} on this memory; "
                             "drop it from --opt lengths or add checkpointing/larger SP")
        best[length] = min(rows, key=lambda s: (s.time_per_token, s.sp))
    l_best = min(candidates, key=lambda c: (best[c].time_per_token, c))
    l_max = candidates[-1]
    s_best, s_max = best[l_best], best[l_max]
    l1 = l_best // s_best.sp
    l2 = l_max // s_max.sp
    levels = {l1, l_best, l_max} | ({l2} if l2 > l_best else set())
    groups = []
    for length in sorted(levels):
        if length in (l_best, l_max):
            s = best[length]
            groups.append(Group(length, s.sp, s.ckpt))
        else:  # needs no SP communication by construction
            ckpt = _cost_for(cost, 1, world).min_ckpt_for(length)
            if ckpt is None:
                s = min(profile_strategies(lengths, [length], sp_set, cost, world)[length],
                        key=lambda x: x.time_per_token)
                groups.append(Group(length, s.sp, s.ckpt))
            else:
                groups.append(Group(length, 1, ckpt))
    report = {"profile": {str(c): {"sp": best[c].sp, "ckpt": best[c].ckpt, "time_per_token": best[c].time_per_token}
                          for c in candidates},
              "l_best": l_best, "l_max": l_max, "l1": l1, "l2": l2, "l2_merged": l2 <= l_best,
              "groups": [g.tag for g in groups]}
    return groups, report
