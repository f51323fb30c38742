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
    n, dp, cp, k = s.size, cost.cfg.dp, cost.cfg.cp, cost.cfg.ckpt_layers
    if n == 0:
        return ExactResult(0.0, "optimal", 0, ())
    if n > limit:
        raise ValueError(f"exact optimum: {n} samples > limit {limit}; the MILP is for small batches")
    if cost.cfg.pp > 1:
        raise ValueError("exact optimum: pipeline parallelism (--pp > 1) is outside the program's scope")
    cap = cost.token_cap()
    shard_tok = -(-s // cp)
    if np.any(shard_tok > cap) or (cp == 1 and np.any(s > cap)):
        raise ValueError(f"exact optimum: a sample of {int(s.max())} tokens needs a chunk chain (cap {cap} x cp {cp})")
    m_min = max(1, math.ceil(int(np.minimum(s, shard_tok * cp).sum()) / (dp * cp * cap)))
    M = micro_batches or m_min + 1
    causal = cost.cfg.causal_factor
    sf = s.astype(np.float64)
    pairs = causal * sf * sf
    c_tok = float(cost.linear_s(1.0, k, ideal=True))  # linear seconds per token
    gemm_loss = float(cost.linear_s(1.0, k)) - c_tok
    own = c_tok * sf + np.asarray(cost.attn_s(pairs, sf, k)) + float(cost.docs_s(1))
    share = (c_tok * shard_tok + np.asarray(cost.attn_s(pairs / cp, sf / (2 * cp) if cp > 1 else sf, k))
             + float(cost.docs_s(2)))
    can_local = s <= cap
    can_shard = np.full(n, cp > 1)
    seg_lo, seg_hi, seg_val, seg_slope = _comm_segments(cost, float(s.sum()))
    Q = len(seg_lo)

    # --- variable layout ----------------------------------------------------------------------------------------
    idx = 0

    def block(size: int) -> int:
        nonlocal idx
        start, idx = idx, idx + size
        return start

    X = block(n * dp * M * cp)
    Y = block(n * dp * M)
    U = block(dp * M * cp)
    V = block(dp * M)
    Z = block(dp * M * Q)
    W = block(dp * M * Q)
    C = block(dp * M)
    TR = block(dp * M * cp)
    TAU = block(dp * M)
    T = block(1)
    nv = idx

    def x(i, r, m, j): return X + ((i * dp + r) * M + m) * cp + j
    def y(i, r, m): return Y + (i * dp + r) * M + m
    def u(r, m, j): return U + (r * M + m) * cp + j
    def v(r, m): return V + r * M + m
    def z(r, m, q): return Z + (r * M + m) * Q + q
    def w(r, m, q): return W + (r * M + m) * Q + q
    def c(r, m): return C + r * M + m
    def t(r, m, j): return TR + (r * M + m) * cp + j
    def tau(r, m): return TAU + r * M + m

    lo = np.zeros(nv)
    hi = np.full(nv, np.inf)
    integrality = np.zeros(nv)
    integrality[X:C] = 1
    integrality[W:W + dp * M * Q] = 0
    hi[X:C] = 1
    hi[W:W + dp * M * Q] = np.inf
    for i in range(n):
        if not can_local[i]:
            for r in range(dp):
                for m in range(M):
                    for j in range(cp):
                        hi[x(i, r, m, j)] = 0
        if not can_shard[i]:
            for r in range(dp):
                for m in range(M):
                    hi[y(i, r, m)] = 0

    rows: list[tuple[dict[int, float], float, float]] = []
    for i in range(n):  # every sample placed once
        row = {x(i, r, m, j): 1.0 for r in range(dp) for m in range(M) for j in range(cp)}
        row.update({y(i, r, m): 1.0 for r in range(dp) for m in range(M)})
        rows.append((row, 1.0, 1.0))
    for r in range(dp):
        for m in range(M):
            xs = {w(r, m, q): 1.0 for q in range(Q)}  # X[r,m] = Σ_q w = Σ_i s_i y
            for i in range(n):
                xs[y(i, r, m)] = -float(s[i])
            rows.append((xs, 0.0, 0.0))
            rows.append(({z(r, m, q): 1.0 for q in range(Q)}, -np.inf, 1.0))
            for q in range(Q):
                rows.append(({w(r, m, q): 1.0, z(r, m, q): -seg_hi[q]}, -np.inf, 0.0))
                rows.append(({w(r, m, q): 1.0, z(r, m, q): -seg_lo[q]}, 0.0, np.inf))
            comm = {c(r, m): 1.0}
            for q in range(Q):
                comm[z(r, m, q)] = -(seg_val[q] - seg_slope[q] * seg_lo[q])
                comm[w(r, m, q)] = -seg_slope[q]
            rows.append((comm, 0.0, 0.0))
            for j in range(cp):
                mem = {x(i, r, m, j): float(s[i]) for i in range(n)}
                mem.update({y(i, r, m): float(shard_tok[i]) for i in range(n)})
                rows.append((mem, -np.inf, float(cap)))
                for i in range(n):
                    rows.append(({u(r, m, j): 1.0, x(i, r, m, j): -1.0}, 0.0, np.inf))
                    rows.append(({u(r, m, j): 1.0, y(i, r, m): -1.0}, 0.0, np.inf))
                rows.append(({v(r, m): 1.0, u(r, m, j): -1.0}, 0.0, np.inf))
                dist = {y(i, r, m): -float(share[i]) for i in range(n)}
                dist[u(r, m, j)] = -gemm_loss
                with_comm = dict(dist)
                with_comm[t(r, m, j)] = 1.0
                with_comm[c(r, m)] = -1.0
                rows.append((with_comm, 0.0, np.inf))
                with_own = dict(dist)
                with_own[t(r, m, j)] = 1.0
                for i in range(n):
                    with_own[x(i, r, m, j)] = -float(own[i])
                rows.append((with_own, 0.0, np.inf))
                rows.append(({tau(r, m): 1.0, t(r, m, j): -1.0, v(r, m): -cost.fixed_s}, 0.0, np.inf))
        span = {T: 1.0}
        for m in range(M):
            span[tau(r, m)] = -1.0
        rows.append((span, 0.0, np.inf))
    A = lil_matrix((len(rows), nv))
    lb = np.empty(len(rows))
    ub = np.empty(len(rows))
    for row_i, (coeffs, a, b) in enumerate(rows):
        for col, val in coeffs.items():
            A[row_i, col] = val
        lb[row_i], ub[row_i] = a, b
    obj = np.zeros(nv)
    obj[T] = 1.0
    res = milp(obj, constraints=LinearConstraint(A.tocsr(), lb, ub), integrality=integrality, bounds=Bounds(lo, hi),
               options={"time_limit": time_limit_s, "disp": False})
    if res.x is None:
        raise ValueError(f"exact optimum: HiGHS found no plan ({res.message})")
    sol = res.x
    placement = []
    for i in range(n):
        where: tuple[int, int, int | None] | None = None
        for r in range(dp):
            for m in range(M):
                if sol[y(i, r, m)] > 0.5:
                    where = (r, m, None)
                for j in range(cp):
                    if sol[x(i, r, m, j)] > 0.5:
                        where = (r, m, j)
        assert where is not None
        placement.append(where)
    status = "optimal" if res.status == 0 else res.message
    value = float(sol[T]) if res.status == 0 else float(getattr(res, "mip_dual_bound", sol[T]))
    return ExactResult(value + cost.grad_allreduce_s(), status, M, tuple(placement))


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
