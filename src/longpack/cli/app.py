"""The ``longpack`` Typer apps (the command groups register on them: planning.py, train_cmd.py, tools.py,
papers.py)."""

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, simulate and compare packing/balancing schedules for long-context SFT.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks of longpack itself.")
app.add_typer(bench_app, name="bench")
reproduce_app = typer.Typer(no_args_is_help=True, help="Re-run a paper's experiments in the simulator.")
app.add_typer(reproduce_app, name="reproduce")
