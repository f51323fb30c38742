"""One candidate's placement as micro-batches, timed by the simulator's own terms.

A :class:`Layout` holds, per replica, its sharded samples, each rank's whole samples, and the big and chain
micro-batches that follow (planners/unified/tail.py). A replica's micro-batches are packed on demand: the fewest
micro-batches m that hold every rank's tokens within the budget B, sharded samples, heaviest first, to the lightest
micro-batch with room, then each rank's samples to the micro-batch that is lightest after adding in Eq. 2 terms
(own work up to the micro-batch's K/V exchange is free); m + 1 when one fits nowhere.

:class:`Timer` memoises :func:`~longpack.sim.simulate.micro_batch_times` per micro-batch for one planning call and
scores a step as :func:`~longpack.sim.simulate.simulate_step` does with one pipeline stage (a replica's time is the
sum of its micro-batches'). Memory: O(distinct micro-batches · d), dropped with the call.
"""

from __future__ import annotations

import numpy as np

from ...cost import CostModel
from ...plan import MicroBatch, Piece, Step
from ...sim.memory import ReplicaMemory
from ...sim.simulate import micro_batch_times
from ..base import Batch, assemble_step

__all__ = ["Timer", "Layout", "holds_chunk"]


class Timer:
    """Memoised micro-batch times at CP degree ``d``: six per-rank rows, read-only, shared by callers."""

    def __init__(self, d: int, cost: CostModel) -> None:
        self.d, self.cost = d, cost
        self._memo: dict[MicroBatch, tuple[np.ndarray, ...]] = {}
        self._sec: dict[MicroBatch, float] = {}
        self._over: dict[MicroBatch, bool] = {}

    def __call__(self, mb: MicroBatch) -> tuple[np.ndarray, ...]:
        hit = self._memo.get(mb)
        if hit is None:
            rows = np.stack(micro_batch_times(mb, self.d, self.cost))
            rows.flags.writeable = False
            hit = self._memo[mb] = tuple(rows)
        return hit

    def seconds(self, mb: MicroBatch) -> float:
        """The micro-batch's simulated time: its slowest rank's (0 when empty)."""
        hit = self._sec.get(mb)
        if hit is None:
            hit = self._sec[mb] = float(self(mb)[0].max()) if mb.pieces else 0.0
        return hit

    def fits(self, mb: MicroBatch, cap: int) -> bool:
        """Whether a micro-batch no chain holds memory in fits the cap and memory on every rank."""
        t = self(mb)
        return bool(np.all(t[4] <= cap)) and not self.over(mb)

    def over(self, mb: MicroBatch) -> bool:
        """Whether a micro-batch no chain holds memory in exceeds memory on some rank, as the simulator prices it."""
        hit = self._over.get(mb)
        if hit is None:
            cost, t = self.cost, self(mb)
            peak = cost.memory_bytes(t[4], mb.ckpt_layers, t[5]) if mb.pieces else cost.memory_bytes(0.0)
            hit = self._over[mb] = bool(np.any(np.asarray(peak) > cost.hw.memory_bytes))
        return hit

    def total(self, mbs: list[MicroBatch]) -> float:
        """Simulated time of micro-batches run one after another (one pipeline stage)."""
        return sum(self.seconds(mb) for mb in mbs)

    def score(self, step: Step, lengths: dict[int, int]) -> tuple[bool, float]:
        """(over memory, simulated time) of a one-stage step at this degree, as :func:`simulate_step` reports
        them; memory is walked only in replicas with chain pieces. O(micro-batches)."""
        oom, slowest, work = False, 0.0, False
        for rep in step.replicas:
            mbs = rep.micro_batches
            slowest = max(slowest, self.total(list(mbs)))
            work = work or any(mb.pieces for mb in mbs)
            if oom:
                continue
            if any(holds_chunk(mb, lengths) for mb in mbs):
                walk = ReplicaMemory(self.cost, self.d, lengths.__getitem__)
                for mb in mbs:
                    t = self(mb)
                    oom = oom or bool(np.any(walk.peak(mb, t[4], t[5]) > self.cost.hw.memory_bytes))
            else:
                oom = any(self.over(mb) for mb in mbs)
        return oom, slowest + (self.cost.grad_allreduce_s() if work else 0.0)


