"""How a decoder layer's own work (norms, rotary embedding, projections, SwiGLU) runs: ``--kernels``.

* ``compile`` — every part of a decoder layer but its attention (its RMSNorms and its gated MLP: the fp32 norm
  chain and SwiGLU fused with their neighbours) compiled with ``torch.compile``, regionally, module by module, as
  torchtitan compiles its blocks; dynamic in the token count, so micro-batches of new lengths reuse the code. Every
  layer's norm shares one compiled graph and every layer's MLP another (torch guards on the module's class, not
  its instance): two compilations per layer class, whatever the lengths. The attention module stays eager — its
  callback holds the plan's collectives, a chain's K/V store and the backend's own FlashAttention kernels, and
  :func:`~longpack.runtime.kernel.engine.longpack_attention` is never traced even when a user compiles more — as
  does transformers' per-layer checkpointing switch, which toggles per micro-batch and would otherwise recompile.
  Compilation happens at a module's first call (seconds; torch caches it on disk for later runs). The rotary
  embedding stays eager (a module-level function of transformers' modeling file).
* ``eager`` — transformers' modules as they are.
* ``auto`` — ``compile`` on CUDA, ``eager`` elsewhere (on the host compilation costs more than it saves for a
  run's few steps; ``--kernels compile`` asks for it there too).

Compilation over Liger's per-op kernels: it fuses the norm and SwiGLU chains of any architecture transformers writes
in torch, with nothing to install, and it runs (and is tested) on the host too. The result equals the eager layer's
up to rounding in the norms, which transformers computes in fp32 whatever the model's dtype (the compiled reduction
and ``rsqrt`` may differ from eager's in the last fp32 bit): the float32 and float64 parity tests run compiled,
within a tolerance stated there.
"""

from __future__ import annotations

from typing import Any

import torch

from .engine import decoder_layers
from .names import KERNELS, check_kernels

__all__ = ["KERNELS", "KERNEL_NAMES", "resolve", "apply_kernels"]

KERNEL_NAMES = {"compile": "torch.compile (norms, MLP)", "eager": "eager"}  # as the run's first line says


def resolve(kind: str, device: torch.device) -> str:
    """The kernels a run uses on ``device`` for ``--kernels kind``; a ValueError names what is missing."""
    check_kernels(kind)
    if kind == "auto":
        return "compile" if device.type == "cuda" else "eager"
    return kind


def apply_kernels(model: Any, kind: str) -> None:
    """Put ``model``'s decoder layers on the ``kind`` kernels (already :func:`resolve` d)."""
    if kind == "compile":
        for layer in decoder_layers(model):
            for name, part in layer.named_children():
                if name != "self_attn":
                    part.compile(dynamic=True)

