"""The step's pass schedule (runtime/kernel/passes.py): every rank's row has the same kind in every slot, keeps its own
passes in order, and never runs an empty backward without an empty forward's graph; the clock refuses a pass out
of step. (That FSDP2 trains exactly on it: tests/test_fsdp.py, case uneven_passes.)"""

import random

import pytest

from longpack.runtime.kernel.passes import Clock, merge


def _check(strings):
    rows = merge(strings)
    assert len({len(r) for r in rows}) == 1
    for slot in zip(*rows, strict=True):
        assert len({c.upper() for c in slot}) == 1
    for s, row in zip(strings, rows, strict=True):
        assert "".join(c for c in row if c.isupper()) == s
        pending = 0
        for c in row:
            pending += {"f": 1, "b": -1}.get(c, 0)
            assert pending >= 0
    return rows


def _replica(rng):
    out = []
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.5:
            out.append("FB")
        else:  # a chain: n forwards, then kept (B) or recomputed (FB) chunks descending
            n = rng.randint(1, 4)
            out.append("F" * n + "".join(rng.choice(["B", "FB"]) for _ in range(n)))
    return "".join(out)


def test_merge_examples():
    assert _check(["FBFFFBBFB", "FBFB"]) == ["FBFFFBBFB", "FBFffBbfb"]
    assert _check(["FB", ""]) == ["FB", "fb"]
    assert _check(["FFBB", "FBFB"]) == ["FFBfB", "FfBFB"]  # a graph no backward takes is dropped


def test_merge_random_replicas():
    rng = random.Random(0)
    for _ in range(300):
        _check([_replica(rng) for _ in range(rng.randint(1, 6))])


def test_clock_runs_empty_passes_and_refuses_out_of_step():
    log = []

    class Graph:
        def backward(self):
            log.append("b")

    def run_empty():
        log.append("f")
        return Graph()

    clock = Clock("FfBbfb", run_empty)
    clock.take("F")
    clock.take("B")  # the empty forward runs first
    clock.finish()
    assert log == ["f", "b", "f", "b"]
    clock = Clock("fFB", run_empty)
    with pytest.raises(RuntimeError, match="out of step"):
        clock.take("B")
