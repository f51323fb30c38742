"""Pipeline schedules: 1F1B and ChunkFlow's state-aware 1F1B, simulated event by event.

Work items are micro-batches (or chunks) with a forward time per stage; backward costs ``bwd_ratio`` times the
forward. Without chains, the classic 1F1B order; with chains, a greedy list schedule whose backwards run a
chain's chunks descending and recompute dropped chunks on the way (docs/EXECUTION.md, "Pipeline schedules in
the simulator", has the rules). Bubble ratio = 1 − useful work / (p · makespan). Cost: milliseconds a step.

>>> round(schedule([Item(4), Item(2), Item(1), Item(1)], pp=4).bubble_ratio, 4)
0.5714
>>> round(schedule(chunk_items([4, 2, 1, 1], 2, k=2), pp=4, k=2).bubble_ratio, 4)
0.4783
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Item", "PipelineResult", "schedule", "one_f_one_b", "chunk_items"]


@dataclass(frozen=True)
class Item:
    """One micro-batch: forward time per stage; ``chain`` groups dependent chunks (None = standalone), in order."""

    fwd: float
    chain: int | None = None
    recompute: bool = False


@dataclass(frozen=True)
class PipelineResult:
    """``ops``: per stage, the schedule as run — (kind "F" / "R" / "B", item, start, end) in start order; a
    runtime that executes each stage's list in order reproduces the schedule's dependencies."""

    makespan: float
    useful: float
    recompute: float
    pp: int
    ops: tuple[tuple[tuple[str, int, float, float], ...], ...] = ()

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - self.useful / (self.pp * self.makespan) if self.makespan > 0 else 0.0


def _chain_links(items: list[Item]) -> list[int | None]:
    """For each item, the next chunk of its chain (whose backward must come first), else None."""
    nxt: list[int | None] = [None] * len(items)
    last: dict[int, int] = {}
    for i, it in enumerate(items):
        if it.chain is not None:
            if it.chain in last:
                nxt[last[it.chain]] = i
            last[it.chain] = i
    return nxt


def schedule(items: list[Item], pp: int, *, bwd_ratio: float = 2.0, k: int = 1,
             eager_recompute: bool = True) -> PipelineResult:
    """Simulate one step over ``pp`` stages: 1F1B, or state-aware 1F1B when items form chains.
    ``eager_recompute=False`` holds each recompute until its backward's gradient has arrived (no overlap)."""
    if not items:
        return PipelineResult(0.0, 0.0, 0.0, pp)
    if all(it.chain is None for it in items):
        return one_f_one_b([it.fwd for it in items], pp, bwd_ratio=bwd_ratio)
    return _state_aware(items, pp, bwd_ratio, k, eager_recompute)


def one_f_one_b(fwd: list[float], pp: int, *, bwd_ratio: float = 2.0) -> PipelineResult:
    """Classic 1F1B: fixed per-stage op order, each op as early as its stage and inputs allow."""
    n = len(fwd)
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, n)
        seq = [("F", i) for i in range(warm)]
        f = warm
        for b in range(n):
            if f < n:
                seq.append(("F", f))
                f += 1
            seq.append(("B", b))
        orders.append(seq)
    f_end = [[-1.0] * n for _ in range(pp)]
    b_end = [[-1.0] * n for _ in range(pp)]
    pos, free = [0] * pp, [0.0] * pp
    ops: list[list[tuple[str, int, float, float]]] = [[] for _ in range(pp)]
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else f_end[s - 1][i]
                else:
                    dep = f_end[s][i] if s == pp - 1 else b_end[s + 1][i]
                if dep < 0:
                    break
                begin = max(free[s], dep)
                end = begin + (fwd[i] if kind == "F" else bwd_ratio * fwd[i])
                ops[s].append((kind, i, begin, end))
                (f_end if kind == "F" else b_end)[s][i] = end
                free[s] = end
                pos[s] += 1
                progressed = True
    makespan = max(max(row) for row in b_end)
    return PipelineResult(makespan=makespan, useful=pp * (1 + bwd_ratio) * sum(fwd), recompute=0.0, pp=pp,
                          ops=tuple(tuple(o) for o in ops))


