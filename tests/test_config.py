"""`--config run.yaml`: every flag of `longpack train` as a key (as the flags spell it), the command line over it,
an unknown key refused by name in one line."""

import json

import pytest
import typer

from longpack.cli import app, main


def _train_command():
    return typer.main.get_command(app).commands["train"]


def _is_flag(p) -> bool:
    return bool(getattr(p, "is_flag", False))


def _value(p):
    """A value other than the default that parses, per the option's type (typer's own click types)."""
    if _is_flag(p):
        return not p.default
    if p.multiple:
        return ["chunk_size=256", "k=1"]
    import typing

    kinds = set(typing.get_args(p.type_descriptor.annotation)) | {p.type_descriptor.annotation}
    if int in kinds:
        return (p.min or 0) + 3
    if float in kinds:
        return 0.25
    return f"value-of-{p.name}"


def _flags(values: dict) -> list[str]:
    out = []
    for p in _train_command().params:
        if p.name not in values:
            continue
        v = values[p.name]
        if _is_flag(p):
            out.append(p.opts[0] if v else p.secondary_opts[0] if p.secondary_opts else "")
        elif p.multiple:
            for x in v:
                out += [p.opts[0], str(x)]
        else:
            out += [p.opts[0], str(v)]
    return [x for x in out if x]


def test_config_round_trips_every_flag_of_train(tmp_path):
    cmd = _train_command()
    options = [p for p in cmd.params if p.opts and p.opts[0].startswith("--") and p.name not in ("config", "help")]
    assert len(options) > 40
    values = {p.name: _value(p) for p in options}
    conf = tmp_path / "run.yaml"
    conf.write_text(json.dumps({p.opts[0].lstrip("-"): values[p.name] for p in options}))  # JSON is YAML
    from_file = cmd.make_context("train", ["--config", str(conf)]).params
    from_flags = cmd.make_context("train", _flags(values)).params
    for p in options:
        assert from_file[p.name] == from_flags[p.name], p.name
        assert from_file[p.name] != p.default or p.name == "json_out", p.name  # really set from the file


def test_command_line_flags_override_the_config(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text("lr: 0.5\ntoken-cap: 8192\nfsdp: false\nopt: [chunk_size=256]\n")
    params = _train_command().make_context("train", ["--config", str(conf), "--lr", "0.1"]).params
    assert params["lr"] == 0.1 and params["token_cap"] == 8192 and params["fsdp"] is False
    assert params["opt"] == ("chunk_size=256",) or params["opt"] == ["chunk_size=256"]


def test_the_deprecated_bucket_size_key_still_sets_the_token_cap(tmp_path, capsys):
    conf = tmp_path / "run.yaml"
    conf.write_text("bucket-size: 2048\n")
    params = _train_command().make_context("train", ["--config", str(conf)]).params
    assert params["token_cap"] == 2048
    assert "--bucket-size is deprecated" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "says"), [
    ("bucket-sz: 8192\nlr: 0.1\n", "no flag bucket-sz in `train`"),
    ("- lr\n", "a mapping of flags to values, got a list"),
    ("lr: [unclosed\n", "cannot be read as YAML"),
])
def test_a_bad_config_is_one_line(tmp_path, monkeypatch, capsys, text, says):
    import sys

    conf = tmp_path / "run.yaml"
    conf.write_text(text)
    monkeypatch.setattr(sys, "argv", ["longpack", "train", "--config", str(conf)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_the_readme_gpu_example_is_a_valid_config():
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "gpu-qwen2.5-7b.yaml"
    params = _train_command().make_context("train", ["--config", str(example)]).params
    assert params["lr_scheduler"] == "cosine" and params["token_cap"] == 16384 and params["dtype"] == "bfloat16"
