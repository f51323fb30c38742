"""A run's start-up, phase by phase: where the seconds before (and of) the first step go.

Phases, in order: ``imports`` (the process's start — or its fork from the launcher — to the run's first line of
work), ``process_group``, ``data`` (rows read or mapped, runtime/run/run_plan.load_source), ``plan`` (the plan's
header and the planner thread started), ``model`` (built or loaded, weights in place), ``sharding`` (FSDP2),
``first_step`` (step 0 itself, its wait on the planner included). :class:`Phases` adds each interval to the phase
named when it ends; its record goes to ``--json`` as ``{"startup": {...}}`` after step 0 (runtime/run/step_log.emit).
"""

from __future__ import annotations

import os
import time

__all__ = ["Phases", "since_process_start"]

_IMPORTED = time.perf_counter()  # when the runtime was imported: the fallback start where /proc is not there


def since_process_start() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere since the runtime was
    imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


class Phases:
    """Seconds per phase: :meth:`mark` ends the interval since the last mark, adding it to ``phase``."""

    ORDER = ("imports", "process_group", "data", "plan", "model", "sharding", "first_step")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"imports": since_process_start()}
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._t
        self._t = now

    def record(self) -> dict[str, float]:
        out = {p: round(self.seconds[p], 3) for p in self.ORDER if p in self.seconds}
        return {**out, "total": round(sum(self.seconds.values()), 3)}

    @staticmethod
    def line(record: dict[str, float]) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in record.items() if k != "total")
        return f"started in {record['total']:.1f} s ({parts})"
