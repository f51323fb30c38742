"""Run the runtime's execution paths on fake CUDA tensors (tests/fakegpu.py) and print what the device
check saw, one JSON object: {scenario: {"violations": [...], "error": str | None, "counts": {...}}}.

Its own process: the fake CUDA device must be registered before torch is imported. Usage:
``python gpu_ready_worker.py SCENARIO [SCENARIO ...]`` (names in ``SCENARIOS``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import fakegpu

fakegpu.activate()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_workers import SPEC, make_plan, sharded_chain_plan, uneven_plan  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from longpack.model import ModelSpec  # noqa: E402
from longpack.plan import MicroBatch, Piece, Plan, Replica, Step  # noqa: E402
from longpack.runtime.dist import leave  # noqa: E402
from longpack.runtime.kernel.cp import CPContext, CPGroups  # noqa: E402
from longpack.runtime.kernel.data import SyntheticCorpus  # noqa: E402
from longpack.runtime.kernel.step import run_micro_batches  # noqa: E402
from longpack.runtime.run.hf_model import build  # noqa: E402

WORLD = 2
CUDA = torch.device("cuda", 0)


def _model(spec: ModelSpec = SPEC) -> torch.nn.Module:
    """The engine's transformers model, bf16, built on meta and placed on the fake device."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.device("meta"):  # real meta parameters, then fake ones on the device
        model = build(spec, 0, torch.bfloat16)
    return model.to_empty(device=CUDA).train()


def _run(plan: Plan, cp: int = 1, model: torch.nn.Module | None = None, world: int = WORLD) -> None:
    model = model or _model()
    groups = CPGroups.for_plan(plan, world) if cp > 1 else None
    ctx = groups.context(plan.steps[0], 0) if groups else CPContext()
    mbs = plan.steps[0].replicas[0].micro_batches
    loss, *_ = run_micro_batches(model, plan, 0, mbs, SyntheticCorpus(SPEC.vocab, seed=0), ctx)
    assert loss.device == CUDA, loss.device


def documents() -> None:
    _run(make_plan("isf", 1))


def cp2_sharded() -> None:
    plan = make_plan("fixed_cp", 1, cp=2)
    assert any(p.cp_rank is None for *_, p in plan.iter_pieces()), "no sharded piece in the plan"
    _run(plan, cp=2)


@contextmanager
def _world(n: int) -> Iterator[None]:
    """The fake process group made again with ``n`` ranks (rank 0 runs), then with WORLD again."""
    dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())


def cp4_sharded() -> None:
    """A step at CP degree 4, on 4 fake ranks."""
    with _world(4):
        plan = make_plan("fixed_cp", 1, cp=4)
        assert any(p.cp_rank is None for *_, p in plan.iter_pieces()), "no sharded piece in the plan"
        _run(plan, cp=4, world=4)


