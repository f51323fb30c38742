"""The ``longpack`` command line: each subcommand parses flags, calls one job (longpack/jobs.py, or the runtime's
run for ``train``), prints. One module per command group: planning.py (stats, plan, simulate, compare, pipeline,
bench), train_cmd.py (train), tools.py (calibrate, report), papers.py (reproduce); options.py declares the options
they share and reads ``--config``.

Errors a user can cause (bad flags, bad files, impossible layouts) print one line ``longpack: error: ...`` and
exit with code 2; nothing else is caught, so a bug still shows its traceback.
"""

from __future__ import annotations

import sys

import typer

from . import papers, planning, tools, train_cmd  # noqa: F401  (each registers its commands on the app)
from .app import app
from .options import DEPRECATED, deprecated

__all__ = ["app", "main"]


def main() -> None:
    """Entry point: run the app; user errors (bad flags included) become one line and exit code 2."""
    deprecated(*(a[2:].split("=")[0] for a in sys.argv[1:] if a.startswith("--") and a[2:].split("=")[0]
                 in DEPRECATED))
    try:
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Abort:
        print("longpack: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:  # an unknown flag, a value out of range, a non-number
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]
            sys.exit(2)
        print(f"longpack: error: {exc.format_message().splitlines()[0]}", file=sys.stderr)  # type: ignore[attr-defined]
        sys.exit(2)
    except (ValueError, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"longpack: error: {msg}", file=sys.stderr)
        sys.exit(2)
