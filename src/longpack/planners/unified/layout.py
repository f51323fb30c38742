"""Micro-batches of whole samples in Eq. 2's closed form: running sums, timed in O(d), exactly as the simulator.

For a micro-batch of whole samples (no chain piece, padding or recompute) at CP degree d with k checkpointed
layers, :func:`~longpack.sim.simulate.micro_batch_times` reduces to

    t = max(X(N), max_j L_j) + Σ_sharded σ_i + h

* ``L_j`` = Σ λ_i over rank j's own samples, λ_i = c·n_i + attn(½n_i², n_i) + doc: a sample's whole-rank seconds
  (c: linear seconds a token at full GEMM efficiency);
* ``σ_i`` = c·⌈n_i/d⌉ + attn(½n_i²/d, n_i/2d) + 2·doc: one rank's share of a sharded sample (zigzag blocks);
* ``X(N)`` the K/V exchange of the N tokens sharded in it, ``h`` the launch cost plus the small-GEMM loss.

Own work hides under the exchange; shares and h add on every rank. :class:`Rates` holds λ, σ and ⌈n/d⌉ of a
batch's samples at one (d, k); :class:`Mb` is one micro-batch as those sums, so a planner prices adding, removing
or swapping a sample in O(d) without building it. :func:`pack` packs one replica's samples into the fewest such
micro-batches; a :class:`Layout` is a candidate's replicas of them, chains after. ``tests/test_unified.py`` checks
the closed form against the simulator on random micro-batches.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from functools import cache, cached_property

import numpy as np

from ...cost import CostModel
from ...hardware import MB
from ...plan import MicroBatch, Piece, Plan, Step
from ...sim.simulate import micro_batch_times, simulate_step
from ..base import assemble_step

__all__ = ["Rates", "Mb", "pack", "floor", "Layout"]


class Rates:
    """λ (``own``), σ (``share``), ⌈n/d⌉ (``w``) and n of a batch's samples by position, at CP degree d with k
    checkpointed layers on ``cost`` (the cost model at that degree; lists for scalar loops, ``*_a`` arrays); ``h``,
    the exchange :meth:`x`, and ``mem``, the most tokens a rank holds within memory. O(n) to build."""

    def __init__(self, cost: CostModel, d: int, n: np.ndarray, k: int) -> None:
        s, c = n.astype(np.float64), float(cost.linear_s(1.0, k, ideal=True))
        pairs, w = cost.cfg.causal_factor * s * s, -(-n // d)
        self.cost, self.d, self.k, self.n = cost, d, k, n.tolist()
        self.own_a = c * s + np.asarray(cost.attn_s(pairs, s, k)) + float(cost.docs_s(1))
        self.share_a = c * w + np.asarray(cost.attn_s(pairs / d, s / (2 * d), k)) + float(cost.docs_s(2))
        self.own, self.share, self.w = self.own_a.tolist(), self.share_a.tolist(), w.tolist()
        self.h = float(cost.linear_s(1.0, k)) - c + cost.fixed_s
        self.mem = math.floor(cost.memory_tokens(k))
        while self.mem > 0 and cost.memory_bytes(float(self.mem), k) > cost.hw.memory_bytes:
            self.mem -= 1
        # the exchange is piecewise linear in tokens between the collective tables' sizes (flat below the first,
        # its latency floor): its values there and each segment's slope, the last one's going on
        self.xs = sorted({mb * MB / cost.kv_bytes_per_token for rows in cost.hw.collectives.values() for mb, _ in rows})
        self.ys = [float(cost.cp_comm_s(t, k)) for t in [*self.xs, 2 * self.xs[-1]]]
        ends = [*self.xs[1:], 2 * self.xs[-1]]
        self.slopes = [(y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in
                       zip(self.xs, ends, self.ys, self.ys[1:], strict=False)]
        self._tables = np.array(self.xs), np.array(self.ys[:-1]), np.array(self.slopes)

    def x(self, tokens: float) -> float:
        """K/V exchange seconds of ``tokens`` sharded tokens in one micro-batch (:meth:`CostModel.cp_comm_s`)."""
        if tokens <= self.xs[0]:
            return self.ys[0] if tokens > 0 else 0.0
        i = bisect_right(self.xs, tokens) - 1
        return self.ys[i] + (tokens - self.xs[i]) * self.slopes[i]

    def x_a(self, tokens: np.ndarray) -> np.ndarray:
        """:meth:`x` of an array of token counts, all > 0 (the same arithmetic, in numpy)."""
        xs, ys, slopes = self._tables
        i = np.maximum(np.searchsorted(xs, tokens, side="right") - 1, 0)
        return np.where(tokens <= xs[0], ys[0], ys[i] + (tokens - xs[i]) * slopes[i])

    def time(self, loc: float, sh: float, n: int) -> float:
        """Eq. 2: a micro-batch's seconds from its largest own load, summed shares and sharded tokens."""
        return max(self.x(n), loc) + sh + self.h

    @cached_property
    def times(self) -> Callable[[MicroBatch], tuple[np.ndarray, ...]]:
        """The simulator's per-rank times of a micro-batch at this degree (memoised: candidates share chains)."""
        return cache(lambda mb: micro_batch_times(mb, self.d, self.cost))

    @cached_property
    def alone(self) -> np.ndarray:
        """Per sample, its share plus the exchange it alone needs: its time sharded (0 exchange at d = 1)."""
        return self.share_a + self.cost.cp_comm_s(np.asarray(self.n, dtype=np.float64), self.k)

    @cached_property
    def forms(self) -> tuple[np.ndarray, np.ndarray]:
        """Per sample, (the least GPU-seconds it costs: whole on a rank, or d shares; its least seconds on the
        ranks that run it: whole, or sharded). A chain's pieces only exceed its whole."""
        if self.d == 1:
            return self.own_a, self.own_a
        return np.minimum(self.own_a, self.d * self.share_a), np.minimum(self.own_a, self.alone)

    @cached_property
    def bound(self) -> float:
        """Least step seconds any layout at this degree takes in these terms: :func:`floor` of its forms."""
        return floor([self])


