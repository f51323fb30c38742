"""The user's Hugging Face checkpoint in and out, on transformers' own model classes.

* :func:`load` — a local checkpoint folder (config.json + safetensors) through ``AutoModelForCausalLM`` with
  ``attn_implementation="longpack"`` (runtime/kernel/engine.py); no downloads.
* :func:`build` — a random-init model of a longpack :class:`~longpack.model.ModelSpec` preset (Llama, or Qwen2
  when the preset has QKV bias), for the synthetic workloads of demos and tests.
* :func:`spec_of` — the ModelSpec the cost model plans with, read from a transformers config.
* :func:`save` — a consolidated checkpoint that ``from_pretrained`` loads (safetensors, config, generation
  config), with the tokenizer files copied when a tokenizer folder is given.
* :func:`check_supported` — refuses, in one line, what the engine cannot run exactly (sliding-window attention
  shorter than the longest sample, a decoder without per-layer attention through the interface).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ...model import ModelSpec
from ..kernel.engine import ATTN, decoder_layers, register

__all__ = ["load", "build", "preload", "spec_of", "save", "check_supported", "positions", "config_of",
           "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def load(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint at ``path`` as a transformers CausalLM running the longpack attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .preflight import check_model_dir

    register()
    p = Path(path)
    check_model_dir(p)
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=dtype, attn_implementation=ATTN,
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--model-path {path}: cannot load it ({str(exc).splitlines()[0]})") from None
    return model


def _config(spec: ModelSpec) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    cls: Any = Qwen2Config if spec.qkv_bias else LlamaConfig
    return cls(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
               num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
               head_dim=spec.head_dim, tie_word_embeddings=spec.tied_embeddings, max_position_embeddings=1 << 20,
               use_cache=False)


def config_of(spec: ModelSpec, path: str | Path | None) -> Any:
    """The run's transformers config: the checkpoint's at ``path``, or the preset ``spec``'s."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True) if path else _config(spec)


def preload(spec: ModelSpec, path: str | Path | None) -> None:
    """Import the transformers class a run will build (seconds: the slow part of building a model), so processes
    forked afterwards start with it. A config that cannot be read is left for :func:`load` to report."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = config_of(spec, path)
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the lazy mapping imports the class's module
    except (OSError, ValueError, KeyError):
        pass


def build(spec: ModelSpec, seed: int, dtype: torch.dtype, device: torch.device | None = None,
          meta: bool | None = None) -> torch.nn.Module:
    """A random-init transformers model of ``spec`` (seeded: every rank builds the same weights). With ``meta``
    (the default on a GPU) it is built on ``meta`` and initialised where it will run, in ``dtype``: no fp32 copy on
    the host, no host-to-device copy. Otherwise it is built on the host (the values the CPU tests compare)."""
    from transformers import AutoModelForCausalLM

    register()
    if spec.experts or spec.mla or not spec.gated_mlp:
        raise ValueError(f"model {spec.name}: only dense Llama/Qwen2 shapes can be built for training; give "
                         "--model-path for other checkpoints")
    device = device or torch.device("cpu")
    if not (device.type != "cpu" if meta is None else meta):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(_config(spec), attn_implementation=ATTN, dtype=dtype)
    from .shard_load import restore_buffers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(spec), attn_implementation=ATTN, dtype=dtype)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    restore_buffers(model)
    return model


def spec_of(config: Any) -> ModelSpec:
    """The cost model's shapes of a transformers decoder config."""
    heads = config.num_attention_heads
    return ModelSpec(name=getattr(config, "model_type", "hf"), layers=config.num_hidden_layers,
                     hidden=config.hidden_size, heads=heads,
                     kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                     head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                     ffn=config.intermediate_size, vocab=config.vocab_size,
                     qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
                     tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def positions(cfg: Any) -> int | None:
    """The longest sequence ``cfg``'s RoPE covers: ``max_position_embeddings``, or with a ``rope_scaling`` factor
    (linear, dynamic, yarn, longrope, llama3) its original length times the factor, whichever is larger; None when
    the config says nothing."""
    n = getattr(cfg, "max_position_embeddings", None)
    scaling = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if factor:
        base = scaling.get("original_max_position_embeddings") or n
        if base:
            n = max(n or 0, int(base * float(factor)))
    return int(n) if n else None


def check_supported(model: Any, longest: int) -> None:
    """Refuse (ValueError, one line) a model the longpack attention would not run exactly."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and longest > window:
        raise ValueError(f"model {cfg.model_type}: sliding_window={window} is shorter than the longest sample "
                         f"({longest} tokens); the longpack attention is full causal: cap --max-len at {window}")
    covered = positions(cfg)
    if covered is not None and longest > covered:
        raise ValueError(f"model {cfg.model_type}: a sample of {longest} tokens is longer than the "
                         f"{covered} positions the model was trained for (max_position_embeddings, times its "
                         f"rope_scaling factor if any); cap --max-len at {covered}, or give a config whose "
                         "rope_scaling covers it")
    layers = decoder_layers(model)
    if not layers or not all(hasattr(getattr(layer, "self_attn", None), "layer_idx") for layer in layers):
        raise ValueError(f"model {cfg.model_type}: its decoder layers do not expose self_attn.layer_idx; the "
                         "longpack attention supports Llama, Qwen2, Qwen3 and Mistral style decoders")


def save(model: Any, state: dict[str, torch.Tensor], out: str | Path, tokenizer: str | None = None,
         dtype: torch.dtype | None = None) -> Path:
    """Write ``state`` (a full, consolidated state dict) as a Hugging Face checkpoint in ``out``."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    from .preflight import STALE_WEIGHTS

    for stale in (f for pattern in STALE_WEIGHTS for f in d.glob(pattern)):  # --overwrite-output-dir: no stale shard
        stale.unlink()
    state = {k: v.to(dtype) for k, v in state.items()} if dtype is not None else dict(state)  # save_pretrained
    # takes entries out of the dict it is given: a second attempt (runtime/run/output.py) needs them all
    model.config.use_cache = True  # the saved model generates as usual
    model.save_pretrained(d, state_dict=state)
    model.config.use_cache = False
    if tokenizer:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer) / name
            if src.is_file():
                shutil.copy2(src, d / name)
    return d
