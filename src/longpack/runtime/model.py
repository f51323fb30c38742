"""A minimal Llama / Qwen2 decoder over packed token streams, loading Hugging Face state dicts.

Shapes: a micro-batch is one packed stream of T tokens (no batch dimension); ``x_td`` is [T, hidden], ``q_thd``
[T, heads, head_dim], ``k_thd`` / ``v_thd`` [T, kv_heads, head_dim]. RMSNorm in float32 like HF, rotary
embeddings from explicit position ids (restarting per sample, continuing across chunks), grouped-query attention,
SwiGLU MLP, optional QKV bias (Qwen2), optional tied embeddings. Module names match HF's
(``model.layers.{i}.self_attn.q_proj`` ...), so ``load_hf_state_dict`` is a plain ``load_state_dict``.

Attention is not computed here: each layer calls ``attend(layer, q_thd, k_thd, v_thd) -> o_thd`` supplied by the
caller (runtime/attention.py for packed documents, runtime/chunked.py for chunk chains, context_parallel.py for
sharded sequences), so the model has no distributed or packing logic of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model import ModelSpec

__all__ = ["DecoderConfig", "Decoder", "Attend"]

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    qkv_bias: bool = False
    tied_embeddings: bool = False
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_spec(cls, spec: ModelSpec, **kw: Any) -> DecoderConfig:
        return cls(vocab=spec.vocab, hidden=spec.hidden, layers=spec.layers, heads=spec.heads,
                   kv_heads=spec.kv_heads, head_dim=spec.head_dim, ffn=spec.ffn, qkv_bias=spec.qkv_bias,
                   tied_embeddings=spec.tied_embeddings, **kw)

    @classmethod
    def from_hf(cls, config: Any) -> DecoderConfig:
        """From a transformers LlamaConfig / Qwen2Config (or anything with the same attribute names)."""
        heads = config.num_attention_heads
        scaling = getattr(config, "rope_scaling", None)
        theta = getattr(config, "rope_theta", None)
        params = getattr(config, "rope_parameters", None)  # transformers >= 5 keeps theta and scaling here
        if isinstance(params, dict):
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", "default") != "default":
                scaling = params
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default", "llama3"):
            raise ValueError(f"rope scaling {scaling!r} is not supported (default and llama3 are)")
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        return cls(vocab=config.vocab_size, hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn=config.intermediate_size,
                   qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), rms_eps=config.rms_norm_eps,
                   rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics whatever the dtype (float64 included), exactly as transformers' Llama/Qwen2 RMSNorm
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    d = cfg.head_dim
    # float32 throughout, as transformers computes it, so that loaded checkpoints see identical rotations
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s:  # Llama 3.1: stretch low frequencies by `factor`, keep high ones, interpolate in between
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv


def _rotate(x_thd: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
    half = x_thd.shape[-1] // 2
    rot = torch.cat((-x_thd[..., half:], x_thd[..., :half]), dim=-1)
    return x_thd * cos_td[:, None, :] + rot * sin_td[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, layer: int, x_td: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        t, c = x_td.shape[0], self.cfg
        q_thd = _rotate(self.q_proj(x_td).view(t, c.heads, c.head_dim), cos_td, sin_td)
        k_thd = _rotate(self.k_proj(x_td).view(t, c.kv_heads, c.head_dim), cos_td, sin_td)
        v_thd = self.v_proj(x_td).view(t, c.kv_heads, c.head_dim)
        return self.o_proj(attend(layer, q_thd, k_thd, v_thd).reshape(t, c.heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(layer, self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)


class Decoder(nn.Module):
    """Decoder-only LM; ``forward(input_ids_t, position_ids_t, attend) -> logits_tv`` on one packed stream."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", _inv_freq(cfg), persistent=False)

    def rope(self, position_ids_t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 even in a float64 model (``.double()`` converts the buffer): transformers does the same
        inv_freq = self.get_buffer("inv_freq")
        freqs = position_ids_t.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden_states(self, input_ids_t: torch.Tensor, position_ids_t: torch.Tensor, attend: Attend) -> torch.Tensor:
        x_td = self.model.embed_tokens(input_ids_t)
        cos, sin = self.rope(position_ids_t, x_td.dtype)
        for i, layer in enumerate(self.model.layers):
            x_td = layer(i, x_td, cos, sin, attend)
        return self.model.norm(x_td)

    def forward(self, input_ids_t: torch.Tensor, position_ids_t: torch.Tensor, attend: Attend) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids_t, position_ids_t, attend))

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face Llama/Qwen2 ``state_dict`` (names match; rotary buffers are ignored)."""
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        if self.cfg.tied_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (self.cfg.tied_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"state dict does not match the model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}")
