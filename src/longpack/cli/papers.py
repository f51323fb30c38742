"""``longpack reproduce``: each paper's experiments in the simulator, beside its published figures."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..reproduce.all import CHUNKFLOW_STEPS, SKRULL_STEPS
from .app import reproduce_app
from .options import Json, Seed

Steps16 = Annotated[int, typer.Option(min=1, help="Global batches simulated per configuration.")]
RepSamples = Annotated[int, typer.Option(min=1, help="Samples drawn from each workload.")]


def _show(result: dict, json_out: bool, paper: str) -> None:
    """A reproduction's result as JSON, or as the paper's tables (report/tables.py)."""
    if json_out:
        print(json.dumps(result))
        return
    from ..report import tables

    getattr(tables, f"{paper}_tables")(result)


@reproduce_app.command("skrull")
def reproduce_skrull(steps: Steps16 = SKRULL_STEPS, samples: RepSamples = 50_000, seed: Seed = 0,
                     sweeps: Annotated[bool, typer.Option(help="Also run the Fig. 4a sweeps.")] = True,
                     json_out: Json = False) -> None:
    """Skrull's Fig. 3 speedups, Table 3 ablation and Fig. 4a sweeps, beside the paper's figures."""
    from ..reproduce.skrull import reproduce

    result = reproduce(steps=steps, samples=samples, seed=seed, sweeps=sweeps)
    _show(result, json_out, "skrull")


@reproduce_app.command("chunkflow")
def reproduce_chunkflow(steps: Annotated[int, typer.Option(min=1, help="Global batches per configuration.")] =
                        CHUNKFLOW_STEPS,
                        samples: RepSamples = 50_000, seed: Seed = 0, json_out: Json = False) -> None:
    """ChunkFlow's pipeline toy, 7B speedups at 32K/256K, (ChunkSize, K) sweep and memory vs context."""
    from ..reproduce.chunkflow import reproduce

    result = reproduce(steps=steps, samples=samples, seed=seed)
    _show(result, json_out, "chunkflow")


@reproduce_app.command("hbp")
def reproduce_hbp(samples: Annotated[int, typer.Option(min=1, help="tulu3-longcite samples to plan.")] = 200_000,
                  seed: Seed = 0, packers: Annotated[bool, typer.Option(help="Also run Table 13's packers.")] = True,
                  unified: Annotated[bool, typer.Option(help="Also plan the same samples with unified (most of the "
                                                        "run time).")] = True,
                  json_out: Json = False) -> None:
    """HBP's Table 6 (ISF, +hierarchical, +balance), group selection (Tables 11/19) and Table 13 packers."""
    from ..reproduce.hbp import reproduce

    result = reproduce(samples=samples, seed=seed, packers=packers, unified=unified)
    _show(result, json_out, "hbp")


@reproduce_app.command("all")
def reproduce_all(steps: Annotated[int | None, typer.Option(min=1, help="Global batches per configuration (default: "
                                                            "each seed's own, as `reproduce <seed>` runs it: "
                                                            "skrull 16, chunkflow 8).")] = None,
                  samples: RepSamples = 50_000,
                  hbp_samples: Annotated[int, typer.Option(min=1, help="tulu3-longcite samples for HBP's setup.")]
                  = 200_000,
                  seed: Seed = 0, json_out: Json = False) -> None:
    """Every seed's setup with the unified planner beside the seed's own: one verdict table, then each seed."""
    from ..reproduce.all import reproduce

    result = reproduce(steps=steps, samples=samples, hbp_samples=hbp_samples, seed=seed)
    if json_out:
        print(json.dumps(result))
        return
    from ..report.tables import chunkflow_tables, hbp_tables, skrull_tables, verdict_table

    verdict_table(result)
    skrull_tables(result["skrull"])
    chunkflow_tables(result["chunkflow"])
    hbp_tables(result["hbp"])


