"""Lower bounds on step time: no plan on this cost model can beat them.

For one step with samples of lengths s_i on dp replicas of cp ranks:

    LB = max( Σ_i W(s_i) / (dp·cp),  max_i U(s_i),  P,  G,  X,  R ) + T_fixed + T_gemm + T_allreduce

W(s): a sample's fewest GPU-seconds over its allowed forms (whole, sharded, chained; recompute where memory forces
it). U(s): its shortest time (its largest indivisible unit, with the least K/V exchange, :func:`comm_minorant`).
P, G: two (:func:`pair_bound`) and m (:func:`group_bound`) samples forced onto one replica by pigeonhole. X: the
exchange a sharded sample cannot hide (:func:`exchange_bound`). R: the per-replica program (sim/replica_bound.py).
The bound is the least over the CP degrees the caller allows. Derivation and why each term is valid:
docs/COST_MODEL.md, "Lower bound and efficiency". Cost: O(samples log samples + layers + r²) per degree, plus R's
node-limited MILPs (0.1–1 s on DP32·CP8 steps). tests/test_bounds.py checks it against about 450 random valid
plans a run and the MILP optimum (sim/exact.py); docs/COST_MODEL.md reports wider sweeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..cost import CostModel, attention_pairs
from .bound_parts import (
    Forms,
    breakpoints,
    chord_slope,
    comm_minorant,
    crossing,
    hull_edges,
    lower_hull,
    per_micro_batch_s,
)

__all__ = ["sample_work", "sample_forms", "Forms", "pair_bound", "step_lower_bound", "mixed_step_bound", "min_ckpt",
           "per_micro_batch_s",
           "comm_minorant", "comm_lower", "comm_floor",
           "chain_exchange", "exchange_bound", "crossing", "memory_caps", "micro_batch_overhead", "group_bound"]


def min_ckpt(lengths: np.ndarray, cost: CostModel) -> np.ndarray:
    """Fewest checkpointed layers that let each length sit whole on one rank; -1 where none does (vectorised
    :meth:`CostModel.min_ckpt_for`)."""
    caps = np.maximum.accumulate(cost.token_caps)  # more checkpointing never lowers the cap
    k = np.searchsorted(caps, np.asarray(lengths, dtype=np.float64), side="left")
    return np.where(k <= cost.layers, k, -1)


def sample_work(lengths: np.ndarray, cost: CostModel, split_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(W, U) per sample: fewest GPU-seconds, and shortest time, on this cost model (see module docstring).
    ``split_len``: the user's --max-len under --overlong split; no piece may be longer, so a longer sample can
    only run as a chain whose attention blocks hold at most split_len (local) or split_len/(2cp) (sharded)
    queries."""
    f = sample_forms(lengths, cost, split_len)
    return f.work, f.unit


