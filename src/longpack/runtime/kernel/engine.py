"""One engine: transformers' own decoder classes, with longpack's attention registered as an implementation.

``attn_implementation="longpack"`` (registered through ``transformers.AttentionInterface``) makes every attention
layer of a Llama / Qwen2 / Qwen3 / Mistral model (any decoder whose attention goes through that interface) call
the micro-batch's ``attend(layer, q_thd, k_thd, v_thd) -> o_thd`` callback, which reaches it as the keyword
argument ``longpack_attend`` through the model's forward, the way transformers passes attention kwargs. The
callbacks hold everything the plan decides for that micro-batch: document boundaries (the attention backend,
runtime/kernel/varlen.py), the CP exchange of sharded pieces (runtime/kernel/context_parallel.py), a chain's K/V store
(runtime/kernel/chunked.py). No global state: two models, or two micro-batches, never share a callback.

transformers builds no attention mask for an implementation outside its mask registry, so a packed stream of
T tokens never materialises a T x T mask; document masking is the callback's job, from explicit boundaries.

Shapes: transformers hands attention [1, heads, T, D] (post-RoPE); the callbacks take [T, heads, D].

:func:`checkpointing` applies a micro-batch's ``ckpt_layers`` with transformers' own per-layer switch
(``GradientCheckpointingLayer``, which keeps FSDP2's hooks outside the recomputed region).

:func:`forward_logits` is the engine's one forward (runtime/kernel/runner.py calls it for every path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["ATTN", "register", "engine_attention", "longpack_attention", "forward_logits", "checkpointing",
           "num_layers", "decoder_layers"]

ATTN = "longpack"
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_CHECKPOINT = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


@torch.compiler.disable
def longpack_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The AttentionInterface entry: [1, H, T, D] q/k/v -> ([1, T, H, D], no weights) via ``longpack_attend``.
    Never traced by ``torch.compile``: a compiled decoder layer (runtime/kernel/kernels.py) breaks its graph here
    and calls the plan's callback as it is — its collectives, a chain's K/V store and the attention backend's own
    kernels stay outside the compiled code."""
    attend = kwargs.get("longpack_attend")
    if attend is None:
        raise ValueError("attn_implementation='longpack' runs only inside longpack's engine (it needs the plan's "
                         "micro-batch); for evaluation or generation call model.set_attn_implementation('sdpa')")
    if query.shape[0] != 1:
        raise ValueError(f"the longpack attention takes one packed stream (batch 1), got batch {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by the longpack attention; set "
                         "config.attention_dropout=0")
    d = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, d ** -0.5, rel_tol=1e-6):
        raise ValueError(f"attention scaling {scaling:g} != head_dim**-0.5 ({d ** -0.5:g}); this model's attention "
                         "is not supported by the longpack attention")
    # under autocast (a Trainer's bf16) q/k may come out of RoPE in another dtype than v: attend in v's dtype,
    # with autocast off, so every kernel (and a chain's K/V store) sees one dtype
    q_thd, k_thd, v_thd = (t[0].transpose(0, 1).to(value.dtype) for t in (query, key, value))
    with torch.autocast(query.device.type, enabled=False):
        out_thd = attend(module.layer_idx, q_thd, k_thd, v_thd)
    return out_thd[None], None


def register() -> None:
    """Register ``attn_implementation="longpack"`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN, longpack_attention)


@contextmanager
def engine_attention(model: Any) -> Iterator[None]:
    """Run ``model`` (a transformers model loaded with any attention implementation) on the longpack attention
    for the block, and give it back its own afterwards (evaluation and generation keep the user's choice)."""
    register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTN
    try:
        yield
    finally:
        config._attn_implementation = before


def forward_logits(model: Any, input_ids_t: torch.Tensor, position_ids_t: torch.Tensor, attend: Attend,
                   hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [T, vocab] of one packed stream with explicit positions, attention through ``attend``; ``hidden``
    [T, hidden size]: the input of a later pipeline stage, in place of the token embeddings (its output is the
    last decoder layer's hidden state then, unless the stage holds the head)."""
    given = {"input_ids": input_ids_t[None]} if hidden is None else {"inputs_embeds": hidden[None]}
    out = model(**given, position_ids=position_ids_t[None], use_cache=False, longpack_attend=attend)
    return out.logits[0]


@contextmanager
def checkpointing(model: Any, layers: int) -> Iterator[None]:
    """Checkpoint the first ``layers`` decoder layers (``torch.utils.checkpoint``, non-reentrant) for one
    micro-batch, through transformers' own ``GradientCheckpointingLayer`` switch; the rest keep activations."""
    if layers <= 0:
        yield
        return
    chosen: list[Any] = decoder_layers(model)[:layers]
    for layer in chosen:
        layer._gradient_checkpointing_func = _CHECKPOINT
        layer.gradient_checkpointing = True
    try:
        yield
    finally:
        for layer in chosen:
            layer.gradient_checkpointing = False


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers, in order (``model.model.layers``)."""
    return list(model.model.layers)


def num_layers(model: Any) -> int:
    return len(decoder_layers(model))
