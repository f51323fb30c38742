"""compare says what a speedup rests on: every planner's share of empty micro-batch slots, and a speedup against a
baseline that runs out of memory is marked in the JSON (speedup_valid) and the table."""

import io

from rich.console import Console

from longpack import jobs
from longpack.report.tables import compare_table


def _result():
    spec = jobs.RunSpec(workload="tiny-longtail", model="tiny", hardware="cpu", dp=8, global_batch=32, steps=2)
    return jobs.compare(spec, ["bfd", "unified"], "bfd")


def test_empty_slots_and_valid_speedups():
    r = _result()
    assert r["baseline_oom_steps"] == 0 and all(p["speedup_valid"] for p in r["planners"].values())
    # 32 short samples over 8 replicas: bfd fills a few packs and leaves most replicas' slots empty; unified not
    assert r["planners"]["bfd"]["empty_slots"] > 0.5 > r["planners"]["unified"]["empty_slots"]


def _table(result):
    out = io.StringIO()
    compare_table(result, Console(file=out, width=250))
    return out.getvalue()


def test_speedups_against_an_out_of_memory_baseline_are_marked():
    r = _result()
    assert "(OOM base)" not in _table(r)
    r["baseline_oom_steps"] = r["planners"]["bfd"]["oom_steps"] = 2
    text = _table(r)
    assert "(OOM base)" in text and "runs out of memory on 2 of" in text