def sample_forms(lengths: np.ndarray, cost: CostModel, split_len: int | None = None, memory: bool = True) -> Forms:
    """The bounds of :class:`Forms` for each sample (see :func:`sample_work`). ``memory=False`` drops what the
    memory limit forces (recompute, checkpointing, chains for lack of room): a bound for plans that run out of
    memory too."""
    s = np.asarray(lengths, dtype=np.float64)
    cp = cost.cfg.cp
    pairs = np.asarray(attention_pairs(0, s, cost.cfg.causal_factor), dtype=np.float64)
    piece = np.minimum(s, split_len) if split_len else s
    lin = np.asarray(cost.linear_s(s, 0, ideal=True))
    # Sharded (whole or as a chain of pieces): every rank does 1/cp of the tokens and pairs in blocks of at most
    # s/(2cp) queries, and waits for the K/V exchanges of its pieces (at least comm_lower(s), see comm_minorant).
    # Each rank holds s/cp of its activations: what its memory cannot hold is recomputed (see the chain below).
    fwd = lin / (3.0 * np.maximum(s, 1.0))  # linear forward seconds per token
    q_shard = piece / (2 * cp) if cp > 1 else piece
    shard = (np.asarray(cost.linear_s(s / cp, 0, ideal=True)) + np.asarray(cost.attn_s(pairs / cp, q_shard, 0))
             + _recompute_s(s / cp, cp, q_shard, fwd, cost, memory))
    work = cp * shard
    # A chain runs its pieces in separate micro-batches (the Plan allows one piece of a sample per micro-batch):
    # at least one more per-micro-batch cost h than a whole sample; sharded whole it pays its own full exchange.
    h = per_micro_batch_s(cost)
    whole_shard = ((min_ckpt(s / cp, cost) >= 0) if memory else True) & (s <= piece)
    # as a chain: at least two pieces, and as many as its length needs (piece cap: cp · cap(L), and --max-len)
    cap = float(cost.token_caps.max()) if memory else math.inf
    limit = min(cp * cap, float(split_len) if split_len else math.inf)
    pieces = np.maximum(2.0, np.ceil(s / max(limit, 1.0)))
    exchange = np.maximum(comm_lower(s, cost, pieces) + (pieces - 1) * h, chain_exchange(s, cost, limit, pieces))
    if cp > 1 and whole_shard.any():
        exchange[whole_shard] = np.minimum(exchange[whole_shard], comm_floor(s[whole_shard], cost))
    unit = shard + exchange
    # A chain on one rank: the tokens whose activations do not fit must run their forward again, or layers are
    # checkpointed.
    chain = lin + _recompute_s(s, 1, piece, fwd, cost, memory) + np.asarray(cost.attn_s(pairs, piece, 0))
    work = np.minimum(work, chain)
    unit = np.minimum(unit, chain + h)
    one_rank = chain.copy()
    # Whole on one rank, with the fewest checkpointed layers that fit.
    k = np.where(s <= piece, min_ckpt(s, cost) if memory else 0, -1)
    for kk in np.unique(k[k >= 0]).tolist():
        at = k == kk
        local = np.asarray(cost.linear_s(s[at], kk, ideal=True)) + np.asarray(cost.attn_s(pairs[at], s[at], kk))
        work[at] = np.minimum(work[at], local)
        unit[at] = np.minimum(unit[at], local)
        one_rank[at] = np.minimum(one_rank[at], local)
    return Forms(work, unit, shard, one_rank, whole_shard & (cp > 1), pieces, cap, exchange)


def _recompute_s(tokens: np.ndarray, ranks: int, q_len: np.ndarray, fwd: np.ndarray, cost: CostModel,
                 memory: bool = True) -> np.ndarray:
    """Least seconds a rank spends running forward passes again when it must hold the activations of ``tokens``
    tokens of one sample (its 1/``ranks`` share): min over k checkpointed layers of what is dropped, (n −
    cap(k))⁺ tokens recomputed in full, plus k/L of the forward of the min(n, cap(k)) it keeps. A recomputed
    token runs its linear forward (``fwd`` seconds per token) and its attention forward again (the simulator
    charges both); the attention of m of the sample's tokens is at least that of its first m, causal·m² pairs
    (split over the ranks, in blocks of at most ``q_len`` queries)."""
    n = np.asarray(tokens, dtype=np.float64)
    if not memory:
        return np.zeros(np.shape(n))
    n = n[:, None]
    caps = cost.token_caps[None, :]
    share = np.arange(cost.layers + 1)[None, :] / cost.layers
    dropped = np.maximum(n - caps, 0.0)
    kept = np.minimum(n, caps)
    per_pair = np.asarray(cost.attn_s(1.0, np.broadcast_to(q_len, np.shape(tokens)), 0), dtype=np.float64)
    per_pair = per_pair[:, None] / (1.0 + cost.cfg.attn_bwd_factor)  # forward only
    pairs = cost.cfg.causal_factor * ((dropped * ranks) ** 2 + share * (kept * ranks) ** 2) / ranks
    return (np.asarray(fwd, dtype=np.float64)[:, None] * (dropped + share * kept) + per_pair * pairs).min(axis=1)


