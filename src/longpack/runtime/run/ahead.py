"""Planning ahead of training: a background thread plans steps t+1, t+2, ... while step t trains.

:class:`PlanAhead` runs a :class:`~longpack.planners.stream.PlanStream` on a daemon thread, at most ``depth``
steps ahead of the step training asks for (a bounded queue: the thread stops planning while ``depth`` planned
steps wait, so the lead, and the memory it holds, stay bounded). :meth:`PlanAhead.wait` blocks until step ``i`` is
planned and returns the seconds it blocked: what that step waited on the planner. Every step is checked as it is
planned (the plan's invariants for that step, and :func:`~longpack.runtime.kernel.step.check_step`); a step that fails
is raised by the ``wait`` for that step, as one ``ValueError`` naming it. Every rank streams the same steps (a step
is a pure function of its batch and the seed), so every rank stops at the same step, before any collective of it.
``depth`` 0 plans the whole run up front, in the caller's thread, as planning did before streaming.

The thread shares the interpreter lock with the training loop. Torch releases the lock inside its kernels, so the
planner runs while the model computes; it keeps up as long as planning a step takes less time than training one.
Cost: the stream's own; one queue hand-off per step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from ...plan import Plan
from ...planners.stream import PlanStream

__all__ = ["PlanAhead"]


class PlanAhead:
    """Steps of ``stream`` planned on a thread, ``depth`` ahead of :meth:`wait` (see the module docstring);
    ``check(plan, s)`` runs on each step as it is planned; ``upto``: plan only the first ``upto`` steps."""

    def __init__(self, stream: PlanStream, depth: int = 4, check: Callable[[Plan, int], None] | None = None,
                 upto: int | None = None) -> None:
        self.stream, self.plan = stream, stream.plan
        self._end = len(stream) if upto is None else min(upto, len(stream))  # steps to plan: the first ``upto``
        self.planning_seconds = 0.0  # the planner's own time, every step planned so far
        self._check, self._ready, self._stop = check, stream.start, threading.Event()
        self._failed: tuple[int, BaseException] | None = None
        self._planned = stream.start  # steps planned and checked (the thread's count), from a resumed run's start
        self._q: queue.Queue[tuple[int, BaseException | None]] = queue.Queue(maxsize=max(depth, 0) or len(stream) + 1)
        if depth <= 0:
            self._work()
            return
        self._thread = threading.Thread(target=self._work, name="longpack-planner", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self.stream)

    def _work(self) -> None:
        for s in range(self.stream.start, self._end):
            t0 = time.perf_counter()
            try:
                if s >= self.stream.made:  # a stream handed over part-planned (the launcher's) goes on from there
                    self.stream.next_step()
                if self._check is not None:
                    self._check(self.plan, s)
            except BaseException as exc:  # handed to the step that needed it, raised there
                self._q.put((s, exc))
                return
            self.planning_seconds += time.perf_counter() - t0
            self._planned = s + 1
            while not self._stop.is_set():
                try:
                    self._q.put((s, None), timeout=0.5)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set():
                return

    def wait(self, i: int) -> float:
        """Block until step ``i`` is planned (and every step before it); the seconds blocked."""
        if not 0 <= i < len(self.stream):
            raise IndexError(f"step {i} outside the run's {len(self.stream)} steps")
        if self._ready > i:
            return 0.0  # planned already: no wait
        blocked = self._planned <= i  # not planned at the time of asking (else only the hand-off remains)
        t0 = time.perf_counter()
        while self._ready <= i and self._failed is None:
            s, exc = self._q.get()
            if exc is not None:
                self._failed = (s, exc)
            else:
                self._ready = s + 1
        if self._failed is not None and i >= self._failed[0]:
            s, exc = self._failed
            if isinstance(exc, ValueError):
                text = str(exc)
                raise ValueError(text if text.startswith("step ") else f"step {s}: {text}") from None
            raise exc
        return time.perf_counter() - t0 if blocked else 0.0

    def close(self) -> None:
        """Stop planning (training ended or failed); the thread exits within half a second."""
        self._stop.set()
