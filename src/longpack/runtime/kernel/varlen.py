"""The one attention backend of the runtime: variable-length, bottom-right causal attention over packed sequences.

Every attention the runtime runs goes through this module: whole documents, a CP rank's share of a sharded piece
(its queries are the last rows of a longer key range), and a chunk of a chain attending to the stored K/V of the
chain's earlier chunks. One description covers all three, :class:`Seqs`: sequence i has s_i queries and
n_i ≥ s_i keys, and query t of it sees keys [0, n_i − s_i + t] (bottom-right aligned; a document is s_i = n_i).

Primitives (exact, GQA through kv_heads | heads):

* :func:`forward` (q, k, v, seqs) -> (o, lse) and :func:`backward` (do, q, k, v, o, lse, seqs) -> (dq, dk, dv):
  the log-sum-exp form, for attention whose keys come from elsewhere and whose key gradients are routed by hand
  (runtime/kernel/chunked.py, runtime/kernel/sharded_chain.py). ``lse`` is [heads, Tq] fp32.
* :func:`attention` (q, k, v, seqs) -> o with autograd.

Kernels:

* CUDA, bf16/fp16: torch's own FlashAttention varlen kernels (``torch.nn.attention.varlen``; its custom ops
  ``torch_attn._varlen_attn`` / ``_varlen_attn_backward``): one call for every sequence of a micro-batch, causal
  as ``window_size=(-1, 0)``, which FlashAttention aligns bottom-right; no mask, no per-sequence loop. ``cu_q`` /
  ``cu_k`` are built on the device once per :class:`Seqs` (once per micro-batch), not per layer.
* CPU (any dtype): documents of one length are batched into one causal SDPA call (the CPU kernel does not skip
  masked blocks, so a block-diagonal mask would cost (Σ s_i)² instead of Σ s_i²); a longer key range runs the
  fused CPU flash kernel on the visible prefix and on the causal square and merges them by log-sum-exp.
  Per distinct length (or per sequence) one call: cheap on a CPU, which has no launch or sync cost.

Cost: O(Σ s_i · n_i · heads · D) compute; memory O(tokens), never queries × keys.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from functools import cache

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from . import blockwise
from .host import to_device

__all__ = ["Seqs", "attention", "attention_offsets", "forward", "backward", "uses_flash"]

_HALF = (torch.float16, torch.bfloat16)


class Seqs:
    """Query and key lengths of the sequences of one packed stream (host ints, from the plan), and their device
    offsets, made once per device."""

    def __init__(self, q_lens: Sequence[int], k_lens: Sequence[int] | None = None) -> None:
        self.q_lens = [int(x) for x in q_lens]
        self.k_lens = list(self.q_lens) if k_lens is None else [int(x) for x in k_lens]
        if len(self.k_lens) != len(self.q_lens) or any(n < s for s, n in zip(self.q_lens, self.k_lens,
                                                                               strict=True)):
            raise ValueError(f"key lengths {self.k_lens} must each cover their query lengths {self.q_lens}")
        self.max_q, self.max_k = max(self.q_lens, default=0), max(self.k_lens, default=0)
        self.square = self.q_lens == self.k_lens
        self._cu: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of_offsets(cls, cu: Sequence[int]) -> Seqs:
        """Documents [cu[i], cu[i+1]) of one stream."""
        return cls([b - a for a, b in zip(cu, cu[1:], strict=False)])

    def offsets(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_q, cu_k) int32 on ``device``: one host-to-device copy per Seqs and device (not blocking the host:
        runtime/kernel/host.py), then reused."""
        got = self._cu.get(device)
        if got is None:
            host = torch.tensor([[0, 0], *zip(self.q_lens, self.k_lens, strict=True)], dtype=torch.int32)
            both = to_device(host.cumsum(0, dtype=torch.int32).t().contiguous(), device)
            got = self._cu[device] = (both[0], both[1])
        return got

    def placed(self, cu: torch.Tensor | None) -> Seqs:
        """These sequences with their offsets already on ``cu``'s device (square ones only: cu_q = cu_k), as a
        micro-batch's one copy brings them (runtime/kernel/data.Packed.to); None: made when first needed."""
        if cu is not None and self.square:
            self._cu[cu.device] = (cu, cu)
        return self


