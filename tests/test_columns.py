"""Plans in columns (longpack/columns.py, planners/columnar.py, planners/isf_rows.py): the same steps as objects."""

from __future__ import annotations

import numpy as np
import pytest

from longpack.columns import Lengths, StepColumns
from longpack.cost import CostModel, TrainConfig
from longpack.hardware import get_hardware
from longpack.model import get_model
from longpack.plan import Plan
from longpack.planners import PlanContext, get_planner, global_batches
from longpack.planners.isf_rows import isf_rows, next_fit_rows, row_order
from longpack.planners.packers import isf, next_fit
from longpack.planners.stream import PlanStream


def _ctx(dp: int, cp: int, cap: int, **options) -> PlanContext:
    cost = CostModel(get_model("tiny"), get_hardware("cpu"), TrainConfig(dp=dp, cp=cp, token_cap=cap))
    return PlanContext(cost=cost, seed=3, options=options)


def _lengths(rng: np.random.Generator, n: int, cap: int, cp: int) -> np.ndarray:
    """Mostly short samples, a few longer than a micro-batch (chains)."""
    lengths = rng.integers(1, cap * cp // 3, n)
    lengths[rng.random(n) < 0.03] = rng.integers(cap * cp + 1, 3 * cap * cp, 1)
    return lengths


CASES = [(1, 1, 64, 37), (2, 1, 100, 16), (4, 2, 80, 50), (3, 4, 60, 9)]  # dp, cp, token cap, global batch


@pytest.mark.parametrize(("dp", "cp", "cap", "gb"), CASES)
@pytest.mark.parametrize("options", [{}, {"micro_batch_size": 2}])
def test_fixed_cp_columns_equal_its_object_steps(dp, cp, cap, gb, options) -> None:
    """fixed_cp planned in columns gives exactly the steps its object plan_batch makes, chains included."""
    ctx = _ctx(dp, cp, cap, **options)
    lengths = _lengths(np.random.default_rng(dp * 10 + cp), 400, cap, cp)
    planner = get_planner("fixed_cp")
    plan = planner.plan(lengths, global_batches(lengths.size, gb, seed=1), ctx)
    assert isinstance(plan.steps, StepColumns) and plan.steps.explicit  # some batches hold chains
    plan.validate()
    stream = PlanStream(planner, lengths, global_batches(lengths.size, gb, seed=1), ctx)
    objects = tuple(planner.plan_batch(stream._batch(s), ctx) for s in range(len(stream)))
    assert tuple(plan.steps) == objects


@pytest.mark.parametrize(("dp", "cp", "cap", "gb"), CASES)
@pytest.mark.parametrize("planner", ["isf", "fixed_cp"])
def test_columnar_plan_equals_its_steps_planned_one_at_a_time(dp, cp, cap, gb, planner) -> None:
    """A whole run in columns equals the stream's steps planned one by one (what `longpack train` runs), is
    valid, and survives the JSON round trip."""
    ctx = _ctx(dp, cp, cap)
    lengths = _lengths(np.random.default_rng(cp * 7 + dp), 300, cap, cp)
    batches = global_batches(lengths.size, gb, seed=2)
    p = get_planner(planner)
    whole = p.plan(lengths, batches, ctx)
    stream = PlanStream(p, lengths, batches, ctx, validate=True)
    for _ in range(len(stream)):
        stream.next_step()
    assert whole == stream.plan and stream.plan == whole
    whole.validate()
    again = Plan.from_json(whole.to_json())
    assert again == whole and again.to_json() == whole.to_json()
    assert whole.total_tokens == int(lengths.sum())


def test_step_columns_index_like_a_tuple() -> None:
    ctx = _ctx(2, 2, 50)
    lengths = _lengths(np.random.default_rng(0), 120, 50, 2)
    plan = get_planner("isf").plan(lengths, global_batches(lengths.size, 20), ctx)
    steps, objects = plan.steps, tuple(plan.steps)
    assert len(steps) == len(objects) == 6
    assert steps[-1] == objects[-1] and steps[1:4] == objects[1:4] and list(steps) == list(objects)
    assert steps[2] is steps[2]  # cached: a runtime reading its step per micro-batch builds it once
    with pytest.raises(IndexError):
        steps[6]
    assert steps != objects[:-1] and steps == objects


def test_lengths_is_a_lazy_mapping() -> None:
    table = Lengths(np.array([5, 2, 9]), np.array([50, 20, 90]))
    assert len(table) == 3 and "_d" not in table.__dict__  # len needs no dict
    assert table[2] == 20 and 9 in table and 4 not in table
    assert table == {5: 50, 2: 20, 9: 90} and list(table) == [5, 2, 9]


def test_isf_rows_each_row_as_if_alone() -> None:
    """Rows packed together give each row's bins as packed alone; every item in one bin within capacity."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        rows, width, cap = int(rng.integers(1, 7)), int(rng.integers(1, 50)), int(rng.integers(5, 120))
        counts = rng.integers(0, width + 1, rows)
        w = rng.integers(0, cap + 1, (rows, width))
        w[np.arange(width)[None, :] >= counts[:, None]] = 0
        seeds = rng.integers(0, 1000, rows)
        label, made = isf_rows(w, counts, cap, seeds, threshold=cap - 2, iters=4)
        for r in range(rows):
            bins = [np.flatnonzero(label[r] == b) for b in range(made[r])]
            assert sorted(np.concatenate([*bins, np.zeros(0, int)]).tolist()) == list(range(counts[r]))
            assert all(b.size and w[r, b].sum() <= cap for b in bins)
            alone, n = isf_rows(w[r:r + 1, :max(1, counts[r])], counts[r:r + 1], cap, seeds[r:r + 1],
                                threshold=cap - 2, iters=4)
            assert n[0] == made[r] and (alone[0, :counts[r]] == label[r, :counts[r]]).all()


def test_isf_rows_packs_as_tightly_as_isf() -> None:
    """Counter-keyed shuffles pack as well as numpy's Generator: over 150 random pools, bins within 1%."""
    rng = np.random.default_rng(1)
    ours = theirs = 0
    for s in range(150):
        n, cap = int(rng.integers(1, 500)), int(rng.integers(200, 4000))
        w = np.minimum(rng.lognormal(4, 1.2, n).astype(np.int64) + 1, cap)
        ours += int(isf_rows(w[None, :], np.array([n]), cap, np.array([s]), threshold=cap - min(128, cap // 32),
                             iters=10)[1][0])
        theirs += len(isf(w, cap, seed=s))
    assert ours <= theirs * 1.01, (ours, theirs)


def test_next_fit_rows_equals_next_fit() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        rows, width, cap = int(rng.integers(1, 6)), int(rng.integers(1, 40)), int(rng.integers(5, 100))
        counts, limit = rng.integers(0, width + 1, rows), int(rng.integers(0, 4))
        w = rng.integers(0, cap + 1, (rows, width))
        w[np.arange(width)[None, :] >= counts[:, None]] = 0
        b = next_fit_rows(np.cumsum(w, axis=1), counts, cap, limit)
        for r in range(rows):
            got = [np.flatnonzero(b[r] == k).tolist() for k in range(b[r].max() + 1)] if counts[r] else []
            assert got == next_fit(w[r, :counts[r]], cap, limit)


def test_row_order_is_a_permutation_per_row() -> None:
    counts = np.array([0, 1, 5, 3])
    rank = row_order(np.arange(4), counts)
    for r, n in enumerate(counts):
        assert sorted(rank[r, :n].tolist()) == list(range(n))
    assert (row_order(np.arange(4), counts) == rank).all()  # deterministic


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("rollback", ["shortest", "longest", "none"])
def test_skrull_columns_equal_its_object_steps(seed, rollback) -> None:
    """Skrull planned in columns (GDS and DACP in lockstep over the batches, rollbacks by dacp itself) gives
    exactly the steps its object plan_batch makes: tight caps force rollbacks and extra micro-batches."""
    rng = np.random.default_rng(seed)
    dp, cp, cap = int(rng.integers(1, 5)), int(rng.choice([1, 2, 4])), int(rng.integers(40, 200))
    ctx = _ctx(dp, cp, cap, rollback=rollback)
    n = int(rng.integers(20, 300))
    lengths = rng.integers(1, cap * cp, n)
    lengths[rng.random(n) < 0.05] = 2 * cap * cp  # chains
    batches = global_batches(n, int(rng.integers(5, n // 2)), seed=seed)  # at least two: one alone plans as objects
    planner = get_planner("skrull")
    plan = planner.plan(lengths, batches, ctx)
    assert isinstance(plan.steps, StepColumns)
    stream = PlanStream(planner, lengths, batches, ctx)
    assert tuple(plan.steps) == tuple(planner.plan_batch(stream._batch(s), ctx) for s in range(len(stream)))
    if rollback != "none":  # "none" overflows the cap by design (Skrull's Table 3 ablation)
        plan.validate()
