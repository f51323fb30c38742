"""Steps whose replicas are CP groups of several sizes (Step.degrees): validation, JSON, simulation at each
group's degree, the lower bound of such layouts against random ones, where a rank sits in such a step, and unified's
``mixed_groups`` option. Runtime parity: tests/test_context_parallel.py."""

import numpy as np
import pytest
from helpers import make_cost, random_layout

from longpack.plan import MicroBatch, Piece, Plan, PlanError, Replica, Step
from longpack.planners.unified.groups import MIN_GAIN
from longpack.runtime.kernel.data import PlanSampler
from longpack.sim import simulate
from longpack.sim.bounds import mixed_step_bound


def _step(groups, degrees, cap=100):
    return Step(cp=max(degrees), token_cap=cap, degrees=tuple(degrees),
                replicas=tuple(Replica(tuple(MicroBatch(tuple(Piece(*p) for p in mb)) for mb in g)) for g in groups))


# world 4: a group of 2 (sample 0 sharded, sample 1 on its rank 1) and two groups of 1
MIXED = Plan("t", 4, {0: 40, 1: 30, 2: 50, 3: 20}, (
    _step([[[(0, 0, 40, None), (1, 0, 30, 1)]], [[(2, 0, 50, 0)]], [[(3, 0, 20, None)]]], (2, 1, 1)),))


def test_mixed_step_validates_and_round_trips_and_uniform_json_is_unchanged():
    MIXED.validate()
    text = MIXED.to_json()
    assert '"degrees":[2,1,1]' in text
    assert Plan.from_json(text) == MIXED
    uniform = Plan("t", 2, {0: 10}, (Step(cp=2, token_cap=10, replicas=(Replica((MicroBatch((Piece(0, 0, 10),)),)),)),))
    uniform.validate()
    assert "degrees" not in uniform.to_json()
    assert not uniform.steps[0].mixed and MIXED.steps[0].mixed


@pytest.mark.parametrize("degrees,cp,message", [
    ((2, 1, 2), 2, "sum to 5, not world=4"),
    ((3, 1, 1), 3, "degree 3 does not divide world=4"),
    ((2, 1, 1), 1, "largest of degrees [2, 1, 1] is 2"),
    ((2, 2), 2, "2 degrees for 3 replicas"),
])
def test_mixed_step_shape_is_checked(degrees, cp, message):
    bad = Step(cp=cp, token_cap=100, degrees=degrees, replicas=MIXED.steps[0].replicas)
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Plan("t", 4, MIXED.lengths, (bad,)).validate()


def test_mixed_step_checks_ranks_and_capacity_at_each_groups_degree():
    # cp_rank 1 is fine in the group of 2 and out of range in a group of 1
    bad = _step([[[(0, 0, 40, None), (1, 0, 30, 1)]], [[(2, 0, 50, 1)]], [[(3, 0, 20, None)]]], (2, 1, 1))
    with pytest.raises(PlanError, match=r"replica 1, micro-batch 0: sample 2 cp_rank=1 not in \[0, 1\)"):
        Plan("t", 4, MIXED.lengths, (bad,)).validate()
    # a sharded piece counts whole in a group of 1: 60 tokens > cap 50 there, 30 per rank in the group of 2
    over = _step([[[(0, 0, 60, None)]], [[(1, 0, 30, 0)]], [[(2, 0, 60, None)]]], (2, 1, 1), cap=50)
    with pytest.raises(PlanError, match="replica 2, micro-batch 0: CP rank 0 holds 60 tokens > token cap 50"):
        Plan("t", 4, {0: 60, 1: 30, 2: 60}, (over,)).validate()


