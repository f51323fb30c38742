"""ChunkFlow: chunk construction, K, chain order, memory bounded by ChunkSize; pipeline toys exactly."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import make_cost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longpack.planners import PlanContext, get_planner, global_batches
from longpack.sim import simulate
from longpack.sim.pipeline import Item, chunk_items, schedule


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=60), chunk=st.sampled_from([64, 256, 1000]),
       k=st.integers(1, 4), layout=st.sampled_from([(1, 1), (2, 1), (2, 2), (1, 4)]), seed=st.integers(0, 2))
def test_chunkflow_invariants_and_k(lengths, chunk, k, layout, seed):
    dp, cp = layout
    x = np.array(lengths)
    ctx = PlanContext(cost=make_cost("tiny", "cpu", dp=dp, cp=cp, token_cap=4000), seed=seed,
                      options={"chunk_size": chunk, "k": k})
    plan = get_planner("chunkflow").plan(x, global_batches(len(x), 16, seed=seed), ctx)
    plan.validate()  # every token once, chain order on one replica, caps
    for step in plan.steps:
        for rep in step.replicas:
            chains: dict[int, list] = {}
            for mb in rep.micro_batches:
                assert sum(p.stop - p.start for p in mb.pieces) <= chunk  # uniform chunks
                for p in mb.pieces:
                    if p.stop - p.start < plan.lengths[p.sample]:
                        chains.setdefault(p.sample, []).append(mb.recompute)
            for flags in chains.values():
                n = len(flags)
                assert flags == [j < n - k for j in range(n)]  # only the last K keep activations
    assert plan.to_json() == get_planner("chunkflow").plan(x, global_batches(len(x), 16, seed=seed), ctx).to_json()


def test_chunk_too_large_for_k_is_refused():
    ctx = PlanContext(cost=make_cost("tiny", "cpu", token_cap=100), options={"chunk_size": 80, "k": 2})
    with pytest.raises(ValueError, match="chunk_size <= 50"):
        get_planner("chunkflow").plan(np.array([500]), [np.array([0])], ctx)


def test_peak_memory_set_by_chunk_size_not_sequence_length():
    cost = make_cost("qwen2.5-7b", "h100", dp=1, cp=4, tp=4, pp=1, zero_stage=1)
    peaks = {}
    for n in (32 * 1024, 256 * 1024):
        x = np.concatenate([[n], np.full(63, 500)])
        ctx = PlanContext(cost=cost, options={"chunk_size": 8192, "k": 2})
        plan = get_planner("chunkflow").plan(x, [np.arange(64)], ctx, max_len=n)
        peaks[n] = simulate(plan, cost).peak_mem_gib
    assert peaks[256 * 1024] <= 1.3 * peaks[32 * 1024]


def test_pipeline_toys_reproduce_exactly():
    assert schedule([Item(4), Item(2), Item(1), Item(1)], 4).bubble_ratio == pytest.approx(4 / 7)
    assert schedule([Item(2)] * 4, 4).bubble_ratio == pytest.approx(3 / 7)
    assert schedule(chunk_items([4, 2, 1, 1], 2, 2), 4, k=2).bubble_ratio == pytest.approx(11 / 23)
    assert schedule(chunk_items([4, 2, 1, 1], 4, 1), 4, k=1).bubble_ratio == pytest.approx(0.6)
    k1 = schedule(chunk_items([4, 2, 1, 1], 2, 1), 4, k=1)
    assert k1.recompute == 4 * 2  # the first half's forward re-run on each of 4 stages


def test_pipeline_respects_chain_backward_order():
    # A chain of 3 unit chunks on 2 stages (F = 1, B = 2). Forwards end at 3 (stage 0) and 4 (stage 1); then
    # backwards strictly descending: stage 1 runs B2 [4,6], B1 [6,8], B0 [8,10]; stage 0 B2 [6,8], B1 [8,10],
    # B0 [10,12].
    items = [Item(1.0, chain=0), Item(1.0, chain=0), Item(1.0, chain=0)]
    assert schedule(items, 2, k=3).makespan == 12
    # With K = 1 the first two chunks are recomputed before their backward on each stage: +1 per chunk per stage
    # on the critical path of stage 0 (B1, B0 each start later by their recompute).
    items = [Item(1.0, chain=0, recompute=True), Item(1.0, chain=0, recompute=True), Item(1.0, chain=0)]
    r = schedule(items, 2, k=1)
    assert r.recompute == 4 and r.makespan == 14


def _one_order(ops) -> None:
    for kind in "FB":
        orders = {tuple(i for op, i, *_ in stage if op == kind) for stage in ops}
        assert len(orders) == 1, (kind, orders)


def test_pipeline_stages_run_backwards_in_one_order():
    """Every stage runs its forwards, and its backwards, in one item order (the runtime's point-to-point messages
    pair by order). Here the standalone item 2's gradient reaches stage 1 while the chain's recomputed chunk 0
    waits there; it used to overtake chunk 0 on stage 1 only."""
    items = [Item(1.0, chain=0, recompute=True), Item(4.0, chain=0), Item(1.0)]
    _one_order(schedule(items, 2, k=1).ops)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.tuples(st.integers(1, 3), st.lists(st.integers(1, 4), min_size=3, max_size=3)),
                      min_size=1, max_size=6), k=st.integers(1, 2), pp=st.integers(2, 4))
def test_pipeline_stages_run_forwards_and_backwards_in_one_order(shape, k, pp):
    """Random mixes of chains (the first len - K chunks recomputed) and standalone items, random forward times."""
    items: list[Item] = []
    for chain, (size, times) in enumerate(shape):
        if size == 1:
            items.append(Item(float(times[0])))
        else:
            items += [Item(float(times[j]), chain=chain, recompute=j < size - k) for j in range(size)]
    _one_order(schedule(items, pp, k=k).ops)


def test_pipeline_cli_json():
    out = subprocess.run([sys.executable, "-m", "longpack.cli", "pipeline", "--lengths", "4,2,1,1", "--pp", "4",
                          "--chunk-size", "2", "--k", "2", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["bubble_ratio"] == pytest.approx(0.4783, abs=1e-4)


def test_reproduction_headlines():
    from longpack.reproduce.chunkflow import reproduce

    r = reproduce(steps=3, samples=20_000)
    assert r["toy"]["1f1b"] == pytest.approx(4 / 7) and r["toy"]["k2"] == pytest.approx(11 / 23)
    assert abs(r["speedups"]["256K"]["speedup_vs_one_seq"] / 4.53 - 1) <= 0.25
    assert r["memory"]["chunkflow_growth_32k_to_256k"] <= 1.3
    best = min(r["sweep"]["ours_ms"], key=r["sweep"]["ours_ms"].get)
    assert best == "8K,4"
