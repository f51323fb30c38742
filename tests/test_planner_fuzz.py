"""The planners under a seeded random sweep (tests/fuzz_planners.py): every call plans or refuses by name."""

from fuzz_planners import sweep


def test_planner_fuzz_raises_only_the_projects_refusals():
    calls, outcomes, bad = sweep(seconds=6.0, seed=1)
    assert calls > 50 and outcomes["ok"] > 0 and outcomes["refused"] > 0
    assert not bad, bad[0]
