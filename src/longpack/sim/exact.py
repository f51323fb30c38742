"""The optimal step time of a small global batch, by mixed-integer programming (SciPy's HiGHS, ``scipy.optimize.milp``).

Scope of the optimum: plans of one step at the configured CP degree and checkpointing, one pipeline stage, no
chunk chains, at most ``M`` micro-batches per replica (default: the fewest that memory allows, plus one). Within
that scope the program is the simulator's time model exactly (sim/simulate.py), so ``optimal_step`` is the best
any planner can reach there and a planner's gap to it is real.

Variables, for sample i, replica r, micro-batch m, CP rank j:

* ``x[i,r,m,j]`` = 1: i held whole on rank j; ``y[i,r,m]`` = 1: i sharded over the CP group; Σ x + Σ y = 1.
* memory: Σ_i s_i·x + Σ_i ceil(s_i/cp)·y <= cap on every (r, m, j).
* ``u[r,m,j]`` >= x, y: the rank holds tokens (pays the small-GEMM loss); ``v[r,m]`` >= u: the micro-batch runs
  (pays the launch cost).
* the K/V exchange ``c[r,m]`` of the sharded tokens X[r,m], a piecewise-linear function with a latency floor
  (zero at X = 0): one binary per linear segment, X split over the segments (exact, no convexity needed).
* per rank, Eq. 2: ``t >= c + D`` and ``t >= Own + D`` with Own the rank's own samples' work and D its share of
  the sharded ones plus the small-GEMM loss; the micro-batch takes ``τ[r,m] >= t + fixed·v`` (all ranks meet),
  and the step ``T >= Σ_m τ[r,m]`` for every replica. Minimise T; the step time is T + the gradient all-reduce.

Size: n·dp·M·(cp + 1) assignment binaries plus dp·M·(cp + 1 + segments); HiGHS solves 12 samples on DP2·CP4
in about a second. Larger batches are refused (``limit``): the bound of sim/bounds.py covers them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..cost import CostModel
from ..plan import Step
from .quiet import native_stdout_silenced

__all__ = ["ExactResult", "optimal_step", "placement_step", "EXACT_LIMIT"]

EXACT_LIMIT = 16


@dataclass(frozen=True)
class ExactResult:
    time_s: float  # optimal step time (compute makespan + gradient all-reduce)
    status: str  # "optimal", or HiGHS's word when it stopped early (time_s is then its best bound)
    micro_batches: int
    placement: tuple[tuple[int, int, int | None], ...]  # per sample: (replica, micro-batch, rank or None = sharded)


def optimal_step(lengths: np.ndarray, cost: CostModel, *, micro_batches: int | None = None,
                 limit: int = EXACT_LIMIT, time_limit_s: float = 60.0) -> ExactResult:
    """Optimal step time for ``lengths`` on ``cost`` (see the module docstring for the scope)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    s = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        return ExactResult(0.0, "optimal", 0, ())
    terms = _Terms(s, cost, micro_batches, limit)
    idx = _Index(s.size, cost.cfg.dp, terms.M, cost.cfg.cp, len(terms.seg_lo))
    lo, hi, integrality = _variable_bounds(idx, terms)
    rows = _rows(idx, terms, cost.fixed_s)
    A = lil_matrix((len(rows), idx.size))
    lb = np.empty(len(rows))
    ub = np.empty(len(rows))
    for row_i, (coeffs, a, b) in enumerate(rows):
        for col, val in coeffs.items():
            A[row_i, col] = val
        lb[row_i], ub[row_i] = a, b
    obj = np.zeros(idx.size)
    obj[idx.T] = 1.0
    with native_stdout_silenced():  # HiGHS prints a debug line on some programs, whatever disp says
        res = milp(obj, constraints=LinearConstraint(A.tocsr(), lb, ub), integrality=integrality,
                   bounds=Bounds(lo, hi), options={"time_limit": time_limit_s, "disp": False})
    if res.x is None:
        raise ValueError(f"exact optimum: HiGHS found no plan ({res.message})")
    status = "optimal" if res.status == 0 else res.message
    value = float(res.x[idx.T]) if res.status == 0 else float(getattr(res, "mip_dual_bound", res.x[idx.T]))
    return ExactResult(value + cost.grad_allreduce_s(), status, terms.M, _placement(res.x, idx))


