"""Shared by the runtime tests and the processes they spawn: a tiny float64 model, a plan, the unpacked reference."""

from __future__ import annotations

import os

import numpy as np
import torch

from longpack.cost import CostModel, TrainConfig
from longpack.hardware import get_hardware
from longpack.model import ModelSpec
from longpack.planners import PlanContext, get_planner, global_batches
from longpack.runtime.dist import all_reduce_sum, init_distributed, leave
from longpack.runtime.kernel.data import IGNORE, SyntheticCorpus
from longpack.runtime.kernel.step import run_micro_batches
from longpack.runtime.run.hf_model import build

SPEC = ModelSpec(name="parity", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=61,
                 qkv_bias=True)
LENGTHS = np.array([37, 5, 64, 2, 90, 17, 33, 1, 48, 70, 9, 26])


def _close() -> None:
    """Leave the process group together: in a worker of tests/pool.py wait for the peers and return (the pool
    destroys the group); in a process of its own, exit without interpreter teardown (runtime/dist.py ``leave``)."""
    if os.environ.get("LONGPACK_TEST_POOL"):
        torch.distributed.barrier()
        return
    leave()


def make_model(attn: str = "longpack") -> torch.nn.Module:
    """transformers' Qwen2ForCausalLM (QKV bias), float64, seeded: the engine's model, or with ``attn="sdpa"`` the
    plain model the references train."""
    model = build(SPEC, 1234, torch.float64).train()
    if attn != "longpack":
        model.set_attn_implementation(attn)
    return model


def plain_logits(model: torch.nn.Module, toks: torch.Tensor) -> torch.Tensor:
    """Unpacked reference forward: one sample alone through transformers' own attention."""
    return model(input_ids=toks[None], use_cache=False).logits[0]


def make_plan(planner: str, dp: int, cap: int = 128, cp: int = 1, **options):
    if planner == "uneven":
        return uneven_plan()
    cost = CostModel(SPEC, get_hardware("cpu"), TrainConfig(dp=dp, cp=cp, token_cap=cap))
    return get_planner(planner).plan(LENGTHS, global_batches(len(LENGTHS), len(LENGTHS), seed=0),
                                     PlanContext(cost=cost, options=options))


def uneven_plan():
    """One step on 2 ranks whose pass strings differ (runtime/kernel/passes.py): replica 0 runs a whole micro-batch,
    then sample 4 as a chain of three 32-token chunks, the first recomputed (FB FFF B B FB); replica 1 an empty
    micro-batch, a whole one, an empty one and a whole one (FB FB) — the merged schedule gives replica 1 empty
    passes, and both ranks gather and reduce-scatter per layer in every pass."""
    from longpack.plan import MicroBatch, Piece, Plan, Replica, Step

    def whole(*samples):
        return MicroBatch(tuple(Piece(s, 0, int(LENGTHS[s]), 0) for s in samples))

    chain = tuple(MicroBatch((Piece(4, a, min(a + 32, 90), 0),), recompute=a == 0) for a in range(0, 90, 32))
    reps = (Replica((whole(0, 1),) + chain), Replica((MicroBatch(()), whole(2, 3), MicroBatch(()), whole(5, 6, 7))))
    return Plan("uneven", 2, {i: int(LENGTHS[i]) for i in (0, 1, 2, 3, 4, 5, 6, 7)},
                (Step(cp=1, token_cap=128, replicas=reps),))


