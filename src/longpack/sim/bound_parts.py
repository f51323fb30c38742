"""The pieces both step bounds (sim/bounds.py, sim/replica_bound.py) are built from: a sample's forms
(:class:`Forms`), the lines under the K/V exchange's cost (:func:`comm_minorant`, :func:`chord_slope`), the
per-micro-batch cost (:func:`per_micro_batch_s`) and the bisection that turns a falling bound into a value
(:func:`crossing`). Derivations: docs/COST_MODEL.md, "Lower bound and efficiency"."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..cost import CostModel

__all__ = ["Forms", "breakpoints", "lower_hull", "hull_edges", "comm_minorant", "chord_slope", "per_micro_batch_s",
           "crossing"]


class Forms(NamedTuple):
    """Per-sample lower bounds on this cost model: ``work`` (GPU-seconds), ``unit`` (time of the sample alone),
    ``shard`` (one rank's compute when it runs sharded, whole or as a chain), ``local`` (its time when all of
    it runs on one rank, whole or as a chain) and ``whole_shard`` (whether memory lets it run sharded whole, in
    one micro-batch, with some checkpointing), ``chain_pieces`` (fewest pieces it has as a sharded chain),
    ``cap`` (most tokens a rank can hold in one micro-batch; infinite for a bound that ignores memory) and
    ``exchange`` (least K/V exchange, plus the per-micro-batch costs of a chain's extra pieces, when sharded)."""

    work: np.ndarray
    unit: np.ndarray
    shard: np.ndarray
    local: np.ndarray
    whole_shard: np.ndarray
    chain_pieces: np.ndarray
    cap: float
    exchange: np.ndarray


def breakpoints(cost: CostModel) -> np.ndarray:
    """Token counts where the exchange's pieces meet (the hardware tables' sizes), ascending, and one far beyond."""
    sizes = sorted({float(mb) for kind in ("all_gather", "reduce_scatter") for mb, _ in cost.hw.collectives[kind]})
    return np.array([mb * 2**20 / cost.kv_bytes_per_token for mb in sizes] + [1e18])


def comm_minorant(cost: CostModel) -> list[tuple[float, float]]:
    """Lines (a, b), a >= 0, with ``a + b·x <= cp_comm_s(x)`` for every x > 0; then for any split of a sample
    into pieces x_i, ``Σ_i cp_comm_s(x_i) >= Σ_i (a + b·x_i) >= a + b·Σ_i x_i`` (one piece at least).

    The lines are the edges of the lower convex hull of the exchange's breakpoints (it is piecewise linear in x,
    flat at its latency floor c0 near zero, with the hardware tables' sizes as breakpoints), plus (c0, 0) and the
    line through the origin with the least slope; edges with a < 0 are left out (n pieces would pay n·a). The
    exchange itself is not subadditive on every table, so the whole-sample exchange is no bound for a chain."""
    if cost.cfg.cp <= 1:
        return [(0.0, 0.0)]
    c0 = cost.cp_comm_s(1e-9, 0)
    pts = [(0.0, c0)] + [(x, cost.cp_comm_s(x, 0)) for x in breakpoints(cost).tolist()]
    shrink = 1 - 1e-9  # rounding margin: stay strictly under the exchange
    lines = [(c0 * shrink, 0.0), (0.0, min(y / x for x, y in pts[1:]) * shrink)]
    lines += [(icpt * shrink, slope * shrink) for icpt, slope in hull_edges(pts) if icpt >= 0]
    return lines


def lower_hull(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The vertices of the lower convex hull of ``pts`` (given by increasing x), monotone chain. O(points)."""
    hull: list[tuple[float, float]] = []
    for p in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):  # hull[-1] is not below the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def hull_edges(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(intercept, slope) of each edge of the lower convex hull of ``pts`` (given by increasing x)."""
    hull = lower_hull(pts)
    edges = []
    for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False):
        slope = (y2 - y1) / (x2 - x1)
        edges.append((y1 - slope * x1, slope))
    return edges


def per_micro_batch_s(cost: CostModel) -> float:
    """What a rank holding tokens pays per micro-batch beyond its work: launch cost + small-GEMM loss."""
    return cost.fixed_s + float(cost.linear_s(1.0, 0)) - float(cost.linear_s(1.0, 0, ideal=True))


def chord_slope(cost: CostModel) -> Callable[[float], float]:
    """A function y -> b: the least exchange per token, min over 0 < x <= x_max of cp_comm_s(x)/x, for micro-batches
    of a replica that takes at most y seconds: one exchanges at most x_max tokens, the fewer of the most whose
    exchange fits y and y / (linear share per token) — its sharded tokens' linear work alone, x/cp tokens per
    rank at the ideal rate, fits y. The exchange is piecewise linear between the tables' sizes, so c(x)/x is
    least at a breakpoint or at x_max. Returns 0 (no slope) where the table does not grow with size. O(breakpoints)
    per call."""
    pts = breakpoints(cost)[:-1]
    vals = np.asarray(cost.cp_comm_s(pts, 0), dtype=np.float64)
    c0 = float(cost.cp_comm_s(1e-9, 0))
    rho = float(cost.linear_s(1.0, 0, ideal=True)) / cost.cfg.cp
    grows = bool(np.all(np.diff(vals) >= 0) and (vals.size == 0 or vals[0] >= c0))
    xs = np.concatenate([[0.0], pts])
    ys = np.concatenate([[c0], vals])
    shrink = 1 - 1e-9

    def slope(y: float) -> float:
        if not grows or y <= c0:
            return 0.0
        x_max = min(float(np.interp(y, ys, xs, right=np.inf)), y / rho)
        if not math.isfinite(x_max) or x_max <= 0:
            return 0.0
        cand = np.append(pts[pts <= x_max], x_max)
        return float(np.min(np.asarray(cost.cp_comm_s(cand, 0)) / cand)) * shrink

    return slope


def crossing(f: Callable[[float], float], lo: float, probes: int) -> float:
    """Bisection for the bound where a falling f crosses the identity, given ``lo`` already a bound: when f(t)
    bounds every plan of time at most t, the optimum is at least min(t, f(t)), so a probe t with f(t) > t is a
    bound. The search runs between lo and f(lo) (for t >= lo, f(t) <= f(lo)), ``probes`` halvings; returns the
    largest bound found (``lo`` when f(lo) <= lo)."""
    hi = f(lo)
    for _ in range(probes):  # invariant: the optimum >= lo
        if hi <= lo:
            break
        mid = 0.5 * (lo + hi)
        if f(mid) > mid:
            lo = mid
        else:
            hi = mid
    return lo