class _Terms:
    """The program's data: per-sample seconds and tokens, the token cap, M, the exchange's linear pieces."""

    def __init__(self, s: np.ndarray, cost: CostModel, micro_batches: int | None, limit: int) -> None:
        n, dp, cp, k = s.size, cost.cfg.dp, cost.cfg.cp, cost.cfg.ckpt_layers
        if n > limit:
            raise ValueError(f"exact optimum: {n} samples > limit {limit}; the MILP is for small batches")
        if cost.cfg.pp > 1:
            raise ValueError("exact optimum: pipeline parallelism (--pp > 1) is outside the program's scope")
        self.cap = cap = cost.token_cap()
        self.s = s
        self.shard_tok = shard_tok = -(-s // cp)
        if np.any(shard_tok > cap) or (cp == 1 and np.any(s > cap)):
            raise ValueError(f"exact optimum: a sample of {int(s.max())} tokens needs a chunk chain "
                             f"(cap {cap} x cp {cp})")
        m_min = max(1, math.ceil(int(np.minimum(s, shard_tok * cp).sum()) / (dp * cp * cap)))
        self.M = micro_batches or m_min + 1
        sf = s.astype(np.float64)
        pairs = cost.cfg.causal_factor * sf * sf
        c_tok = float(cost.linear_s(1.0, k, ideal=True))  # linear seconds per token
        self.gemm_loss = float(cost.linear_s(1.0, k)) - c_tok
        self.own = c_tok * sf + np.asarray(cost.attn_s(pairs, sf, k)) + float(cost.docs_s(1))
        self.share = (c_tok * shard_tok + np.asarray(cost.attn_s(pairs / cp, sf / (2 * cp) if cp > 1 else sf, k))
                      + float(cost.docs_s(2)))
        self.can_local = s <= cap
        self.can_shard = cp > 1
        self.seg_lo, self.seg_hi, self.seg_val, self.seg_slope = _comm_segments(cost, float(s.sum()))


class _Index:
    """Column of every variable: x, y (placement), u, v (rank / micro-batch in use), z, w (exchange segment and
    its tokens), c (exchange seconds), t (rank time), tau (micro-batch time), T (the step)."""

    def __init__(self, n: int, dp: int, M: int, cp: int, Q: int) -> None:
        self.n, self.dp, self.M, self.cp, self.Q = n, dp, M, cp, Q
        sizes = {"X": n * dp * M * cp, "Y": n * dp * M, "U": dp * M * cp, "V": dp * M, "Z": dp * M * Q,
                 "W": dp * M * Q, "C": dp * M, "TR": dp * M * cp, "TAU": dp * M, "T": 1}
        start = 0
        self.at: dict[str, int] = {}
        for name, size in sizes.items():
            self.at[name] = start
            start += size
        self.size = start
        self.T = self.at["T"]

    def x(self, i: int, r: int, m: int, j: int) -> int:
        return self.at["X"] + ((i * self.dp + r) * self.M + m) * self.cp + j

    def y(self, i: int, r: int, m: int) -> int:
        return self.at["Y"] + (i * self.dp + r) * self.M + m

    def u(self, r: int, m: int, j: int) -> int:
        return self.at["U"] + (r * self.M + m) * self.cp + j

    def v(self, r: int, m: int) -> int:
        return self.at["V"] + r * self.M + m

    def z(self, r: int, m: int, q: int) -> int:
        return self.at["Z"] + (r * self.M + m) * self.Q + q

    def w(self, r: int, m: int, q: int) -> int:
        return self.at["W"] + (r * self.M + m) * self.Q + q

    def c(self, r: int, m: int) -> int:
        return self.at["C"] + r * self.M + m

    def t(self, r: int, m: int, j: int) -> int:
        return self.at["TR"] + (r * self.M + m) * self.cp + j

    def tau(self, r: int, m: int) -> int:
        return self.at["TAU"] + r * self.M + m

    def slots(self) -> list[tuple[int, int]]:
        return [(r, m) for r in range(self.dp) for m in range(self.M)]


def _variable_bounds(idx: _Index, terms: _Terms) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lower, upper, integrality): placement and indicator columns binary, the rest continuous and >= 0;
    placements a sample cannot take (over the cap, or sharding at cp 1) fixed at 0."""
    lo = np.zeros(idx.size)
    hi = np.full(idx.size, np.inf)
    integrality = np.zeros(idx.size)
    binary = slice(idx.at["X"], idx.at["W"])  # x, y, u, v, z
    integrality[binary] = 1
    hi[binary] = 1
    for i in range(idx.n):
        for r, m in idx.slots():
            if not terms.can_local[i]:
                for j in range(idx.cp):
                    hi[idx.x(i, r, m, j)] = 0
            if not terms.can_shard:
                hi[idx.y(i, r, m)] = 0
    return lo, hi, integrality


def _rows(idx: _Index, terms: _Terms, fixed_s: float) -> list[tuple[dict[int, float], float, float]]:
    """Every constraint as (coefficients, lower, upper); see the module docstring for their meaning."""
    n, cp, Q, s = idx.n, idx.cp, idx.Q, terms.s
    rows: list[tuple[dict[int, float], float, float]] = []
    for i in range(n):  # every sample placed once
        row = {idx.x(i, r, m, j): 1.0 for r, m in idx.slots() for j in range(cp)}
        row.update({idx.y(i, r, m): 1.0 for r, m in idx.slots()})
        rows.append((row, 1.0, 1.0))
    for r, m in idx.slots():
        tokens = {idx.w(r, m, q): 1.0 for q in range(Q)}  # X[r,m] = Σ_q w = Σ_i s_i y
        tokens.update({idx.y(i, r, m): -float(s[i]) for i in range(n)})
        rows.append((tokens, 0.0, 0.0))
        rows.append(({idx.z(r, m, q): 1.0 for q in range(Q)}, -np.inf, 1.0))
        for q in range(Q):
            rows.append(({idx.w(r, m, q): 1.0, idx.z(r, m, q): -terms.seg_hi[q]}, -np.inf, 0.0))
            rows.append(({idx.w(r, m, q): 1.0, idx.z(r, m, q): -terms.seg_lo[q]}, 0.0, np.inf))
        comm = {idx.c(r, m): 1.0}
        for q in range(Q):
            comm[idx.z(r, m, q)] = -(terms.seg_val[q] - terms.seg_slope[q] * terms.seg_lo[q])
            comm[idx.w(r, m, q)] = -terms.seg_slope[q]
        rows.append((comm, 0.0, 0.0))
        for j in range(cp):
            rows += _rank_rows(idx, terms, fixed_s, r, m, j)
    for r in range(idx.dp):
        span = {idx.T: 1.0}
        span.update({idx.tau(r, m): -1.0 for m in range(idx.M)})
        rows.append((span, 0.0, np.inf))
    return rows


def _rank_rows(idx: _Index, terms: _Terms, fixed_s: float, r: int, m: int, j: int
               ) -> list[tuple[dict[int, float], float, float]]:
    """Memory, in-use indicators and Eq. 2 time of rank j in micro-batch m of replica r."""
    n = idx.n
    rows: list[tuple[dict[int, float], float, float]] = []
    mem = {idx.x(i, r, m, j): float(terms.s[i]) for i in range(n)}
    mem.update({idx.y(i, r, m): float(terms.shard_tok[i]) for i in range(n)})
    rows.append((mem, -np.inf, float(terms.cap)))
    for i in range(n):
        rows.append(({idx.u(r, m, j): 1.0, idx.x(i, r, m, j): -1.0}, 0.0, np.inf))
        rows.append(({idx.u(r, m, j): 1.0, idx.y(i, r, m): -1.0}, 0.0, np.inf))
    rows.append(({idx.v(r, m): 1.0, idx.u(r, m, j): -1.0}, 0.0, np.inf))
    dist = {idx.y(i, r, m): -float(terms.share[i]) for i in range(n)}
    dist[idx.u(r, m, j)] = -terms.gemm_loss
    with_comm = dict(dist)
    with_comm[idx.t(r, m, j)] = 1.0
    with_comm[idx.c(r, m)] = -1.0
    rows.append((with_comm, 0.0, np.inf))
    with_own = dict(dist)
    with_own[idx.t(r, m, j)] = 1.0
    with_own.update({idx.x(i, r, m, j): -float(terms.own[i]) for i in range(n)})
    rows.append((with_own, 0.0, np.inf))
    rows.append(({idx.tau(r, m): 1.0, idx.t(r, m, j): -1.0, idx.v(r, m): -fixed_s}, 0.0, np.inf))
    return rows


def _placement(sol: np.ndarray, idx: _Index) -> tuple[tuple[int, int, int | None], ...]:
    """(replica, micro-batch, rank or None = sharded) of every sample in a solution."""
    out = []
    for i in range(idx.n):
        where: tuple[int, int, int | None] | None = None
        for r, m in idx.slots():
            if sol[idx.y(i, r, m)] > 0.5:
                where = (r, m, None)
            for j in range(idx.cp):
                if sol[idx.x(i, r, m, j)] > 0.5:
                    where = (r, m, j)
        assert where is not None
        out.append(where)
    return tuple(out)


def _comm_segments(cost: CostModel, max_tokens: float) -> tuple[list[float], list[float], list[float], list[float]]:
    """Linear pieces (lo, hi, value at lo, slope) in tokens of the K/V exchange over (0, max_tokens]."""
    if cost.cfg.cp <= 1:
        return [0.0], [0.0], [0.0], [0.0]
    kv = cost.kv_bytes_per_token
    sizes = sorted({float(mb) for kind in ("all_gather", "reduce_scatter") for mb, _ in cost.hw.collectives[kind]})
    points = [0.0] + [mb * 2**20 / kv for mb in sizes if mb * 2**20 / kv < max_tokens] + [max(max_tokens, 1.0)]
    lo, hi, val, slope = [], [], [], []
    k = cost.cfg.ckpt_layers
    for a, b in zip(points, points[1:], strict=False):
        fa = cost.cp_comm_s(max(a, 1e-9), k)  # the floor just above zero
        fb = cost.cp_comm_s(b, k)
        lo.append(a)
        hi.append(b)
        val.append(fa)
        slope.append((fb - fa) / (b - a) if b > a else 0.0)
    return lo, hi, val, slope


def placement_step(result: ExactResult, samples: np.ndarray, lengths: np.ndarray, cost: CostModel) -> Step:
    """The optimal placement as a Step (simulating it gives ``result.time_s``: the program is the simulator's)."""
    from ..plan import MicroBatch, Piece, Replica

    dp, M = cost.cfg.dp, result.micro_batches
    pieces: list[list[list[Piece]]] = [[[] for _ in range(M)] for _ in range(dp)]
    for sample, n, (r, m, j) in zip(samples.tolist(), lengths.tolist(), result.placement, strict=True):
        pieces[r][m].append(Piece(int(sample), 0, int(n), j))
    reps = tuple(Replica(micro_batches=tuple(MicroBatch(pieces=tuple(p), ckpt_layers=cost.cfg.ckpt_layers)
                                             for p in mbs)) for mbs in pieces)
    return Step(cp=cost.cfg.cp, token_cap=cost.token_cap(), replicas=reps)
