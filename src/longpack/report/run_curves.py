"""Curves of a `longpack train` run from its ``metrics.jsonl`` (runtime/run/metrics.py): training and held-out loss,
learning rate, gradient norm and tokens/s per step, as a PNG or a self-contained HTML page."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["read_run", "run_figure", "write_run_report"]


def read_run(run: str | Path) -> list[dict[str, Any]]:
    """The step lines of a run folder's metrics.jsonl (the last line per step: a resumed run appends)."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--run {run}: no metrics.jsonl there; give the --output-dir (or --log-dir) of a "
                         "`longpack train` run")
    steps: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            rec = json.loads(line)
            steps[int(rec["step"])] = rec
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: not a metrics line; the file is damaged") from None
    if not steps:
        raise ValueError(f"--run {run}: metrics.jsonl has no steps yet")
    return [steps[k] for k in sorted(steps)]


def run_figure(steps: list[dict[str, Any]]) -> Any:
    """Loss (train, and held-out where evaluated), lr, gradient norm and tokens/s against the step."""
    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    loss = axes[0][0]
    loss.plot(x, [s["loss"] for s in steps], label="train")
    held = [(s["step"], s["eval_loss"]) for s in steps if "eval_loss" in s]
    if held:
        loss.plot(*zip(*held, strict=True), "o-", label="held-out")
    loss.set_title("loss")
    loss.legend()
    for ax, key, title in ((axes[0][1], "lr", "learning rate"), (axes[1][0], "grad_norm", "gradient norm"),
                           (axes[1][1], "tokens_per_second", "tokens/s")):
        ax.plot(x, [s.get(key, float("nan")) for s in steps])
        ax.set_title(title)
    for row in axes:
        for ax in row:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_run_report(run: str | Path, out: str | Path) -> Path:
    """The run's curves into ``out``: a PNG when it ends in .png, else an HTML page holding the PNG."""
    steps = read_run(run)
    fig = run_figure(steps)
    out = Path(out)
    if out.suffix.lower() == ".png":
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    last = steps[-1]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in last.items()
                   if isinstance(v, (int, float)))
    out.write_text(f"<!doctype html><meta charset=utf-8><title>longpack run {html.escape(str(run))}</title>"
                   f"<h1>longpack run {html.escape(str(run))}</h1><p>{len(steps)} steps</p>"
                   f"<img alt='curves' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"
                   f"<h2>last step</h2><table>{rows}</table>")
    return out