def comm_floor(tokens: np.ndarray, cost: CostModel) -> np.ndarray:
    """Least exchange of a micro-batch holding at least ``tokens`` sharded tokens: min over y >= x of
    cp_comm_s(y). The exchange is piecewise linear, so the least sits at x or at a breakpoint beyond it; where
    the tables grow with size (the presets) this is cp_comm_s itself."""
    x = np.asarray(tokens, dtype=np.float64)
    if cost.cfg.cp <= 1:
        return np.zeros_like(x)
    pts = breakpoints(cost)
    suffix = np.minimum.accumulate(cost.cp_comm_s(pts, 0)[::-1])[::-1]
    idx = np.searchsorted(pts, x, side="left")
    later = np.where(idx < pts.size, suffix[np.minimum(idx, pts.size - 1)], np.inf)
    return np.minimum(cost.cp_comm_s(x, 0), later)


def chain_exchange(lengths: np.ndarray, cost: CostModel, limit: float, pieces: np.ndarray) -> np.ndarray:
    """Least exchange plus extra micro-batch costs of a sharded chain: at least ``pieces`` pieces of at most
    ``limit`` tokens, each in its own micro-batch, whose exchange is at least cp_comm_s(piece) (a micro-batch
    holds at least that piece; the exchange grows with size on the tables this applies to). With ĉ the lower
    convex envelope of the exchange on (0, limit] and c0 its latency floor, n pieces pay at least
    max(n·ĉ(s/n), n·c0) (Jensen) plus (n − 1)·h; the least over n. Tighter than the minorant when the table is
    concave over the pieces' sizes (it usually is: bandwidth grows with message size). Zero when the exchange
    does not grow with size on the table (then only :func:`comm_lower` applies). O(samples · n)."""
    s = np.asarray(lengths, dtype=np.float64)
    if cost.cfg.cp <= 1 or not math.isfinite(limit) or s.size == 0:
        return np.zeros_like(s)
    pts = breakpoints(cost)
    pts = np.concatenate([pts[pts < limit], [limit]])
    vals = cost.cp_comm_s(pts, 0)
    c0 = float(cost.cp_comm_s(1e-9, 0))
    if np.any(np.diff(vals) < 0) or vals[0] < c0:
        return np.zeros_like(s)
    lines = hull_edges([(0.0, c0), *zip(pts.tolist(), vals.tolist(), strict=True)])
    shrink = 1 - 1e-9
    h = per_micro_batch_s(cost)
    n0 = np.asarray(pieces, dtype=np.float64) * np.ones_like(s)
    two = _two_pieces(s, cost, limit) * shrink + h
    best = np.full(s.shape, np.inf)
    for extra in range(64):
        n = n0 + extra
        y = np.minimum(s / n, limit)
        env = np.max([a + b * y for a, b in lines], axis=0)
        jensen = np.maximum(n * env, n * c0) * shrink + (n - 1) * h
        best = np.minimum(best, np.where(n == 2, np.maximum(jensen, two), jensen))
        if np.all((n + 1) * c0 * shrink + n * h >= best):  # more pieces cost more than the floor alone
            return best
    return np.minimum(best, (n + 1) * c0 * shrink + n * h)  # any larger n pays at least its floors


def _two_pieces(s: np.ndarray, cost: CostModel, limit: float) -> np.ndarray:
    """Least exchange of a sample cut into exactly two pieces of at most ``limit`` tokens, each in its own
    micro-batch: min over the cut x of comm_floor(x) + comm_floor(s − x). Both terms are piecewise linear in x
    with the tables' sizes as breakpoints, so the least sits at a breakpoint of either or at an end of the cut's
    range. Exact where the envelope of :func:`chain_exchange` (Jensen) is not: on a table that is concave in
    places, two halves can cost more than the envelope says. Infinite where two pieces cannot hold the sample.
    O(samples · breakpoints)."""
    pts = breakpoints(cost)[:-1]
    lo = np.maximum(s - limit, 1.0)[:, None]
    hi = np.minimum(limit, s - 1.0)[:, None]
    x = np.concatenate([lo, hi, np.broadcast_to(pts, (s.size, pts.size)), s[:, None] - pts[None, :]], axis=1)
    x = np.clip(x, lo, np.maximum(lo, hi))
    shape = x.shape
    flat = x.ravel()
    y = (comm_floor(flat, cost) + comm_floor(np.repeat(s, shape[1]) - flat, cost)).reshape(shape)
    return np.where(hi[:, 0] >= lo[:, 0], y.min(axis=1), np.inf)


