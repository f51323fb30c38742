"""Progress of long jobs: counted from the core's own loops, shown after a delay, with the time left and a hint."""

from __future__ import annotations

import io

from longpack import jobs
from longpack.progress import duration, meter, tick


def test_meter_counts_plan_and_simulation_steps_of_compare():
    spec = jobs.RunSpec(workload="tiny-longtail", model="tiny", hardware="cpu", global_batch=8, steps=5)
    out = io.StringIO()
    with meter("outer", 2 * 5 * 2, ("planned", "simulated"), "steps", after=0.0, every=0.0, stream=out) as m:
        jobs.compare(spec, ["isf", "sorted"], "isf", note=None)
    # compare's own meter is the inner one while it runs; the outer counts the same ticks
    assert m.done == m.total == 20


def test_meter_is_silent_before_its_delay_and_then_says_time_left_and_hint():
    quiet, loud = io.StringIO(), io.StringIO()
    with meter("job", 4, ("run",), "runs", "quicker: --steps 1", after=3600.0, stream=quiet):
        for _ in range(4):
            tick("run")
    assert quiet.getvalue() == ""
    with meter("job", 4, ("run",), "runs", "quicker: --steps 1", after=0.0, every=0.0, stream=loud):
        for _ in range(4):
            tick("run")
            tick("planned")  # a unit this meter does not count
    lines = loud.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("longpack: job: 4/4 runs, ")
    assert all("left (quicker: --steps 1)" in ln for ln in lines)


def test_a_job_whose_first_unit_is_slow_says_it_is_running_once_its_delay_has_passed():
    import time

    out = io.StringIO()
    with meter("job", 4, ("run",), "runs", "quicker: --steps 1", after=0.2, every=60.0, stream=out):
        time.sleep(0.6)  # the first run is still going
        assert out.getvalue().startswith("longpack: job: 0/4 runs, 0 s (quicker: --steps 1)"), out.getvalue()
        tick("run")
    assert len(out.getvalue().splitlines()) == 1  # the next line waits for `every`


def test_the_first_line_comes_once_the_delay_has_passed_even_when_a_unit_ended_before_it():
    import time

    out = io.StringIO()
    with meter("job", 4, ("run",), "runs", after=0.2, every=60.0, stream=out):
        tick("run")  # a quick first unit, before the delay: nothing shown yet
        assert out.getvalue() == ""
        time.sleep(0.6)  # the second is slow: the line does not wait for it
        assert out.getvalue().startswith("longpack: job: 1/4 runs, 0 s, about "), out.getvalue()
    with meter("outer", 2, ("run",), "runs", after=0.2, every=60.0, stream=out):
        out.truncate(0), out.seek(0)
        with meter("inner", 2, ("step",), "steps", after=0.2, every=60.0, stream=out):
            time.sleep(0.6)  # only the innermost meter speaks
    assert out.getvalue().splitlines() == ["longpack: inner: 0/2 steps, 0 s"], out.getvalue()


def test_time_left_weighs_units_by_their_cost():
    import time

    with meter("job", 2, ("cheap", "dear"), "parts", stream=io.StringIO(), weights={"cheap": 1.0, "dear": 9.0},
               work=10.0) as m:
        tick("cheap")
        m.start = time.perf_counter() - 2.0  # the cheap part took 2 s: the dear one, 9 times the work, 18 s
        assert 17.5 < m.eta() < 18.5
    with meter("job", 2, ("cheap", "dear"), "parts", stream=io.StringIO()) as m:  # by count: 2 s for the other
        tick("cheap")
        m.start = time.perf_counter() - 2.0
        assert 1.5 < m.eta() < 2.5


def test_tick_without_a_meter_is_a_no_op_and_durations_read_well():
    tick("planned")
    assert duration(12.4) == "12 s" and duration(75) == "1 min 15 s" and duration(3 * 3600 + 120) == "3 h 02 min"


def test_reproduce_skrull_counts_the_runs_it_announces():
    from longpack.reproduce import skrull

    out = io.StringIO()
    for sweeps in (False, True):
        with meter("outer", skrull.runs(sweeps), ("run", "skrull", "sweep"), "runs", stream=out) as m:
            skrull.reproduce(steps=1, samples=600, sweeps=sweeps)
        assert m.done == skrull.runs(sweeps)