def cp_groups_before_step_0() -> None:
    """A run at --cp 4 on 4 ranks makes its CP groups with its step runner, before any step: steps at CP 2 and 4
    then make none (a group made after it fails the scenario)."""
    from longpack.runtime.dist import DistContext
    from longpack.runtime.kernel.step_fn import StepRunner

    with _world(4):
        runner = StepRunner(DistContext(rank=0, world=4, device=CUDA), cp=4)
        made, new_group = [], dist.new_group
        dist.new_group = lambda *a, **k: made.append(a) or new_group(*a, **k)
        try:
            for cp in (2, 4):
                plan = make_plan("fixed_cp", 4 // cp, cp=cp)
                stats, _ = runner.run(_model(), plan, 0, plan.steps[0].replicas[0].micro_batches,
                                      SyntheticCorpus(SPEC.vocab, seed=0))
                assert stats.device == CUDA
        finally:
            dist.new_group = new_group
        if made:
            raise AssertionError(f"{len(made)} process groups made after the step runner: {made}")


def chain_cp1() -> None:
    _run(sharded_chain_plan(1, cp=1))


def chain_cp2() -> None:
    _run(sharded_chain_plan(1, cp=2), cp=2)


def _pipeline(stage: int) -> None:
    from longpack.runtime.dist import DistContext
    from longpack.runtime.kernel.pipeline import Layout, PipelineStage, split_model
    from longpack.runtime.run.loop import read_once, share

    layout = Layout.build(stage, WORLD, 2, tied=False)
    model = split_model(_model(), stage, 2)
    pipe = PipelineStage(model, layout, stage, SPEC.hidden, torch.bfloat16)
    plan = make_plan("isf", 1)
    mbs = plan.steps[0].replicas[0].micro_batches
    pipe.run_step(plan, 0, mbs, SyntheticCorpus(SPEC.vocab, seed=0), fwd_s=[1.0] * len(mbs))
    values = read_once([share(pipe.columns(WORLD, stage), DistContext(rank=stage, world=WORLD, device=CUDA))])
    assert set(pipe.record(values, WORLD)) >= {"busy_seconds", "measured_bubble"}


def pp2_first_stage() -> None:
    _pipeline(0)


def pp2_last_stage() -> None:
    _pipeline(1)


def step_no_fsdp() -> None:
    """The step runner without FSDP: the gradients and the step's statistics all-reduced (world 2)."""
    from longpack.runtime.dist import DistContext
    from longpack.runtime.kernel.step_fn import StepRunner

    plan = make_plan("isf", 2)
    runner = StepRunner(DistContext(rank=0, world=WORLD, device=CUDA))
    stats, _ = runner.run(_model(), plan, 0, plan.steps[0].replicas[0].micro_batches,
                          SyntheticCorpus(SPEC.vocab, seed=0))
    assert stats.device == CUDA


def step_fsdp_path() -> None:
    """The step runner on its FSDP2 branches over an unsharded model: the per-layer pass schedule with its empty
    one-token passes (PassSync, on a plan whose replicas' passes differ) and the pipeline's gather-once closing pass
    (StepSync), then the statistics' all-reduce. FSDP2's own shard init needs a real CUDA build, so its
    collectives are not run here."""
    from longpack.runtime.dist import DistContext
    from longpack.runtime.kernel.parallelize import PassSync, StepSync
    from longpack.runtime.kernel.step_fn import StepRunner

    model = _model()
    runs = ((uneven_plan(), PassSync(model, CUDA), 1), (make_plan("isf", 2), StepSync(model, CUDA), 0))
    for plan, sync, rank in runs:
        runner = StepRunner(DistContext(rank=rank, world=WORLD, device=CUDA), sync=sync)
        stats, _ = runner.run(model, plan, 0, plan.steps[0].replicas[rank].micro_batches,
                              SyntheticCorpus(SPEC.vocab, seed=0))
        assert stats.device == CUDA


def trainer() -> None:
    """LongpackTrainer.training_step (the Trainer path's whole step) with the model the Trainer built placed on the
    device: the Trainer is set up on the host (CPU args), then its model moves to fake CUDA, as Accelerate moves it
    on a GPU machine; the step must follow the model there."""
    import tempfile

    import hf_case

    with tempfile.TemporaryDirectory() as out:
        tr = hf_case.longpack_trainer(out, cp=1)
    net = tr.model.to(torch.bfloat16).to_empty(device=CUDA)
    loss = tr.training_step(net, {"longpack_step": torch.tensor(0)})
    assert loss.device == CUDA and len(tr.longpack_steps) == 1, (loss.device, tr.longpack_steps)


def cpu_weights_bug() -> None:
    """The token weights left on the host (the bug this harness exists for): the check must catch it."""
    from longpack.runtime.kernel import data

    def moved_but_weights(self, device):  # noqa: ANN001, ANN202
        ids = torch.stack([self.input_ids, self.labels, self.position_ids]).to(device)
        self.input_ids, self.labels, self.position_ids = ids[0], ids[1], ids[2]
        return self

    good = data.Packed.to
    data.Packed.to = moved_but_weights
    try:
        documents()
    finally:
        data.Packed.to = good


def _syncs(layers: int, docs: int) -> None:
    """One training step of a micro-batch of ``docs`` documents of 24 tokens on a model of ``layers`` layers, as
    the loop runs it (runtime/run/loop.py): the step runner (gradients and statistics all-reduced over 2 ranks),
    clipping, AdamW, every rank's figures, and the step's one read."""
    from longpack.cost import CostModel, TrainConfig
    from longpack.hardware import get_hardware
    from longpack.runtime.dist import DistContext
    from longpack.runtime.kernel.step_fn import StepRunner
    from longpack.runtime.run.loop import read_once, share
    from longpack.runtime.run.optim import adamw, clip_gradients
    from longpack.runtime.run.step_log import rank_rows

    spec = ModelSpec(name="sync", layers=layers, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=61,
                     qkv_bias=True)
    mb = MicroBatch(tuple(Piece(s, 0, 24, 0) for s in range(docs)))
    plan = Plan("syncs", 2, {s: 24 for s in range(docs)}, (Step(cp=1, token_cap=24 * docs,
                                                                 replicas=(Replica((mb,)), Replica(()))),))
    model, ctx = _model(spec), DistContext(rank=0, world=WORLD, device=CUDA)
    opt = adamw(model, 1e-3, 0.0)
    stats, peak = StepRunner(ctx).run(model, plan, 0, (mb,), SyntheticCorpus(spec.vocab, seed=0))
    norm = clip_gradients(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    cost = CostModel(spec, get_hardware("h100"), TrainConfig(dp=WORLD, token_cap=24 * docs))
    table = rank_rows(plan, 0, cost, ctx, peak, 0, 0.0)
    assert len(read_once([stats, norm, share(table, ctx)])) == 4 + 3 * WORLD


def step_sync_last_backward() -> None:
    """FSDP2's gather-once synchronisation (StepSync) over a step of several micro-batches: its clock counts the
    backwards and the last one syncs the gradients — no closing one-token pass (the attention calls say so:
    tests/test_gpu_ready.py)."""
    from longpack.runtime.dist import DistContext
    from longpack.runtime.kernel.parallelize import StepSync
    from longpack.runtime.kernel.step_fn import StepRunner

    model, plan = _model(), make_plan("isf", 2)
    sync = StepSync(model, CUDA)
    runner = StepRunner(DistContext(rank=0, world=WORLD, device=CUDA), sync=sync)
    runner.run(model, plan, 0, plan.steps[0].replicas[0].micro_batches, SyntheticCorpus(SPEC.vocab, seed=0))


SCENARIOS = {f.__name__: f for f in (documents, cp2_sharded, cp4_sharded, cp_groups_before_step_0, chain_cp1,
                                     chain_cp2, pp2_first_stage, pp2_last_stage, step_no_fsdp, step_fsdp_path,
                                     step_sync_last_backward, trainer, cpu_weights_bug)}
for _layers in (2, 8):
    for _docs in (4, 64):
        SCENARIOS[f"syncs_{_layers}_layers_{_docs}_docs"] = (lambda a, b: lambda: _syncs(a, b))(_layers, _docs)


def main(names: list[str]) -> None:
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    out = {}
    for name in names:
        check = fakegpu.DeviceCheck()
        error = None
        try:
            with check:
                SCENARIOS[name]()
        except Exception as exc:  # noqa: BLE001  (reported, and the test fails on it)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        out[name] = {"violations": check.violations[:20], "error": error, "counts": dict(check.counts)}
    print(json.dumps(out))
    leave()  # no interpreter teardown: a thread torch left joinable there aborts the process now and then


if __name__ == "__main__":
    main(sys.argv[1:])