def floor(rates: list[Rates]) -> float:
    """Least step seconds of a layout whose samples each run at one of these Rates' degrees (on the same world):
    every sample in its cheapest form spread over the world, or the longest of its least units, plus h and the
    gradient all-reduce (every rank pays h at least once; the step ends with the all-reduce). O(n · degrees)."""
    work, unit = (np.min([r.forms[x] for r in rates], axis=0) for x in (0, 1))
    cost = rates[0].cost
    spread = float(work.sum()) / (cost.cfg.dp * cost.cfg.cp)
    return max(spread, float(unit.max())) + rates[0].h + cost.grad_allreduce_s()


class Mb:
    """One micro-batch of whole samples at ``rates``: its sharded samples and (sample, rank) own ones, with the
    sums of the closed form (``loc``/``tok`` per rank, ``w``/``sh``/``n`` of its shares) and its seconds ``t``."""

    __slots__ = ("r", "shared", "own", "loc", "tok", "w", "sh", "n", "t")

    def __init__(self, rates: Rates, shared: list[int], own: list[tuple[int, int]]) -> None:
        self.r, self.shared, self.own = rates, shared, own
        self.sums()

    def sums(self) -> None:
        """The sums and time, recomputed from the members (after a change, so no rounding drifts)."""
        r = self.r
        self.loc, self.tok = [0.0] * r.d, [0] * r.d
        for i, j in self.own:
            self.loc[j] += r.own[i]
            self.tok[j] += r.n[i]
        self.w, self.sh, self.n = (sum(v[i] for i in self.shared) for v in (r.w, r.share, r.n))
        self.t = r.time(max(self.loc), self.sh, self.n) if self.shared or self.own else 0.0

    def micro_batch(self, samples: list[int]) -> MicroBatch:
        """The plan's micro-batch (``samples``: position -> sample id); sharded pieces first."""
        r, rank = self.r, None if self.r.d > 1 else 0
        pieces = [Piece(samples[i], 0, r.n[i], rank) for i in self.shared]
        pieces += [Piece(samples[i], 0, r.n[i], j) for i, j in self.own]
        return MicroBatch(tuple(pieces), ckpt_layers=r.k)


