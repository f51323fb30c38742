"""Chunk chains sharded over CP (runtime/kernel/sharded_chain.py): the chain's store sharded per rank, the prefix K/V
all-gathered per chunk and layer, forward ascending and backward descending on every rank of the group — equal to
single-process unpacked training of the same samples in float64."""

import pytest

torch = pytest.importorskip("torch")

import pool  # noqa: E402  (tests/pool.py: warm worker processes)
from dist_workers import sharded_chain_plan, sharded_chain_worker, step_reference  # noqa: E402

from longpack.plan import Plan  # noqa: E402
from longpack.runtime.dist import free_port  # noqa: E402

RTOL = 1e-6  # float64: only the order of additions differs


def _run(tmp_path, world, k, chunk=32, cp=2, ckpt=0, fsdp=False):
    out = str(tmp_path / "out.pt")
    pool.spawn(sharded_chain_worker, args=(world, free_port(), out, k, chunk, cp, ckpt, fsdp),
                                nprocs=world)
    got = torch.load(out, weights_only=False)
    plan = Plan.from_json(got["plan"])
    ref = step_reference(plan, 0)
    # step_reference's loss is not returned; the gradients carry the check, the loss is checked positive and finite
    assert got["loss"] > 0
    for name, g in ref.items():
        err = float((got["grads"][name] - g).norm() / g.norm())
        assert err <= RTOL, (name, err)
    return plan


@pytest.mark.parametrize("k", [1, None], ids=["k1", "kall"])
def test_chunk_context_parallel_parity_cp2_sharded_chain(tmp_path, k):
    """CP 2: a 90-token sample in 32-token chunks sharded over the pair (K = 1: two chunks recomputed; K = all),
    with sharded and CP-local whole samples in the chain's first and last micro-batches."""
    plan = _run(tmp_path, 2, k)
    chunks = [p for *_, p in plan.iter_pieces() if plan.is_chunk(p)]
    assert len(chunks) == 3 and all(p.cp_rank is None for p in chunks)


def test_chunk_context_parallel_parity_cp2_sharded_chain_tiny_tail_and_ckpt(tmp_path):
    """Chunks of 29 tokens leave a 3-token tail (CP rank 1 holds one of its tokens); one layer checkpointed."""
    _run(tmp_path, 2, 1, chunk=29, ckpt=1)


def test_chunk_context_parallel_parity_cp2_sharded_chain_one_token_tail(tmp_path):
    """Chunks of 89 tokens leave a 1-token tail: CP rank 0 holds none of it and still joins the prefix exchange."""
    _run(tmp_path, 2, 1, chunk=89)


def test_chunk_context_parallel_parity_cp4_sharded_chain(tmp_path):
    _run(tmp_path, 4, 1, cp=4)


def test_chunk_context_parallel_fsdp_parity_dp2_cp2_sharded_chains(tmp_path):
    """DP 2 x CP 2 under FSDP2: a sharded chain on each CP pair."""
    _run(tmp_path, 4, 1, fsdp=True)


def test_check_runnable_refuses_local_chunk_in_cp_group():
    from dataclasses import replace

    from longpack.runtime.kernel.step import check_runnable

    plan = sharded_chain_plan(1)
    step = plan.steps[0]
    mbs = list(step.replicas[0].micro_batches)
    mbs[2] = replace(mbs[2], pieces=tuple(p._replace(cp_rank=1) if p.sample == 4 else p for p in mbs[2].pieces))
    bad = replace(plan, steps=(replace(step, replicas=(replace(step.replicas[0], micro_batches=tuple(mbs)),)),))
    with pytest.raises(ValueError, match=r"^step 0, replica 0, micro-batch 2: piece of sample 4 \(tokens 32-64\)"):
        check_runnable(bad)
    check_runnable(plan)


def _train(*flags: str) -> list[dict]:
    import json

    proc = pool.cli(["train", "--model", "tiny", "--nproc", "2", "--steps", "3", "--json", *flags], timeout=400)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]


def test_chunk_train_cli_chunkflow_cp2_sharded_chains_same_loss_as_skrull():
    """The issue's command: ChunkFlow at CP 2 with chunks of 256 (K = 1) shards its chains over the pair and
    trains all 3 steps; its losses equal Skrull's on the same batches (one engine, exact up to float32 sums)."""
    from dataclasses import replace

    from longpack.runtime.run.train import TrainArgs, build_plan

    flags = ["--planner", "chunkflow", "--opt", "chunk_size=256", "--opt", "k=1", "--cp", "2"]
    base = TrainArgs.of(planner="chunkflow")
    args = replace(base, run=replace(base.run, cp=2, options={"chunk_size": 256, "k": 1}))
    plan, _ = build_plan(args, 2, note=None)
    assert any(p.cp_rank is None and plan.is_chunk(p) for *_, p in plan.iter_pieces())
    chunked = _train(*flags)
    plain = _train("--planner", "skrull", "--cp", "2")
    assert len(chunked) == len(plain) == 3
    for a, b in zip(chunked, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["targets"] == b["targets"]
