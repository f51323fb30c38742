"""Render `longpack report` in headless Chromium and keep the screenshot (docs/report-example.png).

    python bench/report_render.py [--write]

Needs Debian's chromium (apt-get install chromium); prints what it did and exits non-zero if the page does not
render to a non-empty image.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "report.html"
        subprocess.run([sys.executable, "-m", "longpack.cli", "report", "--workload", "lmsys-chat-1m", "--model",
                        "qwen2.5-7b", "--dp", "4", "--cp", "8", "--out", str(page)], check=True)
        shot = Path(tmp) / "report.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp}/profile", "--window-size=1200,3000", f"--screenshot={shot}",
                        page.as_uri()], check=True, capture_output=True, timeout=120)
        size = shot.stat().st_size if shot.exists() else 0
        print(f"rendered {page.stat().st_size} bytes of HTML to a {size}-byte screenshot")
        if size < 10_000:
            sys.exit("the page did not render")
        if args.write:
            shutil.copy(shot, DOCS / "report-example.png")
            from _report import write_section

            write_section("report", "Report page (rendered in headless Chromium)", "python bench/report_render.py "
                          "--write", "`longpack report --workload lmsys-chat-1m --model qwen2.5-7b --dp 4 --cp 8`, "
                          "screenshot: [report-example.png](report-example.png) (load bars, step Gantt chart, "
                          "memory per rank, length histogram with the packing length marked).")


if __name__ == "__main__":
    main()
