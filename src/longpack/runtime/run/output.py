"""The run's output: a consolidated Hugging Face checkpoint gathered from every rank's shard or stage.

If it cannot be written (a full or failing disk), the trained weights are not lost: rank 0 still holds them whole
and writes them to the checkpoint folder (``--checkpoint-dir``/final-model), or else to the temporary folder, and
the run ends with one line saying where."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..dist import DistContext
from .train_args import TrainArgs

__all__ = ["save_output"]


def save_output(args: TrainArgs, model: Any, ctx: DistContext, pipe: Any = None) -> None:
    """A consolidated Hugging Face checkpoint (rank 0 writes; every rank takes part in gathering)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .hf_model import save

    if pipe is not None:  # the stages' tensors, gathered under the whole model's names, into a full skeleton
        from transformers import AutoModelForCausalLM

        from .stage_state import gather_state

        state: Any = gather_state(model, pipe.layout)
        if ctx.rank == 0:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(model.config)
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failed: str | None = None
    if ctx.rank == 0 and args.out.output_dir:
        dtype = args.model.dtype
        keep = None if dtype == "float64" else (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        try:
            save(model, state, args.out.output_dir, tokenizer=args.data.tokenizer, dtype=keep)
        except Exception as exc:  # noqa: BLE001  (a disk's error, in whatever type the writer raises it)
            failed = _rescue(args, model, state, keep, exc)
    if ctx.distributed:
        torch.distributed.barrier()  # every rank leaves together; the failure is rank 0's to say
    if failed:
        raise ValueError(failed)


def _rescue(args: TrainArgs, model: Any, state: Any, keep: Any, exc: Exception) -> str:
    """Write the weights where they fit after ``--output-dir`` failed; the one line that says what happened."""
    import shutil
    import tempfile
    from pathlib import Path

    from .hf_model import save
    from .preflight import STALE_WEIGHTS

    for partial in (f for pattern in STALE_WEIGHTS for f in Path(args.out.output_dir).glob(pattern)):
        partial.unlink(missing_ok=True)  # a cut file would load as a broken model
    why = _reason(exc)
    rescue = (Path(args.out.checkpoint_dir) / "final-model" if args.out.checkpoint_dir
              else Path(tempfile.gettempdir()) / f"longpack-final-model-{os.getpid()}")
    try:
        save(model, state, rescue, tokenizer=args.data.tokenizer, dtype=keep)
    except Exception as again:  # noqa: BLE001
        shutil.rmtree(rescue, ignore_errors=True)
        last = f"; the last complete checkpoint in {args.out.checkpoint_dir} holds the run up to it" \
            if args.out.checkpoint_dir else ""
        return (f"--output-dir {args.out.output_dir}: the trained model could not be written ({why}), nor to {rescue} "
                f"({_reason(again)}){last}")
    return (f"--output-dir {args.out.output_dir}: the trained model could not be written ({why}); it was written to "
            f"{rescue} instead (AutoModelForCausalLM.from_pretrained loads it)")


def _reason(exc: BaseException) -> str:
    """An OS error's own words (``No space left on device``), else the error's first line."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("I/O error: ")[-1].split(" (os error")[0]
