"""Runtime parity: every packed / DP path equals the unpacked single-process reference in float64."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import forked  # noqa: E402  (tests/forked.py: commands as forked processes)
import pool  # noqa: E402  (tests/pool.py: warm worker processes)
from dist_workers import make_plan, packed_grads, parity_worker, reference_grads  # noqa: E402

from longpack.runtime.dist import free_port  # noqa: E402

# float64 parity: reductions in a different order (packed vs one sample at a time, two ranks summed) differ
# only by rounding, ~1e-15 relative; 1e-6 is the bound and leaves no room for a real bug.
RTOL = 1e-6


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("planner", ["isf", "fixed_cp", "skrull", "random_padded", "sorted", "unified"])
def test_parity_packed_single_process(planner):
    """All the step's micro-batches on one rank (dp=1): packed and padded layouts equal the unpacked reference."""
    ref_loss, ref = reference_grads("token_mean")
    loss, grads = packed_grads(planner, 1, 0, "token_mean")
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    assert make_plan(planner, 1).steps[0].replicas[0].micro_batches  # the plan really packed something
    for name, g in ref.items():
        assert _rel(grads[name], g) <= RTOL, name


def _spawn_dp2(tmp_path, planner, mode, options=None):
    out = str(tmp_path / "grads.pt")
    pool.spawn(parity_worker, args=(2, free_port(), out, planner, mode, options or {}), nprocs=2)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_parity_dp2_global_loss(tmp_path, mode):
    """Two gloo processes, packed micro-batches, gradients summed: equal to the unpacked reference."""
    ref_loss, ref = reference_grads(mode)
    got = _spawn_dp2(tmp_path, "skrull", mode)
    assert got["loss"] == pytest.approx(ref_loss, rel=RTOL)
    for name, g in ref.items():
        assert _rel(got["grads"][name], g) <= RTOL, name


def test_parity_dp2_padded_batches(tmp_path):
    ref_loss, ref = reference_grads("token_mean")
    got = _spawn_dp2(tmp_path, "random_padded", "token_mean", {"micro_batch_size": 3})
    assert got["loss"] == pytest.approx(ref_loss, rel=RTOL)
    for name, g in ref.items():
        assert _rel(got["grads"][name], g) <= RTOL, name


def _train_cli(*args, timeout=300):
    return pool.cli(["train", *args], timeout=timeout)


def test_train_cli_two_processes_json():
    proc = _train_cli("--workload", "tiny-longtail", "--model", "tiny", "--planner", "isf", "--nproc", "2",
                      "--steps", "3", "--json",
                      "--global-batch", "16")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    steps = [x for x in lines if "step" in x]
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["tokens"] > 0 and s["loss"] > 0 for s in steps)
    assert set(steps[0]) == {"step", "loss", "tokens", "targets", "step_seconds", "planner_wait_seconds", "memory",
                             "lr", "grad_norm", "compute_seconds"}
    # step 0 waits for the run's header and its own plan; later steps were planned while earlier ones trained
    assert steps[0]["planner_wait_seconds"] > 0 and all(s["planner_wait_seconds"] >= 0 for s in steps)
    mem = steps[0]["memory"]
    # one number per rank; a rank the plan gives no tokens (isf packs this small step into one pack) holds nothing
    assert len(mem["measured_bytes"]) == 2 and max(mem["measured_bytes"]) > 0
    assert [m > 0 for m in mem["measured_bytes"]] == [p > 0 for p in mem["predicted_bytes"]]
    # every rank's own compute seconds in every step: a rank with tokens computes longer than one without
    for s in steps:
        busy = [c for c, m in zip(s["compute_seconds"], s["memory"]["measured_bytes"], strict=True) if m > 0]
        idle = [c for c, m in zip(s["compute_seconds"], s["memory"]["measured_bytes"], strict=True) if m == 0]
        assert len(s["compute_seconds"]) == 2 and min(busy) > 0 and all(c < min(busy) for c in idle)
    data = next(x["data"] for x in lines if "data" in x)
    assert data["dropped_samples"] == 0 and data["trained_tokens"] == data["tokens"]
    assert sum(s["tokens"] for s in steps) == data["trained_tokens"]
    assert lines[-1]["summary"]["steps"] == 3 and lines[-1]["summary"]["tokens_per_second"] > 0


def test_resume_after_kill_equals_uninterrupted(tmp_path):
    common = ["--workload", "tiny-longtail", "--model", "tiny", "--planner", "skrull", "--steps", "4",
              "--global-batch", "12",
              "--dtype", "float64", "--json", "--checkpoint-every", "1"]
    full = _train_cli(*common, "--checkpoint-dir", str(tmp_path / "full"), "--output-dir", str(tmp_path / "a"))
    assert full.returncode == 0, full.stderr
    assert "Warning" not in full.stderr, full.stderr  # one process, no group: DCP's notice is not the user's
    # a run killed after its second step: start it, wait for step 1's log line, kill it
    killed = forked.popen(["train", *common, "--checkpoint-dir", str(tmp_path / "cut")], stderr=False)
    for line in killed.stdout:
        if line.startswith('{"step": 1'):
            killed.kill()
            break
    killed.wait()
    resumed = _train_cli(*common, "--checkpoint-dir", str(tmp_path / "cut"), "--resume", "--output-dir",
                         str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    assert "Warning" not in resumed.stderr, resumed.stderr
    full_steps = [json.loads(x) for x in full.stdout.splitlines() if x.startswith('{"step"')]
    res_steps = [json.loads(x) for x in resumed.stdout.splitlines() if x.startswith('{"step"')]
    # the resumed run continues exactly where the checkpoint left off: same samples, same losses
    assert res_steps and res_steps[-1]["step"] == 3
    for r in res_steps:
        f = full_steps[r["step"]]
        assert r["tokens"] == f["tokens"] and r["loss"] == pytest.approx(f["loss"], rel=1e-12)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
