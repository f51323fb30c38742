"""The options the ``longpack`` commands share (one declaration each), the ``--config`` YAML reader, and the
RunSpec every planning command builds from its flags (:func:`run_spec`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..planners import PLANNERS
from ..runspec import RunSpec
from ..workloads import WORKLOADS

WORKLOAD_NAMES = ", ".join(WORKLOADS)
PLANNER_NAMES = "unified (recommended), " + ", ".join(n for n in PLANNERS if n != "unified")
Workload = Annotated[str | None, typer.Option(help=f"Built-in workload: {WORKLOAD_NAMES}.")]
PlannerName = Annotated[str, typer.Option(help=f"Planner: {PLANNER_NAMES}.")]
PlannerNames = Annotated[str, typer.Option(help=f"Comma-separated planners: {PLANNER_NAMES}.")]
Lengths = Annotated[str | None, typer.Option("--lengths", help="File of lengths: .txt (one per line), .npy, "
                                             ".jsonl or .parquet with a length column, or a save_to_disk folder.")]
Column = Annotated[str, typer.Option(help="Length column in JSONL/Parquet/HF data.")]
Tokenizer = Annotated[str | None, typer.Option(help="Local HF tokenizer folder: the tokens of text or messages "
                                              "rows, read as train reads them (README, 'Data').")]
Samples = Annotated[int | None, typer.Option(min=1, help="Samples to draw from a built-in workload (default: all).")]
Model = Annotated[str, typer.Option(help="Model preset, e.g. qwen2.5-0.5b, qwen2.5-7b, llama3.1-8b.")]
Hardware = Annotated[str, typer.Option(help="Hardware preset (h100, h200, a100, cpu) or a HardwareSpec .json.")]
Dp = Annotated[int, typer.Option(min=1, help="Data-parallel degree.")]
Cp = Annotated[int, typer.Option(min=1, help="Context-parallel degree.")]
Tp = Annotated[int, typer.Option(min=1, help="Tensor-parallel degree (a replica spans tp*pp*cp GPUs).")]
Pp = Annotated[int, typer.Option(min=1, help="Pipeline-parallel degree.")]
World = Annotated[int | None, typer.Option(min=1, help="Total GPUs; checked against dp*tp*pp*cp.")]
Zero = Annotated[int, typer.Option(min=0, max=3, help="ZeRO stage (0-3) for static memory.")]
Ckpt = Annotated[int, typer.Option(min=0, help="Checkpointed (recomputed) layers per stage.")]
TOKEN_CAP_HELP = ("Token cap per rank per micro-batch (Skrull's BucketSize); 0: the most the --hardware memory takes, "
                  "from the cost model. (--bucket-size: deprecated alias.)")  # one meaning, in every command
TokenCap = Annotated[int, typer.Option("--token-cap", "--bucket-size", min=0, help=TOKEN_CAP_HELP)]
GlobalBatch = Annotated[int, typer.Option(min=1, help="Sequences per optimizer step.")]
Steps = Annotated[int | None, typer.Option(min=1, help="Plan only the first N optimizer steps (default: an epoch).")]
COMPARE_STEPS = 8  # compare's steps without --steps or --epoch: the answer in seconds, not an hour
CompareSteps = Annotated[int | None, typer.Option(min=1, help=f"Optimizer steps compared (default {COMPARE_STEPS}; "
                                                  "--epoch for all).")]
Epoch = Annotated[bool, typer.Option("--epoch", help="Compare a whole epoch (minutes to hours on large data; "
                                     "progress is shown).")]
AllColumns = Annotated[bool, typer.Option("--all-columns", help="Show every metric column (DBR, ABR, PR, CR, Ave-T, "
                                          "bound and optimum gaps, plan seconds).")]
Seed = Annotated[int, typer.Option(min=0, help="Seed of the workload and of the global-batch sampler.")]
MaxLen = Annotated[int | None, typer.Option(min=1, help="Samples longer than this follow --overlong (lmsys: 128K).")]
Overlong = Annotated[str, typer.Option(help="Over-long samples: split (chain of pieces), truncate, drop, error.")]
PackLen = Annotated[int | None, typer.Option(min=1, help="Pack length for isf/ffd/bfd/spfhp (default: the limit).")]
MicroBatchSize = Annotated[int | None, typer.Option(min=0, help="Max rows of padded micro-batches (default 8; 0: as "
                                                             "many as the token cap allows).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]
Opt = Annotated[list[str] | None, typer.Option("--opt", help="Planner option KEY=VALUE (repeatable), e.g. "
                                               "rollback=longest, micro_batch_size=1.")]


DEPRECATED = {"bucket-size": "token-cap"}  # old flag -> its name now; kept as an alias for one release


def deprecated(*old: str) -> None:
    for name in old:
        print(f"longpack: warning: --{name} is deprecated and will be removed; use --{DEPRECATED[name]} (the same "
              "token budget per rank per micro-batch)", file=sys.stderr)


def _load_config(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """``--config FILE``: a YAML (or JSON) mapping of flags, each key a flag as the command spells it without
    ``--`` (``token-cap: 8192``, ``fsdp: false``, ``opt: [chunk_size=256]``), made the command's defaults, so a
    flag given on the command line overrides it. An unknown key or a file that is not a mapping is one line."""
    if value is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(value.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"{value}: cannot be read as YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value}: a mapping of flags to values, got a {type(data).__name__}")
    params = {o.lstrip("-"): p for p in ctx.command.params if p.name != "config" for o in p.opts}
    names = {k: p.name for k, p in params.items()}
    unknown = sorted(str(k) for k in data if str(k) not in names)
    if unknown:
        raise typer.BadParameter(f"{value}: no flag {', '.join(unknown)} in `{ctx.info_name}` (keys are its flags "
                                 "without --, as `--help` lists them)")
    for key, v in data.items():
        _check_yaml_value(value, str(key), v, params[str(key)])
    if any(str(k) in DEPRECATED for k in data):
        deprecated(*(str(k) for k in data if str(k) in DEPRECATED))
    ctx.default_map = {**(ctx.default_map or {}), **{names[str(k)]: v for k, v in data.items()}}
    return value


def _check_yaml_value(path: Path, key: str, value: Any, param: Any) -> None:
    """A YAML value the flag's own parser would refuse on the command line, refused here too: a true/false for a
    number or a text, a list for a flag given once, a mapping anywhere."""
    kind = getattr(getattr(param, "type_descriptor", None), "annotation", None)  # typer's; click's name else
    name = _KINDS.get(kind) or str(getattr(getattr(param, "type", None), "name", "value"))
    if isinstance(value, bool) and not getattr(param, "is_flag", False) and kind is not bool:
        raise typer.BadParameter(f"{path}: {key}: {str(value).lower()} is not a valid {name} (--{key} takes "
                                 f"{'an' if name[0] in 'aeiou' else 'a'} {name})")
    if isinstance(value, dict) or (isinstance(value, list) and not getattr(param, "multiple", False)):
        raise typer.BadParameter(f"{path}: {key}: a {type(value).__name__} where --{key} takes one {name}")


_KINDS = {int: "integer", float: "number", str: "text", bool: "boolean"}


Config = Annotated[Path | None, typer.Option("--config", is_eager=True, callback=_load_config,
                                             help="YAML file of flags (keys as the flags spell them, without --); "
                                                  "flags on the command line override it.")]


def parse_options(opts: list[str] | None) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (ints and floats parsed)."""
    out: dict[str, Any] = {}
    for item in opts or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--opt {item!r}: expected KEY=VALUE")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def run_spec(workload: str | None, lengths: str | None, column: str, tokenizer: str | None, samples: int | None,
            model: str, hardware: str, dp: int, cp: int, tp: int, pp: int, world: int | None, zero_stage: int,
            ckpt_layers: int, token_cap: int, global_batch: int, steps: int | None, seed: int,
            max_len: int | None, overlong: str, pack_len: int | None, micro_batch_size: int | None,
            opt: list[str] | None = None) -> RunSpec:
    options: dict[str, Any] = parse_options(opt)
    if pack_len is not None:
        options["pack_len"] = pack_len
    if micro_batch_size is not None:
        options["micro_batch_size"] = micro_batch_size
    return RunSpec(workload=workload, lengths_file=lengths, column=column, tokenizer=tokenizer, samples=samples,
                        model=model, hardware=hardware, dp=dp, cp=cp, tp=tp, pp=pp, world=world,
                        zero_stage=zero_stage, ckpt_layers=ckpt_layers, token_cap=token_cap or None,
                        global_batch=global_batch, steps=steps, seed=seed, max_len=max_len, overlong=overlong,
                        options=options)


