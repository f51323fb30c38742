"""Checks of `longpack train`'s folders made before anything is spawned, loaded or trained: one line each.

* ``--output-dir``: not an existing file, not the ``--model-path`` folder (nor inside it), and empty unless
  ``--overwrite-output-dir`` (as transformers spells it) — entries that are the run's own ``--checkpoint-dir``
  aside. It is created here, so a folder that cannot be made fails now, not after training.
* space (:func:`check_space`, before step 0): each folder the run writes takes a probe file (a read-only mount or
  folder is refused now), and its filesystem's free space must hold what the run will write there: the final
  model, and two checkpoints (model and AdamW state: the one written and the one before it) — refused naming
  the folder, the need and the free space, unless ``--no-space-check``.
* ``--checkpoint-dir``: a fresh run (no ``--resume``) refuses a folder holding another run's checkpoints, which it
  would interleave with its own; a resume compares the settings recorded in the newest checkpoint's metadata with
  this run's now, before the ranks load the model: a setting that changes what is trained is refused, the layout
  may change (same_run.LAYOUT). The ranks check again on load, with the checksums, the data's content and the
  global batches (runtime/run/resume.py).

Cost: a directory listing and one small JSON read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .same_run import refuse_changed

__all__ = ["check_output_dir", "check_checkpoint_dir", "check_model_dir", "check_space", "STALE_WEIGHTS"]

STALE_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_dir(output_dir: str | None, model_path: str | None, checkpoint_dir: str | None,
                     overwrite: bool, resuming: bool = False) -> None:
    """See the module docstring; ``resuming``: the run's own metrics files there are expected."""
    from .metrics import LOG_FILES

    if not output_dir:
        return
    out = Path(output_dir).resolve()
    flag = f"--output-dir {output_dir}"
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag}: is a file, not a folder; give a folder to write the trained model into")
    if model_path and _inside(out, Path(model_path).resolve()):
        raise ValueError(f"{flag}: is the --model-path folder the run starts from (its weights would be "
                         "overwritten); give another folder")
    if out.is_dir():
        ckpt = Path(checkpoint_dir).resolve() if checkpoint_dir else None
        entries = [e for e in out.iterdir() if (ckpt is None or not _inside(ckpt, e))
                   and not (resuming and any(e.match(pattern) for pattern in LOG_FILES))]
        if entries and not overwrite:
            names = ", ".join(sorted(e.name for e in entries)[:3]) + (", ..." if len(entries) > 3 else "")
            raise ValueError(f"{flag}: is not empty ({len(entries)} entries: {names}); give a new or empty folder, "
                             "or --overwrite-output-dir to replace the model files there")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot be created ({exc.strerror}); give a folder you can write to") from None
    if not os.access(out, os.W_OK):
        raise ValueError(f"{flag}: is not writable; give a folder you can write to")


def _newest(directory: Path) -> Path | None:
    done = sorted((p for p in directory.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)
    return done[0] if done else None


def check_checkpoint_dir(checkpoint_dir: str | None, resuming: bool, now: dict[str, Any]) -> None:
    """``now``: this run's settings by flag (runtime/run/same_run.settings), compared with the newest checkpoint's."""
    if not checkpoint_dir or not Path(checkpoint_dir).is_dir():
        return
    newest = _newest(Path(checkpoint_dir))
    if newest is None:
        return
    if not resuming:
        raise ValueError(f"--checkpoint-dir {checkpoint_dir}: holds another run's checkpoints (newest "
                         f"{newest.name}); continue it with --resume, or give an empty folder")
    try:
        then = json.loads((newest / "longpack.json").read_text()).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return  # damaged: the ranks name it and fall back to the one before
    refuse_changed(then, now, f"--resume: the checkpoint {newest}")


def check_model_dir(path: str | Path, weights: bool = True) -> None:
    """Refuse a ``--model-path`` that is not a folder written by ``save_pretrained``: no config.json, or (unless
    ``weights`` is False: a dry run reads the config alone) no weight files (*.safetensors, *.bin) beside it."""
    p = Path(path)
    files = {f.name for f in p.iterdir()} if p.is_dir() else set()
    if "config.json" not in files:
        raise ValueError(f"--model-path {path}: no config.json there; give a folder written by save_pretrained")
    if weights and not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise ValueError(f"--model-path {path}: no weights there (*.safetensors or *.bin); give a folder written "
                         "by save_pretrained")


def _probe(folder: Path, flag: str) -> None:
    """Write and remove a file in ``folder`` (made if missing): a read-only or full folder fails here."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".longpack-probe-{os.getpid()}"
        with probe.open("wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{flag} {folder}: cannot write there ({exc.strerror}); give a folder you can write to"
                         ) from None


def check_space(output_dir: str | None, checkpoint_dir: str | None, params: float, out_bytes: int,
                state_bytes: int) -> None:
    """The folders' probe and free space (module docstring): the final model ``params`` x ``out_bytes``, a
    checkpoint ``params`` x (1 + 2) x ``state_bytes`` (the weights and AdamW's two moments)."""
    import shutil

    needs: dict[int, list[tuple[str, Path, float, str]]] = {}
    if output_dir:
        out = Path(output_dir)
        _probe(out, "--output-dir")
        needs.setdefault(out.stat().st_dev, []).append(("--output-dir", out, params * out_bytes, "the final model"))
    if checkpoint_dir:
        ck = Path(checkpoint_dir)
        _probe(ck, "--checkpoint-dir")
        ckpt = params * 3 * state_bytes
        needs.setdefault(ck.stat().st_dev, []).append(("--checkpoint-dir", ck, 2 * ckpt,
                                                      f"2 checkpoints of {ckpt / 2**30:.2f} GiB"))
    for group in needs.values():
        flag, folder, _, _ = group[-1]
        need = sum(n for _, _, n, _ in group)
        free = shutil.disk_usage(folder).free
        if need > free:
            what = " and ".join(f"{w} ({f})" for f, _, _, w in group)
            raise ValueError(f"{flag} {folder}: {free / 2**30:.2f} GiB free, the run writes about "
                             f"{need / 2**30:.2f} GiB there: {what}; free some space, give a folder on another disk, "
                             "or --no-space-check")