def _state_aware(items: list[Item], pp: int, bwd_ratio: float, k: int, eager: bool) -> PipelineResult:
    n = len(items)
    nxt = _chain_links(items)
    ends = {kind: [[-1.0] * n for _ in range(pp)] for kind in "FRB"}
    free = [0.0] * pp
    next_f = [0] * pp
    held = [0] * pp  # chunks whose activations a stage holds
    done_b = [0] * pp
    b_seq: list[list[int]] = [[] for _ in range(pp)]  # each stage's backwards so far, in order
    useful = recompute = 0.0
    ops: list[list[tuple[str, int, float, float]]] = [[] for _ in range(pp)]
    while any(d < n for d in done_b):
        best = None  # (start, priority, stage, kind, item)
        for s in range(pp):
            turn = None if s == pp - 1 else (b_seq[s + 1][done_b[s]] if done_b[s] < len(b_seq[s + 1]) else -1)
            cand = _ready(items, s, pp, ends, nxt, next_f[s], held[s], k, free[s], eager, turn)
            if cand is not None and (best is None or cand[:2] < best[:2]):
                best = (*cand[:2], s, *cand[2:])
        assert best is not None, "pipeline deadlock"
        start, _, s, kind, i = best
        it = items[i]
        dur = {"F": it.fwd, "R": it.fwd, "B": bwd_ratio * it.fwd}[kind]
        ends[kind][s][i] = free[s] = start + dur
        ops[s].append((kind, i, start, start + dur))
        if kind == "F":
            next_f[s] += 1
            useful += dur
            held[s] += 0 if it.recompute else 1
        elif kind == "R":
            recompute += dur
            held[s] += 1
        else:
            useful += dur
            held[s] -= 1
            done_b[s] += 1
            b_seq[s].append(i)
    makespan = max(max(row) for row in ends["B"])
    return PipelineResult(makespan=makespan, useful=useful, recompute=recompute, pp=pp,
                          ops=tuple(tuple(o) for o in ops))


def _ready(items: list[Item], s: int, pp: int, ends: dict[str, list[list[float]]], nxt: list[int | None],
           nf: int, held: int, k: int, free: float, eager: bool, turn: int | None
           ) -> tuple[float, int, str, int] | None:
    """The op stage ``s`` can start soonest: (start, priority, kind, item); ties go to B, then R, then F.
    ``turn``: the only item whose backward may run next (the next stage's order; -1 none yet; None: any).

    R(i) (recompute) needs only the stage free and the chain's next chunk backward on this stage done (its
    activations freed), so it can fill time spent waiting for B(i)'s gradient from the next stage."""
    f_end, r_end, b_end = ends["F"][s], ends["R"][s], ends["B"][s]
    best: tuple[float, int, str, int] | None = None
    for i, it in enumerate(items):
        if b_end[i] >= 0 or f_end[i] < 0:
            continue
        later = nxt[i]
        if later is not None and b_end[later] < 0:
            continue
        dep = f_end[i] if s == pp - 1 else ends["B"][s + 1][i]
        if it.recompute and r_end[i] < 0:
            if not eager and dep < 0:
                continue
            cand = (max(free, b_end[later] if later is not None else 0.0, 0.0 if eager else dep), 1, "R", i)
        else:
            if dep < 0 or (turn is not None and i != turn):
                continue
            cand = (max(free, dep, r_end[i]), 0, "B", i)
        if best is None or cand[:2] < best[:2]:
            best = cand
    if nf < len(items) and held < max(pp - s, k):
        dep = 0.0 if s == 0 else ends["F"][s - 1][nf]
        if dep >= 0:
            cand = (max(free, dep), 2, "F", nf)
            if best is None or cand[:2] < best[:2]:
                best = cand
    return best


def chunk_items(lengths: list[float], chunk: float, k: int) -> list[Item]:
    """ChunkFlow's toy construction: sequences longer than ``chunk`` become dependent chunks (placed last, the
    first N−K recomputed); shorter ones are packed first-fit-decreasing into standalone chunks of ``chunk``.

    >>> [(i.fwd, i.chain, i.recompute) for i in chunk_items([4, 2, 1, 1], 2, 1)]
    [(2, None, False), (2, None, False), (2, 0, True), (2, 0, False)]
    """
    bins: list[float] = []
    for x in sorted((x for x in lengths if x <= chunk), reverse=True):
        for j, b in enumerate(bins):
            if b + x <= chunk:
                bins[j] += x
                break
        else:
            bins.append(x)
    items = [Item(b) for b in bins]
    for c, x in enumerate(x for x in lengths if x > chunk):
        pieces = []
        rest = x
        while rest > 0:
            pieces.append(min(chunk, rest))
            rest -= chunk
        n = len(pieces)
        items += [Item(p, chain=c, recompute=j < n - k) for j, p in enumerate(pieces)]
    return items
