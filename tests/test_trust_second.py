"""Trust, second list: a full or read-only disk loses nothing, a frozen rank is named on time, and the smaller
refusals found by probing (held-out rows too long, YAML values, contradictory resume flags, metrics after a
resume, a plan too large for memory, the thread count under both launchers)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import forked
import pool  # tests/pool.py: warm worker processes
import pytest

torch = pytest.importorskip("torch")

COMMON = ["--workload", "tiny-longtail", "--model", "tiny", "--planner", "isf", "--global-batch", "12", "--dtype",
          "float64"]


def _run(*args, timeout=300):
    return forked.run(["train", *COMMON, *args], timeout=timeout)  # tests/forked.py: a real process


def _one_line(proc, *says):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("longpack: error:")]
    assert len(lines) == 1 and all(s in lines[0] for s in says), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "CheckpointException" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


@contextlib.contextmanager
def _small_fs(path, size, read_only=False):
    """A tmpfs of ``size`` mounted at ``path`` (read-only if asked); skipped where mounting is not allowed."""
    path.mkdir()
    opts = f"size={size}" + (",ro" if read_only else "")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"cannot mount a small filesystem here ({got.stderr.strip()[:80]}): needs CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_output_disk_is_refused_before_training_and_a_failed_save_keeps_the_model(tmp_path):
    with _small_fs(tmp_path / "full", "512k") as full:
        line = _one_line(_run("--steps", "1", "--output-dir", str(full / "m")), f"--output-dir {full / 'm'}",
                         "GiB free", "the final model", "--no-space-check")
        assert "step" not in line.split("error:")[1][:12]  # refused before step 0
        ck = tmp_path / "ck"
        proc = _run("--steps", "1", "--output-dir", str(full / "m"), "--checkpoint-dir", str(ck), "--no-space-check",
                    "--nproc", "2")
        _one_line(proc, "could not be written (No space left on device)", f"written to {ck / 'final-model'}")
        assert not list((full / "m").glob("*.safetensors"))  # no cut file left to load
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(ck / "final-model")  # the trained weights, kept


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_read_only_or_full_checkpoint_folder_is_one_line_and_leaves_no_tmp(tmp_path, nproc):
    with _small_fs(tmp_path / "ro", "1m", read_only=True) as ro:
        _one_line(_run("--steps", "2", "--checkpoint-dir", str(ro / "ck"), "--checkpoint-every", "1", "--nproc",
                       nproc), f"--checkpoint-dir {ro / 'ck'}", "cannot write there", "Read-only file system")
    with _small_fs(tmp_path / "full", "1m") as full:
        ck = full / "ck"
        proc = _run("--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--nproc", nproc,
                    "--no-space-check")
        _one_line(proc, f"--checkpoint-dir {ck}: step 1's checkpoint could not be written", "No space left on device",
                  "last complete checkpoint is kept")
        assert not list(ck.glob("*.tmp"))  # its space given back


def _children(pid):
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "longpack.cli" in line]


def test_a_frozen_rank_is_named_within_the_timeout_and_five_seconds():
    proc = forked.popen(["train", *COMMON, "--nproc", "2", "--steps", "40", "--global-batch", "2", "--timeout", "10",
                         "--json"])  # tests/forked.py: a real process, its ranks forked from it
    for line in proc.stdout:
        if line.startswith('{"step": 1,'):
            break
    frozen = _children(proc.pid)[-1]
    rank = 1  # the ranks are forked in order: the last child is rank 1
    os.kill(frozen, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGKILL)
    took = time.monotonic() - t0
    lines = [x for x in err.splitlines() if x.startswith("longpack: error:")]
    assert proc.returncode == 2 and len(lines) == 1, err[-2000:]
    assert f"rank {rank} stopped answering at step" in lines[0] and "stopped (SIGSTOP" in lines[0], lines
    assert "--timeout 10 s" in lines[0], lines
    assert took < 10 + 5, took  # the peers wait --timeout, the launcher ends the run at once
    assert "Terminating process" not in err and "forcefully" not in err  # torch's launcher lines stay out


def test_held_out_rows_longer_than_the_models_positions_are_refused(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1] * 20}) + "\n" for _ in range(4)))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"input_ids": [2] * 30}) + "\n" + json.dumps({"input_ids": [3] * 80}) + "\n")
    proc = forked.run(["train", "--data", str(rows), "--model-path", str(tmp_path / "m"), "--eval-data", str(held),
                       "--steps", "1", "--global-batch", "2"], timeout=300)
    _one_line(proc, f"--eval-data: {held}:2 has 80 tokens, longer than the 64 positions")


def test_yaml_values_are_type_checked_as_flags_are(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: true\n")
    proc = pool.cli(["train", "--config", str(cfg), *COMMON])
    _one_line(proc, "steps: true is not a valid integer")
    cfg.write_text("lr: [1, 2]\n")
    _one_line(pool.cli(["train", "--config", str(cfg), *COMMON]), "lr: a list where --lr takes one")


def test_resume_and_resume_if_present_together_are_refused(tmp_path):
    proc = pool.cli(["train", *COMMON, "--resume", "--resume-if-present", "--checkpoint-dir", str(tmp_path)])
    _one_line(proc, "--resume and --resume-if-present contradict each other")


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    """A run logs steps 0-5 with a checkpoint after step 4, as a run killed after step 5 leaves them; its resume
    trains steps 4 and 5 again and the file holds each step once."""
    args = [*COMMON, "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4",
            "--log-dir", str(tmp_path / "log")]
    assert pool.cli(["train", *args]).returncode == 0
    res = pool.cli(["train", *args, "--resume"])
    assert res.returncode == 0, res.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]


def test_a_plan_too_large_for_memory_is_refused_by_its_size_before_it_is_read(tmp_path):
    plan = tmp_path / "huge.json"
    with plan.open("wb") as f:
        f.truncate(500 * 2**20)  # 500 MB: the size of a 10-million-step plan
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.RLIM_INFINITY)); "
            "from longpack.cli import main; sys.argv = ['longpack', 'simulate', sys.argv[1]]; main()")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, str(plan)], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 30  # refused by its size, not after reading it
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"plan file {plan}: 500 MiB of JSON takes about" in proc.stderr and "longpack plan --steps N" in proc.stderr


def test_torchrun_and_nproc_use_the_same_threads_and_give_the_same_bits(tmp_path):
    args = ["--steps", "2", "--json"]
    a = _run(*args, "--nproc", "2", "--output-dir", str(tmp_path / "a"))
    b = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                        "longpack.cli", "train", *COMMON, *args, "--output-dir", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-1500:], b.stderr[-1500:])
    runs = [next(json.loads(x)["run"] for x in p.stdout.splitlines() if x.startswith('{"run"')) for p in (a, b)]
    assert runs[0]["threads"] == runs[1]["threads"]
    from safetensors.torch import load_file

    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
