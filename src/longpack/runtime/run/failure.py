"""A failed rank's error as one line: which errors mean a peer stopped answering (:class:`PeerLost`), the error
a failed step ends the run with (:func:`step_failure`), its one-line form (:func:`one_line`), and the launcher's
watch over its ranks (:func:`watch`): the cause named once, the rank that froze named as such."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time
from typing import Any

from ..dist import DistContext

__all__ = ["PeerLost", "peer_lost", "step_failure", "one_line", "watch", "heartbeat"]


def peer_lost(exc: BaseException) -> bool:
    """True for a collective that failed because a peer stopped answering (timeout, closed connection)."""
    text = str(exc).lower()
    return any(w in text for w in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe"))


class PeerLost(ValueError):
    """A collective failed because another rank stopped answering: a consequence; the cause is that rank's."""


def step_failure(exc: Exception, step: int, ctx: DistContext, timeout: float) -> Exception:
    """The error a failed step ends the run with: :class:`PeerLost` saying what the wire showed (no answer within
    the timeout, or a closed connection), or ``exc`` noted with its step."""
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    if ctx.distributed and isinstance(exc, RuntimeError) and peer_lost(exc):
        what = (f"the other ranks did not answer within --timeout {timeout:g} s (a rank froze)"
                if "timed out" in text.lower() or "timeout" in text.lower()
                else "another rank closed its connection (it stopped or died; its own error names the cause)")
        return PeerLost(f"step {step}: {what}: {text}")
    exc.add_note(f"step {step}")
    return exc


def one_line(exc: BaseException) -> str:
    """A rank's error in one line: the step it happened at, the exception's type unless it is a user error
    (ValueError, OSError), and its first line."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if not isinstance(exc, (ValueError, OSError)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    steps = [n for n in getattr(exc, "__notes__", []) if n.startswith("step ")]
    return f"{steps[0]}: {text}" if steps else text


def heartbeat(step: int) -> None:
    """A rank's progress for the launcher (``$LONGPACK_HEARTBEAT``, set by `longpack train --nproc`): the step it
    is at; a file write per step."""
    path = os.environ.get("LONGPACK_HEARTBEAT")
    if path:
        with open(path, "w") as f:
            f.write(str(step))


def watch(procs: list[Any], errors: str, timeout: float) -> str | None:
    """Wait for the ranks ``procs`` to end; the run's one line if any failed, else None. On the first failure the
    ranks still running get up to 5 s to say their own line (a peer that lost it ends at once; one waiting in a
    collective at --timeout already has), then every one left is killed, quietly. The line names the cause: a
    rank's own error first; else a rank that stopped answering (still there when its peers gave up on it: stopped
    by a signal, or with no progress), with the step it was at; else a rank ended from outside; else a lost
    peer's line."""
    while any(p.is_alive() for p in procs):
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
        if any(p.exitcode not in (None, 0) for p in procs):
            break
    failed = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode not in (None, 0)}
    if not failed:
        return None
    until = time.monotonic() + 5.0
    while time.monotonic() < until and any(p.is_alive() and not _stopped(p.pid) for p in procs):
        time.sleep(0.1)
    left = [i for i, p in enumerate(procs) if p.is_alive()]
    stopped = {i for i in left if _stopped(procs[i].pid)}
    for i in left:
        os.kill(procs[i].pid, signal.SIGKILL)
        procs[i].join()
    return _cause(errors, failed, left, stopped, timeout)


def _cause(errors: str, failed: dict[int, int], left: list[int], stopped: set[int], timeout: float) -> str:
    said = {int(n.split(".")[0]): n for n in os.listdir(errors) if not n.endswith(".step")}
    own = sorted(r for r, n in said.items() if not n.endswith(".peer"))
    if own:
        return f"rank {own[0]}: {_read(errors, said[own[0]])}"
    if left:
        r = left[0]
        step = _read(errors, f"{r}.step") or "?"
        how = "its process was stopped (SIGSTOP or a debugger)" if r in stopped else "it made no progress"
        return (f"rank {r} stopped answering at step {step} ({how}); the other ranks waited --timeout {timeout:g} s "
                "for it and the run stopped (a checkpoint cut short is never used: --resume takes the last complete "
                "one)")
    outside = sorted(r for r, code in failed.items() if r not in said)
    if outside:
        r, code = outside[0], failed[outside[0]]
        how = f"was killed ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
        return (f"rank {r}: the process {how}; the run stopped (a checkpoint cut short is never used: --resume takes "
                "the last complete one)")
    r = min(said)
    return f"rank {r}: {_read(errors, said[r])}"


def _read(errors: str, name: str) -> str:
    try:
        with open(os.path.join(errors, name)) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state T or t in /proc; False where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