class Layout:
    """Per replica: sharded samples, each rank's own samples, and the micro-batches that follow (``after``)."""

    def __init__(self, timer: Timer, ckpt: int, budget: int, cap: int, batch: Batch, t_loc: np.ndarray,
                 t_sh: np.ndarray, shared: list[list[int]], own: list[list[list[int]]],
                 after: list[list[MicroBatch]]) -> None:
        self.timer, self.cost, self.d = timer, timer.cost, timer.d
        self.ckpt, self.budget, self.cap = ckpt, budget, cap
        self.lengths, self.samples, self.t_loc, self.t_sh = batch.lengths, batch.samples, t_loc, t_sh
        self.shared, self.own, self.after = shared, own, after
        self.full = dict(zip(batch.samples.tolist(), batch.lengths.tolist(), strict=True))
        self.sharding = frozenset(i for g in shared for i in g)  # the samples it shards, as built
        self._mbs: dict[int, list[MicroBatch]] = {}
        self.reps: list[list[MicroBatch]] | None = None  # set by the local search: the replicas as it left them

    def replica(self, g: int) -> list[MicroBatch]:
        if g not in self._mbs:
            self._mbs[g] = self._pack(g) + self.after[g]
        return self._mbs[g]

    def changed(self, *replicas: int) -> None:
        for g in replicas:
            self._mbs.pop(g, None)

    def replica_s(self, g: int) -> float:
        return self.timer.total(self.replica(g))

    def step(self) -> Step:
        reps = self.reps if self.reps is not None else [self.replica(g) for g in range(len(self.own))]
        return assemble_step(reps, cp=self.d, token_cap=self.cap)

    def _pack(self, g: int) -> list[MicroBatch]:
        """Replica g's packed micro-batches (module docstring)."""
        shared, own, lengths, d = self.shared[g], self.own[g], self.lengths, self.d
        if not shared and not any(own):
            return []
        sh_tok = [-(-int(lengths[i]) // d) for i in shared]
        need = max(sum(sh_tok) + sum(int(lengths[i]) for i in mine) for mine in own)
        m = max(1, -(-need // self.budget))
        if m == 1:
            return self._pieces([shared], [[(j, i) for j, mine in enumerate(own) for i in mine]])
        while (dealt := self._deal(g, sh_tok, m)) is None:
            m += 1
        sh_of, own_of = dealt
        sharded = [[i for i, b in zip(shared, sh_of, strict=True) if b == x] for x in range(m)]
        placed = [[(j, i) for j, mine in enumerate(own) for i, b in zip(mine, own_of[j], strict=True) if b == x]
                  for x in range(m)]
        return self._pieces(sharded, placed)

    def _deal(self, g: int, sh_tok: list[int], m: int) -> tuple[list[int], list[list[int]]] | None:
        """Micro-batch index of every sample of replica g for m micro-batches, or None when one fits nowhere."""
        lengths, budget = self.lengths, self.budget
        used, sh_time, sh_of = [0] * m, [0.0] * m, []
        for i, w in zip(self.shared[g], sh_tok, strict=True):  # heaviest first
            fit = [b for b in range(m) if used[b] + w <= budget]
            if not fit:
                return None
            b = min(fit, key=lambda x: (sh_time[x], x))
            used[b] += w
            sh_time[b] += float(self.t_sh[i])
            sh_of.append(b)
        tokens = np.zeros(m)
        for i, b in zip(self.shared[g], sh_of, strict=True):
            tokens[b] += float(lengths[i])
        comm = self.cost.cp_comm_s(tokens, self.ckpt).tolist()
        own_of = []
        for mine in self.own[g]:
            room, loc, where = [budget - u for u in used], [0.0] * m, []
            for i in mine:
                n, t = int(lengths[i]), float(self.t_loc[i])
                fit = [b for b in range(m) if n <= room[b]]
                if not fit:
                    return None
                b = min(fit, key=lambda x: (max(comm[x], loc[x] + t) + sh_time[x], loc[x], x))
                room[b] -= n
                loc[b] += t
                where.append(b)
            own_of.append(where)
        return sh_of, own_of

    def _pieces(self, sharded: list[list[int]], placed: list[list[tuple[int, int]]]) -> list[MicroBatch]:
        """Micro-batches of whole samples: sharded ones (all ranks; rank 0 when d = 1), then (rank, sample) ones."""
        rank, out = None if self.d > 1 else 0, []
        for members, mine in zip(sharded, placed, strict=True):
            pieces = [Piece(int(self.samples[i]), 0, int(self.lengths[i]), rank) for i in members]
            pieces += [Piece(int(self.samples[i]), 0, int(self.lengths[i]), j) for j, i in mine]
            if pieces:
                out.append(MicroBatch(pieces=tuple(pieces), ckpt_layers=self.ckpt))
        return out


def holds_chunk(mb: MicroBatch, full: dict[int, int]) -> bool:
    """Whether a micro-batch holds a piece of a chain (part of a sample, not all of it)."""
    return any(p.start > 0 or p.stop < full[p.sample] for p in mb.pieces)
