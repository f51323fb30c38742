"""Whole samples beside chain pieces: the room a chain's last piece leaves in its micro-batch, used to empty others.

A chain's pieces are cut to what memory or ``--max-len`` allows, so its last piece is often far from the cap. Left
alone, that micro-batch runs mostly empty while the replica's whole samples take micro-batches of their own. On
one replica, after its planner has placed everything:

1. **Room.** Each micro-batch that holds no chain piece, or only chains' *last* pieces, offers per CP rank the
   smaller of the token cap's room and the memory's: what the rank can still add within the hardware while that
   micro-batch runs, its K/V store and what unfinished chains hold counted (sim/memory.py, the simulator's own
   account). One with an earlier, kept piece of a chain offers none: what joins it would stay resident until the
   chain's backward. One with a recomputed piece offers its room only when asked (``recomputed``): what joins it
   runs its forward twice.
2. **Empty micro-batches.** Chain-free micro-batches, the lightest first, are emptied where every one of their
   samples fits the room of the replica's other micro-batches: each sample, heaviest first, goes where it leaves
   the least room (best fit), keeping how it was placed — sharded over the group, or on its CP rank. A micro-batch
   whose samples do not all fit stays as it was; so does one that would put samples beside a recomputed chunk
   (which runs them twice) unless the micro-batches it touches then get faster in the simulator. Merging work
   elsewhere only sheds per-micro-batch costs (launches, the small-GEMM loss, the exchange's latency floor).

Guarantees: the replica keeps exactly its samples and tokens (the planner's balance across replicas stands), no
chain piece moves (order and contiguity hold), no micro-batch or rank goes over the cap or, by the simulator's
memory account, over memory, a ``rows`` limit on samples per micro-batch holds, the count of micro-batches never
rises, and the sum of the replica's micro-batch times (its time with one pipeline stage) only falls.
Deterministic (ties by position). Cost: O(m² · s) per replica holding a chain's last piece, for m micro-batches of
s samples; nothing elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Piece, Replica, Step
from ..sim.memory import ReplicaMemory
from ..sim.simulate import micro_batch_times

__all__ = ["fill_replica", "fill_step"]


def fill_replica(mbs: Sequence[MicroBatch], cp: int, cap: int, cost: CostModel, length: Callable[[int], int],
                 rows: int = 0, recomputed: bool = True) -> list[MicroBatch]:
    """``mbs`` (one replica at CP degree ``cp``, token cap ``cap``) with chain-free micro-batches emptied into the
    room beside chains' last pieces and the others' (module docstring); ``length(sample)``: the tokens the plan
    covers of it; ``rows``: most samples a micro-batch may hold (0: no limit); ``recomputed``: whether recomputed
    chunks offer their room too."""
    if not any(p.start > 0 or p.stop < length(p.sample) for mb in mbs for p in mb.pieces):
        return list(mbs)  # no chain: no room beside one
    room, tails = _rooms(mbs, cp, cap, cost, length, recomputed)
    if not any(any(room[m]) for m in tails):
        return list(mbs)
    pieces = {m: list(mbs[m].pieces) for m in room}
    sec: dict[int, float] = {}  # simulated seconds of the micro-batches a trial touched, as they now are

    def seconds(m: int) -> float:
        if m not in sec:
            sec[m] = _seconds(replace(mbs[m], pieces=tuple(pieces[m])), cp, cost)
        return sec[m]

    alive = sorted(room)
    for x in sorted((m for m in room if m not in tails), key=lambda m: (sum(p.tokens for p in pieces[m]), m)):
        moves = _empty(x, pieces, room, alive, cp, rows)
        if moves is None:
            continue
        grown = {m: replace(mbs[m], pieces=tuple(pieces[m] + [p for t, p in moves if t == m])) for m, _ in moves}
        # merged work only sheds per-micro-batch costs, but what joins a recomputed chunk runs twice: such an
        # emptying is kept only where the micro-batches it touches get faster in the simulator
        after = {m: _seconds(mb, cp, cost) for m, mb in grown.items()} if any(
            mb.recompute for mb in grown.values()) else {}
        if after and sum(after.values()) >= sum(seconds(m) for m in after) + seconds(x):
            continue
        for m, p in moves:
            room[m] = [r - w for r, w in zip(room[m], _weight(p, cp), strict=True)]
        for m, mb in grown.items():
            pieces[m] = list(mb.pieces)
            sec.pop(m, None)
            if m in after:
                sec[m] = after[m]
        pieces[x] = []
        alive.remove(x)
    out = []
    for m, mb in enumerate(mbs):
        if m not in pieces:
            out.append(mb)
        elif pieces[m]:
            out.append(replace(mb, pieces=tuple(pieces[m])) if len(pieces[m]) != len(mb.pieces) else mb)
    return out


def fill_step(step: Step, cost: CostModel, length: Callable[[int], int], rows: int = 0, recomputed: bool = True
              ) -> Step:
    """:func:`fill_replica` on every replica of ``step`` (empty micro-batches dropped, then every replica padded
    again to the same count)."""
    reps = [fill_replica([mb for mb in rep.micro_batches if mb.pieces], step.replica_cp(r), step.token_cap, cost,
                         length, rows, recomputed) for r, rep in enumerate(step.replicas)]
    depth = max((len(r) for r in reps), default=0)
    return replace(step, replicas=tuple(Replica(tuple(r) + (MicroBatch(),) * (depth - len(r))) for r in reps))


def _rooms(mbs: Sequence[MicroBatch], cp: int, cap: int, cost: CostModel, length: Callable[[int], int],
           recomputed: bool) -> tuple[dict[int, list[int]], set[int]]:
    """({micro-batch: tokens each rank may add} for those that offer room, the ones among them holding a chain's
    last piece)."""
    memory = ReplicaMemory(cost, cp, length)
    room: dict[int, list[int]] = {}
    tails: set[int] = set()
    for m, mb in enumerate(mbs):
        held = mb.rank_tokens(cp)
        chunks = [p for p in mb.pieces if memory.is_chunk(p)]
        kept = any(p.stop < length(p.sample) for p in chunks) and not (mb.recompute and recomputed)
        if mb.pad_to or not mb.pieces or kept or max(held) >= cap:
            memory.skip(mb, np.asarray(held, dtype=np.float64))
            if not (mb.pad_to or chunks or not mb.pieces):
                room[m] = [0] * cp  # full, yet it may still be emptied into the others' room
            continue
        peak = memory.peak(mb, np.asarray(held, dtype=np.float64), memory.prefix(mb))
        per_token = cost.hw.fragmentation * cost.act_bytes_per_token(mb.ckpt_layers)
        free = [min(cap - t, int((cost.hw.memory_bytes - b) // per_token)) for t, b in zip(held, peak, strict=True)]
        room[m] = [max(0, f) for f in free]
        if chunks:
            tails.add(m)
    return room, tails


def _empty(x: int, pieces: dict[int, list[Piece]], room: dict[int, list[int]], alive: list[int], cp: int,
           rows: int) -> list[tuple[int, Piece]] | None:
    """Where each of micro-batch ``x``'s samples goes (best fit, heaviest first), or None if one fits nowhere."""
    trial = {m: list(room[m]) for m in alive if m != x}
    count = {m: len(pieces[m]) for m in trial}
    moves = []
    for p in sorted(pieces[x], key=lambda p: (-max(_weight(p, cp)), p.sample)):
        w = _weight(p, cp)
        best, best_left = -1, None
        for m, r in trial.items():
            if rows and count[m] >= rows:
                continue
            left = [a - b for a, b in zip(r, w, strict=True)]
            if min(left) >= 0 and (best_left is None or sum(left) < best_left):
                best, best_left = m, sum(left)
        if best < 0:
            return None
        trial[best] = [a - b for a, b in zip(trial[best], w, strict=True)]
        count[best] += 1
        moves.append((best, p))
    return moves


def _seconds(mb: MicroBatch, cp: int, cost: CostModel) -> float:
    """The simulator's time of ``mb`` at CP degree ``cp``: its slowest rank's."""
    return float(micro_batch_times(mb, cp, cost)[0].max())


def _weight(p: Piece, cp: int) -> list[int]:
    """Tokens ``p`` puts on each of the ``cp`` ranks: ceil(n / cp) on every rank when sharded, n on its own."""
    n = p.stop - p.start
    if cp == 1:
        return [n]
    if p.cp_rank is None:
        return [-(-n // cp)] * cp
    return [n if r == p.cp_rank else 0 for r in range(cp)]
