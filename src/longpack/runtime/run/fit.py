"""Refuse, before allocating anything, a model whose weights, gradients and AdamW state cannot fit.

Per parameter, with ``p`` bytes for a stored parameter (8 float64, else 4: bf16 under FSDP keeps fp32 shards) and
``c`` bytes at compute precision:

* without FSDP: the parameter, its gradient and AdamW's two moments, ``4 · p``, on every process;
* with FSDP2 over ``world`` ranks: the shards, ``4 · p / world``, plus what is gathered: per layer
  (runtime/kernel/parallelize.PassSync) the root (embeddings, head) at compute precision with its gradient, and two
  decoder layers; on pipeline stages and a single bf16 process (gathered once per step) the whole parameters and
  gradients, ``c + max(c, 4)`` per parameter (bf16 gradients accumulate in fp32).

The need is compared with what the device has: the GPU's total memory, or on the CPU the host's available memory
shared by the processes launched on it. Activations are the plan's business (its token cap); this is the floor
below which no plan can help.
"""

from __future__ import annotations

import torch

from ...model import ModelSpec

__all__ = ["static_need", "available_bytes", "check_fits"]


def static_need(spec: ModelSpec, *, world: int, fsdp: bool, dtype: torch.dtype, per_layer: bool = True) -> float:
    """Bytes one process needs for weights, gradients and AdamW state (see the module docstring)."""
    params = float(spec.total_params)
    stored = 8 if dtype == torch.float64 else (2 if dtype == torch.bfloat16 and not fsdp else 4)
    if not fsdp:
        return params * 4 * stored
    compute = dtype.itemsize
    if per_layer:
        gathered = spec.embedding_params + 2 * spec.layer_params()
        return params * 4 * stored / world + gathered * (compute + max(compute, 4))
    return params * (4 * stored / world + compute + max(compute, 4))


def available_bytes(device: torch.device) -> float:
    """Total memory of the GPU, or the host's available memory (MemAvailable) for the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def check_fits(spec: ModelSpec, *, world: int, local: int, fsdp: bool, dtype: torch.dtype,
               device: torch.device, per_layer: bool = True) -> None:
    """Raise ValueError (one line) when the static state of ``local`` processes on this device cannot fit
    (``per_layer``: FSDP2 gathers per layer, else once per step, as on pipeline stages)."""
    need = static_need(spec, world=world, fsdp=fsdp, dtype=dtype, per_layer=per_layer)
    share = local if device.type == "cpu" else 1
    have = available_bytes(device)
    if need * share > have:
        how = f"FSDP over {world}" if fsdp and world > 1 else "no sharding"
        raise ValueError(f"model {spec.name} ({spec.total_params / 1e9:.2f}B parameters): weights, gradients and "
                         f"AdamW state need {need / 2**30:,.1f} GiB per process ({how}) x {share} on this "
                         f"{device.type}, but {have / 2**30:,.1f} GiB is there; use a smaller model, more GPUs "
                         "(FSDP shards the state over every process), or --dtype bfloat16")
