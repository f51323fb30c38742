"""Whole samples beside chain pieces (planners/beside.py): fewer micro-batches, nothing else about the plan moved."""

import numpy as np
import pytest
from helpers import make_cost

from longpack import jobs
from longpack.plan import MicroBatch, Piece, Plan, Replica, Step
from longpack.planners.beside import fill_replica, fill_step
from longpack.planners.packers import best_fit_dec
from longpack.sim.simulate import micro_batch_times, simulate_step


def _count(step):
    return sum(1 for rep in step.replicas for mb in rep.micro_batches if mb.pieces)


def _seconds(rep, cp, cost):
    return sum(float(micro_batch_times(mb, cp, cost)[0].max()) for mb in rep.micro_batches if mb.pieces)


def _samples(rep):
    return sorted((p.sample, p.start, p.stop, p.cp_rank) for mb in rep.micro_batches for p in mb.pieces)


def test_short_samples_move_beside_a_chain_tail_and_their_micro_batch_goes():
    cost = make_cost("tiny", "cpu", token_cap=100)
    lengths = {0: 130, 1: 40, 2: 20, 3: 90}
    mbs = [MicroBatch((Piece(1, 0, 40), Piece(2, 0, 20))), MicroBatch((Piece(3, 0, 90),)),
           MicroBatch((Piece(0, 0, 100),)), MicroBatch((Piece(0, 100, 130),))]
    out = fill_replica(mbs, 1, 100, cost, lengths.__getitem__)
    assert [[(p.sample, p.start, p.stop) for p in mb.pieces] for mb in out] == [
        [(3, 0, 90)], [(0, 0, 100)], [(0, 100, 130), (1, 0, 40), (2, 0, 20)]]
    plan = Plan("t", 1, lengths, (Step(cp=1, token_cap=100, replicas=(Replica(tuple(out)),)),))
    plan.validate()


def test_nothing_joins_an_earlier_kept_chunk_and_rows_are_respected():
    cost = make_cost("tiny", "cpu", token_cap=100)
    lengths = {0: 130, 1: 10, 2: 10}
    head = [MicroBatch((Piece(0, 0, 60),)), MicroBatch((Piece(0, 60, 130),))]  # kept head: what joins it stays
    mbs = [MicroBatch((Piece(1, 0, 10),)), MicroBatch((Piece(2, 0, 10),)), *head]
    out = fill_replica(mbs, 1, 100, cost, lengths.__getitem__)
    assert out == [head[0], MicroBatch((Piece(0, 60, 130), Piece(1, 0, 10), Piece(2, 0, 10)))]
    out = fill_replica(mbs, 1, 100, cost, lengths.__getitem__, rows=2)
    assert max(len(mb.pieces) for mb in out) == 2 and len(out) == 3
    assert fill_replica(mbs, 1, 100, cost, lengths.__getitem__, rows=1) == mbs


