"""``python -m longpack.cli ARGS`` as a real process that skips the interpreter's start-up: forked from a process
that has imported torch, transformers and longpack's runtime once per test session (a zygote).

Each command is its own process, with its own pid, stdin/stdout/stderr, working directory, environment and exit
status, and its children are its own: signals, ``ps --ppid`` and the launcher's forked ranks behave as for
``subprocess``. What it does not pay is the import of torch and transformers (seconds of CPU per command on this
suite's 2 cores). What it cannot show is therefore kept on ``subprocess``: anything about start-up itself (what
is imported before an argument error), environment variables read at import time (``OMP_NUM_THREADS``), and the
launchers ``torchrun`` and ``python -m``. A PYTHONPATH is honoured as start-up would: its new folders go first on
``sys.path`` and a ``sitecustomize`` there is imported before the command runs. The zygote refuses to serve if
its imports wrote anything to stderr, so a warning raised at import time is not hidden from the tests that look for one.

``run(args, timeout=..., env=None, cwd=None)`` returns what ``subprocess.run([python, "-m", "longpack.cli",
*args], capture_output=True, text=True, timeout=...)`` would; ``popen(args, ...)`` gives a ``Forked`` with
``pid``, text ``stdout``/``stderr``, ``wait``, ``communicate``, ``kill`` and ``returncode``. ``PoolWorker(fd,
folder)`` forks a worker of tests/pool.py (``pool._serve`` on the connection ``fd``) the same way.

How: the zygote accepts one Unix-socket connection per command, with the command's stdio descriptors passed over
it (``socket.send_fds``). It forks a waiter, which forks the command, reports its pid, waits for it and reports its
exit status (negative: the signal that ended it, as ``subprocess`` says). The zygote ignores SIGCHLD, so its
waiters are reaped without bookkeeping; the waiter and the command restore the default.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MARK = "longpack.cli"  # in the zygote's command line, so `ps` shows forked commands as longpack's
_ZYGOTE: tuple[subprocess.Popen, str] | None = None


# -- the zygote -------------------------------------------------------------------------------------------------

def _preload() -> None:
    """What a `longpack train` run imports, so that forked commands start with it."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401  (checkpoints)
    import torch.distributed.elastic.multiprocessing  # noqa: F401  (the launcher's start_processes)
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    import longpack.cli  # noqa: F401
    import longpack.runtime.run.launch  # noqa: F401
    import longpack.runtime.run.train  # noqa: F401


def _send_request(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    payload = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(payload)) + payload], fds)


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    while len(data) < 8 or len(data) < 8 + struct.unpack("!Q", data[:8])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the request was cut short")
        data += more
    return json.loads(data[8:8 + struct.unpack("!Q", data[:8])[0]]), list(fds)


def _site(pythonpath: str) -> None:
    """What start-up does with a PYTHONPATH the zygote did not have: its folders first on ``sys.path``, and a
    ``sitecustomize`` found there imported (tests/faults.py injects its faults so)."""
    new = [d for d in pythonpath.split(os.pathsep) if d and d not in sys.path]
    sys.path[1:1] = new
    if any(os.path.isfile(os.path.join(d, "sitecustomize.py")) for d in new):
        sys.modules.pop("sitecustomize", None)
        import sitecustomize  # noqa: F401


def _command(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked command: its stdio, directory, environment and argv, then ``python -m longpack.cli``."""
    import runpy

    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    code: Any = 0
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _site(request["env"].get("PYTHONPATH", ""))
        if request.get("pool"):  # a worker of tests/pool.py, serving jobs on the connection passed fourth
            from multiprocessing.connection import Connection

            import pool

            pool._serve(Connection(fds[3]), request["cwd"])
        else:
            sys.argv = ["-m", *request["argv"]]
            sys.path[0] = request["cwd"]  # as `python -m` puts its directory first
            runpy.run_module("longpack.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001  (what an interpreter would print and exit 1 with)
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def _serve(path: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # ready: the client waits for this name
    parent = os.getppid()
    listener.settimeout(2.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test worker died without stopping us: do not outlive it
                return
            continue
        conn.settimeout(None)
        try:
            request, fds = _recv_request(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        if request.get("stop"):
            return
        if os.fork() == 0:  # the waiter
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                _command(request, fds)
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):  # a client gone (its test ended) still has its command reaped
                conn.sendall(f"pid {pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()


def _main() -> None:
    path = sys.argv[1]
    err = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(err.fileno(), 2)
    try:
        _preload()
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
    err.seek(0)
    said = err.read().decode(errors="replace")
    if said:
        with open(path + ".err", "w") as f:
            f.write(said)
        sys.exit(1)
    _serve(path)


# -- the client -------------------------------------------------------------------------------------------------

def _zygote() -> str:
    """The zygote's socket path, starting the zygote on first use (it imports for about as long as one command)."""
    global _ZYGOTE
    if _ZYGOTE is not None and _ZYGOTE[0].poll() is None:
        return _ZYGOTE[1]
    path = os.path.join(tempfile.mkdtemp(prefix="longpack-zygote-"), "sock")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path, "-m", MARK], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, cwd=os.path.dirname(os.path.abspath(__file__)))
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            said = open(path + ".err").read() if os.path.exists(path + ".err") else ""
            proc.kill()
            raise RuntimeError(f"the zygote did not start (exit {proc.poll()}): {said[-2000:]}")
        time.sleep(0.05)
    _ZYGOTE = (proc, path)
    atexit.register(_stop, proc, path)
    return path