def test_mixed_step_times_each_replica_at_its_groups_degree():
    """A step on groups 4 + 2 + 2 (world 8): each replica takes what it takes in a step of its own degree."""
    cost = make_cost("qwen2.5-0.5b", "h100", dp=1, cp=8)
    cap = int(cost.token_cap())
    wide = [[(0, 0, 20000, None), (1, 0, 3000, 2)], [(2, 0, 9000, None)]]
    narrow_a = [[(3, 0, 8000, None), (4, 0, 2000, 1)], []]
    narrow_b = [[(5, 0, 7000, 0)], [(6, 0, 6000, None)]]
    lengths = {0: 20000, 1: 3000, 2: 9000, 3: 8000, 4: 2000, 5: 7000, 6: 6000}
    mixed = Plan("t", 8, lengths, (_step([wide, narrow_a, narrow_b], (4, 2, 2), cap),))
    mixed.validate()
    rep = simulate(mixed, cost).steps[0]
    empty = [[], []]
    at4 = Plan("t", 8, lengths, (_step([wide, empty], (4, 4), cap),))
    at2 = Plan("t", 8, lengths, (_step([narrow_a, narrow_b, empty, empty], (2, 2, 2, 2), cap),))
    at4_rep = simulate(at4, cost, bounds=False).steps[0]
    at2_rep = simulate(at2, cost, bounds=False).steps[0]
    assert rep.replica_s == pytest.approx((at4_rep.replica_s[0], *at2_rep.replica_s[:2]), rel=1e-12)
    assert rep.time_s == pytest.approx(max(rep.replica_s) + rep.allreduce_s, rel=1e-12)
    assert len(rep.peak_mem_bytes) == 8 and rep.cp == 4
    assert 0 < rep.lower_bound_s <= rep.time_s


def _partition(rng: np.random.Generator, world: int) -> list[int]:
    sizes = [d for d in range(1, world + 1) if world % d == 0]
    out: list[int] = []
    while sum(out) < world:
        out.append(int(rng.choice([d for d in sizes if d <= world - sum(out)])))
    return sorted(out, reverse=True)


def _random_mixed_plan(rng: np.random.Generator, world: int, cap: int) -> Plan:
    """A random layout on random groups (helpers.random_layout, as tests/test_bounds.py does for one degree)."""
    return random_layout(rng, _partition(rng, world), cap)


@pytest.mark.parametrize("model,layout", [("qwen2.5-0.5b", (1, 8)), ("qwen2.5-7b", (2, 8)), ("qwen2.5-7b", (1, 4))])
def test_mixed_bound_holds_for_random_layouts_on_groups_of_several_sizes(model, layout):
    dp, cp = layout
    cost = make_cost(model, "h100", dp=dp, cp=cp, token_cap=8000)
    rng = np.random.default_rng(dp * 10 + cp)
    checked = closest = 0.0
    for _ in range(250):
        plan = _random_mixed_plan(rng, dp * cp, 8000)
        try:
            plan.validate()
        except PlanError:
            continue
        rep = simulate(plan, cost).steps[0]  # over memory: the bound that ignores memory
        assert rep.lower_bound_s <= rep.time_s * (1 + 1e-12), plan.to_json()
        checked += 1
        closest = max(closest, rep.lower_bound_s / rep.time_s)
    assert checked >= 25 and closest > 0.5  # held, and not by being far below every layout


def test_mixed_bound_is_no_higher_than_a_uniform_plans_time():
    """The bound of several sizes covers layouts of one degree too: below every planner's plan."""
    from longpack import jobs

    spec = jobs.RunSpec(workload="chunkflow-eval", samples=2000, model="qwen2.5-0.5b", dp=2, cp=8, global_batch=64,
                        steps=3, seed=0)
    lengths, max_len = jobs.load_workload(spec)
    cost = jobs.build_cost(spec)
    for planner in ("unified", "skrull", "fixed_cp"):
        plan, _ = jobs.run_plan(planner, lengths, spec, cost, max_len)
        report = simulate(plan, cost, bounds=False)
        for step, rep in zip(plan.steps, report.steps, strict=True):
            s = [plan.effective_length(p.sample) for r in step.replicas for mb in r.micro_batches for p in mb.pieces
                 if p.start == 0]
            bound = mixed_step_bound(np.asarray(s, dtype=np.float64), cost, degrees=[1, 2, 4, 8, 16])
            assert 0 < bound <= rep.time_s, (planner, rep.step)


