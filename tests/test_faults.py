"""Faults end cleanly: resume mistakes and damaged checkpoints are named, a run extends with a larger --steps, errors
of spawned ranks reach the user once as one line (a frozen rank: tests/test_trust_second.py), and a rank killed after
a checkpoint resumes to the uninterrupted run's weights bit for bit."""

import json
import os
import signal
import subprocess

import forked
import pool  # tests/pool.py: warm worker processes
import pytest

torch = pytest.importorskip("torch")

COMMON = ["--workload", "tiny-longtail", "--model", "tiny", "--planner", "isf", "--global-batch", "12", "--dtype",
          "float64", "--json"]


def _train(*args, timeout=300):
    """One process on the warm pool (tests/pool.py); with --nproc, the launcher and its ranks as real processes."""
    if "--nproc" not in args:
        return pool.cli(["train", *COMMON, *args], timeout=timeout)
    return forked.run(["train", *COMMON, *args], timeout=timeout)  # tests/forked.py: a real process


def _steps(proc):
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _one_line(proc, says):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("longpack: error:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args,says", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "2"], "needs --checkpoint-dir"),
])
def test_resume_and_checkpoint_flags_need_a_folder(args, says):
    _one_line(_train("--steps", "1", *args), says)


def test_resume_with_nothing_to_resume_is_an_error_unless_asked(tmp_path):
    _one_line(_train("--steps", "1", "--resume", "--checkpoint-dir", str(tmp_path / "none")), "no checkpoint in")
    ok = _train("--steps", "1", "--resume-if-present", "--checkpoint-dir", str(tmp_path / "none"))
    assert ok.returncode == 0 and [s["step"] for s in _steps(ok)] == [0]


def test_threads_per_process():
    proc = _train("--steps", "1", "--nproc", "2", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = next(json.loads(x)["summary"] for x in proc.stdout.splitlines() if x.startswith('{"summary"'))
    assert summary["threads"] == 1


def test_a_missing_checkpoint_is_said_once_by_the_launcher_before_spawning(tmp_path):
    proc = _train("--steps", "1", "--nproc", "2", "--resume", "--checkpoint-dir", str(tmp_path / "none"))
    _one_line(proc, "longpack: error: --resume: no checkpoint in")  # not a rank's line: no rank was started


def test_extend_a_run_and_refuse_a_changed_setting(tmp_path):
    ck = str(tmp_path / "ck")
    first = _train("--steps", "2", "--checkpoint-dir", ck, "--checkpoint-every", "1")
    assert first.returncode == 0, first.stderr
    _one_line(_train("--steps", "4", "--checkpoint-dir", ck, "--resume", "--lr", "0.01"), "--lr")
    more = _train("--steps", "4", "--checkpoint-dir", ck, "--resume", "--output-dir", str(tmp_path / "a"))
    assert more.returncode == 0, more.stderr
    assert [s["step"] for s in _steps(more)] == [2, 3]
    whole = _train("--steps", "4", "--output-dir", str(tmp_path / "b"))
    assert whole.returncode == 0, whole.stderr
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("how", ["changed", "empty"])
def test_damaged_latest_checkpoint_is_named_and_skipped(tmp_path, how):
    ck = tmp_path / "ck"
    assert _train("--steps", "3", "--checkpoint-dir", str(ck), "--checkpoint-every", "1").returncode == 0
    shard = next(p for p in sorted((ck / "step_00000003").iterdir()) if p.suffix == ".distcp")
    if how == "changed":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        shard.write_bytes(b"")
    res = _train("--steps", "4", "--checkpoint-dir", str(ck), "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step_00000003 is damaged" in res.stderr and shard.name in res.stderr
    assert [s["step"] for s in _steps(res)] == [2, 3]


def _children(pid):
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    # the ranks: forked from the launcher on the host (its own command line), spawned elsewhere
    return [int(line.split()[0]) for line in out.splitlines() if "longpack.cli" in line or "spawn_main" in line]


def _start(*args):
    return forked.popen(["train", *COMMON, "--nproc", "2", *args])  # tests/forked.py: a real process


def _wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith(f'{{"step": {step},'):
            return
    raise AssertionError(f"no step {step}: {proc.stderr.read()[-2000:]}")


def test_kill_one_of_two_ranks_after_a_checkpoint_then_resume_bit_identical(tmp_path):
    args = ["--steps", "4", "--checkpoint-every", "1"]
    full = pool.cli(["train", *COMMON, *args, "--nproc", "2", "--checkpoint-dir", str(tmp_path / "full"),
                     "--output-dir", str(tmp_path / "a")])  # the runs not killed: on the warm pool
    assert full.returncode == 0, full.stderr[-2000:]
    proc = _start(*args, "--checkpoint-dir", str(tmp_path / "cut"))
    _wait_for_step(proc, 1)
    os.kill(_children(proc.pid)[-1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    res = pool.cli(["train", *COMMON, *args, "--nproc", "2", "--checkpoint-dir", str(tmp_path / "cut"), "--resume",
                    "--output-dir", str(tmp_path / "b")])
    assert res.returncode == 0, res.stderr[-2000:]
    assert _steps(res) and _steps(res)[-1]["step"] == 3
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