def comm_lower(lengths: np.ndarray, cost: CostModel, pieces: np.ndarray | int = 1) -> np.ndarray:
    """Least K/V exchange seconds a sample of each length costs when sharded in at least ``pieces`` pieces (in as
    many micro-batches), chained or not: max over the minorant lines of pieces·a + b·s (comm_minorant)."""
    s = np.asarray(lengths, dtype=np.float64)
    n = np.asarray(pieces, dtype=np.float64)
    return np.max([a * n + b * s for a, b in comm_minorant(cost)], axis=0)


def memory_caps(cost: CostModel) -> np.ndarray:
    """Most tokens a rank can hold in one micro-batch within memory, for k = 0 .. layers checkpointed layers
    (real-valued; a configured token cap is the planners' choice, not a limit on every plan)."""
    return np.array([cost.memory_tokens(k) for k in range(cost.layers + 1)])


def micro_batch_overhead(lengths: np.ndarray, forms: Forms, free_forms: Forms, cost: CostModel) -> float:
    """GPU-seconds every plan within memory pays beyond Σ W for its micro-batches: a rank pays h per micro-batch
    it holds tokens in, and a micro-batch with k checkpointed layers holds at most cap(k) tokens per rank and
    runs the forward of those layers again, (k/L)·f per token (f: one forward of the linear work per token).

    Per sample, with B its memory-free work (``free_forms``: no recompute, every form allowed) and g = W − B >= 0:
    whatever form it runs in, its pieces' work without checkpointing is at least B, and a piece of n tokens in a
    micro-batch with k layers adds n·(k/L)·f of recompute and holds n/cap(k) of that micro-batch's h. With w_k
    the share of its tokens at k, φ_k = h/cap(k), ψ_k = (k/L)·f, it costs at least
    max(W + s·Σ w_k φ_k, B + s·Σ w_k (φ_k + ψ_k)) = W + s·Φ + max(0, s·Ψ − g), (Φ, Ψ) = Σ w_k (φ_k, ψ_k).
    The least of that over the convex hull of the points (φ_k, ψ_k) is its charge: the lower envelope of φ at
    Ψ = g/s, or a vertex past it. For g = 0 that is s·min_k(φ_k + ψ_k); where W charges forced recompute or
    forced sharding (g > 0), that much of the checkpointing is free. Summed over the ranks and micro-batches,
    with Σ_ranks tokens >= Σ s. O(samples · layers)."""
    s = np.asarray(lengths, dtype=np.float64)
    caps = memory_caps(cost)
    ok = caps >= 1.0
    if not ok.any() or not s.size:
        return 0.0
    h = per_micro_batch_s(cost)
    f = float(cost.linear_s(1.0, cost.layers, ideal=True)) - float(cost.linear_s(1.0, 0, ideal=True))
    phi = h / caps[ok]
    psi = np.flatnonzero(ok).astype(np.float64) / cost.layers * f
    gap = np.maximum(forms.work - free_forms.work, 0.0) / np.maximum(s, 1.0)  # g/s: recompute W already pays
    # lower envelope of φ over ψ (ψ increases with k), evaluated at g/s; past the last point, its φ
    hx, hy = zip(*lower_hull(list(zip(psi.tolist(), phi.tolist(), strict=True))), strict=True)
    env = np.interp(np.minimum(gap, psi[-1]), hx, hy)
    past = np.where(psi[None, :] > gap[:, None], phi[None, :] + psi[None, :] - gap[:, None], np.inf)
    per_token = np.minimum(env, past.min(axis=1))
    shrink = 1 - 1e-9  # rounding margin
    return float(np.dot(per_token, s)) * shrink


