"""A pool of warm worker processes for the multi-process tests, started once per test session.

``spawn(fn, args, nprocs)`` runs ``fn(rank, *args)`` on ``nprocs`` workers at once, as
``torch.multiprocessing.spawn`` does, but in processes that have already imported torch, transformers and the
test helpers (forked from tests/forked.py's zygote, as the ranks are first asked for): a test pays its ranks'
work, not their interpreter start-up. Each job initialises its own process group (a fresh port, as before) and
leaves it in ``dist_workers._close``, which in a pooled worker destroys the group and returns instead of exiting.
After every job a worker restores its environment variables, torch's thread count and default dtype, so jobs
cannot see each other.

``cli(argv)`` runs a ``longpack`` command line on the pool as torchrun would (``--nproc N``: N workers, each one
rank with RANK/WORLD_SIZE set) and returns it as ``subprocess.run`` does: rank 0's stdout, every rank's stderr,
the exit code; ``script(path, args, nproc)`` runs a Python script as ``torchrun --nproc-per-node N path args``
would. The launchers' own behaviour (their checks before spawning, their one line for a failed rank) needs real
processes and is tested with them. Between jobs a worker also restores the warning filters (so a warning shown
once is shown again to the next job) and forgets Accelerate's process state.

A job that raises is re-raised here with the rank's traceback; a job that does not finish within ``timeout``
seconds, or a worker that dies, ends the pool (the next call starts a new one) and fails the test.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

SIZE = 4  # the most ranks a test spawns
_POOL: Pool | None = None


def _serve(conn: Any, tests_dir: str) -> None:
    sys.path.insert(0, tests_dir)
    os.environ["LONGPACK_TEST_POOL"] = "1"
    import importlib

    import dist_workers  # noqa: F401  (imports transformers and longpack's runtime once)
    import torch
    import torch.distributed as dist

    env, threads, dtype = dict(os.environ), torch.get_num_threads(), torch.get_default_dtype()
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        module, name, rank, args = job
        try:
            with warnings.catch_warnings():
                getattr(importlib.import_module(module), name)(rank, *args)
            reply = ("ok", "")
        except BaseException:  # noqa: BLE001  (every failure goes back to the test, with its traceback)
            reply = ("error", traceback.format_exc())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            if "accelerate.state" in sys.modules:  # a singleton that would outlive the job's process group
                state = sys.modules["accelerate.state"]
                state.AcceleratorState._reset_state(True)
                state.PartialState._reset_state()
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)


def _errors(replies: dict[int, tuple[str, str]]) -> str:
    """The failed ranks' tracebacks, rank by rank."""
    return "\n".join(f"rank {r}:\n{text}" for r, (status, text) in sorted(replies.items()) if status != "ok")


class Pool:
    """Workers started as ranks are first asked for (up to ``SIZE``): a session whose tests need two ranks never
    pays for four."""

    def __init__(self, size: int) -> None:
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.grow(size)

    def grow(self, size: int) -> None:
        """Workers forked from tests/forked.py's zygote (torch and transformers imported there once)."""
        import socket
        from multiprocessing.connection import Connection

        import forked

        tests_dir = os.path.dirname(os.path.abspath(__file__))
        new = []
        for _ in range(size - len(self.conns)):
            ours, theirs = socket.socketpair()
            try:
                proc = forked.PoolWorker(theirs.fileno(), tests_dir)
            finally:
                theirs.close()
            parent = Connection(ours.detach())
            new.append(parent)
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in new:
            if conn.recv() != "ready":
                raise RuntimeError("a pool worker did not start")

    def run(self, fn: Any, args: tuple, nprocs: int, timeout: float) -> None:
        if nprocs > SIZE:
            raise ValueError(f"{nprocs} ranks: the pool has at most {SIZE} workers")
        self.grow(max(nprocs, len(self.conns)))
        for rank in range(nprocs):
            self.conns[rank].send((fn.__module__, fn.__name__, rank, args))
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[str, str]] = {}
        while len(replies) < nprocs:
            for rank in range(nprocs):
                if rank not in replies and self.conns[rank].poll(0.05):
                    replies[rank] = self.conns[rank].recv()
            failed = any(status != "ok" for status, _ in replies.values())
            if failed and len(replies) < nprocs:  # the peers of a failed rank may wait in a collective: 5 s
                deadline = min(deadline, time.monotonic() + 5.0)
            dead = [r for r in range(nprocs) if r not in replies and not self.procs[r].is_alive()]
            if len(replies) < nprocs and (dead or time.monotonic() > deadline):
                self.close()
                what = (f"ranks {dead} died" if dead else "the other ranks did not finish" if failed
                        else f"did not finish within {timeout:g} s")
                raise RuntimeError(f"{fn.__name__}: {what}\n{_errors(replies)}")
        if any(status != "ok" for status, _ in replies.values()):
            raise RuntimeError(f"{fn.__name__} failed\n{_errors(replies)}")

    def close(self) -> None:
        global _POOL
        for conn, proc in zip(self.conns, self.procs, strict=True):
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []
        if _POOL is self:
            _POOL = None


