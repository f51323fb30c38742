"""Progress of long CLI jobs: a bar with an ETA on a terminal, a plain line now and then elsewhere.

Work deep in the core (a planner's loop over global batches, the simulator's loop over steps, a reproduction's
planner runs) calls :func:`tick` with a unit name; it costs one context-variable read when nobody listens. A CLI
command wraps its job in :func:`meter`, naming the units it counts and how many it expects, plus a hint on how to
make the job shorter. Nothing is shown for the first ``after`` seconds, so quick commands print nothing extra; then,
even before the first unit is done, stderr gets a rich progress bar (a terminal) or one line every ``every``
seconds (a pipe, a log file), each with the elapsed time and an estimate of the time left from the rate so far.
A job whose units differ in cost gives each unit a ``weight`` (its expected cost in any one scale): the time left is
then the rate so far per unit of weight times the weight still to come, not per count.
``LONGPACK_PROGRESS=always`` shows it from the start (``after`` 0, a line per ``every`` = 0 s),
``LONGPACK_PROGRESS=never`` not at all.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TextIO

__all__ = ["Meter", "meter", "tick", "duration"]


def duration(seconds: float) -> str:
    """``75.2`` -> ``'1 min 15 s'``; under a minute ``'12 s'``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


class Meter:
    """Counts ticks of any of ``units`` against ``total`` (shown as ``noun``) and shows progress (module
    docstring)."""

    def __init__(self, label: str, total: int, units: tuple[str, ...], noun: str, hint: str = "", *,
                 after: float = 2.0, every: float = 15.0, stream: TextIO | None = None,
                 weights: dict[str, float] | None = None, work: float | None = None) -> None:
        mode = os.environ.get("LONGPACK_PROGRESS", "")
        if mode == "always":
            after, every = 0.0, 0.0
        self.label, self.total, self.units, self.noun, self.hint = label, max(1, total), units, noun, hint
        self.after, self.every, self.off = after, every, mode == "never"
        self.stream = stream or sys.stderr
        self.done = 0
        self.weights, self.work, self.work_done = weights or {}, work, 0.0  # ``work``: the total weight expected
        self.start = time.perf_counter()
        self.last_line = -1e9
        self.paused = False
        self._bar: Any = None
        self._task: Any = None

    def eta(self) -> float | None:
        """Seconds left at the rate so far (None before the first tick)."""
        spent = time.perf_counter() - self.start
        if self.work is not None:
            return spent / self.work_done * max(0.0, self.work - self.work_done) if self.work_done else None
        if self.done == 0:
            return None
        return spent / self.done * max(0, self.total - self.done)

    def text(self) -> str:
        spent = time.perf_counter() - self.start
        left = self.eta()
        rest = "" if left is None else f", about {duration(left)} left"
        hint = f" ({self.hint})" if self.hint else ""
        return (f"longpack: {self.label}: {min(self.done, self.total)}/{self.total} {self.noun}, "
                f"{duration(spent)}{rest}{hint}")

    def tick(self, n: int = 1, show: bool = True, unit: str | None = None) -> None:
        self.done += n
        self.work_done += n * self.weights.get(unit, 1.0) if unit is not None else n
        if self.off or not show:
            return
        now = time.perf_counter()
        if now - self.start < self.after:
            return
        if self.stream.isatty():
            self._draw()
        elif now - self.last_line >= self.every:
            print(self.text(), file=self.stream, flush=True)
            self.last_line = now

    def _draw(self) -> None:
        if self._bar is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn(f"{self.label}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn(self.noun), TimeElapsedColumn(), TextColumn("left"),
                                 TimeRemainingColumn(), TextColumn(self.hint),
                                 console=Console(file=self.stream), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        self._bar.update(self._task, completed=min(self.done, self.total))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


_active: ContextVar[tuple[Meter, ...]] = ContextVar("longpack_meters", default=())


def tick(unit: str, n: int = 1) -> None:
    """Count ``n`` units of work for every active meter that counts this unit (a no-op when none does); only the
    innermost meter shows. Units in use: ``planned`` (a global batch planned), ``simulated`` (a step simulated),
    ``run`` (a reproduction's planner run)."""
    meters = _active.get()
    for m in meters:
        if unit in m.units:
            m.tick(n, show=m is meters[-1], unit=unit)


@contextmanager
def meter(label: str, total: int, units: tuple[str, ...], noun: str, hint: str = "",
          **kw: Any) -> Iterator[Meter]:
    """Make a :class:`Meter` the innermost active one for the block: it shows while the block runs (an outer
    meter's bar is put away and comes back on its next tick) and counts its units; outer meters keep counting."""
    outer = _active.get()
    if outer:
        outer[-1].close()
        outer[-1].paused = True  # the inner meter shows until it ends
    m = Meter(label, total, units, noun, hint, **kw)
    token = _active.set(outer + (m,))
    # the first line comes once ``after`` has passed, whenever the units end: a job says it is running, and its
    # estimate, without waiting for the next unit (which may take much longer than the first)
    first = None
    if m.after > 0 and not m.off:
        first = threading.Timer(m.after, lambda: m.last_line < 0 and m._bar is None and not m.paused and m.tick(0))
        first.daemon = True
        first.start()
    try:
        yield m
    finally:
        if first is not None:
            first.cancel()
        _active.reset(token)
        m.close()
        if outer:
            outer[-1].paused = False