def uses_flash(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the FlashAttention varlen kernels: a CUDA tensor in bf16 / fp16, or a fake one in a
    dry run (runtime/run/dry_run.py: the kernels' fake implementations give the GPU's shapes on a 'cpu' mesh)."""
    return t.dtype in _HALF and (t.is_cuda or isinstance(t, FakeTensor))


def _check_device(q: torch.Tensor) -> None:
    if q.is_cuda and q.dtype not in _HALF:
        raise ValueError(f"attention on CUDA in {q.dtype}: the FlashAttention varlen kernels take bfloat16 or "
                         "float16; train with --dtype bfloat16 (the parameters and optimizer stay fp32)")


def _flash_ops():  # noqa: ANN202
    import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn and its backward)

    return torch.ops.torch_attn


@cache
def _takes(op, name: str) -> bool:  # noqa: ANN001
    """Whether the installed build's ``op`` has argument ``name``: the private ops' trailing arguments differ
    between torch releases (``enable_gqa`` came in later; KV-cache arguments sit between), so every optional
    argument is passed by name and only where the schema has it. Read once per op and name, not per layer."""
    return any(a.name == name for a in op.default._schema.arguments)


def _flash_forward(q, k, v, cu_q, cu_k, seqs):  # noqa: ANN001, ANN202
    op = _flash_ops()._varlen_attn
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] and _takes(op, "enable_gqa") else {}
    return op(q, k, v, cu_q, cu_k, seqs.max_q, seqs.max_k, is_causal=True, **_causal(op), **extra)


def _causal(op) -> dict:  # noqa: ANN001
    """Causal as the window (-1, 0) where the op takes a window; FlashAttention's causal mask is bottom-right
    aligned either way."""
    return {"window_size": [-1, 0]} if _takes(op, "window_size") else {}


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [Tq, H, D], lse [H, Tq] fp32) without autograd; q [Tq, H, D], k / v [Tk, Hkv, D]."""
    _check_device(q)
    if uses_flash(q):
        cu_q, cu_k = seqs.offsets(q.device)
        o, lse, _ = _flash_forward(q, k, v, cu_q, cu_k, seqs)
        return o, lse
    outs, lses, qa, ka = [], [], 0, 0
    for s, n in zip(seqs.q_lens, seqs.k_lens, strict=True):
        o, lse = _cpu_forward(q[qa:qa + s], k[ka:ka + n], v[ka:ka + n])
        outs.append(o)
        lses.append(lse)
        qa, ka = qa + s, ka + n
    if not outs:
        return q.new_empty(q.shape), q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses, 1)


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, seqs: Seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`forward`'s output against ``do``, from its saved ``o`` and ``lse``."""
    if uses_flash(q):
        cu_q, cu_k = seqs.offsets(q.device)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the kernel ignores its state
        op = _flash_ops()._varlen_attn_backward
        return op(do.contiguous(), q, k, v, o, lse, cu_q, cu_k, seqs.max_q, seqs.max_k, True, rng, **_causal(op))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qa, ka = 0, 0
    for s, n in zip(seqs.q_lens, seqs.k_lens, strict=True):
        g = _cpu_backward(do[qa:qa + s], q[qa:qa + s], k[ka:ka + n], v[ka:ka + n], o[qa:qa + s],
                          lse[:, qa:qa + s])
        dq[qa:qa + s], dk[ka:ka + n], dv[ka:ka + n] = g
        qa, ka = qa + s, ka + n
    return dq, dk, dv


def _bhsd(x_thd: torch.Tensor) -> torch.Tensor:
    return x_thd.transpose(0, 1)[None].contiguous()


def _thd(x_bhsd: torch.Tensor) -> torch.Tensor:
    return x_bhsd[0].transpose(0, 1)


