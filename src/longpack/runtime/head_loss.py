"""The LM head and its cross-entropy in chunks of tokens: the [tokens, vocab] logits are never held whole.

Forward, per chunk of c tokens: logits = h_c · Wᵀ (in the head's dtype, as the model computes them), upcast to
fp32 (fp64 stays fp64), log-sum-exp, and Σ w_t · (lse_t − logit_t[label_t]). Only h, W, the labels and the weights
are kept. Backward recomputes each chunk's logits: d logits = w_t · (softmax − onehot(label)) · grad, then
dh_c = d logits · W and dW += d logitsᵀ · h_c, summed over chunks in fp32. Tokens of weight 0 (no target, padding)
cost their share of the matmuls but contribute nothing.

Memory: one chunk's logits in fp32 (``CHUNK_BYTES``, ~256 MiB: 441 tokens of Qwen's 152K vocabulary) plus an fp32
[vocab, hidden] gradient accumulator in backward, instead of ~3 copies of [tokens, vocab]. Time: the head's
forward matmul runs twice (once more in backward), as in Liger's fused linear cross-entropy. Exact: the same sums
as ``F.cross_entropy`` over whole logits, in chunks (float64 parity tests).
"""

from __future__ import annotations

import torch

from ..cost import RUNTIME_HEAD_CHUNK_BYTES

__all__ = ["head_cross_entropy", "chunk_tokens", "CHUNK_BYTES", "LossHead", "loss_head"]

CHUNK_BYTES = RUNTIME_HEAD_CHUNK_BYTES


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: one chunk's fp32 logits fill at most ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk):  # type: ignore[override]
        total = torch.zeros((), dtype=_wide(h.dtype), device=h.device)
        for a in range(0, h.shape[0], chunk):
            logits = (h[a:a + chunk] @ weight.T).to(total.dtype)
            picked = logits.gather(1, labels[a:a + chunk, None])[:, 0]
            total += ((torch.logsumexp(logits, 1) - picked) * w[a:a + chunk].to(total.dtype)).sum()
        ctx.save_for_backward(h, weight, labels, w)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        h, weight, labels, w = ctx.saved_tensors
        dh = torch.empty_like(h)
        dweight = torch.zeros(weight.shape, dtype=_wide(weight.dtype), device=weight.device)
        for a in range(0, h.shape[0], ctx.chunk):
            hc = h[a:a + ctx.chunk]
            logits = (hc @ weight.T).to(dweight.dtype)
            d = torch.softmax(logits, 1)
            d.scatter_add_(1, labels[a:a + ctx.chunk, None], torch.full_like(d[:, :1], -1.0))
            d *= (w[a:a + ctx.chunk].to(d.dtype) * grad.to(d.dtype))[:, None]
            dh[a:a + ctx.chunk] = (d.to(h.dtype) @ weight).to(h.dtype)
            dweight.addmm_(d.T, hc.to(d.dtype))
        return dh, dweight.to(weight.dtype), None, None, None


def head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor,
                       chunk: int | None = None) -> torch.Tensor:
    """Σ_t w_t · cross-entropy(h_t · Wᵀ, label_t), computed ``chunk`` tokens at a time (default
    :func:`chunk_tokens`); ``h`` [T, hidden], ``weight`` [vocab, hidden], ``labels`` [T] (any id where w_t = 0)."""
    return _HeadCrossEntropy.apply(h, weight, labels, w, chunk or chunk_tokens(weight.shape[0]))


class LossHead(torch.nn.Linear):
    """A bias-free linear LM head that, while :attr:`target` holds (labels [T], weights [T]), returns the
    micro-batch's Σ w·CE as a [1] tensor (:func:`head_cross_entropy`, autocast off) in place of the logits. The
    loss is computed inside the model's forward, so a sharded head (FSDP2) is gathered for it in forward and again
    for its backward; with no target it is the plain linear layer."""

    target: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.target is None:
            return super().forward(h)
        labels, w = self.target
        with torch.autocast(h.device.type, enabled=False):
            return head_cross_entropy(h[0].to(self.weight.dtype), self.weight, labels, w).reshape(1)


def loss_head(model: torch.nn.Module) -> LossHead | None:
    """``model.lm_head`` as a :class:`LossHead` (a plain bias-free ``nn.Linear`` becomes one in place: the same
    parameters, so optimizers, checkpoints and FSDP2 see the model unchanged); None for any other head."""
    head = getattr(model, "lm_head", None)
    if type(head) is torch.nn.Linear and head.bias is None:
        head.__class__ = LossHead
    return head if isinstance(head, LossHead) else None
