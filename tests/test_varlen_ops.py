"""The FlashAttention varlen ops are bound by argument name to whatever schema the installed torch has: torch
2.11's ops take no ``enable_gqa`` (KV-cache arguments sit where 2.13 has it), and passing it there failed the first
GPU run at step 0. Stand-in ops record what the runtime passes; no GPU needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from longpack.runtime.kernel import varlen  # noqa: E402

OLD = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale", "window_size",
       "k_cache", "v_cache", "cache_seqlens", "cache_batch_idx", "page_table", "seqused_k"]
NEW = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale", "window_size",
       "enable_gqa", "seqused_k", "block_table", "num_splits"]
BACKWARD = ["grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
            "rng_state", "scale", "window_size"]


class Op:
    """A stand-in for a torch.ops overload packet: its schema's argument names, and the calls it got."""

    def __init__(self, names: list[str], result) -> None:  # noqa: ANN001
        self.default = SimpleNamespace(_schema=SimpleNamespace(arguments=[SimpleNamespace(name=n) for n in names]))
        self.calls: list[tuple[tuple, dict]] = []
        self.result = result

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        unknown = set(kwargs) - {a.name for a in self.default._schema.arguments}
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        self.calls.append((args, kwargs))
        return self.result(*args)


@pytest.mark.parametrize("schema", ["torch_2_11", "torch_2_13"])
def test_gpu_ready_varlen_ops_bind_the_installed_schema(monkeypatch, schema):
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)  # GQA: 4 query heads, 2 K/V
    seqs = varlen.Seqs([6, 4])
    fwd = Op(OLD if schema == "torch_2_11" else NEW,
             lambda q, *_: (torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2)))
    bwd = Op(BACKWARD, lambda do, q, k, v, *_: (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    monkeypatch.setattr(varlen, "_flash_ops", lambda: SimpleNamespace(_varlen_attn=fwd, _varlen_attn_backward=bwd))
    monkeypatch.setattr(varlen, "uses_flash", lambda t: True)

    o, lse = varlen.forward(q, k, v, seqs)
    varlen.backward(torch.ones_like(o), q, k, v, o, lse, seqs)

    (args, kwargs), = fwd.calls
    assert args[5:] == (6, 6) and kwargs["is_causal"] is True and kwargs["window_size"] == [-1, 0]
    assert kwargs.get("enable_gqa") is (True if schema == "torch_2_13" else None)
    (args, kwargs), = bwd.calls
    assert args[8:11] == (6, 6, True) and kwargs == {"window_size": [-1, 0]}
    assert args[6].tolist() == [0, 6, 10] and args[7].tolist() == [0, 6, 10]


def test_gpu_ready_public_varlen_attn_gets_no_enable_gqa_where_the_op_lacks_it(monkeypatch):
    import torch.nn.attention.varlen as public

    got = {}

    def old_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), scale=None):  # 2.11's keywords
        got.update(window_size=window_size)
        return torch.zeros_like(q)

    fwd = Op(OLD, lambda *a: None)
    monkeypatch.setattr(varlen, "_flash_ops", lambda: SimpleNamespace(_varlen_attn=fwd))
    monkeypatch.setattr(varlen, "uses_flash", lambda t: True)
    monkeypatch.setattr(public, "varlen_attn", old_varlen_attn)
    out = varlen.attention(torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8), varlen.Seqs([6, 4]))
    assert out.shape == (10, 4, 8) and got == {"window_size": (-1, 0)}
