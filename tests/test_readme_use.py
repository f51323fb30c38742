"""Every command of the README's Use section, run as written, within the time its line states.

A line's comment states its time as ``<N s`` / ``<N min`` (a ceiling: it must finish within it) or, for the long
ones, ``~N min; quick: FLAGS (<N s)``: those run with the quick flags appended, within the quick ceiling, and must
show progress (a line with the time left and how to make it quicker). The ceilings are a hang guard sized for this
2-core machine, several times what the commands take; speed itself is measured in bench/.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _use_commands() -> list[tuple[list[str], float, bool]]:
    """(argv, ceiling seconds, long) of each command in the README's Use section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    out = []
    for line in lines:
        if not line.strip():
            continue
        cmd, _, comment = line.partition("#")
        quick = re.search(r"quick: (.*?) \(<(\d+) (s|min)\)", comment)
        stated = quick or re.search(r"<(\d+) (s|min)", comment)
        assert stated, f"README Use line states no time: {line}"
        argv = shlex.split(cmd)
        if quick:
            argv += shlex.split(quick.group(1))
        n, unit = (quick.group(2), quick.group(3)) if quick else (stated.group(1), stated.group(2))
        out.append((argv, float(n) * (60 if unit == "min" else 1), quick is not None))
    return out


COMMANDS = _use_commands()


def test_readme_use_section_lists_every_command():
    names = [" ".join(a[:3]) for a, _, _ in COMMANDS]
    assert len(COMMANDS) >= 10
    for want in ("longpack stats", "longpack compare", "longpack plan", "longpack simulate", "longpack report",
                 "longpack reproduce skrull", "longpack reproduce hbp", "longpack reproduce all"):
        assert any(n.startswith(want) for n in names), want


@pytest.mark.parametrize("argv,ceiling,long", COMMANDS, ids=[" ".join(a[1:3]) for a, _, _ in COMMANDS])
def test_readme_use_command_runs_as_written_within_its_stated_time(argv, ceiling, long, tmp_path):
    assert argv[0] == "longpack"
    env = dict(os.environ, LONGPACK_PROGRESS="always" if long else "")
    if argv[1] == "simulate":  # the README's plan line writes the plan it reads
        plan = next(a for a, _, _ in COMMANDS if a[1] == "plan")
        subprocess.run([sys.executable, "-m", "longpack.cli", *plan[1:]], cwd=tmp_path, env=env, check=True,
                       capture_output=True, timeout=120)
    proc = subprocess.run([sys.executable, "-m", "longpack.cli", *argv[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=ceiling)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() or "wrote" in proc.stderr or "wrote" in proc.stdout
    if long:
        progress = [ln for ln in proc.stderr.splitlines() if "left" in ln and "quicker" in ln]
        assert progress, proc.stderr[-2000:]
