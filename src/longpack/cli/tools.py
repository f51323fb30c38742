"""``longpack calibrate`` (fit the cost model to this machine) and ``longpack report`` (one HTML page, or a run's
curves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..runspec import RunSpec
from .app import app
from .options import (
    Column,
    Cp,
    Dp,
    GlobalBatch,
    Hardware,
    Json,
    Lengths,
    MaxLen,
    Model,
    Opt,
    PlannerNames,
    Pp,
    Samples,
    Seed,
    TokenCap,
    Tp,
    Workload,
    parse_options,
)


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
    from ..model import get_model
    from ..runtime.run.calibrate import GRIDS
    from ..runtime.run.calibrate import calibrate as run

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
           seed: Seed = 0, token_cap: TokenCap = 0, max_len: MaxLen = None, opt: Opt = None) -> None:
    """One self-contained HTML page: comparison table, per-rank load bars, step Gantt chart, memory, lengths; or,
    with --run, a training run's curves."""
    if run is not None:
        from ..report.run_curves import write_run_report

        print(f"wrote {write_run_report(run, out)}")
        return
    from ..report.html import build_report

    spec = RunSpec(workload=workload, lengths_file=lengths, column=column, samples=samples, model=model,
                        hardware=hardware, dp=dp, cp=cp, tp=tp, pp=pp, global_batch=global_batch, steps=steps,
                        seed=seed, token_cap=token_cap or None, max_len=max_len, options=parse_options(opt))
    names = [n.strip() for n in planners.split(",") if n.strip()]
    out.write_text(build_report(spec, names, baseline))
    print(f"wrote {out}")