def pack(r: Rates, shared: list[int], own: list[list[int]], budget: int) -> list[Mb]:
    """One replica's sharded samples (heaviest first) and each rank's own ones into the fewest micro-batches m
    that hold every rank's tokens within ``budget``: sharded samples each to the micro-batch of least summed
    shares with room, then each rank's samples to the one whose Eq. 2 time grows least (own work up to its
    exchange is free; ties: the lighter rank there, then the first); m + 1 when one fits nowhere. m starts at the
    fewest that can hold them: an own sample too long to sit beside the narrowest share needs a micro-batch the
    shares left empty (they go one to a micro-batch while one is). O(samples · m)."""
    if not shared and not any(own):
        return []
    sh_w, half = [r.w[i] for i in shared], budget // 2
    m = max(1, -(-max(sum(sh_w) + sum(r.n[i] for i in mine) for mine in own) // budget),
            sum(w > half for w in sh_w))
    big = [[n for n in (r.n[i] for i in mine) if n > budget - min(sh_w)] for mine in own] if shared else []
    if any(big):
        m = max(m, len(shared) + max(max(-(-sum(b) // budget), sum(n > half for n in b)) for b in big))
    while (dealt := _deal(r, shared, own, m, budget)) is None:
        m += 1
    return [Mb(r, sh, mine) for sh, mine in zip(*dealt, strict=True) if sh or mine]


def _deal(r: Rates, shared: list[int], own: list[list[int]], m: int, budget: int
          ) -> tuple[list[list[int]], list[list[tuple[int, int]]]] | None:
    """Members of m micro-batches per :func:`pack`, or None when a sample fits none."""
    used, sh, n_sh, bins = [0] * m, [0.0] * m, [0] * m, range(m)
    out_sh: list[list[int]] = [[] for _ in bins]
    out_own: list[list[tuple[int, int]]] = [[] for _ in bins]
    for i in shared:
        b = min((c for c in bins if used[c] + r.w[i] <= budget), key=sh.__getitem__, default=-1)
        if b < 0:
            return None
        used[b], sh[b], n_sh[b] = used[b] + r.w[i], sh[b] + r.share[i], n_sh[b] + r.n[i]
        out_sh[b].append(i)
    x = [r.x(t) for t in n_sh]
    for j, mine in enumerate(own):
        room, loc = [budget - u for u in used], [0.0] * m
        for i in mine:
            n, t, b, least = r.n[i], r.own[i], -1, math.inf
            for c in bins:
                v = max(x[c], loc[c] + t) + sh[c] if n <= room[c] else math.inf
                if v < least or (v == least < math.inf and loc[c] < loc[b]):
                    b, least = c, v
            if b < 0:
                return None
            room[b], loc[b] = room[b] - n, loc[b] + t
            out_own[b].append((i, j))
    return out_sh, out_own


class Layout:
    """One candidate's placement: per replica its micro-batches of whole samples in run order (``reps``), then
    the chain micro-batches that follow them (``chains``), whose seconds (``chain_s``) and memory (``chain_oom``)
    the simulator's own terms gave; ``cost``: the cost model at its degree d; ``floor``: no replica can take less
    (:attr:`Rates.bound` without the all-reduce); ``sharding``: the samples it shards, as built; ``samples``: the
    batch's sample ids by position, ``full``: their lengths."""

    def __init__(self, reps: list[list[Mb]], chains: list[list[MicroBatch]], chain_s: list[float], chain_oom: bool,
                 cost: CostModel, cap: int, floor: float, sharding: frozenset[int], samples: list[int],
                 full: dict[int, int]) -> None:
        self.reps, self.chains, self.chain_s, self.chain_oom = reps, chains, chain_s, chain_oom
        self.cost, self.d, self.cap, self.floor, self.sharding = cost, cost.cfg.cp, cap, floor, sharding
        self.samples, self.full = samples, full

    def replica_s(self, g: int) -> float:
        return sum(mb.t for mb in self.reps[g]) + self.chain_s[g]

    def score(self) -> tuple[bool, float]:
        """(over memory, simulated step time): the closed form with one pipeline stage, else the simulator's
        pipeline schedule of its step."""
        if self.cost.cfg.pp > 1:
            return self.simulated(self.step())
        oom = self.chain_oom or any(max(mb.tok) + mb.w > mb.r.mem for rep in self.reps for mb in rep)
        slowest = max(self.replica_s(g) for g in range(len(self.reps)))
        return oom, slowest + (self.cost.grad_allreduce_s() if any(self.reps) or any(self.chains) else 0.0)

    def simulated(self, step: Step) -> tuple[bool, float]:
        """(over memory, time) of ``step``, laid out at this degree, in the simulator."""
        plan = Plan("unified", self.d * len(self.reps), self.full, (step,))
        rep = simulate_step(0, step, plan, self.cost, bound=False)
        return rep.oom, rep.time_s

    def step(self) -> Step:
        return assemble_step([[mb.micro_batch(self.samples) for mb in rep] + chain for rep, chain in
                              zip(self.reps, self.chains, strict=True)], cp=self.d, token_cap=self.cap)