def test_a_rank_finds_its_group_in_a_step_of_several_sizes():
    step = Step(cp=4, token_cap=10, degrees=(2, 4, 1, 1), replicas=(Replica(),) * 4)
    assert step.spans() == [(0, 2), (2, 4), (6, 1), (7, 1)]
    assert [step.position(r) for r in range(8)] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (3, 0)]
    uniform = Step(cp=4, token_cap=10, replicas=(Replica(),) * 2)
    assert [uniform.position(r) for r in (0, 5, 7)] == [(0, 0), (1, 1), (1, 3)]
    sampler = PlanSampler(MIXED, 3)
    assert sampler.position(0) == (2, 0) and sampler.micro_batches(0) == MIXED.steps[0].replicas[2].micro_batches


def test_unified_mixed_groups_option_regroups_steps_only_where_faster():
    """``--opt mixed_groups`` (on by default): the plan of ``mixed_groups=0``, except steps the simulator says run
    at least ``groups.MIN_GAIN`` faster on groups of several sizes (0.5B chunkflow-eval at DP2·CP8: the fourth step,
    8 -> 8 + 4 + 4, 3.9% faster); with ``--opt degrees``, only groups of those sizes."""
    from longpack import jobs

    def run(**options):
        spec = jobs.RunSpec(workload="chunkflow-eval", samples=2000, model="qwen2.5-0.5b", dp=2, cp=8,
                            global_batch=32, steps=4, seed=0, options=tuple(options.items()))
        lengths, max_len = jobs.load_workload(spec)
        cost = jobs.build_cost(spec)
        plan, _ = jobs.run_plan("unified", lengths, spec, cost, max_len)
        return plan, simulate(plan, cost)

    plain, plain_rep = run(mixed_groups="0")
    on, _ = run(mixed_groups="1")
    mixed, mixed_rep = run()
    assert on.steps == mixed.steps and not any(s.degrees for s in plain.steps)
    regrouped = [i for i, s in enumerate(mixed.steps) if s.mixed]
    assert regrouped, "no step regrouped"
    for i, (a, b) in enumerate(zip(plain_rep.steps, mixed_rep.steps, strict=True)):
        if i in regrouped:
            # faster by the margin, and held to the bound of such layouts: 0.998 of its time there
            assert b.time_s <= (1 - MIN_GAIN) * a.time_s and 0.9 * b.time_s <= b.lower_bound_s <= b.time_s
        else:
            assert mixed.steps[i] == plain.steps[i]
    narrow, _ = run(degrees="8,4")
    assert any(s.mixed for s in narrow.steps) and all(set(s.degrees) <= {8, 4} for s in narrow.steps)
    one, _ = run(degrees="8")
    assert not any(s.mixed for s in one.steps)


def test_regroup_skips_the_search_only_where_no_layout_would_have_paid():
    """On lmsys batches at DP4·CP8 the bound of layouts on several sizes leaves no room for ``MIN_GAIN``: regroup
    returns the step without searching, and the search it skips finds no layout that would have been kept."""
    from longpack.planners import PlanContext, get_planner, global_batches
    from longpack.planners.unified.groups import layout_on_groups, regroup, shapes
    from longpack.sim.simulate import simulate_step
    from longpack.workloads import generate

    cost = make_cost(dp=4, cp=8, token_cap=26 * 1024)
    x = generate("lmsys-chat-1m", 20000, seed=0)
    skipped = 0
    for batch in global_batches(len(x), 256, seed=0, steps=3):
        plan = get_planner("unified").plan(x, [batch], PlanContext(cost=cost, options={"mixed_groups": "0"}))
        step, lengths = plan.steps[0], {int(i): int(x[i]) for i in batch}
        if all(p.cp_rank is not None for _, _, _, p in plan.iter_pieces()):
            continue
        if regroup(step, lengths, cost) is not step:
            continue
        base = simulate_step(0, step, plan, cost, bound=False).time_s
        bound = mixed_step_bound(x[batch].astype(np.float64), cost, [1, 2, 4, 8, 16, 32], split=False)
        if bound < (1 - MIN_GAIN) * base:
            continue  # searched, and nothing kept
        skipped += 1
        for degrees in shapes(32):
            laid = layout_on_groups(step, lengths, cost, degrees)
            if laid is not None:
                assert simulate_step(0, laid, plan, cost, bound=False).time_s > (1 - MIN_GAIN) * base
    assert skipped, "no lmsys step shards a sample and stays"
