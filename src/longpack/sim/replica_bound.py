"""A per-replica relaxation of the step bound, for steps with few replicas (SciPy's HiGHS, ``scipy.optimize.milp``).

sim/bounds.py's aggregate terms add all replicas' work into one sum; with few, wide replicas that is far from any
plan. This program keeps replicas apart: the ``INTEGRAL`` samples of longest one-rank time are placed whole
(sharded on a replica, or on one of its ranks: binaries), the rest is a fluid bucketed by length, and each replica
g obeys Eq. 2 summed over its micro-batches, ``T >= D_g + C_g + h`` and ``T >= D_g + Λ_g + h`` (shares, exchange,
own work; each a lower bound from :func:`bounds.sample_forms`); minimise T. For plans of time <= t the exchange's
chord slope at t is one more line, and bisection finds where R(t) crosses t. HiGHS's dual bound is used, so a
search stopped at ``NODES`` still gives a valid value. Why it is a bound: docs/COST_MODEL.md, "Lower bound and
efficiency" (R).

Cost: one program per probe, (2r + 1)·``INTEGRAL`` rows and 2r·``INTEGRAL`` binaries under a node limit; run only
for 2..``REPLICA_LIMIT`` replicas and one pipeline stage. tests/test_bounds.py checks it against random valid
plans and the MILP optimum.
"""

from __future__ import annotations

import math

import numpy as np

from ..cost import CostModel
from .bound_parts import Forms, chord_slope, comm_minorant, crossing, per_micro_batch_s
from .quiet import native_stdout_silenced

__all__ = ["replica_bound", "REPLICA_LIMIT"]

REPLICA_LIMIT = 8  # most replicas the program runs for
INTEGRAL = 24  # samples placed whole (binaries); the rest is a bucketed fluid
BUCKETS = 24  # length buckets of the fluid
NODES = 200  # branch-and-bound nodes HiGHS may open per program
PROBES = 3  # bisection probes for the chord slope
SHRINK = 1 - 1e-7  # margin for the solver's tolerances


def replica_bound(lengths: np.ndarray, forms: Forms, cost: CostModel, replicas: int, known: float) -> float:
    """Raise ``known``, a bound on the busiest replica's time at this degree, by the program above."""
    s = np.asarray(lengths, dtype=np.float64)
    if cost.cfg.cp <= 1 or cost.cfg.pp > 1 or not 2 <= replicas <= REPLICA_LIMIT or s.size <= replicas:
        return known
    program = _Program(s, forms, cost, replicas)
    return crossing(program.solve, max(known, program.solve(math.inf)), PROBES)


