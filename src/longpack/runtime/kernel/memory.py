"""Measured memory of a step, beside the cost model's prediction for the same rank and step.

* GPU: ``torch.cuda.max_memory_allocated`` over the step (reset at its start) — weights, gradients, optimizer
  state and activations, what the cost model's ``memory_bytes`` predicts (without its reserve).
* CPU, per step: :class:`ActivationMeter` measures the activation memory autograd holds for
  backward — the peak, over the step, of the bytes of distinct tensor storages saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``; a storage leaves the count when its last saved tensor is freed;
  parameters, which every matmul saves too, are not counted),
  plus the layer inputs that ``torch.utils.checkpoint`` keeps for recomputation (a checkpointed layer saves nothing
  else). That is what the cost model's ``act_bytes_per_token · tokens`` predicts; static state is not included.
  It does not see the layer a checkpointed backward re-expands, nor the loss's backward temporaries.
* CPU, for benchmarks: :func:`allocator_peak` — the peak of bytes the CPU allocator holds beyond the start, over a
  call, from ``torch.profiler``'s memory events (the CPU analogue of CUDA's ``max_memory_allocated``): everything,
  temporaries included.

Cost: one Python call per saved tensor (a few hundred per micro-batch of a small model).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["ActivationMeter", "allocator_peak", "predicted_bytes"]


class ActivationMeter:
    """Peak bytes of tensors held for backward while active (see the module docstring)."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors alive]
        self.current = 0
        self.peak = 0
        self.static: set[int] = set()  # storages of parameters: saved by every matmul, but not activations

    def _hold(self, t: torch.Tensor) -> None:
        if isinstance(t, FakeTensor) or t.device.type != "cpu" or not t.is_floating_point():
            return  # a dry run's fake tensors hold no storage (runtime/run/dry_run.py measures them)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.static:
            return
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._hold(t)
        return t

    @contextmanager
    def measure(self, model: torch.nn.Module) -> Iterator[ActivationMeter]:
        """Count while the block runs (``model``'s parameters as they are now, unsharded under FSDP, excluded; its
        checkpointed decoder layers' inputs included)."""
        from .engine import decoder_layers

        layers = decoder_layers(model)
        self.static = {p.untyped_storage().data_ptr() for p in model.parameters()  # host ones: only they count
                       if p.device.type == "cpu" and type(p).__name__ != "DTensor"}

        def keep_input(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if getattr(module, "gradient_checkpointing", False) and torch.is_grad_enabled() and args:
                self._hold(args[0])

        handles = [layer.register_forward_pre_hook(keep_input) for layer in layers]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()


def allocator_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated on the CPU above the level at the start, while ``fn()`` runs (op granularity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # an op's own allocations net of its own frees, and allocations outside any op ("[memory]" events)
    deltas = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                    for e in prof.events())
    current = peak = 0
    for _, delta in deltas:
        current += delta
        peak = max(peak, current)
    return peak


def predicted_bytes(cost: Any, tokens: int, ckpt_layers: int, prefix_tokens: int = 0, *,
                    activations_only: bool) -> float:
    """The cost model's bytes for a rank holding ``tokens`` tokens (activations only, or the whole rank)."""
    if activations_only:
        return float(cost.act_bytes_per_token(ckpt_layers) * tokens + cost.kv_store_bytes(prefix_tokens))
    return float(cost.memory_bytes(tokens, ckpt_layers, prefix_tokens) - cost.hw.reserve_gib * 2**30)
