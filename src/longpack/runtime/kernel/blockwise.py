"""The CPU kernels of the attention backend (runtime/kernel/varlen.py): attention over keys held in several blocks,
merged by log-sum-exp, with a memory-lean exact backward.

On the CPU, a sequence whose queries are the last rows of a longer key range (a chunk after earlier chunks, a CP
rank's late block) runs as its causal square plus the visible prefix block.

Forward: each key block b gives (o_b, lse_b) from the fused CPU flash kernel (no score matrix is kept); the result
is o = Σ_b o_b · exp(lse_b − lse) with lse = logsumexp_b lse_b. Backward: the flash backward of each block, called
with the *merged* o and lse, yields that block's exact share of dq, dk, dv (the softmax normaliser is global, so
per-block gradients computed against it simply add up — the standard ring-attention identity). Nothing of size
queries x keys is stored, so memory is O(tokens), not O(queries · keys).

Shapes: ``q_bhsd`` [1, heads, s, D]; key blocks [1, kv_heads, n_b, D]. Grouped-query attention never repeats the
earlier blocks' K/V: for a block without a causal mask the g query heads of a KV head are folded into the query
length ([1, kv_heads, g·s, D]), which is exact because every query row sees every key of the block.

The backward returns each block's dq, dk, dv (:func:`block_backward`); runtime/kernel/varlen.py routes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flash_lse", "merged", "block_backward"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fold(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, H, s, D] -> [1, Hkv, g·s, D] (query heads h = kv·g + j grouped with their KV head)."""
    _, h, s, d = q.shape
    return q.reshape(1, kv_heads, (h // kv_heads) * s, d)


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_fold` for [1, Hkv, g·s, ...] tensors."""
    return x.reshape(1, heads, -1, *x.shape[3:])


def flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of one key block; GQA folded when not causal, K/V repeated (cheap) when causal."""
    heads, kv = q.shape[1], k.shape[1]
    if heads != kv and not causal:
        o, lse = _FWD(_fold(q, kv), k, v, 0.0, False, scale=scale)
        return _unfold(o, heads), _unfold(lse, heads)
    if heads != kv:
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    return _FWD(q, k, v, 0.0, causal, scale=scale)


def block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   saved: tuple[torch.Tensor, torch.Tensor], causal: bool, scale: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block from the forward's saved (output, log-sum-exp)."""
    o, lse = saved
    heads, kv = q.shape[1], k.shape[1]
    if heads != kv and not causal:
        dq, dk, dv = _BWD(_fold(do, kv), _fold(q, kv), k, v, _fold(o, kv), _fold(lse[..., None], kv)[..., 0],
                          0.0, False, scale=scale)
        return _unfold(dq, heads), dk, dv
    g = heads // kv
    ke, ve = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if g > 1 else (k, v)
    dq, dk, dv = _BWD(do, q, ke, ve, o, lse, 0.0, causal, scale=scale)
    if g > 1:
        dk = dk.reshape(1, kv, g, *dk.shape[2:]).sum(2)
        dv = dv.reshape(1, kv, g, *dv.shape[2:]).sum(2)
    return dq, dk, dv


def merged(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, blocks: Sequence, own_causal: bool,
            scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Online log-sum-exp merge over the blocks (one partial result alive at a time: O(s) extra memory)."""
    out, lse = flash_lse(q, k_own, v_own, own_causal, scale)
    for kb, vb, _, _ in blocks:
        ob, lb = flash_lse(q, kb, vb, False, scale)
        new = torch.logaddexp(lse, lb)
        out = out * torch.exp(lse - new)[..., None] + ob * torch.exp(lb - new)[..., None]
        lse = new
    return out.to(q.dtype), lse  # merged in the logsumexp's precision (fp32 for bf16 inputs), kept in q's
