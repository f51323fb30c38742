"""Keep a native solver's stray prints off the process's standard output.

HiGHS (SciPy's ``milp``) writes a debug line (``HighsMipSolverData::transformNewIntegerFeasibleSolution ...``)
straight to file descriptor 1 from C++ on some programs, whatever ``disp`` says. On a command's stdout that breaks
``--json`` output and litters tables. :func:`native_stdout_silenced` points descriptor 1 at the null device for
the duration of a solve, flushing Python's and C's buffers on both sides, so nothing written before or after is
lost or reordered.

Guarantees: descriptor 1 is restored on exit, also on an exception; where descriptors cannot be duplicated it does
nothing. Descriptor 1 is shared by the whole process, so use it around the solve only (another thread printing
meanwhile is silenced too). Cost: a few system calls per use.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Iterator

__all__ = ["native_stdout_silenced"]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The process's C library (for fflush), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _flush() -> None:
    """Flush Python's stdout and every C stdio stream (where libc can be loaded)."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stdout.flush()
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(AttributeError, OSError, TypeError):
            libc.fflush(None)


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """Descriptor 1 goes to the null device inside the block; see the module docstring."""
    _flush()
    try:
        saved = os.dup(1)
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 1)
        yield
    finally:
        _flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
