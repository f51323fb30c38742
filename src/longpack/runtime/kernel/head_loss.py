"""The LM head fused with its cross-entropy, in chunks of tokens: the [tokens, vocab] logits are never held whole,
and the gradient is made in the forward loop, so the head costs 3 matrix products per token, not 4.

Per chunk of c tokens (forward): logits = h_c · Wᵀ with the compute dtype's inputs (bf16 on a GPU) accumulated
in fp32 (fp64 stays fp64), the loss Σ w_t · (lse_t − logit_t[label_t]), then in place on the same buffer the
gradient d = w_t · (softmax_t − onehot(label_t)); dh_c = d · W and dW += dᵀ · h_c (bf16 inputs, fp32
accumulation across chunks; TF32 nowhere). dh and dW (rounded once to the weight's dtype) are what backward keeps;
backward scales them by the incoming gradient. Under ``no_grad`` (evaluation) only the logits product runs.

Memory: one chunk's fp32 logits (every softmax step in place in it), its copy in the compute dtype, the fp32 dW
accumulator and dh (the size of h, not kept); a chunk is :data:`~longpack.cost.RUNTIME_HEAD_CHUNK_BYTES` of fp32
logits, the budget the cost model prices (1 GiB: 1,766 tokens of Qwen's 152K vocabulary). FLOPs: 6 · T · hidden ·
vocab for forward and backward (2 each for the logits, dh and dW). Exact: the same sums as ``F.cross_entropy`` over
whole logits, in chunks (float64 parity tests; float32 within 1e-6). Liger's kernel runs instead where it gives the
same objective (runtime/kernel/liger_loss.py; ``--head-loss``).
"""

from __future__ import annotations

import torch

from ...cost import RUNTIME_HEAD_CHUNK_BYTES
from .liger_loss import liger_cross_entropy, liger_refusal, liger_runs, liger_version
from .names import check_head_loss

__all__ = ["head_cross_entropy", "chunk_tokens", "CHUNK_BYTES", "LossHead", "loss_head", "head_loss_name",
           "resolve_head_loss", "set_head_loss"]

CHUNK_BYTES = RUNTIME_HEAD_CHUNK_BYTES


def resolve_head_loss(kind: str, device: torch.device, dtype: torch.dtype, loss_mode: str) -> str:
    """The fused loss ``--head-loss kind`` runs, ``liger`` or ``longpack``: ``auto`` is Liger's where it can run the
    objective (CUDA, ``--loss token_mean``, ``liger_kernel`` installed: runtime/kernel/liger_loss.py), else
    longpack's; ``liger`` where it cannot is refused by a ValueError saying why."""
    check_head_loss(kind)
    if kind == "longpack":
        return kind
    why = liger_refusal(device, dtype, loss_mode)
    if why is not None and kind == "liger":
        raise ValueError(f"--head-loss liger: {why}; use --head-loss auto or longpack")
    return "longpack" if why is not None else "liger"


def head_loss_name(resolved: str) -> str:
    """The run's first line's name for a :func:`resolve_head_loss` d loss."""
    if resolved == "liger":
        return f"Liger fused linear cross-entropy (liger_kernel {liger_version()})"
    return "longpack fused linear cross-entropy"


def set_head_loss(model: torch.nn.Module, resolved: str) -> None:
    """Make ``model``'s head (:func:`loss_head`) run the :func:`resolve_head_loss` d loss."""
    head = loss_head(model)
    if head is not None:
        head.liger = resolved == "liger"


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: one chunk's fp32 logits fill at most ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _mm(a: torch.Tensor, b: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """a · b in ``wide`` from inputs of the compute dtype: on CUDA one product with a wide output (bf16 tensor
    cores, fp32 accumulation), elsewhere the inputs widened first."""
    if a.dtype == wide:
        return a @ b
    if _gpu(a):
        return torch.mm(a, b, out_dtype=wide)
    return a.to(wide) @ b.to(wide)


def _gpu(t: torch.Tensor) -> bool:
    """A CUDA tensor, or a fake one (a dry run plays the GPU's kernels on a 'cpu' mesh: runtime/run/dry_run.py)."""
    return t.device.type == "cuda" or _fake(t)


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a · b, ``acc`` wide and a, b in the compute dtype (as :func:`_mm`): on CUDA one product
    accumulating into ``acc`` (checked once per process to accumulate; else through a wide temporary)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif not _gpu(a):
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    elif _accumulates(a.device, a.dtype, acc.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))


_ACCUMULATES: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}