def test_memory_with_the_kv_store_counted_limits_the_room():
    """On hardware where the chain's K/V store leaves a rank no memory beside its tail, nothing moves there."""
    cost = make_cost("qwen2.5-7b", "h100", dp=8)
    cap = cost.token_cap()
    head = cap - 100  # room for sample 1 beside the recomputed head
    free = cost.hw.memory_bytes - cost.memory_bytes(0.0)
    per_token = cost.hw.fragmentation * cost.act_bytes_per_token()
    # the tail's length whose activations plus the store of the head fill memory exactly (to a token)
    tail = int((free - float(cost.kv_store_bytes(head))) // per_token)
    assert 0 < tail < cap - 64  # token room for sample 1 beside the tail
    lengths = {0: head + tail, 1: 64}
    mbs = [MicroBatch((Piece(1, 0, 64),)), MicroBatch((Piece(0, 0, head),), recompute=True),
           MicroBatch((Piece(0, head, head + tail),))]
    kept = fill_replica(mbs, 1, cap, cost, lengths.__getitem__, recomputed=False)
    assert kept == mbs  # the tail's micro-batch has token room (cap - tail) but no memory
    moved = fill_replica(mbs, 1, cap, cost, lengths.__getitem__)  # the recomputed head's micro-batch has both
    assert [len(mb.pieces) for mb in moved] == [2, 1]


def _layout(rng, d, replicas, cap):
    """A one-step plan at CP degree ``d``: per replica a chain (its pieces in order, the earlier ones recomputed or
    kept at random, the last short) and short samples, sharded or on a random rank, in micro-batches of one to
    three, placed before, between and after the chain's pieces."""
    lengths, reps, sample = {}, [], 0
    for _ in range(replicas):
        n = int(rng.integers(2, 4))
        sizes = [int(x) for x in rng.integers(1, cap * d + 1, n - 1)] + [int(rng.integers(1, cap * d // 2))]
        bounds = np.cumsum([0, *sizes]).tolist()
        lengths[sample] = bounds[-1]
        mbs = [MicroBatch((Piece(sample, a, b),), recompute=j < n - 1 and bool(rng.integers(0, 2)))
               for j, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
        sample += 1
        for _ in range(int(rng.integers(2, 7))):
            group = []
            for _ in range(int(rng.integers(1, 4))):
                lengths[sample] = int(rng.integers(1, cap // 4))
                rank = None if d > 1 and rng.random() < 0.5 else int(rng.integers(0, d))
                group.append(Piece(sample, 0, lengths[sample], rank))
                sample += 1
            mbs.insert(int(rng.integers(0, len(mbs) + 1)), MicroBatch(tuple(group)))
        reps.append(mbs)
    depth = max(len(r) for r in reps)
    step = Step(cp=d, token_cap=cap, replicas=tuple(Replica(tuple(r) + (MicroBatch(),) * (depth - len(r)))
                                                    for r in reps))
    return Plan("t", d * replicas, lengths, (step,))


@pytest.mark.parametrize("d", [1, 2, 4])
def test_random_layouts_stay_valid_within_memory_no_slower_and_never_gain_micro_batches(d):
    cost = make_cost("qwen2.5-0.5b", "h100", dp=4 // d, cp=d)
    rng = np.random.default_rng(3)
    fewer = 0
    for _ in range(30):
        plan = _layout(rng, d, 4 // d, 400)
        plan.validate()
        step = plan.steps[0]
        for recomputed in (False, True):
            filled = fill_step(step, cost, plan.effective_length, recomputed=recomputed)
            new = Plan("t", plan.world, plan.lengths, (filled,))
            new.validate()
            assert _count(filled) <= _count(step)
            fewer += _count(filled) < _count(step)
            for a, b in zip(step.replicas, filled.replicas, strict=True):
                assert _samples(a) == _samples(b)
                assert _seconds(b, d, cost) <= _seconds(a, d, cost) + 1e-12
            chain = [(p, mb.recompute) for rep in step.replicas for mb in rep.micro_batches for p in mb.pieces
                     if plan.is_chunk(p)]
            after = [(p, mb.recompute) for rep in filled.replicas for mb in rep.micro_batches for p in mb.pieces
                     if plan.is_chunk(p)]
            assert chain == after
            before = simulate_step(0, step, plan, cost, bound=False)
            report = simulate_step(0, filled, new, cost, bound=False)
            assert max(report.peak_mem_bytes) <= max(max(before.peak_mem_bytes), cost.hw.memory_bytes)
    assert fewer >= 30, fewer  # the layouts exercise the fill, not only its refusals


def _bfd_split_packs(lengths, batches, pack):
    """TRL's bfd_split on each global batch: every sample cut into pieces of at most ``pack`` tokens, then
    best-fit decreasing into packs of ``pack`` tokens."""
    cut = [[pack] * (n // pack) + ([n % pack] if n % pack else []) for n in lengths.tolist()]
    return sum(len(best_fit_dec(np.array([p for i in b for p in cut[i]]), pack)) for b in batches)


@pytest.mark.parametrize("planner", ["isf", "fixed_cp", "skrull"])
def test_long_document_micro_batches_close_to_trl_bfd_split(planner):
    """ChatQA2 at 16K on one rank per replica: without filling, chains' tails alone took 30-60% more micro-batches
    than TRL's bfd_split packs (which cut documents apart; chains keep them whole and exact)."""
    spec = jobs.RunSpec(workload="chatqa2-long-sft", samples=1024, dp=8, token_cap=16384, max_len=16384)
    lengths, default = jobs.load_workload(spec)
    plan, _ = jobs.run_plan(planner, lengths, spec, jobs.build_cost(spec), default, note=None)
    ours = sum(_count(step) for step in plan.steps)
    trl = _bfd_split_packs(lengths, jobs.global_batches(len(lengths), 256), 16384)
    assert ours <= 1.10 * trl, (ours, trl)
