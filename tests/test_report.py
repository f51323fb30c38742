"""`longpack report` writes one self-contained HTML page; the test opens it and checks its parts."""

import re
import subprocess
import sys
from html.parser import HTMLParser


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
    proc = subprocess.run([sys.executable, "-m", "longpack.cli", "report", "--workload", "lmsys-chat-1m", "--model",
                           "qwen2.5-7b", "--dp", "4", "--cp", "8", "--steps", "2", "--samples", "20000", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    page = _Collect()
    page.feed(out.read_text())
    # histogram + (load bars, Gantt, memory) for each of the 3 default planners, all embedded PNGs
    assert len(page.images) == 1 + 3 * 3
    assert all(src.startswith("data:image/png;base64,") and len(src) > 1000 for src in page.images)
    assert page.rows == 1 + 3 and not page.external
    assert re.search(r"<td>skrull</td>", out.read_text())


def test_calibrate_fits_and_saves_a_loadable_hardware_spec(tmp_path):
    import pytest

    pytest.importorskip("torch")
    from longpack.hardware import load_hardware
    from longpack.model import get_model
    from longpack.runtime.calibrate import calibrate

    grid = [(16, 2), (32, 4), (64, 1), (128, 1), (16, 8), (64, 4)]
    hw, rep = calibrate(get_model("tiny"), repeats=1, threads=1, grid=grid)
    assert hw.peak_flops > 0 and 0 < hw.mfu_attn <= 1 and hw.layer_overhead_s >= 0
    assert len(rep["points"]) == len(grid) and rep["rms_relative_error"] >= 0
    path = tmp_path / "hw.json"
    path.write_text(hw.to_json())
    assert load_hardware(str(path)) == hw