def spawn(fn: Any, args: tuple = (), nprocs: int = 2, timeout: float = 600.0) -> None:
    """``fn(rank, *args)`` on ranks 0..nprocs-1 of the warm pool (see the module docstring)."""
    global _POOL
    if _POOL is None:
        _POOL = Pool(nprocs)
        atexit.register(lambda: _POOL.close() if _POOL is not None else None)
    _POOL.run(fn, args, nprocs, timeout)


@contextlib.contextmanager
def _leave_returns() -> Any:
    """``runtime.dist.leave`` (the end of a finished rank: barrier, destroy, ``os._exit``) as a pooled worker needs
    it: the peers wait for each other, then the script exits 0 by ``SystemExit`` and the worker lives on."""
    from longpack.runtime import dist as rdist

    def leave() -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        raise SystemExit(0)

    saved, rdist.leave = rdist.leave, leave
    try:
        yield
    finally:
        rdist.leave = saved


def _cli_rank(rank: int, world: int, port: int, argv: list[str], out: str, env: dict[str, str],
              script: str | None = None) -> None:
    """One rank of a command line (``longpack ARGV``, or ``python SCRIPT ARGV``): its stdout and stderr to
    ``out/rank.*``, its exit code to ``out/rank.code``."""
    import runpy

    import longpack.cli

    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(env)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as `--nproc` sets its ranks' (same float sums)
    saved, sys.argv = sys.argv, [script or "longpack", *argv]
    code: Any = 0
    with open(os.path.join(out, f"{rank}.out"), "w") as o, open(os.path.join(out, f"{rank}.err"), "w") as e, \
            contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            if script:
                with _leave_returns():
                    runpy.run_path(script, run_name="__main__")
            else:
                longpack.cli.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # noqa: BLE001  (a script's uncaught error: its traceback on stderr, exit 1, as python does)
            if not script:
                raise
            traceback.print_exc()
            code = 1
        finally:
            sys.argv = saved
    with open(os.path.join(out, f"{rank}.code"), "w") as f:
        f.write(str(code))


def cli(argv: list[str], env: dict[str, str] | None = None, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``longpack ARGV`` on the warm pool, as torchrun would run it (see the module docstring)."""
    from longpack.runtime.dist import free_port

    argv = [str(a) for a in argv]
    nproc = 1
    for i, a in enumerate(argv):
        if a == "--nproc":
            nproc = int(argv[i + 1])
            argv = argv[:i] + argv[i + 2:]
            break
        if a.startswith("--nproc="):
            nproc = int(a.split("=", 1)[1])
            argv = argv[:i] + argv[i + 1:]
            break
    with tempfile.TemporaryDirectory(prefix="longpack-pool-") as out:
        spawn(_cli_rank, (nproc, free_port(), argv, out, dict(env or {})), nprocs=nproc, timeout=timeout)
        return _completed(["longpack", *argv], out, nproc)


def script(path: str, args: list[str], nproc: int = 1, env: dict[str, str] | None = None,
           timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC PATH ARGS`` on the warm pool (RANK, WORLD_SIZE, MASTER_* set as torchrun
    sets them; for NPROC 1, ``python PATH ARGS``), returned as :func:`cli` returns a command line."""
    from longpack.runtime.dist import free_port

    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="longpack-pool-") as out:
        spawn(_cli_rank, (nproc, free_port(), argv, out, dict(env or {}), str(path)), nprocs=nproc, timeout=timeout)
        return _completed([str(path), *argv], out, nproc)


def _completed(args: list[str], out: str, nproc: int) -> subprocess.CompletedProcess:
    def read(name: str) -> str:
        with open(os.path.join(out, name)) as f:
            return f.read()

    codes = [int(read(f"{r}.code")) for r in range(nproc)]
    return subprocess.CompletedProcess(args, next((c for c in codes if c), 0), read("0.out"),
                                       "".join(read(f"{r}.err") for r in range(nproc)))
