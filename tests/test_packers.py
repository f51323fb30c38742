"""Packers: every item exactly once, no bin over capacity, bin counts near the optimum; partitioners cover."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from longpack.planners.packers import PACKERS, isf, karmarkar_karp, lpt

items = st.lists(st.integers(min_value=1, max_value=100), min_size=0, max_size=60)


@pytest.mark.parametrize("name", sorted(PACKERS))
@settings(max_examples=60, deadline=None)
@given(weights=items, capacity=st.integers(min_value=100, max_value=300))
def test_packers_cover_once_and_respect_capacity(name, weights, capacity):
    bins = PACKERS[name](weights, capacity)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(weights)))
    assert all(b and sum(weights[i] for i in b) <= capacity for b in bins)


@settings(max_examples=60, deadline=None)
@given(weights=items, capacity=st.integers(min_value=100, max_value=300))
@example(weights=[38, 72, 72, 72, 72], capacity=109)
def test_decreasing_packers_are_near_optimal(weights, capacity):
    # OPT >= the volume bound and >= the items over half a bin (no two share one): FFD/BFD <= 11/9 OPT + 6/9.
    # The volume bound alone is no bound on OPT ([38, 72, 72, 72, 72] in bins of 109 needs 5, not 3).
    lower = max(math.ceil(sum(weights) / capacity), sum(1 for w in weights if 2 * w > capacity))
    for name in ("ffd", "bfd", "spfhp"):
        assert len(PACKERS[name](weights, capacity)) <= 11 / 9 * lower + 1


def test_isf_accepts_full_bins_first_and_is_seeded():
    w = [60, 40, 70, 30, 50, 50, 90, 10] * 4
    a, b = isf(w, 100, threshold=100, seed=3), isf(w, 100, threshold=100, seed=3)
    assert a == b
    assert sum(1 for x in a if sum(w[i] for i in x) == 100) >= 12  # 16 perfect pairs exist; ISF finds most


def test_item_over_capacity_is_refused_not_dropped():
    for fn in PACKERS.values():
        with pytest.raises(ValueError, match="item 1 weighs 11"):
            fn([3, 11], 10)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(min_value=0, max_value=1e3), max_size=40), k=st.integers(min_value=1, max_value=6))
def test_partitions_cover_and_kk_no_worse_than_twice_lpt(costs, k):
    for fn in (lpt, karmarkar_karp):
        groups = fn(costs, k)
        assert len(groups) == k and sorted(i for g in groups for i in g) == list(range(len(costs)))
    span = lambda gs: max(sum(costs[i] for i in g) for g in gs)  # noqa: E731
    assert span(karmarkar_karp(costs, k)) <= 2 * span(lpt(costs, k)) + 1e-9


def test_kk_balances_many_items_better_than_lpt():
    costs = np.random.default_rng(0).lognormal(0, 1.5, 400)
    spread = lambda gs: np.ptp([costs[g].sum() for g in gs])  # noqa: E731
    assert spread(karmarkar_karp(costs, 8)) < spread(lpt(costs, 8))