def _stop(proc: subprocess.Popen, path: str) -> None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        _send_request(s, {"stop": True}, [])
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    import shutil

    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


class Forked:
    """A command forked from the zygote; the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 stderr: bool = True, pool_fd: int | None = None) -> None:
        self.args = argv
        self.returncode: int | None = None
        out_r, out_w = os.pipe() if pool_fd is None else (-1, os.dup(1))  # a pool worker: this process's stdout
        err_r, err_w = os.pipe() if stderr else (-1, os.dup(2))  # not captured: this process's stderr
        null = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_zygote())
            _send_request(self._conn, {"argv": [str(a) for a in argv], "env": dict(os.environ if env is None else env),
                                       "cwd": os.path.abspath(cwd or os.getcwd()), "pool": pool_fd is not None},
                          [null, out_w, err_w] + ([] if pool_fd is None else [pool_fd]))
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        self.stdout = open(out_r, encoding="utf-8", errors="replace") if out_r >= 0 else None  # noqa: SIM115
        self.stderr = open(err_r, encoding="utf-8", errors="replace") if stderr else None  # noqa: SIM115
        self._said = self._conn.makefile("r", encoding="utf-8")
        line = self._said.readline()
        if not line.startswith("pid "):
            raise RuntimeError(f"the zygote did not fork the command: {line!r}")
        self.pid = int(line.split()[1])

    def poll(self) -> int | None:
        """The exit status if the command has ended (its waiter has said so), else None; never blocks."""
        import select

        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                line = self._said.readline()
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                self._conn.settimeout(None)
            if not line.startswith("exit "):
                raise RuntimeError(f"the zygote's waiter ended without the command's status: {line!r}")
            self.returncode = int(line.split()[1])
            self._said.close()
            self._conn.close()
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams to their end, then the exit status; on timeout ``subprocess.TimeoutExpired`` (the command
        still runs, as with ``subprocess``)."""
        got: dict[str, str] = {}

        def read(name: str, stream: Any) -> None:
            got[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=read, args=(n, s), daemon=True)
                   for n, s in (("out", self.stdout), ("err", self.stderr)) if s is not None and not s.closed]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.1, deadline - time.monotonic()))
        return got.get("out", ""), got.get("err", "")


def popen(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None, stderr: bool = True) -> Forked:
    """``subprocess.Popen([python, "-m", "longpack.cli", *argv], stdout=PIPE, stderr=PIPE, text=True)``, forked;
    ``stderr=False``: the command writes to this process's stderr (``stderr=None`` there)."""
    return Forked(argv, env, cwd, stderr)


class PoolWorker:
    """A worker of tests/pool.py forked from the zygote, with the parts of ``multiprocessing.Process`` the pool
    uses: it starts with torch and transformers imported instead of importing them (seconds per worker)."""

    def __init__(self, fd: int, tests_dir: str) -> None:
        self._proc = Forked([], cwd=tests_dir, stderr=False, pool_fd=fd)

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout)

    def kill(self) -> None:
        self._proc.kill()


def run(argv: list[str], timeout: float = 300, env: dict[str, str] | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "longpack.cli", *argv], capture_output=True, text=True, timeout=timeout)``,
    forked; on timeout the command is killed and ``subprocess.TimeoutExpired`` raised, as there."""
    proc = Forked(argv, env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess([sys.executable, "-m", MARK, *argv], proc.returncode, out, err)


if __name__ == "__main__":
    _main()
