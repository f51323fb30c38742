"""Epoch-scale plans in columns: a plan's pieces in numpy arrays, Step objects made only for the step read.

:class:`StepColumns` is a ``Sequence[Step]`` for :attr:`Plan.steps <longpack.plan.Plan.steps>`. Its pieces are
seven int32 columns (step, replica, micro-batch, sample, start, stop, cp_rank with −1 for sharded), ordered by
step, replica and micro-batch, plus per step: cp, token cap, replica count, micro-batches per replica (depth) and
checkpointed layers. ``steps[i]`` builds that one Step from its rows of the columns: its replicas' micro-batches
in order, the ones with pieces carrying the step's ``ckpt_layers`` and the rest empty padding (``MicroBatch()``),
exactly what :func:`~longpack.planners.base.assemble_step` makes. Steps a planner made as objects (a batch it
could not plan in columns) are held as they are, by index. The last few steps read are cached, so a runtime
reading its step once per micro-batch builds it once.

:class:`Lengths` is the plan's ``{sample: tokens}`` as two arrays; the dict is built on first use.

A columnar plan equals (``==``) the same plan made of objects, and writes the same JSON (format unchanged).
Cost: 28 bytes per piece and 16 per sample in numpy arrays, no Python object per piece; reading a step costs
O(its pieces).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import overload

import numpy as np

from .plan import MicroBatch, Piece, Replica, Step, make_pieces

__all__ = ["StepColumns", "Lengths", "PIECE_COLUMNS"]

PIECE_COLUMNS = ("step", "replica", "micro", "sample", "start", "stop", "rank")
_CACHE = 8


class StepColumns(Sequence[Step]):
    """Steps stored as columns (see the module docstring). ``pieces`` maps each name of :data:`PIECE_COLUMNS`
    to an array, ordered by (step, replica, micro); per-step arrays have one entry per step; ``explicit`` holds
    steps given as objects, by index (their per-step entries and pieces are ignored)."""

    def __init__(self, pieces: Mapping[str, np.ndarray], *, cp: np.ndarray, token_cap: np.ndarray,
                 replicas: np.ndarray, depth: np.ndarray, ckpt: np.ndarray,
                 explicit: Mapping[int, Step] | None = None) -> None:
        self.cols = {k: np.ascontiguousarray(pieces[k], dtype=np.int32) for k in PIECE_COLUMNS}
        self.cp, self.token_cap = np.asarray(cp, dtype=np.int64), np.asarray(token_cap, dtype=np.int64)
        self.depth, self.ckpt = np.asarray(depth, dtype=np.int64), np.asarray(ckpt, dtype=np.int64)
        self.replicas = np.asarray(replicas, dtype=np.int64)
        self.explicit = dict(explicit or {})
        steps = self.cols["step"]
        if steps.size and np.any(np.diff(steps) < 0):
            raise ValueError("piece columns must be ordered by step")
        self._offsets = np.searchsorted(steps, np.arange(self.cp.size + 1))
        self._cache: dict[int, Step] = {}

    def __len__(self) -> int:
        return int(self.cp.size)

    @overload
    def __getitem__(self, i: int) -> Step: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Step, ...]: ...

    def __getitem__(self, i: int | slice) -> Step | tuple[Step, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"step {i} of {n}")
        i %= n
        if i in self.explicit:
            return self.explicit[i]
        step = self._cache.get(i)
        if step is None:
            step = self._build(i)
            if len(self._cache) >= _CACHE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[i] = step
        return step

    def __iter__(self) -> Iterator[Step]:
        for i in range(len(self)):
            yield self.explicit[i] if i in self.explicit else self._build(i)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepColumns({len(self)} steps, {self.cols['step'].size} pieces in columns)"

    def _build(self, i: int) -> Step:
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        c = {k: v[lo:hi].tolist() for k, v in self.cols.items() if k != "step"}
        cp, depth, ckpt = int(self.cp[i]), int(self.depth[i]), int(self.ckpt[i])
        grid: list[list[MicroBatch]] = [[MicroBatch()] * depth for _ in range(int(self.replicas[i]))]
        j, n = 0, hi - lo
        while j < n:
            r, m = c["replica"][j], c["micro"][j]
            k = j
            while k < n and c["replica"][k] == r and c["micro"][k] == m:
                k += 1
            grid[r][m] = MicroBatch(pieces=_pieces(c, j, k), ckpt_layers=ckpt)
            j = k
        return Step(cp=cp, token_cap=int(self.token_cap[i]), replicas=tuple(Replica(tuple(g)) for g in grid))


def _pieces(c: Mapping[str, list[int]], j: int, k: int) -> tuple[Piece, ...]:
    ranks = c["rank"][j:k]
    if all(r < 0 for r in ranks):
        return make_pieces(c["sample"][j:k], c["start"][j:k], c["stop"][j:k], None)
    return tuple([_new(Piece, (s, a, b, None if r < 0 else r))
                  for s, a, b, r in zip(c["sample"][j:k], c["start"][j:k], c["stop"][j:k], ranks, strict=True)])


_new = tuple.__new__


class Lengths(Mapping[int, int]):
    """``{sample: tokens}`` over two arrays, the dict built on first lookup (``len`` needs none)."""

    def __init__(self, samples: np.ndarray, tokens: np.ndarray) -> None:
        self.samples, self.tokens = np.asarray(samples), np.asarray(tokens)

    @cached_property
    def _d(self) -> dict[int, int]:
        return dict(zip(self.samples.tolist(), self.tokens.tolist(), strict=True))

    def __getitem__(self, k: int) -> int:
        return self._d[k]

    def __contains__(self, k: object) -> bool:
        return k in self._d

    def __iter__(self) -> Iterator[int]:
        return iter(self._d)

    def __len__(self) -> int:
        return int(self.samples.size)

    def __repr__(self) -> str:
        return f"Lengths({len(self)} samples)"
