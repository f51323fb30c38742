"""One pass schedule per step, the same on every rank, so that FSDP2's per-layer collectives match (ZeRO-3).

Under ``fully_shard`` every forward pass all-gathers each layer's parameters and every backward pass all-gathers
them again and reduce-scatters their gradients, over all ranks. A plan gives ranks different work within a step
(empty micro-batches, chunk chains whose forwards all run before their backwards, recomputed chunks that run
forward twice), so each rank's passes are first written as a string over {F, B}, in the order the runtime
(runtime/kernel/step.py) runs them:

* a micro-batch of whole documents: ``FB``; a micro-batch with no pieces: nothing;
* a chain of n chunks (runtime/kernel/chunked.py): ``F`` n times (ascending), then per chunk descending ``B`` for a kept
  chunk and ``FB`` for a recomputed one.

Every rank of a CP group runs its replica's string (a rank holding nothing of a micro-batch runs empty passes in
its place). :func:`merge` then lays the replicas' strings on one sequence of slots: a slot is F when some
replica's next pass is F, B when every replica's next pass is B or it holds an empty forward's graph, F otherwise;
a replica whose next pass is not the slot's kind runs an *empty* pass there (``f``: a one-token forward whose loss
is multiplied by zero, its graph kept; ``b``: the backward of one such graph), with the same collectives and a
zero gradient. Each replica keeps its own order, so results are exact. :class:`Clock` walks one rank's row of the
merged schedule as its micro-batches run. Cost: one slot per pass of the busiest replica plus the slots where
replicas' kinds disagree; each empty pass costs one layer-by-layer gather (and one reduce-scatter for ``b``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...plan import MicroBatch

__all__ = ["replica_passes", "merge", "Clock", "LastBackward", "NO_CLOCK"]


def replica_passes(mbs: tuple[MicroBatch, ...], chains: dict[int, tuple[int, int]]) -> str:
    """The F/B string of a replica's micro-batches whose chunk chains are ``chains`` ({first index: (last index,
    sample)}, runtime/kernel/step.chain_segments: the runtime's own walk of them); see the module docstring."""
    out: list[str] = []
    i = 0
    while i < len(mbs):
        if i in chains:
            last = chains[i][0]
            seg = mbs[i:last + 1]
            out.append("F" * len(seg))
            out.extend("FB" if mb.recompute else "B" for mb in reversed(seg))
            i = last + 1
        else:
            out.append("FB" if mbs[i].pieces else "")
            i += 1
    return "".join(out)


def merge(strings: list[str]) -> list[str]:
    """Per replica, its row of the merged schedule: its own passes as ``F``/``B``, empty passes as ``f``/``b``; all
    rows have the same length and the same kind (F or B, either case) in every slot."""
    n = len(strings)
    pos, pending = [0] * n, [0] * n
    rows: list[list[str]] = [[] for _ in range(n)]
    while any(pos[i] < len(strings[i]) for i in range(n)):
        heads = [strings[i][pos[i]] if pos[i] < len(strings[i]) else None for i in range(n)]
        if "F" not in heads and all(h == "B" or pending[i] > 0 for i, h in enumerate(heads)):
            kind = "B"
        else:
            kind = "F"
        for i, h in enumerate(heads):
            if h == kind:
                rows[i].append(kind)
                pos[i] += 1
            elif kind == "F":
                rows[i].append("f")
                pending[i] += 1
            else:
                rows[i].append("b")
                pending[i] -= 1
    return ["".join(r) for r in rows]


class Clock:
    """One rank's row of the merged schedule. :meth:`take` is called before each of the rank's own passes: it runs
    the empty passes scheduled before it (``run_empty()`` returns a graph to keep, whose ``backward()`` an empty
    backward calls) and checks that the pass is the one scheduled; :meth:`finish` runs the row's remaining empty
    passes and drops the graphs no backward took."""

    def __init__(self, row: str, run_empty: Callable[[], Any]) -> None:
        self.row, self.run_empty, self.at = row, run_empty, 0
        self.graphs: list[Any] = []

    def _empties(self) -> None:
        while self.at < len(self.row) and self.row[self.at].islower():
            if self.row[self.at] == "f":
                self.graphs.append(self.run_empty())
            else:
                self.graphs.pop().backward()
            self.at += 1

    def take(self, kind: str, empty: bool = False) -> None:
        """Before this rank's next pass, of ``kind`` (F or B); ``empty``: the pass itself is empty (a CP rank that
        holds nothing of the micro-batch) and runs here."""
        self._empties()
        if self.at >= len(self.row) or self.row[self.at] != kind:
            got = self.row[self.at] if self.at < len(self.row) else "the end"
            raise RuntimeError(f"pass schedule out of step: this rank runs {kind} where slot {self.at} of its "
                               f"schedule {self.row!r} holds {got}")
        self.at += 1
        if empty and kind == "F":
            self.graphs.append(self.run_empty())
        elif empty:
            self.graphs.pop().backward()

    def finish(self) -> None:
        self._empties()
        if self.at != len(self.row):
            raise RuntimeError(f"pass schedule out of step: this rank ended at slot {self.at} of {self.row!r}")
        self.graphs.clear()


class LastBackward:
    """The clock of a rank whose parameters are gathered once per step (runtime/kernel/parallelize.StepSync): it
    counts the rank's backward passes (``backwards``, one per micro-batch with pieces, whoever drives them) and,
    before the last one, calls ``on_last`` (FSDP2's gradient sync on), so that this backward reduce-scatters the
    step's accumulated gradients layer by layer as it goes. An empty last backward (a CP rank holding nothing of
    the micro-batch) runs ``run_empty()``'s backward in its place. ``synced`` says whether the sync ran."""

    def __init__(self, backwards: int, on_last: Callable[[], None], run_empty: Callable[[], Any]) -> None:
        self.left, self.on_last, self.run_empty, self.synced = backwards, on_last, run_empty, False

    def take(self, kind: str, empty: bool = False) -> None:
        if kind != "B" or self.left <= 0:
            return
        self.left -= 1
        if self.left == 0:
            self.on_last()
            self.synced = True
            if empty:
                self.run_empty().backward()

    def finish(self) -> None:
        return None


class _NoClock:
    """The clock of a rank whose passes need no schedule (no FSDP2, or parameters gathered once per step)."""

    def take(self, kind: str, empty: bool = False) -> None:
        return None

    def finish(self) -> None:
        return None


NO_CLOCK: Any = _NoClock()