class _Program:
    """The program's data for one degree; :meth:`solve` solves it for plans of time at most t."""

    def __init__(self, s: np.ndarray, forms: Forms, cost: CostModel, replicas: int) -> None:
        self.d, self.r, self.h = cost.cfg.cp, replicas, per_micro_batch_s(cost)
        self.chord = chord_slope(cost)
        order = np.argsort(-forms.local, kind="stable")
        self.placed = order[:INTEGRAL]
        self.s, self.forms = s, forms
        self.lines = [(a, b) for a, b in comm_minorant(cost) if b > 0]
        rest = order[INTEGRAL:]
        self.buckets: list[tuple[float, float, float]] = []  # (tokens, local s/token, share s/token)
        if rest.size:
            x = np.maximum(s[rest], 1.0)
            edges = np.geomspace(x.min(), x.max() * (1 + 1e-9), BUCKETS + 1)
            which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, BUCKETS - 1)
            for k in np.unique(which).tolist():
                m = rest[which == k]
                self.buckets.append((float(s[m].sum()), float(np.min(forms.local[m] / np.maximum(s[m], 1.0))),
                                     float(np.min(forms.shard[m] / np.maximum(s[m], 1.0)))))

    def solve(self, t: float) -> float:
        """R(t): the least busiest-replica time of plans of time at most ``t`` (infinite: of any plan). Such a
        plan's micro-batches exchange at most what fits t, so the chord slope at t is one more exchange line,
        and a sample whose one-rank time exceeds t cannot run on one rank. The optimum is at least min(t, R(t))."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        r, d, h = self.r, self.d, self.h
        placed, s, f = self.placed, self.s, self.forms
        n, nb = placed.size, len(self.buckets)
        # columns: T | a[k,g] | o[k,g] | u[b,g] own fluid tokens | v[b,g] sharded fluid tokens | z[g] | C[g] | L[g]
        a0, o0 = 1, 1 + n * r
        u0, v0 = o0 + n * r, o0 + n * r + nb * r
        z0 = v0 + nb * r
        c0, l0 = z0 + r, z0 + 2 * r
        size = l0 + r
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lo: list[float] = []
        hi: list[float] = []

        def add(terms: list[tuple[int, float]], low: float, high: float = np.inf) -> None:
            row = len(lo)
            for col, val in terms:
                rows.append(row)
                cols.append(col)
                vals.append(val)
            lo.append(low)
            hi.append(high)

        for k in range(n):
            add([(a0 + k * r + g, 1.0) for g in range(r)] + [(o0 + k * r + g, 1.0) for g in range(r)], 1.0, 1.0)
        for b, (tokens, _, _) in enumerate(self.buckets):
            add([(u0 + b * r + g, 1.0) for g in range(r)] + [(v0 + b * r + g, 1.0) for g in range(r)], tokens, tokens)
        chord = self.chord(t - h) if math.isfinite(t) else 0.0
        lines = self.lines + ([(0.0, chord)] if chord > 0 else [])
        for g in range(r):
            shares = [(a0 + k * r + g, -float(f.shard[i])) for k, i in enumerate(placed.tolist())]
            shares += [(v0 + b * r + g, -bk[2]) for b, bk in enumerate(self.buckets)]
            add([(0, 1.0), (c0 + g, -1.0), *shares], h)
            add([(0, 1.0), (l0 + g, -1.0), *shares], h)
            for k, i in enumerate(placed.tolist()):
                add([(c0 + g, 1.0), (a0 + k * r + g, -float(f.exchange[i]))], 0.0)
                add([(l0 + g, 1.0), (o0 + k * r + g, -float(f.local[i]))], 0.0)
                add([(z0 + g, 1.0), (a0 + k * r + g, -1.0)], 0.0)
            for alpha, beta in lines:
                add([(c0 + g, 1.0), (z0 + g, -alpha)] + [(a0 + k * r + g, -beta * float(s[i]))
                                                        for k, i in enumerate(placed.tolist())]
                    + [(v0 + b * r + g, -beta) for b in range(nb)], 0.0)
            add([(l0 + g, 1.0)] + [(o0 + k * r + g, -float(f.local[i]) / d) for k, i in enumerate(placed.tolist())]
                + [(u0 + b * r + g, -bk[1] / d) for b, bk in enumerate(self.buckets)], 0.0)
        upper = np.full(size, np.inf)
        integrality = np.zeros(size)
        for k in range(n):  # the k-th placed sample on replicas 0..k (replicas relabelled by first use)
            whole = float(f.local[placed[k]]) + h <= t  # it may run on one rank
            for g in range(r):
                upper[a0 + k * r + g] = 1.0 if g <= k else 0.0
                upper[o0 + k * r + g] = 1.0 if g <= k and whole else 0.0
            integrality[a0 + k * r: a0 + (k + 1) * r] = 1
            integrality[o0 + k * r: o0 + (k + 1) * r] = 1
        upper[z0: z0 + r] = 1.0
        objective = np.zeros(size)
        objective[0] = 1.0
        matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), size)).tocsr()
        with native_stdout_silenced():  # HiGHS prints a debug line on some programs, whatever disp says
            res = milp(objective, constraints=LinearConstraint(matrix, np.array(lo), np.array(hi)),
                       integrality=integrality, bounds=Bounds(np.zeros(size), upper),
                       options={"node_limit": NODES, "disp": False, "time_limit": 60.0, "presolve": False})
        bound = getattr(res, "mip_dual_bound", None)
        if bound is None or not np.isfinite(bound):
            return 0.0
        return float(bound) * SHRINK
