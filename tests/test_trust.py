"""What the user owns is not overwritten and a resume trains the same run: --output-dir refused when it is a file, the
checkpoint being fine-tuned or a non-empty folder (unless --overwrite-output-dir); a checkpoint folder of another run
refused for a fresh run; a resume refused before spawning when a setting that changes what is trained changed (the
layout may change: tests/test_elastic.py), and by the ranks when the rows' tokens or labels changed; stale weight
files gone after an overwrite."""

import json
import subprocess
import sys
import time

import forked
import pool  # tests/pool.py: warm worker processes
import pytest
from faults import faulty_env  # noqa: E402  (tests/faults.py)

from longpack.runtime.run.preflight import check_checkpoint_dir, check_output_dir

COMMON = ["--workload", "tiny-longtail", "--model", "tiny", "--planner", "isf", "--global-batch", "6", "--dtype",
          "float64", "--json"]


def _train(*args, timeout=300):
    """One process on the warm pool (tests/pool.py); with --nproc, the launcher and its ranks as real processes."""
    t0 = time.perf_counter()
    if "--nproc" not in args:
        return pool.cli(["train", *COMMON, *args], timeout=timeout), time.perf_counter() - t0
    proc = subprocess.run([sys.executable, "-m", "longpack.cli", "train", *COMMON, *args], capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


def _one_line(proc, says):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("longpack: error:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_output_dir_that_is_a_file_or_the_model_or_not_empty_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ValueError, match="is a file"):
        check_output_dir(str(afile), None, None, overwrite=True)
    for target in (model, model / "out"):
        with pytest.raises(ValueError, match="is the --model-path folder"):
            check_output_dir(str(target), str(model), None, overwrite=True)
    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is not empty \(1 entries: model.safetensors.index.json\).*"
                                         "--overwrite-output-dir"):
        check_output_dir(str(used), str(model), None, overwrite=False)
    check_output_dir(str(used), str(model), None, overwrite=True)
    new = tmp_path / "a" / "b"
    check_output_dir(str(new), str(model), None, overwrite=False)
    assert new.is_dir()  # made now: a folder that cannot be made fails before training, not after
    (new / "ckpt" / "step_00000001").mkdir(parents=True)  # the run's own checkpoints inside it: a resume
    check_output_dir(str(new), str(model), str(new / "ckpt"), overwrite=False)


def test_output_dir_equal_to_model_path_is_one_line_before_anything_loads(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc, seconds = _train("--steps", "1", "--model-path", str(tmp_path), "--output-dir", str(tmp_path))
    _one_line(proc, "is the --model-path folder")
    assert seconds < 20, seconds  # interpreter and imports only (10 s on an idle machine)


def _settings(tmp_path, **changed):
    folder = tmp_path / "ck" / "step_00000002"
    folder.mkdir(parents=True)
    then = {"nproc": 2, "lr": 0.001, "planner": "isf"}
    (folder / "longpack.json").write_text(json.dumps({"step": 2, "settings": then}))
    return str(tmp_path / "ck"), {**then, **changed}


def test_fresh_run_into_another_runs_checkpoints_is_refused(tmp_path):
    ck, now = _settings(tmp_path)
    with pytest.raises(ValueError, match="holds another run's checkpoints .newest step_00000002.; continue it "
                                         "with --resume"):
        check_checkpoint_dir(ck, resuming=False, now=now)
    check_checkpoint_dir(ck, resuming=True, now=now)
    check_checkpoint_dir(str(tmp_path / "empty"), resuming=False, now=now)


def test_resume_on_another_world_size_passes_and_another_lr_is_refused_before_spawning(tmp_path):
    ck, now = _settings(tmp_path, nproc=4)
    check_checkpoint_dir(ck, resuming=True, now=now)  # the layout may change (tests/test_elastic.py)
    ck, now = _settings(tmp_path / "lr", lr=0.01)
    with pytest.raises(ValueError, match="was made with --lr 0.001, this run has 0.01"):
        check_checkpoint_dir(ck, resuming=True, now=now)


def test_resume_on_rows_with_other_tokens_is_refused(tmp_path):
    rows = tmp_path / "rows.jsonl"

    def write(offset):
        with open(rows, "w") as f:
            for i in range(12):
                ids = [(7 * i + j + offset) % 1000 + 1 for j in range(5 + 3 * i)]
                f.write(json.dumps({"input_ids": ids}) + "\n")

    write(0)
    ck = str(tmp_path / "ck")
    first, _ = _train("--data", str(rows), "--steps", "1", "--checkpoint-dir", ck, "--checkpoint-every", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    data = next(json.loads(x)["data"] for x in first.stdout.splitlines() if x.startswith('{"data"'))
    assert data["line"].startswith("12 rows read, 6 samples in this run"), data["line"]  # rows read, not planned
    write(1)  # the same lengths, other token values: the same plan, other data
    proc, _ = _train("--data", str(rows), "--steps", "2", "--checkpoint-dir", ck, "--resume")
    _one_line(proc, "was trained on other rows")
    write(0)
    again, _ = _train("--data", str(rows), "--steps", "2", "--checkpoint-dir", ck, "--resume")
    assert again.returncode == 0, again.stderr[-2000:]


def test_overwritten_output_holds_no_stale_weight_files(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from longpack.runtime.run.hf_model import save

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-00001-of-00002.safetensors"}}')
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    (out / "notes.txt").write_text("mine")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(cfg)
    save(model, model.state_dict(), out)
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)


def test_labels_outside_the_vocabulary_or_negative_are_refused_naming_the_row(tmp_path):
    from longpack.rows import load_rows
    from longpack.sources import SourceError

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}\n\n'
                    '{"input_ids": [4, 5, 6], "labels": [-100, 5, 999]}\n')
    with pytest.raises(SourceError, match=r"rows.jsonl:3: labels holds 999, outside the model's vocabulary of 256"):
        load_rows(rows, vocab=256)
    assert len(load_rows(rows, vocab=1000).ids) == 2
    rows.write_text('{"input_ids": [4, 5, 6], "labels": [-100, -7, 6]}\n')
    with pytest.raises(SourceError, match=r"rows.jsonl:1: labels holds -7; a label is a token id, or -100"):
        load_rows(rows)


def test_a_label_outside_the_vocabulary_is_one_line_before_spawning(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [5] * 9, "labels": [5] * 8 + [9999 if i == 7 else 5]}) + "\n"
                            for i in range(12)))
    proc, seconds = _train("--data", str(rows), "--steps", "1", "--nproc", "2")
    _one_line(proc, "rows.jsonl:8: labels holds 9999, outside the model's vocabulary of 256")
    assert seconds < 20, seconds