def _accumulates(device: torch.device, dtype: torch.dtype, wide: torch.dtype) -> bool:
    """Whether ``addmm(acc, a, b, out_dtype=wide, out=acc)`` adds into ``acc`` on this device: a 2x2 product
    checked once (one host read per process); under fake tensors (a dry run) assumed."""
    key = (device.type, dtype, wide)
    if key not in _ACCUMULATES:
        acc = torch.ones(2, 2, dtype=wide, device=device)
        if _fake(acc) or device.type != "cuda":
            return True
        one = torch.eye(2, dtype=dtype, device=device)
        try:
            torch.addmm(acc, one, one, out_dtype=wide, out=acc)
            _ACCUMULATES[key] = bool((acc.cpu() == torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=wide)).all())
        except (RuntimeError, NotImplementedError):
            _ACCUMULATES[key] = False
    return _ACCUMULATES[key]


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ w · CE of one chunk's wide logits (no gradient: evaluation), in the chunk's own buffer."""
    top = logits.amax(1, keepdim=True)
    picked = logits.gather(1, labels[:, None])[:, 0] - top[:, 0]
    return ((logits.sub_(top).exp_().sum(1).log() - picked) * w).sum()


def _chunk_grad(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ w · CE of one chunk's wide logits, which become, in place, w · (softmax − onehot(label)): every step
    writes into the chunk's own buffer (no second [tokens, vocab] temporary, as logsumexp would make)."""
    top = logits.amax(1, keepdim=True)
    logits.sub_(top)  # x - max: exp cannot overflow
    picked = logits.gather(1, labels[:, None])[:, 0]
    total = logits.exp_().sum(1)  # Σ exp(x - max); lse = max + log(total)
    loss = ((total.log() - picked) * w).sum()
    logits.mul_((w / total)[:, None])
    logits.scatter_add_(1, labels[:, None], -w[:, None])
    return loss


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk, grads):  # type: ignore[override]
        wide = _wide(h.dtype)
        total = torch.zeros((), dtype=wide, device=h.device)
        dh = torch.empty_like(h) if grads else None
        dweight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if grads else None
        for a in range(0, h.shape[0], chunk):
            hc, wc, lab = h[a:a + chunk], w[a:a + chunk].to(wide), labels[a:a + chunk]
            logits = _mm(hc, weight.T, wide)
            if not grads:
                total += _chunk_loss(logits, lab, wc)
                del logits
                continue
            total += _chunk_grad(logits, lab, wc)
            d = logits.to(h.dtype)
            torch.mm(d, weight, out=dh[a:a + chunk])
            _addmm_(dweight, d.T, hc)
            del logits, d  # before the next chunk's logits exist: one chunk at a time
        if grads:
            ctx.save_for_backward(dh, dweight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dh, dweight = ctx.saved_tensors
        return dh * grad.to(dh.dtype), dweight * grad.to(dweight.dtype), None, None, None, None


def head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor,
                       chunk: int | None = None, uniform: float | None = None) -> torch.Tensor:
    """Σ_t w_t · cross-entropy(h_t · Wᵀ, label_t), computed ``chunk`` tokens at a time (default
    :func:`chunk_tokens`); ``h`` [T, hidden], ``weight`` [vocab, hidden], ``labels`` [T] (any id where w_t = 0).
    ``uniform``: the one value of every nonzero w_t, when they share one — then, with gradients to make, Liger's
    kernel runs where it can (runtime/kernel/liger_loss.py; evaluation keeps the logits-only loop below: Liger
    would allocate a [vocab, hidden] gradient buffer it never fills)."""
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)  # none to make in evaluation
    if grads and uniform is not None and not _fake(h) and liger_runs(h.device, h.dtype):
        return liger_cross_entropy(h, weight, labels, w, uniform, CHUNK_BYTES)
    return _FusedLinearCrossEntropy.apply(h, weight, labels, w, chunk or chunk_tokens(weight.shape[0]), grads)


class LossHead(torch.nn.Linear):
    """A bias-free linear LM head that, while :attr:`target` holds (labels [T], weights [T], their one value or
    None), returns the micro-batch's Σ w·CE as a [1] tensor (:func:`head_cross_entropy`, autocast off) in place of
    the logits. The loss is computed inside the model's forward, so a sharded head (FSDP2) is gathered for it in
    forward; with no target it is the plain linear layer."""

    target: tuple[torch.Tensor, torch.Tensor, float | None] | None = None
    liger = True  # Liger's kernel where it runs (:func:`set_head_loss`: --head-loss)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.target is None:
            return super().forward(h)
        labels, w, uniform = self.target
        with torch.autocast(h.device.type, enabled=False):
            return head_cross_entropy(h[0].to(self.weight.dtype), self.weight, labels, w,
                                      uniform=uniform if self.liger else None).reshape(1)


def loss_head(model: torch.nn.Module) -> LossHead | None:
    """``model.lm_head`` as a :class:`LossHead` (a plain bias-free ``nn.Linear`` becomes one in place: the same
    parameters, so optimizers, checkpoints and FSDP2 see the model unchanged); None for any other head."""
    head = getattr(model, "lm_head", None)
    if type(head) is torch.nn.Linear and head.bias is None:
        head.__class__ = LossHead
    return head if isinstance(head, LossHead) else None
