"""The ``longpack`` command line: each subcommand parses flags, calls one job in :mod:`longpack.jobs`, prints.

Errors a user can cause (bad flags, bad files, impossible layouts) print one line ``longpack: error: ...`` and
exit with code 2; nothing else is caught, so a bug still shows its traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from . import jobs
from .planners import PLANNERS
from .report.tables import METRICS
from .reproduce.all import CHUNKFLOW_STEPS, SKRULL_STEPS
from .workloads import WORKLOADS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, simulate and compare packing/balancing schedules for long-context SFT.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks of longpack itself.")
app.add_typer(bench_app, name="bench")
reproduce_app = typer.Typer(no_args_is_help=True, help="Re-run a paper's experiments in the simulator.")
app.add_typer(reproduce_app, name="reproduce")

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
TokenCap = Annotated[int | None, typer.Option("--token-cap", "--bucket-size", min=1,
                                              help="Token cap per rank per micro-batch (Skrull's BucketSize); "
                                                   "default: memory model. (--bucket-size: deprecated alias.)")]
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


def _deprecated(*old: str) -> None:
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
        _deprecated(*(str(k) for k in data if str(k) in DEPRECATED))
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


def _options(opts: list[str] | None) -> dict[str, Any]:
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


def _common(workload: str | None, lengths: str | None, column: str, tokenizer: str | None, samples: int | None,
            model: str, hardware: str, dp: int, cp: int, tp: int, pp: int, world: int | None, zero_stage: int,
            ckpt_layers: int, token_cap: int | None, global_batch: int, steps: int | None, seed: int,
            max_len: int | None, overlong: str, pack_len: int | None, micro_batch_size: int | None,
            opt: list[str] | None = None) -> jobs.RunSpec:
    options: dict[str, Any] = _options(opt)
    if pack_len is not None:
        options["pack_len"] = pack_len
    if micro_batch_size is not None:
        options["micro_batch_size"] = micro_batch_size
    return jobs.RunSpec(workload=workload, lengths_file=lengths, column=column, tokenizer=tokenizer, samples=samples,
                        model=model, hardware=hardware, dp=dp, cp=cp, tp=tp, pp=pp, world=world,
                        zero_stage=zero_stage, ckpt_layers=ckpt_layers, token_cap=token_cap,
                        global_batch=global_batch, steps=steps, seed=seed, max_len=max_len, overlong=overlong,
                        options=options)


@app.command()
def stats(workload: Workload = None, lengths: Lengths = None, column: Column = "length",
          tokenizer: Tokenizer = None, samples: Samples = None, seed: Seed = 0, json_out: Json = False) -> None:
    """Length histogram and quantiles of a workload or a file."""
    from .workloads import WORKLOADS

    spec = jobs.RunSpec(workload=workload, lengths_file=lengths, column=column, tokenizer=tokenizer,
                        samples=samples, seed=seed)
    if workload is None and lengths is None:
        raise ValueError("give --workload NAME or --lengths FILE; workloads: " + ", ".join(WORKLOADS))
    data = jobs.length_stats(jobs.load_workload(spec)[0])
    if json_out:
        print(json.dumps(data))
        return
    from .report.tables import stats_table

    stats_table(data, workload or lengths or "")


@app.command()
def plan(planner: PlannerName = "unified",
         out: Annotated[Path | None, typer.Option(help="Write the Plan JSON here (default: stdout).")] = None,
         workload: Workload = None, lengths: Lengths = None, column: Column = "length", tokenizer: Tokenizer = None,
         samples: Samples = None, model: Model = "qwen2.5-0.5b", hardware: Hardware = "h100", dp: Dp = 1,
         cp: Cp = 1, tp: Tp = 1, pp: Pp = 1, world: World = None, zero_stage: Zero = 2, ckpt_layers: Ckpt = 0,
         token_cap: TokenCap = None, global_batch: GlobalBatch = 256, steps: Steps = None, seed: Seed = 0,
         max_len: MaxLen = None, overlong: Overlong = "split", pack_len: PackLen = None,
         micro_batch_size: MicroBatchSize = None, opt: Opt = None) -> None:
    """Plan the workload with one planner and write the validated Plan JSON."""
    spec = _common(workload, lengths, column, tokenizer, samples, model, hardware, dp, cp, tp, pp, world,
                   zero_stage, ckpt_layers, token_cap, global_batch, steps, seed, max_len, overlong, pack_len,
                   micro_batch_size, opt)
    from .progress import meter
    from .sim import simulate as sim

    data, default_max_len = jobs.load_workload(spec)
    cost = jobs.build_cost(spec)
    epoch = jobs.epoch_steps(len(data), min(spec.global_batch, len(data)))
    with meter(f"plan {planner}", min(steps or epoch, epoch), ("planned",), "global batches planned",
               "--steps N for fewer"):
        result, seconds = jobs.run_plan(planner, data, spec, cost, default_max_len)
    line = jobs.oom_note(planner, sim(result, cost, bounds=False), cost)
    if line is not None:
        jobs.say(line)
    text = result.to_json()
    if out is None:
        print(text)
    else:
        out.write_text(text)
        ov = result.meta["overlong"]
        print(f"wrote {out}: {len(result.steps)} steps, {len(result.lengths)} samples, planned in {seconds:.3f} s; "
              f"over-long: {ov['split']} split, {ov['truncated']} truncated, {ov['dropped']} dropped",
              file=sys.stderr)


@app.command()
def simulate(plan_file: Annotated[Path, typer.Argument(help="A Plan JSON written by `longpack plan`.")],
             model: Annotated[str | None, typer.Option(help="Model preset (default: the plan's).")] = None,
             hardware: Annotated[str | None, typer.Option(help="Hardware (default: the plan's).")] = None,
             dp: Annotated[int | None, typer.Option(min=1, help="Checked against the plan.")] = None,
             cp: Annotated[int | None, typer.Option(min=1, help="Checked against the plan.")] = None,
             json_out: Json = False) -> None:
    """Simulate a Plan JSON: step time, efficiency, balance metrics and memory."""
    p = jobs.load_plan_file(plan_file)
    meta = p.meta
    for flag, value, planned in (("--dp", dp, meta.get("dp")), ("--cp", cp, meta.get("cp"))):
        if value is not None and value != planned:
            raise ValueError(f"{flag} {value} does not match the plan's {planned} (dp x cp must equal its world "
                             f"{p.world})")
    spec = jobs.RunSpec(model=model or meta.get("model", "qwen2.5-0.5b"), hardware=hardware or meta.get("hardware",
                        "h100"), dp=meta.get("dp", p.world), cp=meta.get("cp", 1), tp=meta.get("tp", 1),
                        pp=meta.get("pp", 1), ckpt_layers=meta.get("ckpt_layers", 0),
                        token_cap=meta.get("token_cap"))
    result = jobs.summarize(p, jobs.build_cost(spec))
    if json_out:
        print(json.dumps(result))
        return
    from .report.tables import compare_table

    ov = dict(meta.get("overlong", {})) | {"scheduled_samples": len(p.lengths)}
    setup = spec.describe() | {"workload": str(plan_file), "token_cap": meta.get("token_cap"), "seed":
                               meta.get("seed", 0), "global_batch": max((len({pc.sample for r in st.replicas for mb in
                                                                            r.micro_batches for pc in mb.pieces})
                                                                       for st in p.steps), default=0)}
    compare_table({"setup": setup, "baseline": p.planner, "samples": ov,
                   "planners": {p.planner: result | {"speedup": 1.0, "plan_seconds": None}}})


@app.command(help="Several planners on the same global batches: simulated step time, speedup, efficiency, "
             "memory (balance metrics with --all-columns). " + METRICS + ".")
def compare(planners: PlannerNames = "unified,skrull,chunkflow,hbp,fixed_cp,sorted,isf",
            baseline: Annotated[str, typer.Option(help="Planner the speedups are relative to.")] = "fixed_cp",
            workload: Workload = None, lengths: Lengths = None, column: Column = "length",
            tokenizer: Tokenizer = None, samples: Samples = None, model: Model = "qwen2.5-0.5b",
            hardware: Hardware = "h100", dp: Dp = 1, cp: Cp = 1, tp: Tp = 1, pp: Pp = 1, world: World = None,
            zero_stage: Zero = 2, ckpt_layers: Ckpt = 0, token_cap: TokenCap = None,
            global_batch: GlobalBatch = 256, steps: CompareSteps = None, epoch: Epoch = False, seed: Seed = 0,
            max_len: MaxLen = None, overlong: Overlong = "split", pack_len: PackLen = None,
            micro_batch_size: MicroBatchSize = None, opt: Opt = None, all_columns: AllColumns = False,
            json_out: Json = False) -> None:
    if epoch and steps is not None:
        raise ValueError("give --steps N or --epoch, not both")
    if not epoch and steps is None:
        steps = COMPARE_STEPS
    spec = _common(workload, lengths, column, tokenizer, samples, model, hardware, dp, cp, tp, pp, world,
                   zero_stage, ckpt_layers, token_cap, global_batch, steps, seed, max_len, overlong, pack_len,
                   micro_batch_size, opt)
    names = [n.strip() for n in planners.split(",") if n.strip()]
    result = jobs.compare(spec, names, baseline)
    if json_out:
        print(json.dumps(result))
        return
    from .report.tables import compare_table

    compare_table(result, all_columns=all_columns)


@bench_app.command("planning")
def bench_planning(planner: PlannerName = "fixed_cp",
                   workload: Workload = "lmsys-chat-1m", samples: Samples = 1_000_000,
                   model: Model = "qwen2.5-0.5b", hardware: Hardware = "h100", dp: Dp = 4, cp: Cp = 8,
                   global_batch: GlobalBatch = 256, seed: Seed = 0, json_out: Json = False) -> None:
    """Time and peak memory of planning a full epoch of a workload."""
    spec = jobs.RunSpec(workload=workload, samples=samples, model=model, hardware=hardware, dp=dp, cp=cp,
                        global_batch=global_batch, seed=seed)
    result = jobs.bench_planning(planner, spec)
    if json_out:
        print(json.dumps({"seconds": result["seconds"], "peak_mib": result["peak_mib"]} | result))
        return
    print(f"{planner}: {result['samples']} samples planned in {result['seconds']:.3f} s "
          f"({result['vs_numpy_sort']:.1f}x numpy.sort of their lengths), peak {result['peak_mib']:.1f} MiB")


@app.command()
def pipeline(lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated sequence lengths of one step "
                                                  "(forward time units), e.g. 4,2,1,1.")],
             pp: Annotated[int, typer.Option(min=1, help="Pipeline stages.")] = 4,
             chunk_size: Annotated[float | None, typer.Option(help="State-aware 1F1B with this ChunkSize.")] = None,
             k: Annotated[int, typer.Option(min=1, help="Chunks of a chain that keep activations.")] = 1,
             bwd_ratio: Annotated[float, typer.Option(help="Backward time / forward time.")] = 2.0,
             json_out: Json = False) -> None:
    """Bubble ratio of one step through a pipeline: 1F1B, or ChunkFlow's state-aware 1F1B with --chunk-size."""
    from .sim.pipeline import Item, chunk_items, schedule

    try:
        xs = [float(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths {lengths!r}: expected comma-separated numbers like 4,2,1,1") from None
    if not xs or min(xs) <= 0 or pp < 1 or k < 1 or (chunk_size is not None and chunk_size <= 0) or bwd_ratio <= 0:
        raise ValueError("--lengths must be positive numbers, --pp and --k >= 1, --chunk-size and --bwd-ratio > 0")
    items = [Item(x) for x in xs] if chunk_size is None else chunk_items(xs, chunk_size, k)
    res = schedule(items, pp, bwd_ratio=bwd_ratio, k=k)
    out = {"bubble_ratio": res.bubble_ratio, "makespan": res.makespan, "useful": res.useful,
           "recompute": res.recompute}
    print(json.dumps(out) if json_out else f"bubble ratio {100 * res.bubble_ratio:.2f}% (makespan {res.makespan:g})")


Steps16 = Annotated[int, typer.Option(min=1, help="Global batches simulated per configuration.")]
RepSamples = Annotated[int, typer.Option(min=1, help="Samples drawn from each workload.")]


@reproduce_app.command("skrull")
def reproduce_skrull(steps: Steps16 = SKRULL_STEPS, samples: RepSamples = 50_000, seed: Seed = 0,
                     sweeps: Annotated[bool, typer.Option(help="Also run the Fig. 4a sweeps.")] = True,
                     json_out: Json = False) -> None:
    """Skrull's Fig. 3 speedups, Table 3 ablation and Fig. 4a sweeps, beside the paper's figures."""
    from .reproduce.skrull import reproduce

    result = reproduce(steps=steps, samples=samples, seed=seed, sweeps=sweeps)
    if json_out:
        print(json.dumps(result))
        return
    from .report.tables import skrull_tables

    skrull_tables(result)


@reproduce_app.command("chunkflow")
def reproduce_chunkflow(steps: Annotated[int, typer.Option(min=1, help="Global batches per configuration.")] =
                        CHUNKFLOW_STEPS,
                        samples: RepSamples = 50_000, seed: Seed = 0, json_out: Json = False) -> None:
    """ChunkFlow's pipeline toy, 7B speedups at 32K/256K, (ChunkSize, K) sweep and memory vs context."""
    from .reproduce.chunkflow import reproduce

    result = reproduce(steps=steps, samples=samples, seed=seed)
    if json_out:
        print(json.dumps(result))
        return
    from .report.tables import chunkflow_tables

    chunkflow_tables(result)


@app.command()
def calibrate(out: Annotated[Path, typer.Option(help="HardwareSpec JSON to write.")] = Path("calibrated.json"),
              model: Annotated[str, typer.Option(help="Model shape to time (random init).")] = "tiny-llama",
              base: Annotated[str, typer.Option(help="Hardware preset for memory and collectives.")] = "cpu",
              repeats: Annotated[int, typer.Option(min=1, help="Timed steps per grid point (median).")] = 3,
              threads: Annotated[int | None, typer.Option(min=1, help="torch threads (default: torch's).")] = None,
              nproc: Annotated[int, typer.Option(min=1, help="Processes timing each point at once (as in training).")]
              = 1,
              dtype: Annotated[str, typer.Option(help="float32 or bfloat16 (GPU).")] = "float32",
              grid: Annotated[str, typer.Option(help="cpu (512-4K tokens per pack) or gpu (8K-32K).")] = "cpu",
              json_out: Json = False) -> None:
    """Time real training steps on this machine, fit the cost model (least squares), save a HardwareSpec JSON."""
    from .model import get_model
    from .runtime.calibrate import GRIDS
    from .runtime.calibrate import calibrate as run

    if grid not in GRIDS:
        raise ValueError(f"--grid {grid!r}: choose one of {', '.join(GRIDS)}")
    hw, rep = run(get_model(model), base=base, repeats=repeats, threads=threads, nproc=nproc, dtype=dtype,
                  grid=GRIDS[grid])
    out.write_text(hw.to_json())
    if json_out:
        print(json.dumps(rep | {"out": str(out)}))
        return
    for p in rep["points"]:
        print(f"{p['docs']:3d} x {p['doc_len']:5d} tokens: measured {p['measured_s']:.4f} s, predicted "
              f"{p['predicted_s']:.4f} s ({100 * p['error']:+.1f}%)")
    print(f"fit error: rms {100 * rep['rms_relative_error']:.1f}%, max {100 * rep['max_relative_error']:.1f}% "
          f"({rep['device']}, {rep['threads']} threads); wrote {out}")


@app.command()
def report(out: Annotated[Path, typer.Option(help="HTML file to write (with --run: .png or .html).")] =
           Path("longpack-report.html"),
           run: Annotated[Path | None, typer.Option(help="A `longpack train` run's --output-dir/--log-dir: draw its "
                                                    "loss, lr, gradient norm and tokens/s per step instead.")] = None,
           planners: PlannerNames = "unified,fixed_cp,skrull,isf",
           baseline: Annotated[str, typer.Option(help="Planner the speedups are relative to.")] = "fixed_cp",
           workload: Workload = None, lengths: Lengths = None, column: Column = "length", samples: Samples = None,
           model: Model = "qwen2.5-0.5b", hardware: Hardware = "h100", dp: Dp = 1, cp: Cp = 1, tp: Tp = 1,
           pp: Pp = 1, global_batch: GlobalBatch = 256, steps: Annotated[int, typer.Option(min=1, help="Steps.")] = 4,
           seed: Seed = 0, token_cap: TokenCap = None, max_len: MaxLen = None, opt: Opt = None) -> None:
    """One self-contained HTML page: comparison table, per-rank load bars, step Gantt chart, memory, lengths; or,
    with --run, a training run's curves."""
    if run is not None:
        from .report.run_curves import write_run_report

        print(f"wrote {write_run_report(run, out)}")
        return
    from .report.html import build_report

    spec = jobs.RunSpec(workload=workload, lengths_file=lengths, column=column, samples=samples, model=model,
                        hardware=hardware, dp=dp, cp=cp, tp=tp, pp=pp, global_batch=global_batch, steps=steps,
                        seed=seed, token_cap=token_cap, max_len=max_len, options=_options(opt))
    names = [n.strip() for n in planners.split(",") if n.strip()]
    out.write_text(build_report(spec, names, baseline))
    print(f"wrote {out}")


@app.command()
def train(planner: PlannerName = "unified",
          workload: Workload = "tiny-longtail", lengths: Lengths = None, column: Column = "length",
          samples: Samples = None, model: Annotated[str, typer.Option(help="Model shape (random init).")] =
          "tiny-llama", hardware: Hardware = "cpu",
          cp: Annotated[int, typer.Option(min=1, help="Context-parallel degree (dp = processes / (cp x pp)).")] = 1,
          pp: Annotated[int, typer.Option(min=1, help="Pipeline stages: the decoder split over pp processes per "
                                          "plan rank, state-aware 1F1B; FSDP2 shards within each stage.")] = 1,
          global_batch: GlobalBatch = 32, steps: Steps = None, seed: Seed = 0,
          epochs: Annotated[int, typer.Option(min=1, help="Passes over the rows, each a new permutation (seeded "
                                              "by --seed and the epoch) planned as global batches of its own; "
                                              "--steps counts over all of them.")] = 1,
          token_cap: Annotated[int, typer.Option("--token-cap", "--bucket-size", min=0,
                                                 help="Token cap per rank per micro-batch; 0: the most the "
                                                      "--hardware memory takes at each checkpointing, from the "
                                                      "cost model. (--bucket-size: deprecated alias.)")] = 4096,
          max_len: MaxLen = None, overlong: Overlong = "split", opt: Opt = None,
          lr: Annotated[float, typer.Option(help="AdamW learning rate (the peak, with a schedule).")] = 1e-3,
          lr_scheduler: Annotated[str, typer.Option(help="constant, linear or cosine (decay to --min-lr over the "
                                                   "run's steps, after the warmup).")] = "constant",
          warmup_steps: Annotated[int, typer.Option(min=0, help="Steps of linear warmup to --lr.")] = 0,
          warmup_ratio: Annotated[float, typer.Option(min=0.0, max=0.999, help="Warmup as a share of the run's "
                                                     "steps (when --warmup-steps is 0).")] = 0.0,
          min_lr: Annotated[float, typer.Option(min=0.0, help="The rate linear and cosine decay end at.")] = 0.0,
          max_grad_norm: Annotated[float, typer.Option(min=0.0, help="Clip the global gradient norm (over every rank, "
                                                      "shard and stage) to this; 0: no clipping.")] = 1.0,
          weight_decay: Annotated[float, typer.Option(min=0.0, help="AdamW weight decay.")] = 0.0,
          loss: Annotated[str, typer.Option(help="token_mean or sequence_mean, exact over each step.")] =
          "token_mean",
          dtype: Annotated[str, typer.Option(help="float32, float64 or bfloat16.")] = "float32",
          checkpoint_dir: Annotated[str | None, typer.Option(help="Where checkpoints go.")] = None,
          checkpoint_every: Annotated[int, typer.Option(min=0, help="Save every N steps (0: never).")] = 0,
          resume: Annotated[bool, typer.Option(help="Continue from the latest checkpoint (an error when there is "
                                                   "none).")] = False,
          resume_if_present: Annotated[bool, typer.Option(help="Continue from the latest checkpoint if there is "
                                                              "one, else start at step 0.")] = False,
          threads: Annotated[int | None, typer.Option(min=1, help="torch threads per process (default: cores / "
                                                      "processes).")] = None,
          timeout: Annotated[float, typer.Option(help="Seconds a collective waits for the other ranks before the "
                                                 "run ends with one line naming the step.")] = 600.0,
          nproc: Annotated[int, typer.Option(min=1, help="Processes to spawn (ignored under torchrun).")] = 1,
          plan_ahead: Annotated[int, typer.Option(min=0, help="Steps planned ahead on a background thread while "
                                                  "earlier ones train (0: the whole run before step 0).")] = 4,
          data: Annotated[str | None, typer.Option(help="Tokenized SFT rows: JSONL, Parquet or a save_to_disk "
                                                   "folder with input_ids (+ labels or --mask-column), or "
                                                   "messages / text with --tokenizer.")] = None,
          mask_column: Annotated[str | None, typer.Option(help="0/1 target mask column of --data, e.g. "
                                                          "completion_mask or assistant_masks.")] = None,
          tokenizer: Tokenizer = None,
          cache_dir: Annotated[str | None, typer.Option(help="Where the rows' token store is cached (default: "
                                                        ".longpack-cache beside --data; README, 'Data').")] = None,
          num_proc: Annotated[int | None, typer.Option(min=1, help="Processes that read and tokenize the rows "
                                                       "(default: the cores available).")] = None,
          keep_untargeted: Annotated[bool, typer.Option(help="Keep rows with no target (e.g. no assistant turn) "
                                                        "in the plan; by default they are left out and counted."
                                                        )] = False,
          model_path: Annotated[str | None, typer.Option(help="Local Hugging Face checkpoint to fine-tune "
                                                         "(config.json + safetensors).")] = None,
          output_dir: Annotated[str | None, typer.Option(help="Write the trained model here as a Hugging Face "
                                                         "checkpoint (a new or empty folder).")] = None,
          overwrite_output_dir: Annotated[bool, typer.Option(help="Allow a non-empty --output-dir: its model files "
                                                             "are replaced.")] = False,
          eval_data: Annotated[str | None, typer.Option(help="Held-out rows (as --data): their exact mean loss, "
                                                        "run on the training engine, without an optimizer step."
                                                        )] = None,
          eval_every: Annotated[int, typer.Option(min=0, help="Evaluate every N steps (0: after the last step "
                                                  "only).")] = 0,
          report_to: Annotated[str, typer.Option(help="Also report the per-step metrics to: wandb (installed; "
                                                 "WANDB_MODE=offline without a network).")] = "",
          log_dir: Annotated[str | None, typer.Option(help="Per-step metrics.jsonl (and TensorBoard events when "
                                                      "tensorboard is installed); default: --output-dir.")] = None,
          fsdp: Annotated[bool, typer.Option(help="Shard parameters, gradients and AdamW state with FSDP2 over "
                                             "all processes; on one bfloat16 process, FSDP2 keeps them fp32 and "
                                             "computes in bf16 (--no-fsdp: all bf16).")] = True,
          shard: Annotated[str, typer.Option(help="FSDP2's gathers: step (whole weights and gradients while a step "
                                             "runs, one all-gather and one reduce-scatter a step), layer (ZeRO-3: "
                                             "per layer and pass) or auto (step when that takes at most a quarter "
                                             "of the --hardware memory, else layer).")] = "auto",
          ckpt_layers: Annotated[int, typer.Option(min=0, help="Checkpointed layers the plan starts from (the "
                                                   "planner may add more per micro-batch).")] = 0,
          dry_run: Annotated[bool, typer.Option(help="Run the first steps on fake tensors in this one process "
                                                "for each of --nproc ranks (the model from its config alone, no "
                                                "weights read) and print each rank's memory peak beside the cost "
                                                "model's prediction and the --hardware capacity.")] = False,
          dry_run_steps: Annotated[int, typer.Option(min=1, help="Steps a dry run plays.")] = 1,
          space_check: Annotated[bool, typer.Option(help="Check before step 0 that --output-dir and "
                                                    "--checkpoint-dir can be written and hold the final model and two "
                                                    "checkpoints (--no-space-check: skip).")] = True,
          dry_run_ranks: Annotated[str, typer.Option(help="Ranks a dry run plays: all, or e.g. 0,5.")] = "all",
          json_out: Json = False, config: Config = None) -> None:
    """Fine-tune a model on a plan for real with PyTorch (torchrun, or --nproc N local processes on gloo)."""
    import os

    from .runtime.preflight import check_checkpoint_dir, check_output_dir
    from .runtime.train_args import TrainArgs, check_layout, settings  # no torch yet: bad input is refused fast
    if workload is not None and lengths is not None:
        workload = None  # an explicit --lengths file wins over the default workload
    if data is not None:
        workload, lengths = None, None  # the rows' own lengths are planned
    run = jobs.RunSpec(workload=workload, lengths_file=lengths, column=column, samples=samples, model=model,
                       hardware=hardware, cp=cp, global_batch=global_batch, steps=steps, seed=seed,
                       token_cap=token_cap or None, max_len=max_len, overlong=overlong, options=_options(opt),
                       ckpt_layers=ckpt_layers, epochs=epochs)
    args = TrainArgs(planner=planner, run=run, lr=lr, lr_scheduler=lr_scheduler, warmup_steps=warmup_steps,
                     warmup_ratio=warmup_ratio, min_lr=min_lr, max_grad_norm=max_grad_norm,
                     weight_decay=weight_decay, loss=loss, dtype=dtype, checkpoint_dir=checkpoint_dir,
                     checkpoint_every=checkpoint_every, resume=resume, resume_if_present=resume_if_present,
                     threads=threads, timeout=timeout, json_log=json_out, data=data,
                     mask_column=mask_column, tokenizer=tokenizer, cache_dir=cache_dir, num_proc=num_proc,
                     keep_untargeted=keep_untargeted, model_path=model_path, output_dir=output_dir,
                     overwrite_output_dir=overwrite_output_dir, log_dir=log_dir, report_to=report_to,
                     eval_data=eval_data, eval_every=eval_every, fsdp=fsdp, shard=shard, pp=pp, plan_ahead=plan_ahead,
                     dry_run=dry_run, space_check=space_check)
    world = int(os.environ.get("WORLD_SIZE", nproc))
    check_output_dir(output_dir, model_path, checkpoint_dir, overwrite_output_dir, resume or resume_if_present)
    now = {k: v for k, v in settings(args, world).items() if k != "data-content"}  # the rows are not read yet
    check_checkpoint_dir(checkpoint_dir, resume or resume_if_present, now)
    check_layout(args, world)
    from .runtime.failure import one_line
    if dry_run:
        _dry_run(args, world, dry_run_steps, dry_run_ranks, json_out)
        return
    from .runtime.launch import launch
    from .runtime.train import train as run_train

    try:
        if "WORLD_SIZE" in os.environ:
            run_train(args)
        else:
            launch(args, nproc)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (this rank's error, one line; torch's BaseException ones too)
        rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        raise ValueError(f"{rank}{one_line(exc)}") from None


def _dry_run(args: Any, world: int, steps: int, ranks: str, json_out: bool) -> None:
    """`longpack train --dry-run` (runtime/dry_run.py), in this one process; its errors in one line."""
    import os

    from .runtime.dry_run import dry_run, parse_ranks
    from .runtime.failure import one_line

    if "WORLD_SIZE" in os.environ:
        raise ValueError("--dry-run runs in one process: start it without torchrun, with --nproc N for the world it "
                         "plays")
    parse_ranks(ranks, world)
    try:
        result = dry_run(args, world, steps, ranks)
    except Exception as exc:  # noqa: BLE001  (one line, as a run's own error)
        raise ValueError(f"--dry-run: {one_line(exc)}") from None
    if json_out:
        print(json.dumps(result))


@reproduce_app.command("hbp")
def reproduce_hbp(samples: Annotated[int, typer.Option(min=1, help="tulu3-longcite samples to plan.")] = 200_000,
                  seed: Seed = 0, packers: Annotated[bool, typer.Option(help="Also run Table 13's packers.")] = True,
                  unified: Annotated[bool, typer.Option(help="Also plan the same samples with unified (most of the "
                                                        "run time).")] = True,
                  json_out: Json = False) -> None:
    """HBP's Table 6 (ISF, +hierarchical, +balance), group selection (Tables 11/19) and Table 13 packers."""
    from .reproduce.hbp import reproduce

    result = reproduce(samples=samples, seed=seed, packers=packers, unified=unified)
    if json_out:
        print(json.dumps(result))
        return
    from .report.tables import hbp_tables

    hbp_tables(result)


@reproduce_app.command("all")
def reproduce_all(steps: Annotated[int | None, typer.Option(min=1, help="Global batches per configuration (default: "
                                                            "each seed's own, as `reproduce <seed>` runs it: "
                                                            "skrull 16, chunkflow 8).")] = None,
                  samples: RepSamples = 50_000,
                  hbp_samples: Annotated[int, typer.Option(min=1, help="tulu3-longcite samples for HBP's setup.")]
                  = 200_000,
                  seed: Seed = 0, json_out: Json = False) -> None:
    """Every seed's setup with the unified planner beside the seed's own: one verdict table, then each seed."""
    from .reproduce.all import reproduce

    result = reproduce(steps=steps, samples=samples, hbp_samples=hbp_samples, seed=seed)
    if json_out:
        print(json.dumps(result))
        return
    from .report.tables import chunkflow_tables, hbp_tables, skrull_tables, verdict_table

    verdict_table(result)
    skrull_tables(result["skrull"])
    chunkflow_tables(result["chunkflow"])
    hbp_tables(result["hbp"])


def main() -> None:
    """Entry point: run the app; user errors (bad flags included) become one line and exit code 2."""
    _deprecated(*(a[2:].split("=")[0] for a in sys.argv[1:] if a.startswith("--") and a[2:].split("=")[0]
                  in DEPRECATED))
    try:
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Abort:
        print("longpack: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:  # an unknown flag, a value out of range, a non-number
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]
            sys.exit(2)
        print(f"longpack: error: {exc.format_message().splitlines()[0]}", file=sys.stderr)  # type: ignore[attr-defined]
        sys.exit(2)
    except (ValueError, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"longpack: error: {msg}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
