"""What follows a replica's packed micro-batches: samples longer than a CP group holds, as ChunkFlow chains.

A chain is either of the fewest chunks of at most B·d tokens (even, or full after one short first piece,
whichever is estimated faster) whose first N − K are recomputed, or (the candidate's ``tail`` twin) memory-sized:
its last piece as long as a rank can keep beside the K/V store of what precedes it, the head before it cut as long
as memory allows beside the K/V of what precedes each piece, all but the last recomputed — the least recompute
memory allows (a sample just over what a group holds runs as a two-piece chain whose head alone is recomputed).
Over a CP group of d ranks every piece holds at least 2·d tokens, so that the zigzag split gives each rank some
(:func:`least_pieces`: a shorter piece takes tokens from its neighbour).

Each chain goes, heaviest first, to the replica of least estimated load (LPT). Estimates are the
cost model's per-rank seconds (a recomputed piece's forward runs twice: 4/3 of it). :func:`chain_cost` then
times a replica's chain micro-batches and walks their memory in the simulator's own terms. Cost: O(samples +
pieces).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...cost import CostModel
from ...plan import MicroBatch, Piece, Plan
from ...sim.simulate import simulate_step
from ..base import Batch, assemble_step
from ..packers import lpt
from .layout import Rates

__all__ = ["tail", "chain_cuts", "least_pieces", "pieces", "chain_cost"]

def tail(batch: Batch, r: Rates, split: int, twin: bool, budget: int, is_chain: np.ndarray
         ) -> tuple[list[list[MicroBatch]], np.ndarray] | None:
    """Chains' micro-batches per replica (LPT on estimates) and their estimated seconds per replica, at Rates r's
    degree and checkpointing; None when memory cannot hold a chain."""
    cost, d, k0, n_rep = r.cost, r.d, r.k, r.cost.cfg.dp
    limit, cap, rank = batch.split_len or np.iinfo(np.int64).max, cost.token_cap(r.k), None if d > 1 else 0
    chunk = min(budget * d, limit)
    kept = max(split, cap // -(-chunk // d))  # as many kept chunks as the cap holds
    units: list[list[MicroBatch]] = []  # one list of micro-batches a chain
    est: list[float] = []
    for i in np.flatnonzero(is_chain).tolist():
        n = int(batch.lengths[i])
        sized = memory_chain(n, d, cost, k0, budget, limit) if twin else None
        if twin and sized is None:
            return None
        cuts, t = (sized, pieces_s(sized, d, 1, cost, k0)) if sized else chain_cuts(n, chunk, d, kept, cost, k0)
        units.append(pieces(int(batch.samples[i]), cuts, rank, k0, 1 if twin else kept))
        est.append(t)
    chains: list[list[MicroBatch]] = [[] for _ in range(n_rep)]
    load = np.zeros(n_rep)
    for g, members in enumerate(lpt(est, n_rep)):
        for m in members:
            chains[g] += units[m]
            load[g] += est[m]
    return chains, load


@lru_cache(maxsize=4096)  # pure; candidates of one batch ask for the same chains
def chain_cuts(n: int, chunk: int, d: int, kept: int, cost: CostModel, k: int) -> tuple[list[int], float]:
    """Cuts of a chain of n tokens into the fewest pieces of at most ``chunk``: even, or full chunks after one
    short first piece (it attends to no prefix, so its slow small blocks cost little), whichever
    :func:`pieces_s` estimates faster (ties: even); with that estimate. O(pieces)."""
    count = -(-n // chunk)
    even = [n * j // count for j in range(count + 1)]
    first = n - (count - 1) * chunk
    options = [even] + ([[0] + [first + chunk * j for j in range(count)]] if count > 1 and first < chunk else [])
    options = [least_pieces(cuts, d) for cuts in options]
    t, _, cuts = min((pieces_s(cuts, d, kept, cost, k), i, cuts) for i, cuts in enumerate(options))
    return cuts, t


def least_pieces(bounds: list[int], d: int) -> list[int]:
    """``bounds`` with every piece of at least 2·d tokens when d > 1 (runtime/kernel/step.py's rule for a piece sharded
    over d ranks: each rank's zigzag share holds a token): a short piece takes what it lacks from the piece before
    it (its start moves earlier: the earlier piece shrinks, it starts after a shorter prefix), or, the first piece,
    from the one after it (which shrinks as its prefix grows by as much: no more memory when a token's activations
    cost at least its K/V). Unchanged where the neighbour cannot spare it. O(pieces)."""
    least = 2 * d if d > 1 else 1
    out = list(bounds)
    for j in range(len(out) - 1):
        short = least - (out[j + 1] - out[j])
        if short <= 0:
            continue
        if j > 0 and out[j] - out[j - 1] - short >= least:
            out[j] -= short
        elif j == 0 and len(out) > 2 and out[2] - out[1] - short >= least:
            out[1] += short
    return out


def pieces_s(bounds: list[int], d: int, kept: int, cost: CostModel, k: int) -> float:
    """Estimated seconds on each of d ranks of a chain with pieces [bounds[j], bounds[j+1]); all but the last
    ``kept`` run their forward twice."""
    total = 0.0
    for j, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        pairs = cost.cfg.causal_factor * (b * b - a * a) / d
        t = float(cost.linear_s((b - a) / d, k, ideal=True)) + float(cost.attn_s(pairs, (b - a) / (2 * d), k))
        total += t * (4 / 3 if j < len(bounds) - 1 - kept else 1.0)
    return total


def _memory_terms(cost: CostModel, k: int, d: int) -> tuple[float, float, float]:
    """(activation bytes a token, K/V store bytes a prefix token, bytes a rank has for both) of a chain sharded
    over ``d`` ranks, as the simulator's memory walk counts them (a sharded token with its surcharge,
    :meth:`CostModel.shard_act_bytes_per_token`)."""
    act = cost.hw.fragmentation * (cost.act_bytes_per_token(k) + cost.at_cp(d).shard_act_bytes_per_token(k))
    return act, float(cost.kv_store_bytes(1.0)), cost.hw.memory_bytes - cost.static_bytes - cost.hw.reserve_gib * 2**30


def tail_tokens(cost: CostModel, per_rank: int, k: int, cap: int, d: int = 1) -> int:
    """Most of a sample's ``per_rank`` tokens a rank can keep as a chain's last piece (sharded over ``d`` ranks)
    beside the K/V store of the head before it, within memory and the cap. O(1) plus a short correction loop."""
    act, kv, free = _memory_terms(cost, k, d)
    if act * per_rank <= free and per_rank <= cap:
        return per_rank
    n = min(cap, per_rank, int((free - kv * per_rank) // (act - kv))) if act > kv else 0
    while n > 0 and act * n + kv * (per_rank - n) > free:
        n -= 1
    return max(n, 0)


@lru_cache(maxsize=4096)
def memory_chain(n: int, d: int, cost: CostModel, k: int, budget: int, limit: int) -> list[int] | None:
    """Bounds of a memory-sized chain of n tokens over d ranks: the last piece per :func:`tail_tokens`, the head
    cut greedily as long as memory allows beside the K/V of what precedes each piece, every piece within
    ``budget`` tokens a rank and ``limit`` tokens; None when memory holds no more. O(pieces)."""
    last = min(tail_tokens(cost, -(-n // d), k, budget, d) * d, limit)
    if last <= 0:
        return None
    head, (act, kv, free) = max(0, n - last), _memory_terms(cost, k, d)
    bounds, pos = [0], 0
    while pos < head:
        room = min(budget, int((free - kv * pos / d) // act))
        if room <= 0:
            return None
        pos = min(head, pos + min(room * d, limit))
        bounds.append(pos)
    return least_pieces(bounds + [n] if head else [0, n], d)


def pieces(sample: int, cuts: list[int], rank: int | None, ckpt: int, kept: int = 1) -> list[MicroBatch]:
    """A chain with pieces [cuts[j], cuts[j+1]), one per micro-batch, all but the last ``kept`` recomputed."""
    return [MicroBatch((Piece(sample, a, b, rank),), ckpt_layers=ckpt, recompute=j < len(cuts) - 1 - kept)
            for j, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]


def chain_cost(chains: list[list[MicroBatch]], r: Rates, full: dict[int, int]) -> tuple[list[float], bool]:
    """Per replica, the simulator's seconds of its chain micro-batches, and whether any runs over memory (its
    memory walk, on the replicas holding chains; the whole samples before them hold nothing)."""
    secs, held = [0.0] * len(chains), [g for g, mbs in enumerate(chains) if mbs]
    if not held:
        return secs, False
    step = assemble_step([chains[g] for g in held], cp=r.d, token_cap=r.cost.token_cap())
    rep = simulate_step(0, step, Plan("unified", r.d * len(held), full, (step,)), r.cost, bound=False, times=r.times)
    for g, t in zip(held, rep.replica_s, strict=True):
        secs[g] = t
    return secs, rep.oom
