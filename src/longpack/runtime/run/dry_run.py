"""`longpack train --dry-run`: the user's command, model config, data and hardware, run for a few steps on fake
tensors, each rank's memory peak beside the cost model's prediction and the device's capacity — before anyone
rents a GPU.

One process plays each rank in turn: a fake process group of the run's world size
(``dist.init_process_group("fake")``, collectives that move nothing), the model built on ``meta`` from its config
alone (no weights are read, so a 72B dry-runs on a laptop-class CPU), sharded as the run shards it (FSDP2 per layer,
runtime/kernel/parallelize.py) and materialised with ``to_empty`` under ``FakeTensorMode`` — tensors with shapes,
dtypes and devices but no storage. The rank then runs the run's own steps (runtime/kernel/step_fn.py, StepRunner.run:
its plan, its micro-batches, chains, CP shares, checkpointing, the chunked loss; not the filler passes that only keep
FSDP2's collectives in step across ranks, :func:`_own_passes`) and AdamW's step, while torch's ``FSDPMemTracker``
(``MemTracker`` without FSDP) counts every tensor the rank would hold: parameters and their gathered copies,
gradients, optimizer state (made before step 0, so that every step holds it), activations and temporaries.

FSDP2 on a CPU-only torch build shards over a 'cpu' mesh standing for the GPUs; the bytes are the same (the
device kernels' outputs have the same shapes). Not counted: the CUDA caching allocator's fragmentation and the
NCCL / cuBLAS workspaces — the cost model's fragmentation factor and reserve, reported apart.

The prediction is the simulator's peak for the rank in that step (sim/memory.py: static state, the micro-batch's
activations, what unfinished chunk chains keep and their K/V store) as allocated: without the fragmentation margin
and reserve the planner sizes its token caps with.

Cost: the plan's first ``steps`` steps only (the run's own: a step is a pure function of its batch and the seed),
then per rank and step a few Python calls per operator of its passes (a pass costs the same at any length: nothing
scales with the tokens but the head's chunks); seconds for a small model, tens of seconds a rank for a 7B or 72B.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ...sim.simulate import simulate_step
from .run_plan import build_plan, load_source, model_spec, sharded
from .train_args import TrainArgs

__all__ = ["dry_run", "parse_ranks"]


def parse_ranks(text: str, world: int) -> list[int]:
    """``all`` or comma-separated ranks, each in [0, world); one clear line otherwise."""
    if text == "all":
        return list(range(world))
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--dry-run-ranks {text!r}: give 'all' or ranks like 0,3,7") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ValueError(f"--dry-run-ranks {text!r}: ranks must lie in 0..{world - 1} (the run's processes)")
    return ranks


@contextmanager
def _fake_world(rank: int, world: int):  # noqa: ANN202
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _pass_tracker(fsdp: bool) -> Any:
    """torch's memory tracker (FSDPMemTracker under FSDP2) over steps of many passes. The trackers keep per-module
    statistics of one forward per iteration and refuse a second root forward; only their device totals are read
    here, so the per-module statistics restart at every root forward (their private pre-forward hooks, wrapped),
    and the device peak is kept without the per-module peaks: torch's tracker walks every module's statistics after
    each operator (a thousand modules in an 80-layer model: a third of a 72B rank's dry run). The engine's device
    queries (``prim.device``, which allocate nothing) bypass the tracker."""
    from copy import deepcopy

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    def device_peak(self: Any, peak_state: Any) -> None:  # noqa: ARG001  (MemTracker._update_peak_stats, devices only)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = deepcopy(snap)

    device_of = torch.ops.prim.device.default

    class Untracked:  # the autograd engine asks every fake tensor its device: most operators of a backward
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is device_of:  # allocates nothing: no bookkeeping
                return func(*args)
            return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    class PassFSDPTracker(Untracked, FSDPMemTracker):
        _update_peak_stats = device_peak

        def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:  # type: ignore[override]
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def pre(*args: Any, **kwargs: Any) -> Any:
                if fsdp_mod is self._root_mod and not self._mod_tracker.is_bw:
                    self.memory_tracking.clear()
                return inner(*args, **kwargs)

            return pre

    class PassTracker(Untracked, MemTracker):
        _update_peak_stats = device_peak

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:  # type: ignore[override]
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} == {"Global"}):
                self.memory_tracking.clear()
            super()._pre_fw_hook(module, inputs)

    return PassFSDPTracker if fsdp else PassTracker


def _rank(args: TrainArgs, world: int, rank: int, inputs: tuple[Any, Any, Any, Any], steps: int, fillers: bool
          ) -> list[dict[str, Any]]:
    """Rank ``rank``'s steps on fake tensors; ``inputs``: (plan, rows, model shapes, cost model)."""
    plan, source, spec, cost = inputs
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..dist import DistContext
    from ..kernel.head_loss import loss_head
    from ..kernel.parallelize import PassSync, parallelize, sync_for
    from ..kernel.step_fn import StepRunner
    from .hf_model import check_supported, config_of
    from .optim import adamw
    from .shard_load import meta_model
    from .train import DTYPES, stored_dtype

    dtype = DTYPES[args.model.dtype]
    fsdp = sharded(args, world)
    device = torch.device("cpu")
    out = []
    with _fake_world(rank, world):
        model = meta_model(config_of(spec, args.model.path), stored_dtype(dtype, fsdp))
        check_supported(model, max((plan.effective_length(s) for s in plan.lengths), default=1))
        loss_head(model)
        if fsdp:
            parallelize(model, world, device, dtype)
        sync = sync_for(model, device, cost.cfg.zero_stage) if fsdp else None
        if isinstance(sync, PassSync) and not fillers:
            sync = _own_passes(sync)
        runner = StepRunner(DistContext(rank=rank, world=world, device=device), args.optim.loss, sync,
                            timeout=args.parallel.timeout)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=device)
            model.train()
            opt = adamw(model, args.optim.lr, args.optim.weight_decay)
            for p in model.parameters():  # AdamW's state made up front, so that every step holds it
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tracker = _pass_tracker(True)(mod=model, optm=opt) if fsdp else _pass_tracker(False)()
            if not fsdp:
                tracker.track_external(model, opt)
            for step in range(min(steps, len(plan.steps))):
                t0 = time.perf_counter()
                mbs = plan.steps[step].replicas[plan.steps[step].position(rank)[0]].micro_batches
                with tracker:
                    runner.run(model, plan, step, mbs, source)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                peak = max(tracker.get_tracker_snapshot("peak")[device]["Total"], 0)
                predicted = simulate_step(step, plan.steps[step], plan, cost, bound=False).peak_mem_bytes[rank]
                predicted -= cost.hw.reserve_gib * 2**30
                longest = max((plan.effective_length(pc.sample) for mb in mbs for pc in mb.pieces), default=0)
                out.append({"step": step, "rank": rank, "peak_bytes": int(peak), "predicted_bytes": int(predicted),
                            "capacity_bytes": int(cost.hw.memory_bytes), "longest_sample": longest,
                            "seconds": time.perf_counter() - t0})
    return out


