"""Checkpoints with ``torch.distributed.checkpoint``: each rank writes its shard of the model and optimizer.

A checkpoint is the folder ``step_NNNNNNNN`` in the checkpoint directory: DCP's files (sharded state of FSDP2
parameters and AdamW moments, or the whole state without FSDP) plus ``longpack.json`` (step, sampler position,
the run's settings, the world it was written on, a fingerprint of the global batches trained so far, RNG state,
and a SHA-256 of every other file). It is written under a temporary name and renamed once every rank has finished,
so a crash never leaves a half-written checkpoint under a real name; a checkpoint damaged later (a file changed,
cut or missing) fails its checksums (:func:`newest`), is named, and the previous one is used.

Every rank writes one form whatever the layout (``FORM``): the whole model's names (a pipeline stage's layers
under their global indices) and flat optimizer state, one key per parameter's tensor. DCP stores each tensor's
global shape and the shards written, so a checkpoint loads into any layout (:func:`load`): FSDP2 over another
number of ranks, no FSDP, other pipeline stages — DCP reads each rank's part of every tensor it now holds. What
a resume may change, and how it continues: runtime/run/resume.py. Checksums assume the folder is visible to rank 0
(one machine, or a shared file system).
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

__all__ = ["save", "newest", "load", "damage", "plan_fingerprint", "steps_fingerprint", "META", "FORM"]

META = "longpack.json"
FORM = "flat-global"  # the state's form in checkpoints that load into any layout (absent: a nested, one-layout one)


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


def _options(flat: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True) if flat else None


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, first_layer: int | None, flat: bool = True
           ) -> dict[str, Any]:
    """Model and optimizer state: flat (one key per tensor, optimizer keys named by parameter) under the whole
    model's layer indices (a pipeline stage's ``first_layer`` added), so stages write disjoint keys, data-parallel
    replicas the same ones, and any layout reads them; ``flat`` False: torch's nested form (older checkpoints)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # DCP: imported by runs that checkpoint

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(flat))
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
        import torch.distributed.checkpoint as dcp

        dcp.save(_state(model, optimizer, first_layer), checkpoint_id=str(tmp))
        if rank == 0:
            rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
            files = {p.name: _sha(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            meta = {"step": step, **record, "form": FORM, "torch_rng": rng, "files": files}
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


def newest(directory: str | Path, warn: Any = None) -> dict[str, Any] | None:
    """The metadata of the newest intact checkpoint in ``directory`` (its folder under ``"path"``), or None if
    none. A damaged checkpoint is reported through ``warn(line)`` and the one before it tried. Cost: one read of
    each file checked (its SHA-256)."""
    done = sorted((p for p in Path(directory).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                  reverse=True)
    for folder in done:
        why = damage(folder)
        if why is None:
            meta = json.loads((folder / META).read_text())
            meta["path"] = str(folder)
            return dict(meta)
        if warn is not None:
            warn(f"checkpoint {folder} is damaged ({why}); skipping it for the one before")
    return None


def load(meta: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         first_layer: int | None = None) -> None:
    """Load the checkpoint ``meta`` describes (:func:`newest`) into ``model`` and ``optimizer``, whatever their
    layout now (FSDP2 or not, this rank's pipeline stage from ``first_layer`` as in :func:`save`), and restore
    torch's RNG."""
    flat = meta.get("form") == FORM or first_layer is not None  # pipeline stages always wrote the flat form
    state = _state(model, optimizer, first_layer, flat)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    dcp.load(state, checkpoint_id=meta["path"])  # into the state's own tensors: each rank reads its shards
    shift = -(first_layer or 0)
    set_state_dict(model, optimizer, model_state_dict=_renamed(state["model"], shift),
                   optim_state_dict=_renamed(state["optim"], shift), options=_options(flat))
    rng = np.frombuffer(base64.b64decode(meta["torch_rng"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(rng))
