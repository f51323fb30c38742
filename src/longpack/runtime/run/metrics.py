"""Per-step metrics of `longpack train` in files: ``metrics.jsonl`` (one JSON object per step) and, when the
``tensorboard`` package is installed, TensorBoard event files through ``torch.utils.tensorboard``.

With ``--report-to wandb`` (the ``wandb`` package installed; ``WANDB_MODE=offline`` without a network) the same
lines go to a Weights & Biases run whose files live in the log folder.

Rank 0 writes them in ``--log-dir`` (default ``--output-dir``), flushed every step so a killed run keeps what it
trained; a resumed run drops the lines of the steps it trains again (those the killed run logged after its last
checkpoint) and appends, so each step is there once. Each line: step, loss, eval_loss (steps that evaluated), lr,
grad_norm, tokens, targets, tokens_per_second, step_seconds, planner_wait_seconds, the largest measured and
predicted memory over ranks (bytes), and (the file alone) the step's sample ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "LOG_FILES", "REPORTERS"]

LOG_FILES = ("metrics.jsonl", "events.out.tfevents.*", "wandb")  # what a resumed run may find in its --output-dir
REPORTERS = ("wandb",)


class MetricsLog:
    def __init__(self, directory: str | Path, report_to: tuple[str, ...] = (), config: dict | None = None,
                 resumed_at: int | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        if resumed_at is not None:
            _drop_from(self.dir / "metrics.jsonl", resumed_at)
        self.file = (self.dir / "metrics.jsonl").open("a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.board: Any = SummaryWriter(log_dir=str(self.dir))
        except ImportError:  # tensorboard not installed: the JSON lines alone
            self.board = None
        self.wandb: Any = None
        if "wandb" in report_to:
            import wandb

            self.wandb = wandb.init(project="longpack", dir=str(self.dir), config=config or {})

    def step(self, rec: dict[str, Any]) -> None:
        mem = rec.get("memory", {})
        line: dict[str, Any] = {k: rec[k] for k in ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens", "targets",
                                    "step_seconds", "planner_wait_seconds") if k in rec}
        line["tokens_per_second"] = rec["tokens"] / rec["step_seconds"] if rec.get("step_seconds") else 0.0
        if mem:
            line["memory_measured_bytes"] = max(mem["measured_bytes"])
            line["memory_predicted_bytes"] = max(mem["predicted_bytes"])
        self.file.write(json.dumps({**line, "samples": rec["samples"]} if "samples" in rec else line) + "\n")
        self.file.flush()
        if self.board is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_second", "memory_measured_bytes"):
                if key in line:
                    self.board.add_scalar(f"train/{key}", line[key], line["step"])
            if "eval_loss" in line:
                self.board.add_scalar("eval/loss", line["eval_loss"], line["step"])
            self.board.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in line.items() if k != "step"}, step=line["step"])

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.board is not None:
            self.board.close()


def _drop_from(path: Path, step: int) -> None:
    """Keep the lines of ``path`` whose step is before ``step`` (a cut last line goes too), written atomically."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line)["step"]) < step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut by the kill
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
    tmp.replace(path)
