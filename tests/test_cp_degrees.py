"""Planners use the CP groups the user asked for: by default every step's CP degrees divide --cp (at --cp 1, none
above 1); unified and HBP go wider only with --opt widen=1; compare reports the degrees each planner used."""

import pytest

from longpack import jobs
from longpack.planners import PLANNERS, get_planner

get_planner("isf")  # registers the built-in planners
WORKLOADS = ("lmsys-chat-1m", "chatqa2-long-sft")


def _degrees(planner, workload, model, cp, dp, **options):
    spec = jobs.RunSpec(workload=workload, samples=512, model=model, hardware="h100", dp=dp, cp=cp,
                        global_batch=256, steps=2, options=options)
    lengths, max_len = jobs.load_workload(spec)
    plan, _ = jobs.run_plan(planner, lengths, spec, jobs.build_cost(spec), max_len, note=None)
    return {d for st in plan.steps for d in (st.degrees or (st.cp,))}


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "qwen2.5-7b"])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_no_planner_shards_at_cp_1_unless_asked(workload, model):
    for planner in sorted(PLANNERS):
        assert _degrees(planner, workload, model, cp=1, dp=8) == {1}, planner


def test_degrees_divide_cp_by_default():
    for planner in ("unified", "hbp", "skrull", "fixed_cp"):
        for workload in WORKLOADS:
            used = _degrees(planner, workload, "qwen2.5-7b", cp=4, dp=8)
            assert used and all(4 % d == 0 for d in used), (planner, workload, used)


def test_unified_and_hbp_go_wider_only_when_asked():
    # 0.5B lmsys at DP 8: one rank's share of the longest sample dominates a step, so a wider group pays
    assert _degrees("unified", "lmsys-chat-1m", "qwen2.5-0.5b", cp=1, dp=8) == {1}
    assert max(_degrees("unified", "lmsys-chat-1m", "qwen2.5-0.5b", cp=1, dp=8, widen=1)) > 1
    # HBP's longest packing group on 7B ChatQA2 needs SP to fit memory: without it that group is left out
    assert _degrees("hbp", "chatqa2-long-sft", "qwen2.5-7b", cp=1, dp=8) == {1}
    assert max(_degrees("hbp", "chatqa2-long-sft", "qwen2.5-7b", cp=1, dp=8, widen=1)) > 1


def test_compare_reports_each_planners_cp_degrees():
    spec = jobs.RunSpec(workload="lmsys-chat-1m", samples=512, model="qwen2.5-0.5b", hardware="h100", dp=4, cp=8,
                        global_batch=256, steps=1)
    res = jobs.compare(spec, ["unified", "fixed_cp"], "fixed_cp")
    assert res["planners"]["fixed_cp"]["cp_degrees"] == [8]
    assert set(res["planners"]["unified"]["cp_degrees"]) <= {1, 2, 4, 8}
