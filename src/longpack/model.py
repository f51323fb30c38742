"""Model shapes: what a transformer costs per token, per token pair, and per parameter.

A :class:`ModelSpec` holds the real shapes of a decoder-only LLM (dense or MoE, GQA or MLA) and derives the three
quantities the cost model needs, all per layer and forward only:

* ``linear_flops_per_token``: 2 x (multiply-accumulates of every projection and MLP matrix a token passes through);
* ``attn_flops_per_pair``: FLOPs of QK^T plus PV for one (query, key) pair summed over heads, so a document of
  length s costs ``attn_flops_per_pair * s**2`` before the causal factor;
* ``kv_width``: numbers of K plus V per token, the size of what context parallelism exchanges.

Presets are functions of no arguments, looked up by name with :func:`get_model`. Shapes are from the models'
published ``config.json`` files. Derivations in the docstrings; nothing here imports torch.

>>> m = get_model("qwen2.5-0.5b")
>>> round(m.total_params / 1e6)
494
>>> m.kv_width                      # 2 KV heads x 64 dims, K and V
256
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSpec", "MODEL_PRESETS", "get_model", "UnknownNameError"]


class UnknownNameError(ValueError):
    """A preset name that does not exist; the message lists the known ones."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a decoder-only transformer.

    MoE: ``experts`` routed experts of width ``moe_ffn``, ``top_k`` of them active per token, plus
    ``shared_experts`` always active; the first ``dense_layers`` layers use a dense MLP of width ``ffn``.
    MLA (DeepSeek-V2): queries through a ``q_lora_rank`` bottleneck, keys/values through a ``kv_lora_rank``
    latent; per head ``qk_nope_dim + qk_rope_dim`` for Q/K and ``v_head_dim`` for V.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated_mlp: bool = True
    qkv_bias: bool = False
    tied_embeddings: bool = False
    experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    moe_ffn: int = 0
    dense_layers: int = 0
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {self.name!r}: {field}={value!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.experts and not (0 < self.top_k <= self.experts and self.moe_ffn > 0):
            raise ValueError(f"model {self.name!r}: MoE needs 0 < top_k <= experts and moe_ffn > 0")
        if self.mla and min(self.kv_lora_rank, self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim) <= 0:
            raise ValueError(f"model {self.name!r}: MLA needs kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim")

    # --- shapes -------------------------------------------------------------------------------------------
    @property
    def q_width(self) -> int:
        """Query width (heads x per-head Q/K dim)."""
        per_head = self.qk_nope_dim + self.qk_rope_dim if self.mla else self.head_dim
        return self.heads * per_head

    @property
    def v_width(self) -> int:
        """Attention output width before the O projection (heads x V dim)."""
        return self.heads * (self.v_head_dim if self.mla else self.head_dim)

    @property
    def kv_width(self) -> int:
        """K plus V numbers per token per layer: what CP all-gathers. For MLA, K/V are exchanged after the
        up-projection (as Megatron's MLA context parallelism does), so they are as wide as MHA (HBP App. C, on
        DeepSeek-V2)."""
        if self.mla:
            return self.heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)
        return 2 * self.kv_heads * self.head_dim

    def _attn_params(self) -> int:
        h = self.hidden
        if self.mla:
            q = h * self.q_lora_rank + self.q_lora_rank * self.q_width if self.q_lora_rank else h * self.q_width
            kv_down = h * (self.kv_lora_rank + self.qk_rope_dim)
            kv_up = self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
            return q + kv_down + kv_up + self.v_width * h
        return h * self.q_width + 2 * h * self.kv_heads * self.head_dim + self.v_width * h

    def _mlp_params(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * width

    def _moe_layer_params(self, active: bool) -> int:
        routed = self.top_k if active else self.experts
        return (routed + self.shared_experts) * self._mlp_params(self.moe_ffn) + self.hidden * self.experts

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def layer_params(self, *, active: bool = False) -> float:
        """Mean parameters per layer; ``active=True`` counts only what one token uses (MoE top-k)."""
        dense = self._attn_params() + self._mlp_params(self.ffn)
        if not self.experts:
            return float(dense)
        moe = self._attn_params() + self._moe_layer_params(active)
        return (self.dense_layers * dense + self.moe_layers * moe) / self.layers

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> float:
        return self.layers * self.layer_params() + self.embedding_params

    # --- FLOPs -----------------------------------------------------------------------------------------------
    @property
    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token per layer of every matrix multiply (2 FLOPs per multiply-accumulate)."""
        return 2.0 * self.layer_params(active=True)

    @property
    def attn_flops_per_pair(self) -> float:
        """Forward FLOPs per (query, key) pair per layer: QK^T (2 x q_width) plus PV (2 x v_width).
        For a standard model this is 4h, the ``4·b·h·S²`` of Skrull's formula (Skrull App. C.2)."""
        return 2.0 * (self.q_width + self.v_width)

    @property
    def head_flops_per_token(self) -> float:
        """Forward FLOPs per token of the LM head (the embedding lookup costs none)."""
        return 2.0 * self.hidden * self.vocab

    def skrull_layer_flops(self, s: Any) -> Any:
        """Skrull's per-layer forward FLOPs for one sequence (Skrull App. C.2):
        ``20·h²·S + 4·h·h_kv·S + 4·h·S²`` with h_kv = KV heads x head dim. It assumes a 4h non-gated MLP,
        so it under-counts gated MLPs (Qwen2.5-0.5B's is 5.4h wide and gated); kept to check the paper's claims."""
        h, h_kv = self.hidden, self.kv_heads * self.head_dim
        return 20.0 * h * h * s + 4.0 * h * h_kv * s + 4.0 * h * s * s


def _qwen(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, head_dim=hidden // heads,
                     ffn=ffn, vocab=vocab, qkv_bias=True, tied_embeddings=tied)


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=8, head_dim=hidden // heads,
                     ffn=ffn, vocab=128256)


def _deepseek_v2() -> ModelSpec:
    return ModelSpec(name="deepseek-v2", layers=60, hidden=5120, heads=128, kv_heads=128, head_dim=128, ffn=12288,
                     vocab=102400, experts=160, top_k=6, shared_experts=2, moe_ffn=1536, dense_layers=1, mla=True,
                     q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)


MODEL_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "qwen2.5-0.5b": lambda: _qwen("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, True),
    "qwen2.5-7b": lambda: _qwen("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": lambda: _qwen("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": lambda: _qwen("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": lambda: _qwen("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, False),
    "llama3.1-8b": lambda: _llama("llama3.1-8b", 32, 4096, 32, 14336),
    "llama3.1-70b": lambda: _llama("llama3.1-70b", 80, 8192, 64, 28672),
    "deepseek-v2": _deepseek_v2,
    # CPU shapes: small enough that a training step on 2 cores takes well under a second.
    "tiny": lambda: ModelSpec(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
                              vocab=256),
    "tiny-llama": lambda: ModelSpec(name="tiny-llama", layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32,
                                    ffn=688, vocab=1024),
    "tiny-qwen": lambda: ModelSpec(name="tiny-qwen", layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32,
                                   ffn=688, vocab=1024, qkv_bias=True, tied_embeddings=True),
}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name``; an unknown name raises with the list of known ones."""
    try:
        return MODEL_PRESETS[name]()
    except KeyError:
        known = ", ".join(sorted(MODEL_PRESETS))
        raise UnknownNameError(f"unknown model {name!r}; choose one of: {known}") from None
