"""tests/forked.py answers as `subprocess` does for `python -m longpack.cli`: the same stdout, stderr and exit code
for a run and a refusal, the command's own working directory and environment, and a signal as a negative code."""

import os
import re
import signal
import subprocess
import sys

import forked


def _real(args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "longpack.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def _said(proc):
    """Exit code and both streams, timings (``0.004 s``) written as ``T s``: they differ run to run."""
    return proc.returncode, *(re.sub(r"\d+\.\d+ s\b", "T s", x) for x in (proc.stdout, proc.stderr))


def test_forked_commands_say_what_real_ones_say(tmp_path):
    env = {**os.environ, "COLUMNS": "100"}
    for args in (["plan", "--workload", "tiny-longtail", "--model", "tiny", "--hardware", "cpu", "--steps", "1",
                  "--out", "plan.json"],
                 ["simulate", "plan.json"],
                 ["compare", "--workload", "tiny-longtail", "--steps", "2", "--micro-batch-size", "-1"]):
        real, fork = _real(args, cwd=tmp_path, env=env), forked.run(args, cwd=tmp_path, env=env)
        assert _said(fork) == _said(real), args
    assert (tmp_path / "plan.json").is_file()  # written in the command's own directory
    assert fork.returncode == 2 and fork.stderr.startswith("longpack: error:")


def test_a_forked_command_killed_by_a_signal_says_so():
    proc = forked.popen(["bench", "planning", "--planner", "fixed_cp", "--workload", "lmsys-chat-1m", "--samples",
                         "1000000"])
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
