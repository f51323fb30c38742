"""Write a benchmark's figures into docs/BENCHMARKS.md, between markers, with machine, versions and date."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def machine() -> str:
    import numpy

    cpu = platform.processor() or platform.machine()
    return (f"{os.cpu_count()} CPU cores ({cpu}), Python {sys.version.split()[0]}, numpy {numpy.__version__}, "
            f"{platform.system()} {platform.release()}")


def versions() -> str:
    """torch's and transformers' versions, for a section whose figures depend on them."""
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def write_section(name: str, title: str, command: str, body: str) -> None:
    """Replace (or append) the section ``name`` of docs/BENCHMARKS.md."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    date = datetime.date.today().isoformat()
    section = (f"{start}\n## {title}\n\nCommand: `{command}`  \nMachine: {machine()}  \nDate: {date}\n\n"
               f"{body.strip()}\n{end}")
    header = "# Benchmarks\n\nEvery figure below was produced by the command shown.\n"
    text = DOC.read_text() if DOC.exists() else header
    if start in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    DOC.write_text(text)