def test_a_rank_killed_while_writing_a_checkpoint_is_one_line(tmp_path):
    args = [*COMMON, "--steps", "2", "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every",
            "1", "--timeout", "300"]
    proc = forked.run(["train", *args], timeout=300, env=faulty_env(tmp_path, "kill"))
    _one_line(proc, "rank 1: the process was killed (SIGKILL)")


@pytest.mark.parametrize("launcher", ["nproc", "torchrun"])
def test_the_failing_ranks_own_error_reaches_the_user_at_once(tmp_path, launcher):
    env = faulty_env(tmp_path, "raise")
    args = ["-m", "longpack.cli", "train", *COMMON, "--steps", "2", "--timeout", "300"]
    cmd = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args] if launcher == "torchrun"
           else [*args, "--nproc", "2"])
    t0 = time.perf_counter()
    if launcher == "torchrun":
        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300, env=env)
    else:  # the launcher forked (tests/forked.py), its ranks forked from it as always
        proc = forked.run(cmd[2:], timeout=300, env=env)
    seconds = time.perf_counter() - t0
    assert proc.returncode != 0 and seconds < 60, (seconds, proc.stderr[-2000:])  # not the 300 s timeout
    lines = [x for x in proc.stderr.splitlines() if x.startswith("longpack: error:")]
    cause = "longpack: error: rank 1: step 0: IndexError: index 999 is out of bounds"
    if launcher == "nproc":  # the launcher reports the cause once, not the peer that lost it
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(cause), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    else:  # each rank says its own line; torchrun's summary names rank 1 as the root cause
        assert any(x.startswith(cause) for x in lines), proc.stderr[-2000:]
        # the peer says what it saw: a closed connection, not a timeout it never waited for
        assert not any("did not answer" in x for x in lines)
        assert all("closed its connection" in x for x in lines if x.startswith("longpack: error: rank 0")), lines


