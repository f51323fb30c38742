"""Checkpoints with ``torch.distributed.checkpoint``: each rank writes its shard of the model and optimizer.

A checkpoint is the folder ``step_NNNNNNNN`` in the checkpoint directory: DCP's files (sharded state of FSDP2
parameters and AdamW moments, or the whole state without FSDP) plus ``longpack.json`` (step, sampler position,
plan fingerprint, RNG state). It is written under a temporary name and renamed once every rank has finished, so
a crash never leaves a half-written checkpoint under a real name. Resuming rebuilds the plan deterministically
from the same arguments, checks it against the stored fingerprint and continues at the exact next step, so the
remaining sample order and the final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["save", "load_latest", "plan_fingerprint", "META"]

META = "longpack.json"


def plan_fingerprint(plan_json: str) -> str:
    return hashlib.sha256(plan_json.encode()).hexdigest()[:16]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(directory: str | Path, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         sampler: dict[str, int], fingerprint: str, rank: int) -> Path:
    final = Path(directory) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if rank == 0:
        rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        meta = {"step": step, "sampler": sampler, "plan": fingerprint, "torch_rng": rng}
        (tmp / META).write_text(json.dumps(meta))
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def load_latest(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                ) -> dict[str, Any] | None:
    """Load the newest complete checkpoint into ``model`` and ``optimizer``; its metadata, or None if none."""
    done = sorted(p for p in Path(directory).glob("step_*") if p.is_dir() and (p / META).is_file()
                  and not p.name.endswith(".tmp"))
    if not done:
        return None
    latest = done[-1]
    meta = json.loads((latest / META).read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(latest))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = np.frombuffer(base64.b64decode(meta["torch_rng"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(rng))
    meta["path"] = str(latest)
    return meta
