"""The whole model's weights from pipeline stages: names made global, and rank 0's copy gathered point to point.

Each stage's first plan rank holds its stage's tensors (FSDP2 shards gathered within the stage first). Rank 0 (stage
0) receives every later stage's tensors one by one in name order with ``send``/``recv`` on the model's device —
what NCCL accepts: no pickled objects, no tags. The names and shapes it expects come from a ``meta`` skeleton of the
whole model and the stage bounds, and a count sent first makes a disagreement an error, not a hang. Cost: one
message per tensor; rank 0 holds the whole state on the host, as a consolidated save needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..kernel.pipeline import Layout, stage_bounds

__all__ = ["global_names", "gather_state"]


def global_names(model: Any, stage: int, pp: int, keys: Any = None) -> dict[str, str]:
    """A stage model's parameter names (or state-dict ``keys``) -> the whole model's (layer indices made global)."""
    a = stage_bounds(model.config.num_hidden_layers, pp)[stage][0]
    out = {}
    for name in (keys if keys is not None else [n for n, _ in model.named_parameters()]):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(a + int(parts[2]))
        out[name] = ".".join(parts)
    return out


def _owned(key: str, stage: int, pp: int, bounds: tuple[int, int]) -> bool:
    """Whether the whole model's tensor ``key`` lives on ``stage`` alone (its layers; the embeddings on the first
    stage; the final norm and LM head on the last) — what a later stage sends."""
    parts = key.split(".")
    if parts[:2] == ["model", "layers"]:
        return bounds[0] <= int(parts[2]) < bounds[1]
    if parts[:2] == ["model", "embed_tokens"]:
        return stage == 0
    return stage == pp - 1 and (parts[:2] == ["model", "norm"] or parts[0] == "lm_head")


def gather_state(model: Any, layout: Layout) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, on the host of global rank 0 (None elsewhere). Every rank calls it."""
    from torch.distributed.tensor import DTensor

    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    names = global_names(model, layout.stage, layout.pp, list(state))
    mine = {names[k]: v.detach() for k, v in state.items()}
    if layout.prank != 0:
        return None
    bounds = stage_bounds(model.config.num_hidden_layers, layout.pp)
    if layout.stage > 0:
        keys = sorted(k for k in mine if _owned(k, layout.stage, layout.pp, bounds[layout.stage]))
        first = next(iter(mine.values()))
        dist.send(torch.tensor([len(keys)], device=first.device), dst=0)
        for k in keys:
            dist.send(mine[k].contiguous(), dst=0)
        return None
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(model.config).state_dict()
    first = next(iter(mine.values()))
    full = {k: v.cpu() for k, v in mine.items()}
    for s in range(1, layout.pp):
        keys = sorted(k for k in shapes if _owned(k, s, layout.pp, bounds[s]))
        count = torch.zeros(1, dtype=torch.int64, device=first.device)
        dist.recv(count, src=s * layout.n)
        if int(count) != len(keys):
            raise RuntimeError(f"pipeline save: stage {s} holds {int(count)} tensors of its own, the model's "
                               f"skeleton expects {len(keys)}")
        for k in keys:
            buf = torch.empty(shapes[k].shape, dtype=first.dtype, device=first.device)
            dist.recv(buf, src=s * layout.n)
            full[k] = buf.cpu()
    return full
