"""Checkpoints with ``torch.distributed.checkpoint``: each rank writes its shard of the model and optimizer.

A checkpoint is the folder ``step_NNNNNNNN`` in the checkpoint directory: DCP's files (sharded state of FSDP2
parameters and AdamW moments, or the whole state without FSDP) plus ``longpack.json`` (step, sampler position,
the run's settings that must not change, a fingerprint of the steps trained so far, RNG state, and a SHA-256 of
every other file). It is written under a temporary name and renamed once every rank has finished, so a crash never
leaves a half-written checkpoint under a real name; a checkpoint damaged later (a file changed, cut or missing)
fails its checksums on load, is named, and the previous one is used. Resuming rebuilds the plan
deterministically, refuses a changed setting by name, checks that the new plan begins with the steps already
trained (so a run can be extended with a larger ``--steps``) and continues at the exact next step: the remaining
sample order and the final weights equal an uninterrupted run's. Under pipeline parallelism each stage writes its
layers under the whole model's indices (flat optimizer state, one key per tensor), so stages never collide.
Checksums assume the folder is visible to rank 0 (one machine, or a shared file system).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save", "load_latest", "damage", "plan_fingerprint", "steps_fingerprint", "META"]

META = "longpack.json"


def plan_fingerprint(plan_json: str) -> str:
    return hashlib.sha256(plan_json.encode()).hexdigest()[:16]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def steps_fingerprint(plan_steps: list[Any]) -> str:
    """Fingerprint of a plan's first steps (their JSON), the part a resumed run must repeat exactly."""
    return plan_fingerprint(json.dumps(plan_steps, sort_keys=True, separators=(",", ":")))


_LAYER = re.compile(r"(^|\.)model\.layers\.(\d+)\.")


def _renamed(state: dict[str, Any], shift: int) -> dict[str, Any]:
    """``state`` with decoder layer indices moved by ``shift`` (a pipeline stage's local names <-> the whole
    model's): the same tensors under other keys."""
    if not shift:
        return state
    return {_LAYER.sub(lambda m: f"{m.group(1)}model.layers.{int(m.group(2)) + shift}.", k): v
            for k, v in state.items()}


def _options(first_layer: int | None) -> StateDictOptions | None:
    return StateDictOptions(flatten_optimizer_state_dict=True) if first_layer is not None else None


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, first_layer: int | None) -> dict[str, Any]:
    """Model and optimizer state. For a pipeline stage (``first_layer`` given): flat (one key per tensor, optimizer
    keys named by parameter) under the whole model's layer indices, so stages write disjoint keys and data-parallel
    replicas the same ones; otherwise torch's nested form."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(first_layer))
    shift = first_layer or 0
    return {"model": _renamed(model_sd, shift), "optim": _renamed(optim_sd, shift)}


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(directory: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         record: dict[str, Any], rank: int, first_layer: int | None = None) -> Path:
    """Write step ``step``'s checkpoint (every rank calls it); ``record``: the run's JSON for the metadata (the
    sampler's state, the plan's fingerprint, the settings, the learning-rate scheduler's state); ``first_layer``:
    under pipeline parallelism, the global index of this rank's stage's first decoder layer."""
    final = Path(directory) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    failed = None
    try:
        dcp.save(_state(model, optimizer, first_layer), checkpoint_id=str(tmp))
        if rank == 0:
            rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
            files = {p.name: _sha(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            meta = {"step": step, **record, "torch_rng": rng, "files": files}
            (tmp / META).write_text(json.dumps(meta))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (DCP's CheckpointException derives from BaseException)
        failed = _reason(exc, final.parent)
    failed = _any(failed)  # every rank stops alike, none waits for a peer that left
    if failed is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise ValueError(f"--checkpoint-dir {directory}: step {step}'s checkpoint could not be written ({failed}); "
                         "the run stopped, its last complete checkpoint is kept (--resume continues from it)")
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def _reason(exc: BaseException, folder: Path) -> str:
    """What failed, in the OS's words where an OS error is behind it (each rank's, for DCP's exception); a writer
    that lost the OS's error (torch's file writer says only where it stopped) on a full disk: the disk is full."""
    inner = [e for e, _ in getattr(exc, "failures", {}).values()] if hasattr(exc, "failures") else []
    for e in (*inner, exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.strerror:
            return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    try:
        if shutil.disk_usage(folder).free < 1 << 20:
            return f"No space left on device ({shutil.disk_usage(folder).free >> 10} KiB free)"
    except OSError:
        pass
    e = inner[0] if inner else exc
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _any(failed: str | None) -> str | None:
    """The first rank's failure, seen by every rank (one small collective); ``failed`` alone in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failed
    seen: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, failed)
    return next((f for f in seen if f is not None), None)


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint ``folder`` (one phrase), or None when its metadata and checksums hold."""
    try:
        meta = json.loads((folder / META).read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{META} is missing or unreadable"
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha(path) != digest:
            return f"{name} does not match its checksum"
    return None


def load_latest(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                warn: Any = None, first_layer: int | None = None) -> dict[str, Any] | None:
    """Load the newest intact checkpoint into ``model`` and ``optimizer``; its metadata, or None if none.
    A damaged checkpoint is reported through ``warn(line)`` and the one before it tried. ``first_layer``: as in
    :func:`save`."""
    done = sorted((p for p in Path(directory).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                  reverse=True)
    latest = None
    for folder in done:
        why = damage(folder)
        if why is None:
            latest = folder
            break
        if warn is not None:
            warn(f"checkpoint {folder} is damaged ({why}); skipping it for the one before")
    if latest is None:
        return None
    meta = json.loads((latest / META).read_text())
    state = _state(model, optimizer, first_layer)
    dcp.load(state, checkpoint_id=str(latest))  # into the state's own tensors
    shift = -(first_layer or 0)
    set_state_dict(model, optimizer, model_state_dict=_renamed(state["model"], shift),
                   optim_state_dict=_renamed(state["optim"], shift), options=_options(first_layer))
    rng = np.frombuffer(base64.b64decode(meta["torch_rng"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(rng))
    meta["path"] = str(latest)
    return meta