def step_lower_bound(lengths: np.ndarray, cost: CostModel, degrees: Sequence[int] | None = None,
                     split_len: int | None = None, memory: bool = True) -> float:
    """Lower bound on the time of one step holding samples of ``lengths`` (see module docstring): the least over
    the CP ``degrees`` a step may use (default: the cost model's), each with world/degree replicas; ``split_len``
    as in :func:`sample_work`. It holds for plans within memory; ``memory=False`` gives the weaker bound that
    also holds for plans over memory (no recompute, checkpointing or chains forced by it)."""
    if len(lengths) == 0:
        return 0.0
    from .replica_bound import replica_bound

    world = cost.cfg.dp * cost.cfg.cp
    found = []  # per degree: (bound, busiest-replica bound, all-reduce, cost model, forms)
    for d in degrees or (cost.cfg.cp,):
        c = cost.at_cp(d)
        forms = sample_forms(lengths, c, split_len, memory)
        work, unit = forms.work, forms.unit
        h = per_micro_batch_s(c)
        overhead = micro_batch_overhead(lengths, forms, sample_forms(lengths, c, split_len, False), c) if memory \
            else 0.0
        spread = max(float(work.sum()) / world + h, (float(work.sum()) + overhead) / world)
        busiest = max(spread, float(unit.max()) + h, pair_bound(lengths, forms, c, world // d),
                      group_bound(lengths, forms, c, world // d))
        busiest = exchange_bound(lengths, forms, c, world // d, busiest)
        allreduce = c.grad_allreduce_s()
        found.append((busiest + allreduce, busiest, allreduce, c, forms))
    # the per-replica program (few replicas) raises a degree's bound: run on the (at most REFINED) degrees of
    # least bound, while they could hold the least
    out = math.inf
    for rank, (bound, busiest, allreduce, c, forms) in enumerate(sorted(found, key=lambda x: x[0])):
        if bound >= out:
            break
        if rank < REFINED:
            bound = replica_bound(lengths, forms, c, world // c.cfg.cp, busiest) + allreduce
        out = min(out, bound)
    return out


REFINED = 2  # degrees per step the per-replica program runs on (each: up to 2 + PROBES MILPs)


def mixed_step_bound(lengths: np.ndarray, cost: CostModel, degrees: Sequence[int] | None = None,
                     split_len: int | None = None, memory: bool = True, split: bool = True) -> float:
    """Lower bound on the time of one step whose replicas may be CP groups of several sizes (Step.degrees): any
    split of the world into groups whose degrees are among ``degrees`` (default: the cost model's).

    Each sample runs in one group, so it costs at least its cheapest form over the degrees. Terms (no
    per-replica ones: the number of groups is free):

    * spread: Σ_i min_d W_i(d) / world + h (the busiest rank of the world);
    * unit: max_i min_d U_i(d) + h (the group that runs sample i);
    * exchange, in GPU-seconds: a group g of degree d takes T >= D_g + θ·C_g + (1 − θ)·Λ_g + h for θ in [0, 1],
      with C_g >= b_d·(its sharded tokens) for b_d the steepest minorant slope of the exchange at degree d (and
      the chord slope at T, as in :func:`exchange_bound`) and d·Λ_g >= Σ of its own samples' one-rank times;
      times d and summed over the groups, world·T >= Σ_i min(min_d d·(θ·b_d·s_i + shard_i(d)),
      (1 − θ)·local_i) + world·h. In a plan of time T a sample runs on one rank only if its one-rank time fits T,
      and sharded at degree d only if its share and exchange there do (shard_i(d) + exchange_i(d) + h <= T): the
      minimum runs over those, here and in the spread (Σ_i of the least of local_i and d·shard_i(d) over them,
      / world + h). The bound is the crossing with T (bisection).

    * the longest unit's group: a sample i sits in a group of some degree d. If d is the whole world, the step is
      one group, a layout of one degree, held by :func:`step_lower_bound` at that degree; otherwise the step takes
      at least U_i(d) + h. So it takes at least the lesser of the two, for each of the ``SPLIT`` samples of longest
      least unit (the largest of these bounds is kept).

    Weaker than :func:`step_lower_bound` for one degree (no pair, group or per-replica terms), and valid for
    every layout of one degree too. Cost: O(samples · degrees · 40) after the forms, plus one bound of one degree
    at the whole world (``split=False`` leaves that term out: a weaker bound, a few ms for a planner's test)."""
    if len(lengths) == 0:
        return 0.0
    s = np.asarray(lengths, dtype=np.float64)
    world = cost.cfg.dp * cost.cfg.cp
    found = []
    for d in degrees or (cost.cfg.cp,):
        c = cost.at_cp(d)
        slopes = [b for _, b in comm_minorant(c) if b > 0]
        found.append((d, sample_forms(s, c, split_len, memory), max(slopes, default=0.0),
                      chord_slope(c) if d > 1 else None))
    h = per_micro_batch_s(cost)
    work = np.min([f.work for _, f, _, _ in found], axis=0)
    unit = np.min([f.unit for _, f, _, _ in found], axis=0)
    local = np.min([f.local for _, f, _, _ in found], axis=0)
    known = max(float(work.sum()) / world, float(unit.max())) + h
    theta = (0.25, 0.5, 0.75, 1.0)

    def f(t: float) -> float:
        fits = local + h <= t
        # degrees a sample may run sharded at in a plan of time t: its share plus its exchange fit t
        allowed = [(d, forms, b, chord, forms.shard + forms.exchange + h <= t) for d, forms, b, chord in found if d > 1]
        spread = np.where(fits, local, np.inf)
        for d, forms, _, _, ok in allowed:
            spread = np.minimum(spread, np.where(ok, d * forms.shard, np.inf))
        best = float(spread.sum()) / world
        slopes = [max(b, chord(t - h)) if chord else b for _, _, b, chord, _ in allowed]  # the same for every θ
        for th in theta:
            cheapest = np.where(fits, (1.0 - th) * local, np.inf)
            for (d, forms, _, _, ok), slope in zip(allowed, slopes, strict=True):
                cheapest = np.minimum(cheapest, np.where(ok, d * (th * slope * s + forms.shard), np.inf))
            best = max(best, float(cheapest.sum()) / world)
        return best + h

    best = crossing(f, known, 40)
    if split and world > 1 and any(d == world for d, *_ in found) and len(found) > 1:
        whole = step_lower_bound(s, cost, degrees=[world], split_len=split_len, memory=memory) - cost.grad_allreduce_s()
        units = np.array([forms.unit for d, forms, _, _ in found if d < world])  # degrees below the world
        for i in np.argsort(-unit, kind="stable")[:SPLIT].tolist():
            best = max(best, min(whole, float(units[:, i].min()) + h))
    return best + cost.grad_allreduce_s()


SPLIT = 4  # samples of longest unit whose group the mixed bound splits on (each: one more valid bound)


PAIR_LIMIT = 256  # replicas up to which the pair bound is computed (O(replicas²) pairs)


def pair_bound(lengths: np.ndarray, forms: Forms, cost: CostModel, replicas: int) -> float:
    """Busiest-replica time forced by two samples sharing a replica: with ``replicas`` replicas, two of the
    replicas + 1 largest samples (by unit) share one (a sample's pieces all run on one replica, and all sharded
    or all on one CP rank: Plan.validate), so the slowest replica takes at least the least, over those pairs, of

    * both sharded: ``shard_a + shard_b + h`` plus ``comm_floor(s_a + s_b)`` in one micro-batch (when memory
      lets both run sharded whole side by side), or else ``comm_lower(s_a + s_b, 2) + h`` in two or more: every
      micro-batch holding a sharded piece pays its exchange, and summed over micro-batches the exchanges exceed
      the minorant of the total tokens;
    * one sharded, the other on one rank r: ``shard_a + h`` plus ``max(comm_floor(s_a), local_b)`` when a is
      sharded whole, or ``max(comm_lower(s_a, n_a), local_b) + h`` as a chain (r waits for the exchanges and for its
      own work, Eq. 2, and does a's share on top);
    * both on ranks: ``max(local_a, local_b) + h`` (CP degree 1: one rank does both, ``work_a + work_b + h``).

    Returns 0 when there are not more samples than replicas or more than ``PAIR_LIMIT`` replicas.
    Cost: O(n + replicas²)."""
    n = len(lengths)
    if replicas >= n or replicas > PAIR_LIMIT:
        return 0.0
    h = per_micro_batch_s(cost)
    top = np.argsort(-forms.unit, kind="stable")[: replicas + 1]
    a, b = np.triu_indices(top.size, 1)
    i, j = top[a], top[b]
    if cost.cfg.cp <= 1:
        return float(np.min(forms.work[i] + forms.work[j])) + h
    s = np.asarray(lengths, dtype=np.float64)
    sh, loc = forms.shard, forms.local
    cl = comm_lower(s, cost, forms.chain_pieces) + (forms.chain_pieces - 2) * h  # a chain: >= 2 micro-batches
    whole = np.where(forms.whole_shard, comm_floor(s, cost), np.inf)  # sharded whole: one micro-batch
    d = cost.cfg.cp
    together = forms.whole_shard[i] & forms.whole_shard[j] & (np.ceil(s[i] / d) + np.ceil(s[j] / d)
                                                              <= forms.cap)
    one_mb = np.where(together, comm_floor(s[i] + s[j], cost), np.inf)
    both = sh[i] + sh[j] + np.minimum(one_mb, comm_lower(s[i] + s[j], cost, 2) + h)
    i_sh = sh[i] + np.minimum(np.maximum(whole[i], loc[j]), np.maximum(cl[i], loc[j]) + h)
    j_sh = sh[j] + np.minimum(np.maximum(whole[j], loc[i]), np.maximum(cl[j], loc[i]) + h)
    ranks = np.maximum(loc[i], loc[j])
    return float(np.min(np.minimum(np.minimum(both, i_sh), np.minimum(j_sh, ranks)))) + h


GROUP_SIZES = 24  # group sizes m the group bound tries (geometric spread; any m gives a valid bound)


def group_bound(lengths: np.ndarray, forms: Forms, cost: CostModel, replicas: int) -> float:
    """Busiest-replica time forced by m samples sharing a replica (CP degree > 1).

    Pigeonhole: of the N = replicas·(m − 1) + 1 longest samples, some replica holds m. Every form's cost grows
    with length (the forms a sample allows only shrink as it grows), so that replica holds at least as much as
    the m shortest of those N, and the bound below for them holds for it. On one replica with sharded set Sh
    and the rest on ranks, a rank holding own sample o takes, over its micro-batches, Σ max(C, own) + Σ shares
    + h >= Σ_Sh shard + max(X(Sh), local_o) + h, with X(Sh) the least exchange the set pays: its largest
    single-sample exchange, and at least comm_floor of its tokens in one micro-batch (when they fit one) or the
    minorant n·a + b·Σ s plus (n − 1)·h over n >= 2 micro-batches (n at least a chain's pieces). Own samples
    only cost their largest one-rank time, so the best split shards the k of largest one-rank time, for some
    k; the bound is the least over k. Sizes m: every one on a single replica, else ``GROUP_SIZES`` values up to
    the largest the batch allows. Cost: O(n log n + Σ m)."""
    d = cost.cfg.cp
    n = len(lengths)
    if d <= 1 or n < 2:
        return 0.0
    s = np.asarray(lengths, dtype=np.float64)
    order = np.argsort(-s, kind="stable")
    top = (n - 1) // replicas + 1  # the largest m with replicas·(m − 1) + 1 <= n
    if top < 2:
        return 0.0
    sizes = [n] if replicas == 1 else sorted({int(round(x)) for x in np.geomspace(2, top, GROUP_SIZES)} | {top})
    h = per_micro_batch_s(cost)
    best = 0.0
    for m in sizes:
        stop = replicas * (m - 1) + 1
        group = order[stop - m: stop]
        best = max(best, _group_time(s[group], forms.shard[group], forms.local[group], forms.exchange[group],
                                     forms.whole_shard[group], forms.chain_pieces[group], forms.cap, cost, h))
    return best


def _group_time(s: np.ndarray, shard: np.ndarray, local: np.ndarray, exchange: np.ndarray, whole: np.ndarray,
                pieces: np.ndarray, cap: float, cost: CostModel, h: float) -> float:
    """Least time of one replica holding these samples (given longest first, :func:`group_bound`). O(m)."""
    d = cost.cfg.cp
    area = np.cumsum(shard)  # shares of the k longest, sharded
    tokens = np.cumsum(s)
    single = np.maximum.accumulate(exchange)
    fits = np.logical_and.accumulate(whole) & (np.cumsum(np.ceil(s / d)) <= cap)
    mbs = np.maximum(2.0, np.maximum.accumulate(np.where(whole, 1.0, pieces)))
    several = comm_lower(tokens, cost, mbs) + (mbs - 1) * h
    one = np.where(fits, comm_floor(tokens, cost), np.inf)
    ex = np.maximum(single, np.minimum(one, several))
    ex[0] = exchange[0]
    own = np.append(local[1:], 0.0)  # with the k longest sharded, the longest own sample is the next one
    return float(min(local[0], np.min(area + np.maximum(ex, own)))) + h


def exchange_bound(lengths: np.ndarray, forms: Forms, cost: CostModel, replicas: int, known: float) -> float:
    """Raise ``known`` (a bound on the busiest replica) by charging sharded samples their exchange.

    A replica g takes at least max(C_g, Λ_g) + D_g (Eq. 2 summed over its micro-batches: C its exchanges, Λ its
    busiest rank's own work, at least the mean own work, D the shares of its sharded samples), so for any θ in
    [0, 1] and any minorant line (a, b) of the exchange, ``replicas · T >= Σ_sharded (θ·b·s + shard) +
    Σ_local (1 − θ)·local / cp``. Which samples are sharded is the plan's choice, so each sample takes the
    cheaper term; but a sample whose one-rank time exceeds T cannot be local in a plan of time T. Hence for every
    T: optimum >= min(T, f(T)) with f(T) the best such sum (plus h); f falls as T grows and the bound is its
    crossing, found by bisection. Besides the minorant's slopes, the slope of :func:`chord_slope` at T: no
    micro-batch of a plan of time T exchanges more tokens than the exchange time or the shares' linear work allow
    within T, and below that size the exchange is at least that chord's slope times the tokens — on a concave
    table much steeper than the minorant's, which must hold for any size. Cost: O(samples · lines · θs · 40)."""
    if cost.cfg.cp <= 1:
        return known
    s = np.asarray(lengths, dtype=np.float64)
    h = per_micro_batch_s(cost)
    slopes = np.array([b for _, b in comm_minorant(cost) if b > 0])
    if slopes.size == 0:
        return known
    theta = np.array([0.25, 0.5, 0.75, 1.0])
    th = np.repeat(theta, slopes.size)[None, :]
    sharded = th * np.tile(slopes, theta.size)[None, :] * s[:, None] + forms.shard[:, None]
    local = (1.0 - th) * forms.local[:, None] / cost.cfg.cp
    local_short = (1.0 - theta)[None, :] * forms.local[:, None] / cost.cfg.cp
    chord = chord_slope(cost)

    def f(t: float) -> float:
        fits = (forms.local + h <= t)[:, None]
        best = float(np.minimum(sharded, np.where(fits, local, np.inf)).sum(axis=0).max())
        b = chord(t - h)
        if b > 0:
            short = theta[None, :] * b * s[:, None] + forms.shard[:, None]
            best = max(best, float(np.minimum(short, np.where(fits, local_short, np.inf)).sum(axis=0).max()))
        return best / replicas + h

    return crossing(f, known, 40)
