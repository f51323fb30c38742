"""Memory of processes, read from /proc (Linux): what the memory benchmarks sample."""

from __future__ import annotations

from pathlib import Path


def pss(pid: int) -> int:
    """Bytes of ``pid``'s proportional set size (shared pages split between the processes that map them); 0 once
    it has gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
