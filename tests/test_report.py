"""`longpack report` writes one self-contained HTML page; the test opens it and checks its parts."""

import re
from html.parser import HTMLParser

import forked


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.rows, self.external = [], 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a.get("src", ""))
        if tag == "tr":
            self.rows += 1
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http:", "https:", "//")):
                self.external.append(a[key])


def test_report_page_for_the_issue_setup(tmp_path):
    out = tmp_path / "report.html"
    proc = forked.run(["report", "--workload", "lmsys-chat-1m", "--model", "qwen2.5-7b", "--dp", "4", "--cp", "8",
                       "--steps", "2", "--samples", "20000", "--out", str(out)], timeout=300)  # tests/forked.py
    assert proc.returncode == 0, proc.stderr
    page = _Collect()
    page.feed(out.read_text())
    # histogram + (load bars, Gantt, memory) for each of the 4 default planners, all embedded PNGs
    assert len(page.images) == 1 + 4 * 3
    assert all(src.startswith("data:image/png;base64,") and len(src) > 1000 for src in page.images)
    assert page.rows == 1 + 4 and not page.external
    text = out.read_text()
    assert re.search(r"<td>skrull</td>", text) and re.search(r"<td>unified</td>", text)
    assert text.count("Gantt chart: all 32 ranks") == 4  # every rank drawn, for every planner


def test_report_gantt_beyond_its_row_limit_draws_the_replicas_that_finish_last():
    import numpy as np

    from longpack import jobs
    from longpack.report.html import gantt

    spec = jobs.RunSpec(workload="lmsys-chat-1m", samples=5000, model="qwen2.5-7b", dp=4, cp=8, steps=2)
    comparison = jobs.compare_plans(spec, ["fixed_cp"], "fixed_cp", note=None)
    plan, report = comparison.plans["fixed_cp"]
    step = max(report.steps, key=lambda s: s.time_s)
    _, caption = gantt(plan, comparison.cost, step.step, max_ranks=16)
    # the two slowest replicas (8 ranks each) by the simulator's own replica times, named in the caption
    slowest = sorted(np.argsort(step.replica_s)[-2:].tolist())
    assert caption.startswith("the 16 ranks of the replicas that finish last, of 32: ")
    assert caption.endswith(", ".join(f"{8 * r}-{8 * r + 7}" for r in slowest))


def test_calibrate_fits_and_saves_a_loadable_hardware_spec(tmp_path):
    import pytest

    pytest.importorskip("torch")
    from longpack.hardware import load_hardware
    from longpack.model import get_model
    from longpack.runtime.run.calibrate import calibrate

    grid = [(16, 2), (32, 4), (64, 1), (128, 1), (16, 8), (64, 4)]
    hw, rep = calibrate(get_model("tiny"), repeats=1, threads=1, grid=grid)
    assert hw.peak_flops > 0 and 0 < hw.mfu_attn <= 1 and hw.layer_overhead_s >= 0
    assert len(rep["points"]) == len(grid) and rep["rms_relative_error"] >= 0
    path = tmp_path / "hw.json"
    path.write_text(hw.to_json())
    assert load_hardware(str(path)) == hw