def _cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence on the CPU flash kernel: the causal square (the last s keys) merged with the visible prefix."""
    p = k.shape[0] - q.shape[0]
    blocks = [(_bhsd(k[:p]), _bhsd(v[:p]), None, None)] if p else []
    o, lse = blockwise.merged(_bhsd(q), _bhsd(k[p:]), _bhsd(v[p:]), blocks, True, None)
    return _thd(o), lse[0]


def _cpu_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = k.shape[0] - q.shape[0]
    args = (_bhsd(do.to(q.dtype)), _bhsd(q))
    ob, lb = _bhsd(o), lse[None].contiguous()
    dq, dks, dvs = blockwise.block_backward(*args, _bhsd(k[p:]), _bhsd(v[p:]), (ob, lb), True, None)
    dk, dv = [_thd(dks)], [_thd(dvs)]
    if p:
        dqp, dkp, dvp = blockwise.block_backward(*args, _bhsd(k[:p]), _bhsd(v[:p]), (ob, lb), False, None)
        dq = dq + dqp
        dk.insert(0, _thd(dkp))
        dv.insert(0, _thd(dvp))
    return _thd(dq), torch.cat(dk), torch.cat(dv)


class _Varlen(torch.autograd.Function):
    """Autograd over :func:`forward` / :func:`backward` (a key range longer than its queries, on the CPU)."""

    @staticmethod
    def forward(ctx, q, k, v, seqs):  # type: ignore[override]
        o, lse = forward(q, k, v, seqs)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.seqs = seqs
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward(do, q, k, v, o, lse, ctx.seqs)
        return dq, dk, dv, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Seqs) -> torch.Tensor:
    """Bottom-right causal attention of every sequence of ``seqs``, with autograd through q, k and v."""
    _check_device(q)
    if uses_flash(q):
        from torch.nn.attention.varlen import varlen_attn

        cu_q, cu_k = seqs.offsets(q.device)
        gqa = q.shape[1] != k.shape[1] and _takes(_flash_ops()._varlen_attn, "enable_gqa")
        return varlen_attn(q, k, v, cu_q, cu_k, seqs.max_q, seqs.max_k, window_size=(-1, 0),
                           **({"enable_gqa": True} if gqa else {}))
    if seqs.square:
        return _documents_cpu(q, k, v, seqs.q_lens)
    return _Varlen.apply(q, k, v, seqs)


def attention_offsets(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int
                      ) -> torch.Tensor:
    """Causal documents [cu[i], cu[i+1]) of q, k, v (int32 offsets already on q's device, ``longest`` the longest
    document as a host int), as :func:`attention`: for callers that get the offsets from elsewhere (a collator's
    flash-attention kwargs); on the GPU no host read, on the CPU the offsets are read once."""
    _check_device(q)
    if uses_flash(q):
        from torch.nn.attention.varlen import varlen_attn

        gqa = q.shape[1] != k.shape[1] and _takes(_flash_ops()._varlen_attn, "enable_gqa")
        return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0),
                           **({"enable_gqa": True} if gqa else {}))
    return attention(q, k, v, Seqs.of_offsets(cu.tolist()))


def _documents_cpu(q_thd: torch.Tensor, k_thd: torch.Tensor, v_thd: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Causal documents on the CPU: one batched SDPA call per distinct length (exact, no padding, Σ s_i²)."""
    by_len: dict[int, list[int]] = defaultdict(list)
    at = 0
    for s in lens:
        if s:
            by_len[s].append(at)
        at += s
    if len(by_len) == 1 and len(lens) == 1:  # one document: no gather, no scatter
        return _thd(F.scaled_dot_product_attention(_bhsd(q_thd), _bhsd(k_thd), _bhsd(v_thd), is_causal=True,
                                                   enable_gqa=q_thd.shape[1] != k_thd.shape[1])).to(q_thd.dtype)
    out = torch.empty_like(q_thd)
    gqa = q_thd.shape[1] != k_thd.shape[1]
    for s, starts in by_len.items():
        idx = (torch.tensor(starts)[:, None] + torch.arange(s)).reshape(-1)
        n = len(starts)
        q, k, v = (t[idx].view(n, s, *t.shape[1:]).transpose(1, 2) for t in (q_thd, k_thd, v_thd))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        out[idx] = o.transpose(1, 2).reshape(n * s, *q_thd.shape[1:]).to(out.dtype)  # autocast: sdpa may give bf16
    return out
