"""Sharding from outside the model: FSDP2 (``torch.distributed.fsdp.fully_shard``) over every dp·cp rank (over a
pipeline stage's ranks under PP; on a single bfloat16 process over a group of one, for fp32 weights and AdamW state
under bf16 compute).

* :func:`parallelize` — ``fully_shard`` on each decoder layer, then on the root (embeddings, final norm, LM head),
  over a 1-D mesh of all ranks: CP ranks hold different tokens of the same parameters, so their gradients are summed
  with DP's. The reduction is a sum (divide factor 1): each rank's loss already carries the step's global weights
  (runtime/kernel/loss.py). ``bfloat16`` computes in bf16 and reduces gradients in fp32 (``MixedPrecisionPolicy``);
  the sharded parameters, their gradients (accumulated in fp32 over a step's backward passes) and AdamW state stay
  fp32.
* :class:`PassSync` — ZeRO-3: each decoder layer is gathered for each forward and backward pass and resharded
  after it, its gradient reduce-scattered after each backward; the root (embeddings, norm, head) stays gathered
  from a step's first forward to the end of the next backward. A plan gives ranks different work within a step,
  so every rank follows one pass schedule per step (runtime/kernel/passes.py), running empty one-token passes where it
  has less to do: the same collectives in the same order on every rank. Static memory: 16 bytes per parameter
  over the ranks, plus one gathered layer (two with prefetch) and the root while gathered.
* :class:`StepSync` — pipeline stages (and models Accelerate sharded): the parameters gathered once per step,
  the rank's micro-batches run with gradient sync off until its last backward, which reduce-scatters the step's
  accumulated gradients layer by layer while it runs (:class:`~longpack.runtime.kernel.passes.LastBackward`
  counts the backwards). The cost: full parameters and gradients live through the step (ZeRO-2's footprint); a
  rank with no micro-batch in a step reduce-scatters through one empty one-token pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .engine import decoder_layers
from .passes import Clock, LastBackward, merge, replica_passes
from .runner import empty_loss
from .step import chain_segments

__all__ = ["parallelize", "PassSync", "StepSync", "sync_for", "fsdp_modules"]


def parallelize(model: torch.nn.Module, world: int, device: torch.device, dtype: torch.dtype,
                stages: int = 1) -> torch.nn.Module:
    """Shard ``model`` (a transformers CausalLM, fp32 or fp64 parameters) with FSDP2 over ``world`` ranks; with
    ``stages`` pipeline stages, over the world/stages ranks of this rank's stage (a stage model of
    runtime/kernel/pipeline.py)."""
    if world == 1 and not dist.is_initialized():  # one process: a group of one for the mesh
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    if stages > 1:
        mesh = init_device_mesh(device.type, (stages, world // stages), mesh_dim_names=("pp", "shard"))["shard"]
    else:
        mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype == torch.bfloat16 else None
    kw: dict[str, Any] = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class PassSync:
    """Per-layer gathers and reduce-scatters in every pass, on one pass schedule per step (module docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.modules = fsdp_modules(model)
        self.clock: Clock | None = None

    def begin(self, plan: Any, step: int, rank: int) -> Clock:
        """This rank's clock over ``step``'s pass schedule (every replica's passes, merged)."""
        st = plan.steps[step]
        rows = merge([replica_passes(rep.micro_batches, chain_segments(plan, rep.micro_batches))
                      for rep in st.replicas])
        self.clock = Clock(rows[st.position(rank)[0]], lambda: empty_loss(self.model, self.device))
        return self.clock

    def end(self) -> None:
        """The schedule's remaining empty passes; every unit resharded (a forward no backward followed leaves the
        root gathered, and the optimizer steps the shards)."""
        if self.clock is not None:
            self.clock.finish()
            self.clock = None
        for m in self.modules:
            m.reshard()


class StepSync:
    """Gather the parameters once per step; the step's last backward reduce-scatters the gradients (see the module
    docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.modules = fsdp_modules(model)
        self.clock: LastBackward | None = None

    def begin(self, plan: Any = None, step: int = 0, rank: int = 0) -> LastBackward:
        """Gather every unit, gradient sync off; the clock turns it on before the rank's last backward of
        ``step`` (one per micro-batch with pieces on the rank's replica; none without a plan)."""
        for m in self.modules:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for m in self.modules:  # same modules, same order on every rank: the all-gathers match
            m.unshard()
        backwards = 0
        if plan is not None:
            st = plan.steps[step]
            backwards = sum(1 for mb in st.replicas[st.position(rank)[0]].micro_batches if mb.pieces)
        self.clock = LastBackward(backwards, self._sync_on, lambda: empty_loss(self.model, self.device))
        return self.clock

    def _sync_on(self) -> None:
        for m in self.modules:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)

    def end(self) -> None:
        """A rank that ran no backward this step (no micro-batch with pieces) reduce-scatters through one empty
        pass, with its peers' last backwards."""
        if self.clock is None or not self.clock.synced:
            self._sync_on()
            empty_loss(self.model, self.device).backward()
        self.clock = None


def sync_for(model: torch.nn.Module, device: torch.device, zero_stage: int) -> PassSync | StepSync:
    """The synchronisation of the sharding the run's cost model prices (runtime/run/run_plan.zero_stage): per layer and
    pass at ZeRO-3, once per step otherwise."""
    return PassSync(model, device) if zero_stage == 3 else StepSync(model, device)
