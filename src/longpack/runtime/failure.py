"""A failed rank's error as one line: which errors mean a peer stopped answering (:class:`PeerLost`), the error
a failed step ends the run with (:func:`step_failure`), and its one-line form (:func:`one_line`)."""

from __future__ import annotations

from .dist import DistContext

__all__ = ["PeerLost", "peer_lost", "step_failure", "one_line"]


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
