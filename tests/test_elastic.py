"""Elastic resume: a run checkpointed on one world and killed with SIGKILL mid-epoch continues on another — other
process counts (FSDP2 resharded by DCP), CP degree, pipeline stages, planner — with the same mathematics: each resumed
step's loss and the final weights equal the uninterrupted run's on the first world (float64, within 1e-9: the same
global batches, only the reduction order differs), and every row is trained exactly once per epoch across the
interruption, counted by sample id in metrics.jsonl. Settings that change what is trained are still refused before
spawning, naming them."""

import json

import forked
import pool  # tests/pool.py: warm worker processes
import pytest
from faults import faulty_env  # tests/faults.py

torch = pytest.importorskip("torch")

ROWS, BATCH, EPOCHS = 12, 4, 2  # 3 steps an epoch, 6 in all
COMMON = ["--model", "tiny", "--dtype", "float64", "--json", "--global-batch", str(BATCH), "--epochs", str(EPOCHS),
          "--token-cap", "16", "--timeout", "300"]
TOL = 1e-9


def _rows(path):
    with open(path, "w") as f:
        for i in range(ROWS):
            ids = [(11 * i + 3 * j) % 250 + 1 for j in range(5 + 3 * i)]  # 5 to 38 tokens: the long ones chained
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * 2 + ids[2:]}) + "\n")
    return str(path)


def _steps(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _run(tmp_path, name, layout, rows, extra=()):
    """An uninterrupted (or resumed) run on the warm pool, as torchrun runs it."""
    out = tmp_path / name
    return pool.cli(["train", *COMMON, "--data", rows, *layout, "--output-dir", str(out), *extra])


CASES = {  # first world, then the world it resumes on
    "nproc_4_to_2": (["--nproc", "4"], ["--nproc", "2"]),
    "nproc_2_to_4": (["--nproc", "2"], ["--nproc", "4"]),
    "context_parallel_cp_2_to_1": (["--nproc", "2", "--cp", "2"], ["--nproc", "2"]),
    "pipeline_pp_2_to_none": (["--nproc", "2", "--pp", "2"], ["--nproc", "2"]),
    "planner_unified_to_isf": (["--nproc", "2", "--planner", "unified"], ["--nproc", "2", "--planner", "isf"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_fsdp_elastic_resume_on_another_world(tmp_path, case):
    first, then = CASES[case]
    rows = _rows(tmp_path / "rows.jsonl")
    whole_logs = tmp_path / "whole-logs"
    whole = _steps(_run(tmp_path, "whole", first, rows, ["--log-dir", str(whole_logs)]))
    assert [s["step"] for s in whole] == list(range(ROWS // BATCH * EPOCHS))
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    # the real launcher on the first world, rank 0 SIGKILLed as it enters its 3rd checkpoint: steps 0-2 trained,
    # steps 0-1 checkpointed, the resume continues at step 2 (the last of epoch 1)
    killed = forked.run(["train", *COMMON, "--data", rows, *first, "--checkpoint-dir", str(ck), "--checkpoint-every",
                         "1", "--log-dir", str(logs)], timeout=300, env=faulty_env(tmp_path, "kill", rank=0, at=3))
    assert killed.returncode == 2 and "the process was killed (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001", "step_00000002"]
    resumed = _run(tmp_path, "resumed", then, rows, ["--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                                                    "--log-dir", str(logs), "--resume"])
    rest = _steps(resumed)
    n_then, n_first = int(then[then.index("--nproc") + 1]), int(first[first.index("--nproc") + 1])
    was = f" (was {n_first})" if n_then != n_first else ""
    assert f"resuming step 2 on {n_then} processes{was}: same global batches, re-planned" in resumed.stderr, \
        resumed.stderr[-3000:]
    said = next(json.loads(x)["resume"] for x in resumed.stdout.splitlines() if x.startswith('{"resume"'))
    assert said["step"] == 2 and said["world"]["then"]["nproc"] == n_first and said["world"]["now"]["nproc"] == n_then
    assert said["changed"] and {"global-batch", "lr", "seed", "data-content"} <= set(said["kept"])
    assert [s["step"] for s in rest] == [2, 3, 4, 5]
    logged = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (whole_logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(6))  # each step logged once: the redone ones by the resume
    for a, b, la, lb in zip(rest, whole[2:], logged[2:], want[2:], strict=True):
        assert la["samples"] == lb["samples"] and a["targets"] == b["targets"]
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    got, want_w = _weights(tmp_path / "resumed"), _weights(tmp_path / "whole")
    worst = max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)) for k, v in want_w.items())
    assert worst <= TOL, worst
    for epoch in range(EPOCHS):
        seen = sorted(s % ROWS for r in logged for s in r["samples"] if s // ROWS == epoch)
        assert seen == list(range(ROWS)), (epoch, seen)  # every row exactly once per epoch


@pytest.mark.parametrize(("flag", "value"), [("--global-batch", "6"), ("--lr", "0.01"), ("--seed", "1"),
                                             ("--data", "other.jsonl")])
def test_a_resume_that_changes_what_is_trained_is_refused_before_spawning(tmp_path, flag, value):
    from longpack.runtime.run.preflight import check_checkpoint_dir

    folder = tmp_path / "ck" / "step_00000002"
    folder.mkdir(parents=True)
    then = {"nproc": 2, "cp": 1, "global-batch": 4, "lr": 0.001, "seed": 0, "data": "rows.jsonl"}
    (folder / "longpack.json").write_text(json.dumps({"step": 2, "settings": then}))
    check_checkpoint_dir(str(tmp_path / "ck"), True, {**then, "nproc": 4, "cp": 2})  # the layout may change
    now = {**then, "nproc": 4, flag[2:]: type(then[flag[2:]])(value)}
    with pytest.raises(ValueError, match=f"was made with {flag} .*, this run has .*; resume with the same {flag}"):
        check_checkpoint_dir(str(tmp_path / "ck"), True, now)

