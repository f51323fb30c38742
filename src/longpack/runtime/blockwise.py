"""Attention over keys held in several blocks, merged by log-sum-exp, with a memory-lean exact backward.

Used wherever queries must see keys that were computed elsewhere: a chunk attending to the K/V of earlier chunks
of its sequence (ChunkFlow) and a rank attending to other ranks' shards (context parallelism).

Forward: each key block b gives (o_b, lse_b) from the fused CPU flash kernel (no score matrix is kept); the result
is o = Σ_b o_b · exp(lse_b − lse) with lse = logsumexp_b lse_b. Backward: the flash backward of each block, called
with the *merged* o and lse, yields that block's exact share of dq, dk, dv (the softmax normaliser is global, so
per-block gradients computed against it simply add up — the standard ring-attention identity). Nothing of size
queries x keys is stored, so memory is O(tokens), not O(queries · keys).

Shapes: ``q_bhsd`` [1, heads, s, D]; key blocks [1, kv_heads, n_b, D]. Grouped-query attention never repeats the
earlier blocks' K/V: for a block without a causal mask the g query heads of a KV head are folded into the query
length ([1, kv_heads, g·s, D]), which is exact because every query row sees every key of the block.

Gradients of blocks that are *not* autograd inputs (stored K/V of earlier chunks or other ranks) are added into
caller-provided accumulator tensors during backward instead of being returned, so no leaf copies are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["attention_with_blocks", "flash_lse"]

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


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def _merged(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, blocks: Sequence, own_causal: bool,
            scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Online log-sum-exp merge over the blocks (one partial result alive at a time: O(s) extra memory)."""
    out, lse = flash_lse(q, k_own, v_own, own_causal, scale)
    for kb, vb, _, _ in blocks:
        ob, lb = flash_lse(q, kb, vb, False, scale)
        new = torch.logaddexp(lse, lb)
        out = out * torch.exp(lse - new)[..., None] + ob * torch.exp(lb - new)[..., None]
        lse = new
    return out.to(q.dtype), lse  # merged in the logsumexp's precision (fp32 for bf16 inputs), kept in q's


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_own, v_own, scale, blocks, own_causal):  # type: ignore[override]
        out, lse = _merged(q, k_own, v_own, blocks, own_causal, scale)
        ctx.save_for_backward(q, k_own, v_own, out, lse)
        ctx.blocks, ctx.scale, ctx.own_causal = blocks, scale, own_causal
        return out

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k_own, v_own, out, lse = ctx.saved_tensors
        do = do.contiguous().to(q.dtype)  # an upstream gradient in another dtype (autocast) than the inputs
        dq, dk, dv = _block_backward(do, q, k_own, v_own, out, lse, ctx.own_causal, ctx.scale)
        for kb, vb, acc_k, acc_v in ctx.blocks:
            dqb, dkb, dvb = _block_backward(do, q, kb, vb, out, lse, False, ctx.scale)
            dq = dq + dqb
            if acc_k is not None:
                acc_k.add_(dkb)
                acc_v.add_(dvb)
        return dq, dk, dv, None, None, None


def attention_with_blocks(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor,
                          blocks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                 torch.Tensor | None]],
                          *, own_causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Queries ``q`` over their own keys (causal) and over fully visible earlier key ``blocks``.

    ``blocks`` holds (k, v, grad_k_accumulator, grad_v_accumulator); the accumulators receive the blocks' key and
    value gradients in backward (pass None to drop them). All [1, heads, len, D] tensors, contiguous.
    """
    if not torch.is_grad_enabled() or not (q.requires_grad or k_own.requires_grad):
        return _merged(q, k_own, v_own, blocks, own_causal, scale)[0]
    return _BlockAttention.apply(q, k_own, v_own, scale, blocks, own_causal)
