"""Liger's fused linear cross-entropy (``liger_kernel``'s ``LigerFusedLinearCrossEntropyFunction``, Triton), run in
place of longpack's own (runtime/kernel/head_loss.py) where it can give the same objective.

Liger computes the head's gradient in its forward chunk loop, like longpack's loss, but only for a loss that is a
sum (or mean) over targets: a per-token weight can enter only through its ``reduction="none"`` path, which
recomputes the logits in backward (4 head products per token, not 3). So it runs where every target of the
micro-batch has one weight ``u`` — the ``token_mean`` objective (runtime/kernel/loss.py) — as u · Σ CE with the
untargeted positions given its ignore index; elsewhere (``sequence_mean``, a micro-batch without targets, float64,
the host, fake tensors) longpack's loss runs; ``--head-loss`` chooses (head_loss.resolve_head_loss). Liger
accumulates dW in fp32 (``accum_dtype``) from inputs of the compute dtype, as longpack's loss does, in chunks of
the largest power of two of tokens whose logits fit the budget longpack's chunks have (``chunk_mem_const``, where
the installed Liger takes it; its default bounds a chunk's logits to tokens × hidden, ~100 tokens of a 152K
vocabulary). Cost beside longpack's: Liger reads the target count back to the host in forward and compares the
incoming gradient with 1 in backward — two host synchronisations per micro-batch.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch

__all__ = ["liger_runs", "liger_refusal", "liger_cross_entropy", "liger_version", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # Liger's default: a position with no target
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _function() -> Any | None:
    """Liger's autograd function, or None where ``liger_kernel`` (with its ``accum_dtype`` argument) is absent."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction  # type: ignore[import-untyped]
    except Exception:  # noqa: BLE001 - absent, or a Triton that cannot load: longpack's loss runs
        return None
    forward = inspect.signature(LigerFusedLinearCrossEntropyFunction.forward).parameters
    return LigerFusedLinearCrossEntropyFunction if "accum_dtype" in forward else None


def liger_version() -> str | None:
    """The installed ``liger_kernel``'s version where its fused loss can run here, else None."""
    if _function() is None:
        return None
    from importlib.metadata import version

    return version("liger-kernel")


def liger_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a uniformly weighted micro-batch's loss runs on Liger's kernel: a CUDA device, a dtype its kernels
    take, and ``liger_kernel`` importable."""
    return device.type == "cuda" and dtype in _DTYPES and _function() is not None


def liger_refusal(device: torch.device, dtype: torch.dtype, loss_mode: str) -> str | None:
    """Why a run on ``device`` in ``dtype`` with ``--loss loss_mode`` cannot use Liger's loss, or None."""
    if device.type != "cuda":
        return f"Liger's Triton kernels run on CUDA, this run on {device.type}"
    if dtype not in _DTYPES:
        return f"Liger's kernels take bfloat16, float16 or float32, not {str(dtype).removeprefix('torch.')}"
    if loss_mode != "token_mean":
        return (f"--loss {loss_mode} weighs each sample's targets apart, and Liger gives a per-token weight only by "
                "recomputing the logits in backward; it runs --loss token_mean")
    if _function() is None:
        return "liger_kernel is not installed here (pip install 'longpack[liger]')"
    return None


def liger_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor,
                        uniform: float, chunk_bytes: int) -> torch.Tensor:
    """Σ_t w_t · CE(h_t · Wᵀ, label_t) where every nonzero w_t equals ``uniform``: ``uniform`` · Liger's summed CE
    over the positions with w_t ≠ 0 (wide scalar: fp32), a chunk's logits within ``chunk_bytes``. ``h`` [T,
    hidden], ``weight`` [vocab, hidden]."""
    function = _function()
    if function is None:
        raise RuntimeError("liger_kernel is not importable here: install it (pip install 'longpack[liger]')")
    target = torch.where(w != 0, labels, torch.full_like(labels, IGNORE_INDEX))
    wide = torch.promote_types(h.dtype, torch.float32)
    (tokens, hidden), vocab = h.shape, weight.shape[0]
    named = {"ignore_index": IGNORE_INDEX, "reduction": "sum", "accum_dtype": wide,
             "chunk_mem_const": mem_const(tokens, hidden, vocab, chunk_bytes // (vocab * h.element_size()))}
    out = function.apply(h, weight, target, *_positional(function, named))
    return out[0].to(wide) * uniform


def mem_const(tokens: int, hidden: int, vocab: int, most: int) -> int:
    """Liger's ``chunk_mem_const`` C that makes its chunk (the next power of two of ⌈T / ⌈V / (C·H)⌉⌉, at most T)
    the largest power of two of tokens not above ``most``: ⌈V / (C·H)⌉ ≥ m = ⌈T / p⌉ for p that power. C is 1 at
    least: below that Liger's own bound holds (a chunk's logits about T × H elements, the size of ``h``)."""
    p = 1 << max(0, int(most).bit_length() - 1)
    m = math.ceil(tokens / p)
    return max(1, vocab // (m * hidden) if m > 1 else math.ceil(vocab / hidden))


def _positional(function: Any, named: dict[str, Any]) -> list[Any]:
    """The arguments of Liger's forward after (input, weight, target), positional as ``apply`` takes them: each
    named one given, the others their defaults; one this Liger does not take is left out."""
    params = list(inspect.signature(function.forward).parameters.values())[4:]  # after ctx, input, weight, target
    return [named.get(p.name, p.default) for p in params]
