"""A plan made for its first steps only (runtime/run/run_plan.build_plan, ``steps``; the dry run plays only those):
the same steps as the whole plan's, and no others planned."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def test_build_plan_first_steps_equal_the_whole_plans():
    from dataclasses import replace

    from longpack.runtime.run.run_plan import build_plan
    from longpack.runtime.run.train_args import TrainArgs

    base = TrainArgs.of(planner="unified")
    args = replace(base, run=replace(base.run, cp=2, steps=6))
    whole, _ = build_plan(args, 4, note=None)
    first, _ = build_plan(args, 4, note=None, steps=2)
    assert len(whole.steps) == 6 and len(first.steps) == 2
    assert first.steps == tuple(whole.steps[:2])
    assert first.lengths == whole.lengths and first.dropped == whole.dropped
    assert len(build_plan(args, 4, note=None, steps=50)[0].steps) == 6  # more than the run has: the run's
