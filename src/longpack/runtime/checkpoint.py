"""Checkpoints: model, optimizer, sampler position and RNG states in one file per step (rank 0 writes).

Resuming restores the exact next step of the plan (the plan itself is rebuilt deterministically from the same
arguments and checked against the fingerprint stored in the checkpoint), so the remaining sample order and the
final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["save", "load_latest", "plan_fingerprint"]


def plan_fingerprint(plan_json: str) -> str:
    return hashlib.sha256(plan_json.encode()).hexdigest()[:16]


def save(directory: str | Path, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         sampler: dict[str, int], fingerprint: str) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:08d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler,
                "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(), "plan": fingerprint}, tmp)
    tmp.replace(path)  # atomic: a crash never leaves a half-written checkpoint behind
    return path


def load_latest(directory: str | Path) -> dict[str, Any] | None:
    files = sorted(Path(directory).glob("step_*.pt"))
    if not files:
        return None
    state = torch.load(files[-1], map_location="cpu", weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    return state
