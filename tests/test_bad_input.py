"""Bad input ends in one line and exit 2, before any work: every numeric option is range-checked, unknown planner
options and over-large batches are refused, a model that cannot fit is refused before allocating."""

import sys
import typing

import forked
import pool
import pytest
import typer

from longpack.cli import app, main


def _numeric_options():
    """(command path, option name, lowest accepted value) for every int or float option of the CLI."""

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, cmd

    out = []
    for path, cmd in walk(typer.main.get_command(app), []):
        for p in cmd.params:
            ann = p.type_descriptor.annotation
            kinds = set(typing.get_args(ann)) | {ann}
            if kinds & {int, float} and p.opts:
                out.append((tuple(path), p.opts[0], p.min))
    return out


def _run_main(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["longpack", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


OPTIONS = _numeric_options()
REQUIRED = {("pipeline",): ["--lengths", "4,2,1,1"], ("simulate",): ["plan.json"]}  # so the option is what fails


def test_every_numeric_option_is_range_checked():
    # the floats (learning rate, timeout, chunk size, backward ratio) are checked in their commands, one line too
    floats = ("--lr", "--timeout", "--chunk-size", "--bwd-ratio")
    unchecked = [(p, o) for p, o, lo in OPTIONS if lo is None and o not in floats]
    assert len(OPTIONS) > 40 and not unchecked


@pytest.mark.parametrize("path,option,low", OPTIONS, ids=[f"{' '.join(p)} {o}" for p, o, _ in OPTIONS])
def test_numeric_option_out_of_range_or_not_a_number_is_one_line(monkeypatch, capsys, path, option, low):
    bad = ["-1", "x"] + (["0"] if low is not None and low >= 1 else [])
    for value in bad:
        code, err = _run_main(monkeypatch, capsys, *path, *REQUIRED.get(path, []), option, value)
        assert code == 2, (option, value, err)
        assert err.count("\n") == 1 and err.startswith("longpack: error:") and option in err, err


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_numeric_options_at_zero_where_zero_is_allowed_run(monkeypatch, capsys, command):
    """0 where the range allows it (seed, ZeRO stage, checkpointed layers, micro-batch size) runs, no traceback."""
    zeros = [o for p, o, lo in OPTIONS if p == (command,) and lo == 0]
    assert zeros
    for option in zeros:
        argv = [command, "--workload", "tiny-longtail", "--model", "tiny", "--hardware", "cpu", "--steps", "1",
                "--global-batch", "16", "--planners" if command == "compare" else "--planner", "random_padded",
                option, "0"]
        monkeypatch.setattr(sys, "argv", ["longpack", *argv])
        with pytest.raises(SystemExit) as exc:
            main()
        assert exc.value.code == 0, (option, capsys.readouterr().err)
        capsys.readouterr()


def _cli(*args):
    return forked.run(list(args), timeout=300)  # tests/forked.py: a real process, without the start-up


@pytest.mark.parametrize("args,says", [
    (["train", "--steps", "1", "--model", "qwen2.5-72b", "--hardware", "cpu"], "GiB per process"),
    (["train", "--steps", "1", "--opt", "nosuch=3"], "--opt nosuch: no such option for unified"),
    (["plan", "--planner", "unified", "--workload", "tiny-longtail", "--model", "tiny", "--hardware", "cpu",
      "--opt", "rollback=longest"], "unified takes"),
    (["compare", "--workload", "tiny-longtail", "--steps", "2", "--micro-batch-size", "-1"], "--micro-batch-size"),
    (["train", "--max-len", "0", "--steps", "1"], "--max-len"),
    (["train", "--steps", "1", "--head-loss", "liger"], "--head-loss liger: Liger's Triton kernels run on CUDA"),
])
def test_bad_input_one_line_exit_2(args, says):
    proc = _cli(*args)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_global_batch_larger_than_the_data_is_one_step_said_once():
    proc = pool.cli(["train", "--model", "tiny", "--global-batch", "5000", "--samples", "8", "--nproc", "2",
                     "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = "--global-batch 5000 is more than the 8 samples of tiny-longtail: one step of all 8"
    assert proc.stderr.count(said) == 1
    assert sum(1 for x in proc.stdout.splitlines() if x.startswith('{"step"')) == 1


def test_compare_accepts_an_option_of_one_of_its_planners():
    proc = _cli("compare", "--workload", "tiny-longtail", "--model", "tiny", "--hardware", "cpu", "--planners",
                "unified,skrull", "--opt", "rollback=longest", "--steps", "1", "--global-batch", "16", "--json")
    assert proc.returncode == 0, proc.stderr
