"""What a new user meets first: the demo's table at 100 columns, one default planner, OOM said, honest output."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import subprocess
import sys

import forked
import pytest
from rich.console import Console

from longpack import jobs
from longpack.report.tables import compare_table

DEMO = ["--workload", "lmsys-chat-1m", "--model", "qwen2.5-0.5b", "--hardware", "h100", "--dp", "4", "--cp", "8",
        "--global-batch", "256", "--steps", "8"]
DEMO_PLANNERS = "unified,skrull,chunkflow,hbp,fixed_cp,sorted,isf,random_padded,one_seq"


def _cli(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    return forked.run(list(args), timeout=300, env=dict(os.environ, **(env or {})), cwd=cwd)  # tests/forked.py


@pytest.fixture(scope="module")
def demo_result() -> dict:
    proc = _cli("compare", *DEMO, "--planners", DEMO_PLANNERS, "--baseline", "fixed_cp", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_demo_table_fits_100_columns_uncut(demo_result):
    buf = io.StringIO()
    compare_table(demo_result, console=Console(file=buf, width=100))
    text = buf.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 100
    for name, r in demo_result["planners"].items():  # every planner's row, every value in full
        row = next(line for line in text.splitlines() if line.startswith(f"│ {name} "))
        for cell in (str(r["steps"]), f"{r['step_time_s']:.4f}", f"{r['speedup']:.2f}x", f"{r['efficiency']:.3f}",
                     f"{r['peak_mem_gib']:.1f}"):
            assert cell in row, (name, cell, row)


def test_demo_table_at_columns_100_through_the_cli():
    proc = _cli("compare", *DEMO, "--planners", "unified,fixed_cp,hbp", "--baseline", "fixed_cp",
                env={"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout and max(len(line) for line in proc.stdout.splitlines()) <= 100


def test_compare_shows_planners_with_other_step_counts_apart_and_says_what_speedup_means(demo_result):
    buf = io.StringIO()
    compare_table(demo_result, console=Console(file=buf, width=100))
    text = buf.getvalue()
    first, _, second = text.partition("planners that make their own optimizer steps")
    base_steps = demo_result["planners"]["fixed_cp"]["steps"]
    apart = [n for n, r in demo_result["planners"].items() if r["steps"] != base_steps]
    assert apart == ["hbp"]  # HBP regroups the 2,048 samples into its own steps
    assert "│ hbp " in second and "│ hbp " not in first and "│ unified " in first
    assert "speedup = simulated time to train the same 2,048 samples relative to fixed_cp" in " ".join(text.split())
    # the default view leaves out the optimum gap (a narrower problem's optimum) and the balance metrics
    assert "gap to optimum" not in text and "DBR" not in text and "--all-columns" in text


def test_compare_all_columns_shows_the_optimum_gap_with_its_scope():
    proc = _cli("compare", "--workload", "lmsys-chat-1m", "--samples", "2000", "--dp", "2", "--cp", "2",
                "--global-batch", "8", "--steps", "2", "--planners", "unified,fixed_cp", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["exact"]["steps"] == 2
    buf = io.StringIO()
    compare_table(result, console=Console(file=buf, width=250), all_columns=True)
    text = " ".join(buf.getvalue().split())
    for col in ("gap to optimum", "DBR", "ABR", "PR", "CR", "Ave-T", "plan s"):
        assert col in text
    assert "scope:" in text and "can beat it" in text and "DBR, ABR = data, attention balance ratio" in text


def test_compare_defaults_to_8_steps_and_says_so():
    proc = _cli("compare", "--workload", "lmsys-chat-1m", "--samples", "5000", "--dp", "2", "--cp", "2",
                "--planners", "fixed_cp,isf")
    assert proc.returncode == 0, proc.stderr
    assert "8 of 20 steps of the epoch (--epoch for all)" in " ".join(proc.stdout.split())
    proc = _cli("compare", "--workload", "lmsys-chat-1m", "--samples", "1000", "--dp", "2", "--cp", "2",
                "--planners", "fixed_cp", "--epoch", "--json")
    assert json.loads(proc.stdout)["setup"]["steps"] == 4  # ceil(1000 / 256): the last, smaller batch counted
    assert _cli("compare", "--workload", "tiny-longtail", "--epoch", "--steps", "2").returncode == 2


def test_one_default_planner_unified_everywhere():
    from longpack.cli import planning, tools, train_cmd

    for command in (planning.plan, train_cmd.train):
        assert _default(command, "planner") == "unified"
    for command in (tools.report, planning.compare):
        assert _default(command, "planners").split(",")[0] == "unified"
    with open(os.path.join(os.path.dirname(__file__), "..", "Makefile")) as f:
        assert "--planners unified," in f.read()


def _default(command, name: str):
    import inspect

    return inspect.signature(command).parameters[name].default


def test_help_lists_workloads_and_planners():
    from longpack.planners import PLANNERS
    from longpack.workloads import WORKLOADS

    for sub in ("compare", "plan", "train", "report"):
        text = " ".join(_cli(sub, "--help", env={"COLUMNS": "200"}).stdout.split())
        assert all(w in text for w in WORKLOADS), sub
        assert all(p in text for p in PLANNERS) and "unified (recommended)" in text, sub
    assert "stats --help" not in _cli("compare", "--help").stdout


def test_plan_and_compare_warn_once_about_a_plan_that_runs_out_of_memory(tmp_path):
    # fixed_cp at 7B with the whole sample on every rank of its group: over an 80 GiB H100 on the longest steps
    args = ["--workload", "chatqa2-long-sft", "--model", "qwen2.5-7b", "--dp", "1", "--cp", "8", "--steps", "3",
            "--samples", "3000", "--token-cap", "200000"]
    proc = _cli("plan", "--planner", "fixed_cp", *args, "--out", str(tmp_path / "p.json"))
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if "runs out of memory" in ln]
    assert len(notes) == 1 and re.search(r"fixed_cp runs out of memory on \d+ of 3 steps: step \d+ needs [\d.]+ GiB "
                                         r"on rank \d+, h100 has 80 GiB", notes[0]), proc.stderr
    proc = _cli("compare", "--planners", "fixed_cp,unified,isf", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    over = sorted(n for n, r in json.loads(proc.stdout)["planners"].items() if r["oom_steps"])
    notes = sorted(ln.split()[2] for ln in proc.stderr.splitlines() if "runs out of memory" in ln)
    assert "fixed_cp" in over and notes == over, proc.stderr  # each plan over memory said exactly once


def test_simulate_prints_the_plan_file_its_cap_and_samples(tmp_path):
    plan = tmp_path / "plan.json"
    assert _cli("plan", "--planner", "isf", "--workload", "tulu3-longcite", "--samples", "2000", "--dp", "4", "--cp",
                "8", "--steps", "2", "--out", str(plan)).returncode == 0
    proc = _cli("simulate", str(plan), env={"COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert f"{plan} on qwen2.5-0.5b" in text and "token cap 48194" in text and "512 scheduled samples" in text
    for bad in ("None", "?", "nan"):
        assert bad not in text, (bad, text)


def test_simulate_and_tokenizer_errors_name_the_file(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_bytes(b"\xff\xfe\x00binary")
    proc = _cli("simulate", str(bad))
    assert proc.returncode == 2 and f"plan file {bad}: not UTF-8 text" in proc.stderr
    bad.write_text("[1, 2]")
    proc = _cli("simulate", str(bad))
    assert proc.returncode == 2 and f"plan file {bad}: not a longpack plan" in proc.stderr
    lengths = tmp_path / "rows.jsonl"
    lengths.write_text('{"text": "hello"}\n')
    proc = _cli("stats", "--lengths", str(lengths), "--column", "text", "--tokenizer", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "no such folder" in proc.stderr and "Repo id" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


class _Called(Exception):
    pass


def test_reproduce_all_plans_each_seed_as_its_own_command_does(monkeypatch):
    """`reproduce all` calls each seed's reproduction with the arguments `reproduce <seed>` uses by default (the
    figures are a function of them: a cell in `all` is the same figure). A step default that differed between the
    two commands (16 for skrull, against 8 in `all` once) changed skrull's cells."""
    from typer.testing import CliRunner

    from longpack.cli import app
    from longpack.reproduce import all as rep_all
    from longpack.reproduce import chunkflow, hbp, skrull

    calls: dict[str, list[dict]] = {}

    def recorder(name: str, then: object = None):
        def record(**kwargs):
            calls.setdefault(name, []).append(kwargs)
            if then is None:
                raise _Called
            return then(**kwargs)
        return record

    hbp_defaults = {k: p.default for k, p in inspect.signature(hbp.reproduce).parameters.items()}
    for mod in (skrull, chunkflow, hbp):
        monkeypatch.setattr(mod, "reproduce", recorder(mod.__name__.rsplit(".", 1)[1]))
    for seed in ("skrull", "chunkflow", "hbp"):
        assert isinstance(CliRunner().invoke(app, ["reproduce", seed]).exception, _Called), seed
    # `all` in full: each seed's call recorded, then let through to the next one
    empty = {"skrull": lambda **kw: {"cells": []}, "chunkflow": lambda **kw: {"speedups": {}}}
    for mod in (skrull, chunkflow):
        name = mod.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(mod, "reproduce", recorder(name, empty[name]))
    monkeypatch.setattr(hbp, "reproduce", recorder("hbp"))
    with pytest.raises(_Called):
        rep_all.reproduce()
    alone, together = calls["skrull"]
    assert {**alone, "sweeps": False} == together  # sweeps add tables, not cells
    alone, together = calls["chunkflow"]
    assert alone == together
    alone, together = ({**hbp_defaults, **kw} for kw in calls["hbp"])
    assert {**alone, "packers": False} == together  # packers add a table, not the verdict's cell


