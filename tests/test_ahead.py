"""Planning ahead (planners/stream.py, runtime/run/ahead.py): the streamed plan is the whole plan, step by step; the
planner thread stays a bounded number of steps ahead; a step that fails is raised at that step; training with and
without planning ahead runs the same steps."""

import json
import time

import numpy as np
import pool  # tests/pool.py: warm worker processes
import pytest

from longpack import jobs
from longpack.runtime.run.ahead import PlanAhead

PLANNERS = ["isf", "fixed_cp", "skrull", "chunkflow", "unified", "hbp"]


def _stream(planner, *, steps=6, validate=True):
    spec = jobs.RunSpec(workload="lmsys-chat-1m", samples=400, model="qwen2.5-0.5b", hardware="h100", dp=2, cp=2,
                        global_batch=64, steps=steps, seed=3)
    lengths, max_len = jobs.load_workload(spec)
    cost = jobs.build_cost(spec)
    return spec, (lengths, max_len), cost, jobs.plan_stream(planner, lengths, spec, cost, max_len, note=None)


@pytest.mark.parametrize("planner", PLANNERS)
def test_stream_makes_the_whole_plan_step_by_step(planner):
    spec, (lengths, max_len), cost, stream = _stream(planner)
    whole, _ = jobs.run_plan(planner, lengths, spec, cost, max_len, note=None)
    assert len(stream) == len(whole.steps) > 1
    for s in range(len(stream)):
        assert stream.next_step() == whole.steps[s]
    assert stream.plan.lengths == whole.lengths and stream.plan.meta == whole.meta
    with pytest.raises(IndexError):
        stream.next_step()


def _until(cond, seconds=20.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_planner_thread_stays_depth_steps_ahead():
    *_, stream = _stream("isf", steps=None)
    assert len(stream) > 6
    ahead = PlanAhead(stream, depth=2)
    assert ahead.wait(0) >= 0
    # one step taken; two wait in the queue and the thread holds one more it cannot hand over
    assert _until(lambda: stream.made == 4)
    time.sleep(0.3)
    assert stream.made == 4 and len(stream.plan.steps) == 4
    assert ahead.wait(1) == 0.0  # planned already
    assert _until(lambda: stream.made == 5)
    for s in range(len(stream)):
        ahead.wait(s)
    assert stream.made == len(stream) and ahead.planning_seconds > 0
    ahead.close()


def test_depth_zero_plans_the_whole_run_up_front():
    *_, stream = _stream("skrull")
    ahead = PlanAhead(stream, depth=0)
    assert stream.made == len(stream) and all(ahead.wait(s) == 0.0 for s in range(len(stream)))


def test_a_failing_step_is_raised_at_that_step_naming_it():
    def check(plan, s):
        if s == 2:
            raise ValueError("replica 0: this step cannot run")

    *_, stream = _stream("isf")
    ahead = PlanAhead(stream, depth=3, check=check)
    ahead.wait(0), ahead.wait(1)
    for s in (2, 3):
        with pytest.raises(ValueError, match=r"^step 2: replica 0: this step cannot run$"):
            ahead.wait(s)
    with pytest.raises(IndexError):
        ahead.wait(len(stream))


def test_a_streamed_step_is_validated_as_it_is_planned():
    *_, stream = _stream("isf")
    stream.next_step()
    broken = stream.plan.steps[0]
    from dataclasses import replace

    from longpack.plan import PlanError

    stream.plan.steps[0] = replace(broken, replicas=broken.replicas[:1])
    with pytest.raises(PlanError, match=r"step 0: 1 replicas, expected world // cp = 2"):
        stream.plan.validate_steps([0], np.zeros(0, dtype=np.int64).tolist())


def _train(*extra):
    proc = pool.cli(["train", "--workload", "tiny-longtail", "--model", "tiny", "--samples", "400",
                     "--global-batch", "12", "--planner",
                     "unified", "--steps", "4", "--json", "--dtype", "float64", *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return [x for x in lines if "step" in x], next(x["summary"] for x in lines if "summary" in x)


def test_training_planned_ahead_runs_the_steps_planned_up_front():
    ahead, summary = _train()
    upfront, summary0 = _train("--plan-ahead", "0")
    assert [s["loss"] for s in ahead] == [s["loss"] for s in upfront]
    assert [s["targets"] for s in ahead] == [s["targets"] for s in upfront]
    # up front, step 0 waits for the whole plan and no later step waits; planned ahead, every wait is logged
    assert upfront[0]["planner_wait_seconds"] > 0 and all(s["planner_wait_seconds"] == 0 for s in upfront[1:])
    assert all(s["planner_wait_seconds"] >= 0 for s in ahead)
    assert summary["planner_wait_seconds"] == pytest.approx(sum(s["planner_wait_seconds"] for s in ahead))
    assert summary["chained_samples"] == summary0["chained_samples"] and summary["planning_seconds"] > 0