def reference_grads(mode: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Single process, unpacked: every sample alone, the step objective summed, one backward."""
    model = make_model("sdpa")
    corpus = SyntheticCorpus(SPEC.vocab, seed=0)
    targets = {i: int(n) - 1 for i, n in enumerate(LENGTHS)}
    total = sum(targets.values())
    n_seq = sum(1 for t in targets.values() if t > 0)
    loss = torch.zeros((), dtype=torch.float64)
    for i, n in enumerate(LENGTHS.tolist()):
        toks = torch.from_numpy(corpus.tokens(i, n)).long()
        logits = plain_logits(model, toks)
        if n < 2:
            continue
        ce = torch.nn.functional.cross_entropy(logits[:-1], toks[1:], reduction="sum")
        loss = loss + (ce / total if mode == "token_mean" else ce / (targets[i] * n_seq))
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


def packed_grads(planner: str, dp: int, rank: int, mode: str, **options) -> tuple[float, dict[str, torch.Tensor]]:
    model = make_model()
    plan = make_plan(planner, dp, **options)
    plan.validate()
    mbs = plan.steps[0].replicas[rank].micro_batches
    loss, *_ = run_micro_batches(model, plan, 0, mbs, SyntheticCorpus(SPEC.vocab, seed=0), mode=mode)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    stats = torch.tensor([loss], dtype=torch.float64)
    all_reduce_sum(grads + [stats])
    return float(stats[0]), dict(zip([k for k, _ in model.named_parameters()], grads, strict=True))


def parity_worker(rank: int, world: int, port: int, out: str, planner: str, mode: str, options: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    loss, grads = packed_grads(planner, world, rank, mode, **options)
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, out)
    _close()


def cp_worker(rank: int, world: int, port: int, out: str, planner: str, cp: int, cap: int, options: dict,
              overlap: bool = True) -> None:
    """One rank of a dp x cp run of step 0 of ``planner``'s plan; rank 0 saves the summed loss and gradients."""
    from longpack.runtime.kernel.cp import CPContext, CPGroups

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    plan = make_plan(planner, world // cp, cap=cap, cp=cp, **options)
    plan.validate()
    cp = plan.steps[0].cp  # a planner may choose the step's degree (unified)
    groups = CPGroups.build({cp}, world)
    model = make_model()
    mbs = plan.steps[0].replicas[rank // cp].micro_batches
    ctx = CPContext(degree=cp, rank=rank % cp, group=groups.group(cp, rank) if cp > 1 else None, overlap=overlap)
    loss, *_ = run_micro_batches(model, plan, 0, mbs, SyntheticCorpus(SPEC.vocab, seed=0), ctx)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    stats = torch.tensor([loss], dtype=torch.float64)
    all_reduce_sum(grads + [stats])
    if rank == 0:
        sharded = sum(1 for r in plan.steps[0].replicas for mb in r.micro_batches for p in mb.pieces
                      if p.cp_rank is None)
        local = sum(1 for r in plan.steps[0].replicas for mb in r.micro_batches for p in mb.pieces
                    if p.cp_rank is not None)
        torch.save({"loss": float(stats[0]), "grads": dict(zip([k for k, _ in model.named_parameters()], grads,
                                                                 strict=True)), "sharded": sharded, "local": local,
                    "cp": cp}, out)
    _close()


def step_reference(plan, step: int, layers: int | None = None) -> dict[str, torch.Tensor]:
    """Unpacked single-process gradients of one step's samples (token mean over that step); ``layers``: a deeper
    model of the same shape otherwise."""
    if layers is None:
        model = make_model("sdpa")
    else:
        from dataclasses import replace

        model = build(replace(SPEC, layers=layers), 1234, torch.float64).train()
        model.set_attn_implementation("sdpa")
    corpus = SyntheticCorpus(SPEC.vocab, seed=0)
    samples = sorted({p.sample for r in plan.steps[step].replicas for mb in r.micro_batches for p in mb.pieces})
    total = sum(int(LENGTHS[s]) - 1 for s in samples)
    loss = torch.zeros((), dtype=torch.float64)
    for s in samples:
        n = int(LENGTHS[s])
        toks = torch.from_numpy(corpus.tokens(s, n)).long()
        logits = plain_logits(model, toks)
        if n > 1:
            loss = loss + torch.nn.functional.cross_entropy(logits[:-1], toks[1:], reduction="sum") / total
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def adaptive_worker(rank: int, world: int, port: int, out: str, groups_opt: str) -> None:
    """Every step of an HBP plan whose steps use different CP degrees; rank 0 saves each step's gradients."""
    from longpack.runtime.kernel.cp import CPContext, CPGroups

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    plan = make_plan("hbp", world, cap=10**6, groups=groups_opt, curriculum=0)
    groups = CPGroups.build({s.cp for s in plan.steps}, world)
    model = make_model()
    saved = []
    for step, st in enumerate(plan.steps):
        model.zero_grad(set_to_none=True)
        mbs = st.replicas[rank // st.cp].micro_batches
        run_micro_batches(model, plan, step, mbs, SyntheticCorpus(SPEC.vocab, seed=0),
                          CPContext(degree=st.cp, rank=rank % st.cp, group=groups.group(st.cp, rank)))
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        all_reduce_sum(grads)
        saved.append({k: g.clone() for (k, _), g in zip(model.named_parameters(), grads, strict=True)})
    if rank == 0:
        torch.save({"plan": plan.to_json(), "grads": saved}, out)
    _close()


def mixed_plan():
    """One step of LENGTHS on world 4 as CP groups of 1, 2 and 1 ranks (the group of 2 starts at rank 1, off its
    degree's alignment): sharded and own pieces in the group of 2, whole samples on the single ranks."""
    from longpack.plan import MicroBatch, Piece, Plan, Replica, Step

    def mb(*pieces):
        return MicroBatch(tuple(Piece(s, 0, int(LENGTHS[s]), r) for s, r in pieces))

    reps = (Replica((mb((0, 0), (1, 0)), mb((8, 0)))),
            Replica((mb((4, None), (9, None), (5, 0), (11, 1)), mb((2, None), (10, 1)))),
            Replica((mb((6, 0), (3, 0), (7, 0)), mb())))
    return Plan("mixed", 4, {i: int(n) for i, n in enumerate(LENGTHS)},
                (Step(cp=2, token_cap=128, degrees=(1, 2, 1), replicas=reps),))


def mixed_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of :func:`mixed_plan`; rank 0 saves the summed loss and gradients."""
    from longpack.runtime.kernel.cp import CPGroups

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    plan = mixed_plan()
    plan.validate()
    step = plan.steps[0]
    groups = CPGroups.for_plan(plan, world)
    replica, _ = step.position(rank)
    model = make_model()
    loss, *_ = run_micro_batches(model, plan, 0, step.replicas[replica].micro_batches,
                                 SyntheticCorpus(SPEC.vocab, seed=0), groups.context(step, rank))
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    stats = torch.tensor([loss], dtype=torch.float64)
    all_reduce_sum(grads + [stats])
    if rank == 0:
        torch.save({"loss": float(stats[0]), "grads": dict(zip([k for k, _ in model.named_parameters()], grads,
                                                                 strict=True))}, out)
    _close()


def with_ckpt_layers(plan, layers: int):
    """``plan`` with every micro-batch checkpointing ``layers`` decoder layers."""
    from dataclasses import replace

    steps = tuple(replace(st, replicas=tuple(replace(r, micro_batches=tuple(replace(mb, ckpt_layers=layers)
                                                                              for mb in r.micro_batches))
                                             for r in st.replicas)) for st in plan.steps)
    return replace(plan, steps=steps)


def fsdp_worker(rank: int, world: int, port: int, out: str, planner: str, cp: int, cap: int, options: dict,
                ckpt: int, gathers: str = "layer") -> None:
    """Step 0 of ``planner``'s plan on a dp x cp world under FSDP2, gathered per layer and pass (``gathers``
    "layer", ZeRO-3) or once per step ("step"); rank 0 saves the loss and the full gradients."""
    from longpack.runtime.kernel.cp import CPContext, CPGroups
    from longpack.runtime.kernel.parallelize import PassSync, StepSync, parallelize
    from longpack.runtime.kernel.passes import NO_CLOCK

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    plan = with_ckpt_layers(make_plan(planner, world // cp, cap=cap, cp=cp, **options), ckpt)
    plan.validate()
    step = plan.steps[0]
    groups = CPGroups.for_plan(plan, world) if step.cp > 1 else None
    model = parallelize(make_model(), world, torch.device("cpu"), torch.float64)
    sync = (PassSync if gathers == "layer" else StepSync)(model, torch.device("cpu"))
    clock = sync.begin(plan, 0, rank) or NO_CLOCK
    ctx = groups.context(step, rank, clock=clock) if groups else CPContext(clock=clock)
    loss, *_ = run_micro_batches(model, plan, 0, step.replicas[step.position(rank)[0]].micro_batches,
                                 SyntheticCorpus(SPEC.vocab, seed=0), ctx)
    sync.end()
    stats = torch.tensor([loss], dtype=torch.float64)
    all_reduce_sum([stats])
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    if rank == 0:
        kinds = {"sharded": sum(1 for *_, p in plan.iter_pieces() if p.cp_rank is None and step.cp > 1),
                 "chunks": sum(1 for *_, p in plan.iter_pieces() if plan.is_chunk(p)),
                 "ckpt": min(mb.ckpt_layers for *_, mb in _micro_batches(plan)),
                 "empty_passes": sum(c.islower() for c in sync_rows(plan))}
        torch.save({"loss": float(stats[0]), "grads": grads, "plan": plan.to_json()} | kinds, out)
    _close()


def sync_rows(plan) -> str:
    """Every rank's row of step 0's pass schedule, joined."""
    from longpack.runtime.kernel.passes import merge, replica_passes
    from longpack.runtime.kernel.step import chain_segments

    reps = [r.micro_batches for r in plan.steps[0].replicas]
    return "".join(merge([replica_passes(mbs, chain_segments(plan, mbs)) for mbs in reps]))


def sharded_chain_plan(k: int | None = None, chunk: int = 32, cp: int = 2, dp: int = 1, ckpt: int = 0):
    """One step on dp x cp ranks: sample 4 (90 tokens) as a chain of ``chunk``-token chunks sharded over each CP
    group (the first N-K recomputed, K = all when None), beside sharded and CP-local whole samples; with dp 2 the
    second replica chains sample 9 (70 tokens)."""
    from longpack.plan import MicroBatch, Piece, Plan, Replica, Step

    def chain(sample, others_first, others_last):
        n = int(LENGTHS[sample])
        cuts = list(range(0, n, chunk)) + [n]
        kept = len(cuts) - 1 if k is None else k
        def whole(s, r):
            return Piece(s, 0, int(LENGTHS[s]), r if cp > 1 else 0)

        mbs = [MicroBatch(tuple(whole(s, r) for s, r in others_first), ckpt_layers=ckpt)]
        for j, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            extra = tuple(whole(s, r) for s, r in others_last) if b == n else ()
            mbs.append(MicroBatch((Piece(sample, a, b, None if cp > 1 else 0),) + extra, ckpt_layers=ckpt,
                                  recompute=j < len(cuts) - 1 - kept))
        return Replica(tuple(mbs))

    reps = [chain(4, [(0, None), (1, 0)], [(5, 0), (6, 1), (11, None)])]
    if dp > 1:
        reps.append(chain(9, [(2, 1), (8, None)], [(3, 0), (10, None)]))
    used = {p.sample for rep in reps for mb in rep.micro_batches for p in mb.pieces}
    return Plan("sharded_chain", dp * cp, {i: int(LENGTHS[i]) for i in sorted(used)},
                (Step(cp=cp, token_cap=1024, replicas=tuple(reps)),))


def sharded_chain_worker(rank: int, world: int, port: int, out: str, k: int | None, chunk: int, cp: int,
                         ckpt: int, fsdp: bool) -> None:
    """One rank of :func:`sharded_chain_plan`; rank 0 saves the summed loss and gradients."""
    from longpack.runtime.kernel.cp import CPGroups
    from longpack.runtime.kernel.step import check_runnable

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    plan = sharded_chain_plan(k, chunk, cp, world // cp, ckpt)
    plan.validate()
    check_runnable(plan)
    step = plan.steps[0]
    groups = CPGroups.for_plan(plan, world)
    model = make_model()
    sync = clock = None
    if fsdp:
        from longpack.runtime.kernel.parallelize import PassSync, parallelize

        model = parallelize(model, world, torch.device("cpu"), torch.float64)
        sync = PassSync(model, torch.device("cpu"))
        clock = sync.begin(plan, 0, rank)
    ctx = groups.context(step, rank, **({"clock": clock} if clock is not None else {}))
    loss, *_ = run_micro_batches(model, plan, 0, step.replicas[step.position(rank)[0]].micro_batches,
                                 SyntheticCorpus(SPEC.vocab, seed=0), ctx)
    stats = torch.tensor([loss], dtype=torch.float64)
    if sync is not None:
        sync.end()
        all_reduce_sum([stats])
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    else:
        flat = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        all_reduce_sum(flat + [stats])
        grads = dict(zip([n for n, _ in model.named_parameters()], flat, strict=True))
    if rank == 0:
        torch.save({"loss": float(stats[0]), "grads": grads, "plan": plan.to_json()}, out)
    _close()


def pipeline_worker(rank: int, world: int, port: int, out: str, pp: int, cp: int, k: int | None, chunk: int,
                    layers: int) -> None:
    """One rank of :func:`sharded_chain_plan` run through ``pp`` pipeline stages of a ``layers``-layer model (world
    = pp x dp x cp); rank 0 saves the loss and every stage's gradients under the whole model's names."""
    from dataclasses import replace

    from longpack.runtime.kernel.cp import CPContext, CPGroups
    from longpack.runtime.kernel.pipeline import Layout, PipelineStage, split_model
    from longpack.runtime.kernel.step import check_runnable
    from longpack.runtime.run.stage_state import global_names

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    n = world // pp
    stage, prank = divmod(rank, n)
    plan = sharded_chain_plan(k, chunk, cp, n // cp)
    plan.validate()
    check_runnable(plan)
    st = plan.steps[0]
    groups = CPGroups.for_plan(plan, world, stages=pp) if cp > 1 else None
    ctx = groups.context(st, prank, offset=stage * n) if groups else CPContext()
    spec = replace(SPEC, layers=layers)
    model = split_model(build(spec, 1234, torch.float64).train(), stage, pp)
    runner = PipelineStage(model, Layout.build(rank, world, pp, tied=False), rank, spec.hidden, torch.float64)
    mbs = st.replicas[st.position(prank)[0]].micro_batches
    fwd = [float(sum(p.stop - p.start for p in mb.pieces)) for mb in mbs]
    loss, *_ = runner.run_step(plan, 0, mbs, SyntheticCorpus(SPEC.vocab, seed=0), ctx, fwd)
    names = global_names(model, stage, pp)
    mine = {names[nm]: (p.grad if p.grad is not None else torch.zeros_like(p)) for nm, p in model.named_parameters()}
    full = build(spec, 1234, torch.float64)
    grads = {nm: torch.zeros_like(p) for nm, p in full.named_parameters()}
    for nm, g in mine.items():
        grads[nm] += g
    flat = list(grads.values())
    stats = torch.tensor([loss], dtype=torch.float64)
    all_reduce_sum(flat + [stats])
    if rank == 0:
        torch.save({"loss": float(stats[0]), "grads": grads, "plan": plan.to_json(), "layers": layers,
                    "ops": runner.ops}, out)
    _close()


def _micro_batches(plan):
    for st in plan.steps:
        for r, rep in enumerate(st.replicas):
            for m, mb in enumerate(rep.micro_batches):
                yield r, m, mb


__all__ = ["pipeline_worker", "sharded_chain_plan", "sharded_chain_worker",
           "fsdp_worker", "with_ckpt_layers", "plain_logits", "step_reference", "adaptive_worker", "mixed_plan",
           "mixed_worker", "cp_worker", "IGNORE", "make_model", "make_plan", "reference_grads", "packed_grads",
           "parity_worker", "SPEC"]


def shard_load_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    """Rank ``rank`` starts the checkpoint at ``path`` as `longpack train` does under FSDP2 (meta model, sharded,
    each rank reading its rows: runtime/run/shard_load.py); rank 0 saves the gathered weights and RoPE buffers."""
    from longpack.runtime.kernel.parallelize import parallelize
    from longpack.runtime.run.hf_model import config_of
    from longpack.runtime.run.shard_load import load_shards, meta_model, restore_buffers

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    model = parallelize(meta_model(config_of(SPEC, path), torch.float32), world, torch.device("cpu"), torch.float32)
    model.to_empty(device=torch.device("cpu"))
    load_shards(model, path)
    restore_buffers(model)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"params": full, "buffers": {n: b.clone() for n, b in model.named_buffers()}}, out)
    _close()