def test_compare_job_plans_the_steps_it_says():
    spec = jobs.RunSpec(workload="tiny-longtail", model="tiny", hardware="cpu", global_batch=8, steps=3)
    result = jobs.compare(spec, ["isf"], "isf", note=None)
    assert result["setup"]["steps"] == 3 and result["planners"]["isf"]["steps"] == 3


def test_the_readme_set_up_puts_longpack_on_the_path():
    """After the README's set-up, its `source .venv/bin/activate` line makes `longpack` a command in a fresh shell
    (a shell that knows nothing of this test's interpreter); the demo's last lines say the next two commands."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, ".venv", "bin", "activate")):
        pytest.skip("no .venv here: `make test` creates it (this run uses another interpreter)")
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    assert "source .venv/bin/activate" in readme
    shell = subprocess.run(["env", "-i", f"HOME={os.environ.get('HOME', '/tmp')}", "PATH=/usr/bin:/bin", "bash",
                            "-c", "source .venv/bin/activate && longpack --help"], cwd=root, capture_output=True,
                           text=True, timeout=60)
    assert shell.returncode == 0 and "train" in shell.stdout, shell.stderr[-2000:]
    makefile = open(os.path.join(root, "Makefile"), encoding="utf-8").read()
    demo = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "source .venv/bin/activate" in demo and "longpack train --data" in demo


@pytest.mark.parametrize(("args", "says"), [
    (["--cp", "3", "--nproc", "2"], "--cp 3 must divide the number of processes per pipeline stage (2)"),
    (["--pp", "3", "--nproc", "4"], "--pp 3 must divide the number of processes (4)"),
    (["--lr", "-1"], "--lr -1.0: a learning rate must be >= 0"),
    (["--data", "/nonexistent/rows.jsonl"], "--data /nonexistent/rows.jsonl: no such file or folder"),
    (["--planner", "nosuch"], "unknown planner 'nosuch'"),
    (["--model-path", "MODEL"], "no weights there"),
    (["--lr-scheduler", "step"], "--lr-scheduler 'step': choose one of"),
])
def test_argument_errors_of_train_come_before_torch_is_imported(tmp_path, args, says):
    """A command line `longpack train` cannot run is one line and exit 2 before torch is even imported (so no
    process is spawned and no model loaded): within 5 s on this machine, typically under 1 s."""
    import time

    (tmp_path / "config.json").write_text("{}")  # a model folder without weights
    args = [str(tmp_path) if a == "MODEL" else a for a in args]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "longpack.cli", "train", "--steps", "1", *args],
                          capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("longpack: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr[-2000:]
    imported = {x.rsplit("|", 1)[-1].strip() for x in proc.stderr.splitlines() if x.startswith("import time:")}
    assert "torch" not in imported and seconds <= 5.0, (seconds, sorted(m for m in imported if "torch" in m)[:5])


def test_a_two_process_run_on_a_checkpoint_speaks_with_one_voice(tmp_path):
    """`longpack train --nproc 2` on a save_pretrained folder: stdout has the run's lines, stderr nothing from the
    libraries (no per-rank loading or writing bars, no warnings, nothing at exit)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    proc = forked.run(["train", "--model-path", str(tmp_path / "model"), "--workload", "tiny-longtail", "--steps",
                       "2", "--nproc", "2", "--output-dir", str(tmp_path / "out")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = proc.stdout.splitlines()[:2]
    assert first.startswith("run: 2 processes, 1 thread each") and second.startswith("data: ")
    assert "done: 2 steps" in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr[-2000:]
