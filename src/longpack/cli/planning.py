"""The planning commands: ``stats``, ``plan``, ``simulate``, ``compare``, ``pipeline`` and ``bench planning`` —
each parses its flags, calls one job (longpack/jobs.py) and prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from .. import jobs
from ..report.tables import METRICS
from .app import app, bench_app
from .options import (
    COMPARE_STEPS,
    AllColumns,
    Ckpt,
    Column,
    CompareSteps,
    Cp,
    Dp,
    Epoch,
    GlobalBatch,
    Hardware,
    Json,
    Lengths,
    MaxLen,
    MicroBatchSize,
    Model,
    Opt,
    Overlong,
    PackLen,
    PlannerName,
    PlannerNames,
    Pp,
    Samples,
    Seed,
    Steps,
    TokenCap,
    Tokenizer,
    Tp,
    Workload,
    World,
    Zero,
    run_spec,
)


@app.command()
def stats(workload: Workload = None, lengths: Lengths = None, column: Column = "length",
          tokenizer: Tokenizer = None, samples: Samples = None, seed: Seed = 0, json_out: Json = False) -> None:
    """Length histogram and quantiles of a workload or a file."""
    from ..workloads import WORKLOADS

    spec = jobs.RunSpec(workload=workload, lengths_file=lengths, column=column, tokenizer=tokenizer,
                        samples=samples, seed=seed)
    if workload is None and lengths is None:
        raise ValueError("give --workload NAME or --lengths FILE; workloads: " + ", ".join(WORKLOADS))
    data = jobs.length_stats(jobs.load_workload(spec)[0])
    if json_out:
        print(json.dumps(data))
        return
    from ..report.tables import stats_table

    stats_table(data, workload or lengths or "")


@app.command()
def plan(planner: PlannerName = "unified",
         out: Annotated[Path | None, typer.Option(help="Write the Plan JSON here (default: stdout).")] = None,
         workload: Workload = None, lengths: Lengths = None, column: Column = "length", tokenizer: Tokenizer = None,
         samples: Samples = None, model: Model = "qwen2.5-0.5b", hardware: Hardware = "h100", dp: Dp = 1,
         cp: Cp = 1, tp: Tp = 1, pp: Pp = 1, world: World = None, zero_stage: Zero = 2, ckpt_layers: Ckpt = 0,
         token_cap: TokenCap = 0, global_batch: GlobalBatch = 256, steps: Steps = None, seed: Seed = 0,
         max_len: MaxLen = None, overlong: Overlong = "split", pack_len: PackLen = None,
         micro_batch_size: MicroBatchSize = None, opt: Opt = None) -> None:
    """Plan the workload with one planner and write the validated Plan JSON."""
    spec = run_spec(workload, lengths, column, tokenizer, samples, model, hardware, dp, cp, tp, pp, world,
                   zero_stage, ckpt_layers, token_cap, global_batch, steps, seed, max_len, overlong, pack_len,
                   micro_batch_size, opt)
    from ..progress import meter
    from ..sim import simulate as sim

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
    from ..report.tables import compare_table

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
            zero_stage: Zero = 2, ckpt_layers: Ckpt = 0, token_cap: TokenCap = 0,
            global_batch: GlobalBatch = 256, steps: CompareSteps = None, epoch: Epoch = False, seed: Seed = 0,
            max_len: MaxLen = None, overlong: Overlong = "split", pack_len: PackLen = None,
            micro_batch_size: MicroBatchSize = None, opt: Opt = None, all_columns: AllColumns = False,
            json_out: Json = False) -> None:
    if epoch and steps is not None:
        raise ValueError("give --steps N or --epoch, not both")
    if not epoch and steps is None:
        steps = COMPARE_STEPS
    spec = run_spec(workload, lengths, column, tokenizer, samples, model, hardware, dp, cp, tp, pp, world,
                   zero_stage, ckpt_layers, token_cap, global_batch, steps, seed, max_len, overlong, pack_len,
                   micro_batch_size, opt)
    names = [n.strip() for n in planners.split(",") if n.strip()]
    result = jobs.compare(spec, names, baseline)
    if json_out:
        print(json.dumps(result))
        return
    from ..report.tables import compare_table

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
    from ..sim.pipeline import Item, chunk_items, schedule

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