def _own_passes(sync: Any) -> Any:
    """``sync`` (runtime/kernel/parallelize.PassSync) without the filler passes of its schedule: the empty passes a rank
    runs only to keep FSDP2's collectives in step with busier ranks (runtime/kernel/passes.py's ``f``/``b`` slots). The
    fake process group needs no such matching. A filler pass holds what the rank holds between its own passes plus
    one gathered layer (and its gradient, backward) — what the rank's own next pass starts from and gathers too —
    and leaves a one-token graph until its backward (a few MiB with a 152K vocabulary); so the peaks without the
    fillers are those with them less at most those graphs (tests/test_dry_run.py compares both). A rank with no
    pass of its own keeps its fillers. Each filler costs a whole pass of Python calls: on 32 ranks, most of a rank's
    dry run. The empty passes a CP rank runs in place of its own (capital slots) are played."""
    begin = sync.begin

    def own(plan: Any, step: int, rank: int) -> Any:
        clock = begin(plan, step, rank)
        if any(c.isupper() for c in clock.row):
            clock.row = "".join(c for c in clock.row if c.isupper())
        return clock

    sync.begin = own
    return sync


def _quiet_torch_tools() -> None:
    """torch's notices that do not concern the user here: a fake tensor's storage pointer read (the activation
    meter tells parameters apart by storage; fake storages are distinct objects) and the module tracker's doubt
    about the hierarchy (its per-module statistics are not read, :func:`_pass_tracker`), and FSDP2's notice that
    the model returns a view (its logits; never written in place)."""
    import warnings

    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # as in training: runtime/run/train._one_voice


def dry_run(args: TrainArgs, world: int, steps: int = 2, ranks: str = "all", fillers: bool = False,
            ) -> dict[str, Any]:
    """Run ``steps`` steps of the command's plan on fake tensors for each of ``ranks`` (see the module docstring);
    ``fillers``: play the filler passes too (:func:`_own_passes`; the same peaks, slower). Returns {"dry_run": [per
    step and rank: peak, predicted and capacity bytes, longest sample], "world", "hardware", "model"} and
    prints a line per step and rank (unless --json)."""
    if args.parallel.pp > 1:
        raise ValueError(f"--dry-run with --pp {args.parallel.pp}: the dry run plays data and context parallel ranks "
                         "only; drop --pp")
    chosen = parse_ranks(ranks, world)
    _quiet_torch_tools()
    spec = model_spec(args)
    source = load_source(args, spec.vocab)
    plan, cost = build_plan(args, world, source=source, spec=spec, steps=steps)  # only the steps it plays
    # the prediction of what is allocated (as the tracker counts, and CUDA's max_memory_allocated): without the
    # fragmentation margin the planner sizes caps with; the capacity is the device's whole memory
    cost = type(cost)(cost.model, replace(cost.hw, fragmentation=1.0),
                      replace(cost.cfg, act_bytes=2 if args.model.dtype == "bfloat16" else 4))
    rows: list[dict[str, Any]] = []
    for rank in chosen:
        for rec in _rank(args, world, rank, (plan, source, spec, cost), steps, fillers):
            rows.append(rec)
            if not args.out.json_log:
                print(_line(rec), flush=True)
    return {"dry_run": rows, "world": world, "hardware": cost.hw.name, "model": spec.name,
            "static_bytes": cost.static_bytes, "zero_stage": cost.cfg.zero_stage}


def _line(rec: dict[str, Any]) -> str:
    g = 2**30
    peak, pred, cap = rec["peak_bytes"] / g, rec["predicted_bytes"] / g, rec["capacity_bytes"] / g
    ratio = f"{pred / peak:.2f}x of the peak" if peak else "no peak"
    return (f"dry run  step {rec['step']:3d}  rank {rec['rank']:3d}  peak {peak:7.2f} GiB  predicted {pred:7.2f} GiB "
            f"({ratio})  capacity {cap:.0f} GiB ({peak / cap:.0%} used)  longest sample {rec['longest_sample']:,}  "
            f"{rec['seconds']:.1f} s")
