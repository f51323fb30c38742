"""Property tests over random workloads: every baseline's plan keeps the Plan invariants, deterministically."""

import numpy as np
import pytest
from helpers import make_cost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longpack.model import UnknownNameError
from longpack.planners import PLANNERS, PlanContext, get_planner, global_batches
from longpack.planners.base import OverlongError

BASELINES = ["random_padded", "sorted", "isf", "ffd", "bfd", "spfhp", "fixed_cp", "one_seq"]

workloads = st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=80)
layouts = st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (3, 1)])


@pytest.mark.parametrize("name", BASELINES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=workloads, layout=layouts, gb=st.integers(min_value=1, max_value=40), cap=st.integers(200, 3000),
       seed=st.integers(0, 3), policy=st.sampled_from(["split", "truncate", "drop"]))
def test_baseline_plans_satisfy_invariants(name, lengths, layout, gb, cap, seed, policy):
    dp, cp = layout
    x = np.array(lengths, dtype=np.int64)
    ctx = PlanContext(cost=make_cost("tiny", "cpu", dp=dp, cp=cp, token_cap=cap), seed=seed)
    batches = global_batches(len(x), gb, seed=seed)
    plan = get_planner(name).plan(x, batches, ctx, overlong=policy)
    plan.validate()
    # same samples in every optimizer step, in every planner (a batch whose samples were all dropped is skipped)
    kept = [ids for ids in batches if set(ids.tolist()) - set(plan.dropped)]
    for step, ids in zip(plan.steps, kept, strict=True):
        scheduled = {p.sample for rep in step.replicas for m in rep.micro_batches for p in m.pieces}
        assert scheduled == {int(i) for i in ids} - set(plan.dropped)
    # every over-long sample is counted
    ov = plan.meta["overlong"]
    over = int((x > cap * cp).sum())
    assert ov["split"] + ov["truncated"] + ov["dropped"] == over
    # determinism: the same inputs give byte-identical JSON
    again = get_planner(name).plan(x, batches, ctx, overlong=policy)
    assert again.to_json() == plan.to_json()


def test_registry_has_all_baselines_and_refuses_unknown():
    assert set(BASELINES) <= set(PLANNERS)
    with pytest.raises(UnknownNameError, match="fixed_cp"):
        get_planner("magic")


def test_overlong_error_policy_names_the_sample():
    ctx = PlanContext(cost=make_cost("tiny", "cpu", dp=1, cp=2, token_cap=10))
    with pytest.raises(OverlongError, match="sample 1 has 21 tokens > limit 20"):
        get_planner("fixed_cp").plan(np.array([5, 21]), [np.array([0, 1])], ctx, overlong="error")


def test_split_chain_runs_in_order_on_one_replica():
    ctx = PlanContext(cost=make_cost("tiny", "cpu", dp=2, cp=1, token_cap=10))
    plan = get_planner("fixed_cp").plan(np.array([25, 3, 4]), [np.array([0, 1, 2])], ctx)
    plan.validate()
    pieces = [(r, m, p) for _, r, m, p in plan.iter_pieces() if p.sample == 0]
    assert [(p.start, p.stop) for *_, p in pieces] == [(0, 10), (10, 20), (20, 25)]
    assert len({r for r, _, _ in pieces}) == 1
    assert plan.meta["overlong"]["split"] == 1


def test_max_len_truncates_and_drops_are_recorded():
    ctx = PlanContext(cost=make_cost("tiny", "cpu", dp=1, cp=1, token_cap=1000))
    x = np.array([50, 300, 20])
    t = get_planner("isf").plan(x, [np.arange(3)], ctx, max_len=100, overlong="truncate")
    assert t.truncated == {1: 100} and t.total_tokens == 170
    d = get_planner("isf").plan(x, [np.arange(3)], ctx, max_len=100, overlong="drop")
    assert set(d.dropped) == {1} and d.total_tokens == 70


def test_packed_baselines_never_pad_and_padded_ones_do():
    ctx = PlanContext(cost=make_cost("tiny", "cpu", dp=2, cp=2, token_cap=2000))
    x = np.random.default_rng(0).integers(1, 1500, 200)
    batches = global_batches(len(x), 64)
    for name in ("isf", "ffd", "fixed_cp", "one_seq"):
        plan = get_planner(name).plan(x, batches, ctx)
        assert all(m.pad_to == 0 for s in plan.steps for r in s.replicas for m in r.micro_batches)
    for name in ("sorted", "random_padded"):
        plan = get_planner(name).plan(x, batches, ctx)
        assert any(m.pad_to for s in plan.steps for r in s.replicas for m in r.micro_batches)