def _crafted(world=2, cp=1, meta_cp=1):
    return {"format": "longpack.plan/1", "planner": "x", "world": world, "meta": {"cp": meta_cp},
            "lengths": [[0, 4]], "steps": [{"cp": cp, "token_cap": 8, "group": "", "replicas": [
                [{"ckpt": 0, "recompute": False, "pad_to": 0, "pieces": [[0, 0, 4, None]]}]] * (world // max(cp, 1))}]}


@pytest.mark.parametrize("plan,says", [
    (_crafted(world=10**9, cp=10**9), "plan world: 1000000000 is outside [1, 131072]"),
    (_crafted(meta_cp="2"), "plan meta.cp: '2' is not an integer"),
    (_crafted(cp=True), "plan step 0 cp: True is not an integer"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_crafted_plans_are_refused_before_anything_is_allocated(plan, says):
    from longpack.plan import Plan, PlanError

    t0 = time.perf_counter()
    with pytest.raises(PlanError, match=says.replace("[", r"\[").replace("]", r"\]")):
        Plan.from_json(plan if isinstance(plan, str) else json.dumps(plan))
    assert time.perf_counter() - t0 < 1.0
    assert Plan.from_json(json.dumps(_crafted())).world == 2  # the same shape, in range, loads


def test_simulate_refuses_a_crafted_plan_in_one_line(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(_crafted(world=10**9, cp=10**9)))
    proc = forked.run(["simulate", str(bad)], timeout=120)  # tests/forked.py
    _one_line(proc, "is outside [1, 131072]")


def test_calibrate_over_processes_reads_back_json_not_pickles():
    from pathlib import Path

    from longpack.model import ModelSpec
    from longpack.runtime.run.calibrate import calibrate

    src = Path(__file__).resolve().parent.parent / "src" / "longpack"
    assert not [p for p in src.rglob("*.py") if "torch.load(" in p.read_text()]  # nothing unpickles a file
    spec = ModelSpec(name="cal", layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=61)
    _, report = calibrate(spec, grid=[(16, 2), (32, 1)], nproc=2, repeats=1, threads=1)
    assert len(report["points"]) == 2 and all(p["measured_s"] > 0 for p in report["points"])


def test_blank_lines_are_counted_and_errors_name_the_file_row(tmp_path):
    from longpack import jobs
    from longpack.rows import load_rows
    from longpack.runtime.run.train import TrainArgs, plan_stream

    rows = tmp_path / "rows.jsonl"
    long = json.dumps({"input_ids": [3] * 40})
    rows.write_text('{"input_ids": [1, 2, 3, 4, 5]}\n\n{"input_ids": []}\n' + long + "\n")
    got = load_rows(rows).describe()
    assert got["rows"] == 4 and got["empty_dropped"] == 2 and got["empty_at"] == [f"{rows}:2", f"{rows}:3"]
    args = TrainArgs.of(data=str(rows), run=jobs.RunSpec(model="tiny-llama", hardware="cpu", token_cap=16,
                                                      global_batch=2, overlong="error"))
    with pytest.raises(ValueError, match=rf"^{rows}:4 has 40 tokens > limit 16"):  # sample 1, the file's line 4
        plan_stream(args, 1, note=None)


def test_rows_without_any_target_are_refused():
    from longpack.rows import rows_from_records
    from longpack.sources import SourceError

    records = [(f"r:{i}", {"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}) for i in range(3)]
    with pytest.raises(SourceError, match="no row has a target"):
        rows_from_records(records, "r")
