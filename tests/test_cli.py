"""The command line as a user runs it: JSON shapes, plan -> simulate, and one clear line + exit 2 on bad input."""

import json
import subprocess
import sys

import forked
import pytest


def run(*args, check=True):
    proc = forked.run(list(args), timeout=120)  # tests/forked.py: a real process, without the start-up
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr}")
    return proc


KEYS = {"step_time_s", "speedup", "efficiency", "dbr", "pr", "abr", "cr", "peak_mem_gib", "oom_steps",
        "plan_seconds"}


def test_compare_json_issue_command():
    out = run("compare", "--workload", "lmsys-chat-1m", "--model", "qwen2.5-0.5b", "--hardware", "h100", "--dp", "4",
              "--cp", "8", "--global-batch", "256", "--planners", "fixed_cp,sorted,isf,random_padded", "--baseline",
              "fixed_cp", "--json", "--samples", "20000", "--steps", "6")
    data = json.loads(out.stdout)
    assert set(data["planners"]) == {"fixed_cp", "sorted", "isf", "random_padded"}
    for r in data["planners"].values():
        assert KEYS <= set(r)
        assert 0 < r["efficiency"] <= 1
    assert data["planners"]["fixed_cp"]["speedup"] == 1.0
    assert data["setup"]["max_len"] == 128 * 1024


def test_compare_table_prints(tmp_path):
    out = run("compare", "--workload", "tiny-longtail", "--model", "tiny", "--hardware", "cpu", "--dp", "2",
              "--planners", "fixed_cp,isf", "--steps", "2", "--global-batch", "32")
    assert "fixed_cp" in out.stdout and "isf" in out.stdout and "speedup" in out.stdout


def test_plan_then_simulate(tmp_path):
    f = tmp_path / "plan.json"
    run("plan", "--planner", "isf", "--workload", "chatqa2-long-sft", "--samples", "500", "--dp", "2", "--cp", "4",
        "--steps", "2", "--global-batch", "64", "--out", str(f))
    sim = json.loads(run("simulate", str(f), "--json").stdout)
    assert sim["steps"] == 2 and 0 < sim["efficiency"] <= 1
    bad = run("simulate", str(f), "--dp", "3", check=False)
    assert bad.returncode == 2 and "--dp 3 does not match" in bad.stderr


def test_stats_json_and_lengths_file(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("100\n2000\n70000\n")
    data = json.loads(run("stats", "--lengths", str(f), "--json").stdout)
    assert data["samples"] == 3 and data["max"] == 70000 and data["share_below"]["<1K"] == pytest.approx(1 / 3)
    assert "quantiles" in run("stats", "--workload", "wikipedia-cn", "--samples", "5000").stdout


def test_bench_planning_json():
    data = json.loads(run("bench", "planning", "--planner", "fixed_cp", "--workload", "wikipedia-cn", "--samples",
                          "5000", "--json").stdout)
    assert data["seconds"] > 0 and data["peak_mib"] > 0
    assert data["numpy_sort_seconds"] > 0 and data["vs_numpy_sort"] == pytest.approx(
        data["seconds"] / data["numpy_sort_seconds"])


def test_overlong_counts_reported(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("10\n5000\n20\n")
    data = json.loads(run("compare", "--lengths", str(f), "--model", "tiny", "--hardware", "cpu", "--token-cap",
                          "1000", "--planners", "fixed_cp", "--overlong", "truncate", "--json").stdout)
    assert data["samples"]["truncated"] == 1 and data["samples"]["limit"] == 1000


def test_bucket_size_is_a_deprecated_alias_of_token_cap(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("10\n5000\n20\n")
    common = ["compare", "--lengths", str(f), "--model", "tiny", "--hardware", "cpu", "--planners", "fixed_cp",
              "--overlong", "truncate", "--json"]
    new, old = run(*common, "--token-cap", "1000"), run(*common, "--bucket-size=1000")
    assert json.loads(old.stdout)["samples"] == json.loads(new.stdout)["samples"]
    assert json.loads(old.stdout)["samples"]["limit"] == 1000
    assert "--bucket-size is deprecated" in old.stderr and "use --token-cap" in old.stderr
    assert "deprecated" not in new.stderr


def _bad(tmp_path, name, content):
    f = tmp_path / name
    f.write_text(content)
    return str(f)


@pytest.mark.parametrize("case,args,needle", [
    ("empty workload", lambda t: ["--lengths", _bad(t, "e.txt", "")], "no samples"),
    ("zero length", lambda t: ["--lengths", _bad(t, "z.txt", "5\n0\n")], "sample 1 has length 0"),
    ("negative length", lambda t: ["--lengths", _bad(t, "n.txt", "-3\n")], "sample 0 has length -3"),
    ("NaN length", lambda t: ["--lengths", _bad(t, "nan.jsonl", '{"length": NaN}\n')], "has length nan"),
    ("malformed JSONL", lambda t: ["--lengths", _bad(t, "m.jsonl", '{"length": 3}\n{"length": \n')],
     "m.jsonl:2: malformed JSON line"),
    ("longer than every cap", lambda t: ["--lengths", _bad(t, "o.txt", "10\n99999\n"), "--token-cap", "100",
                                         "--overlong", "error", "--global-batch", "2"],
     "sample 1 has 99999 tokens > limit 100"),
    ("unknown model", lambda t: ["--workload", "tiny-longtail", "--model", "gpt-9"], "unknown model 'gpt-9'"),
    ("dp*cp not matching world", lambda t: ["--workload", "tiny-longtail", "--dp", "4", "--cp", "8", "--world",
                                            "16"], "--world 16 != dp 4 x tp 1 x pp 1 x cp 8 = 32"),
    ("memory too small", lambda t: ["--workload", "tiny-longtail", "--model", "deepseek-v2"],
     "leaves no room for activations"),
    ("unknown planner", lambda t: ["--workload", "tiny-longtail", "--planners", "nope"], "unknown planner 'nope'"),
    ("bad overlong policy", lambda t: ["--workload", "tiny-longtail", "--overlong", "ignore"], "--overlong 'ignore'"),
])
def test_bad_input_one_line_exit_2(tmp_path, case, args, needle):
    proc = run("compare", "--planners", "fixed_cp", *args(tmp_path), check=False)
    assert proc.returncode == 2, (case, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], (case, proc.stderr)
    assert "Traceback" not in proc.stderr


def test_core_imports_do_not_pull_torch():
    code = "import sys, longpack, longpack.planners, longpack.sim, longpack.jobs; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
