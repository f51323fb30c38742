"""The run's output: a consolidated Hugging Face checkpoint gathered from every rank's shard or stage."""

from __future__ import annotations

from typing import Any

import torch

from .dist import DistContext
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
    if ctx.rank == 0 and args.output_dir:
        keep = None if args.dtype == "float64" else (torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
        save(model, state, args.output_dir, tokenizer=args.tokenizer, dtype=keep)
    if ctx.distributed:
        torch.distributed.barrier()
