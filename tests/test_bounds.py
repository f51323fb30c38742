"""The lower bound against random valid plans: no plan may beat it (plans over memory: the bound that ignores
memory)."""

import os

import numpy as np
import pytest
from helpers import make_cost, random_layout

from longpack.plan import MicroBatch, Piece, Plan, PlanError, Replica, Step
from longpack.sim import simulate
from longpack.sim.bounds import pair_bound, sample_forms, step_lower_bound
from longpack.sim.bounds import per_micro_batch_s as per_mb


def _random_plan(rng: np.random.Generator, world: int, cap: int) -> tuple[Plan, int]:
    """A random step of a random CP degree (helpers.random_layout)."""
    d = int(rng.choice([d for d in range(1, world + 1) if world % d == 0]))
    return random_layout(rng, [d] * (world // d), cap), d


@pytest.mark.parametrize("model,layout", [("qwen2.5-0.5b", (2, 4)), ("qwen2.5-7b", (1, 8)), ("qwen2.5-0.5b", (4, 1)),
                                          ("qwen2.5-7b", (2, 2))])
def test_lower_bound_holds_for_random_plans(model, layout):
    dp, cp = layout
    cost = make_cost(model, "h100", dp=dp, cp=cp, token_cap=8000)
    rng = np.random.default_rng(dp * 100 + cp)
    checked = 0
    for _ in range(400):  # about 90-140 valid plans per layout
        plan, _ = _random_plan(rng, dp * cp, 8000)
        try:
            plan.validate()
        except PlanError:
            continue
        rep = simulate(plan, cost).steps[0]  # a plan over memory is held to the bound that ignores memory
        checked += 1
        assert rep.lower_bound_s <= rep.time_s * (1 + 1e-12), plan.to_json()
    assert checked >= 60


def test_validate_refuses_a_chain_split_over_two_cp_ranks():
    step = Step(cp=2, token_cap=100, replicas=(Replica((MicroBatch((Piece(0, 0, 10, 0),)),
                                                        MicroBatch((Piece(0, 10, 20, 1),)))),))
    with pytest.raises(PlanError, match="sample 0: pieces with cp_rank 0 and 1"):
        Plan("t", 2, {0: 20}, (step,)).validate()


def test_pair_bound_two_long_samples_on_one_replica_cost_more_than_either():
    """One replica of 8 ranks and two 60K samples: both must run there, so the bound exceeds the single-sample
    unit; with two replicas of 4 they can be apart and the pair bound says nothing more."""
    cost = make_cost("qwen2.5-0.5b", "h100", dp=1, cp=8)
    x = np.array([60_000.0, 60_000.0])
    forms = sample_forms(x, cost)
    one = pair_bound(x, forms, cost, 1)
    assert one > float(forms.unit.max()) + forms.shard[0]  # both shares on the same ranks, plus exchanges
    assert pair_bound(x, forms, cost, 2) == 0.0  # as many replicas as samples: no pair is forced together
    assert step_lower_bound(x, cost, degrees=[8]) >= one


@pytest.mark.parametrize("seed", range(4))
def test_lower_bound_with_pairs_stays_below_the_exact_optimum(seed):
    """Small batches where two long samples must share the only replica: the pair term lifts the bound above
    the single-sample unit, and it still stays at or below the MILP's optimal step (sim/exact.py)."""
    pytest.importorskip("scipy")
    from longpack.sim.exact import optimal_step

    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.integers(300, 4000, 5), rng.integers(20_000, 60_000, 2)]).astype(float)
    cost = make_cost("qwen2.5-0.5b", "h100", dp=1, cp=4, token_cap=16_000)
    res = optimal_step(x, cost)
    assert res.status == "optimal"
    forms = sample_forms(x, cost)
    assert pair_bound(x, forms, cost, 1) > float(forms.unit.max()) + 1e-9
    assert step_lower_bound(x, cost) <= res.time_s * (1 + 1e-9)


def test_exchange_arrays_match_scalars_and_comm_floor_is_the_least_beyond():
    """cp_comm_s over arrays equals the scalar path (intra- and inter-node groups); comm_floor is the least
    exchange of any larger micro-batch, also on a table that dips (a calibrated file may)."""
    from dataclasses import replace

    from longpack.cost import CostModel
    from longpack.sim.bounds import comm_floor

    for cp in (4, 16):
        cost = make_cost("qwen2.5-7b", "h100", dp=1, cp=cp)
        x = np.geomspace(1.0, 5e6, 400)
        assert np.allclose(cost.cp_comm_s(x), [cost.cp_comm_s(float(v)) for v in x], rtol=1e-12, atol=0)
        assert np.array_equal(comm_floor(x, cost), cost.cp_comm_s(x, 0))  # the preset grows with size
    base = make_cost("qwen2.5-7b", "h100", dp=1, cp=8)
    ag = dict(base.hw.collectives["all_gather"])
    ag[8] = ag[4] * 0.5  # a dip at 8 MiB
    hw = replace(base.hw, collectives={**base.hw.collectives, "all_gather": tuple(sorted(ag.items()))})
    cost = CostModel(base.model, hw, base.cfg)
    x = np.geomspace(10.0, 2e5, 300)
    grid = np.geomspace(10.0, 1e9, 20000)
    comm = cost.cp_comm_s(grid, 0)
    want = np.array([comm[grid >= v].min() for v in x])
    got = comm_floor(x, cost)
    assert np.all(got <= cost.cp_comm_s(x, 0)) and np.any(got < cost.cp_comm_s(x, 0))
    assert np.all(got <= want * (1 + 1e-12))


@pytest.mark.parametrize("cut", [0.5, 0.3, 0.7])
def test_chain_exchange_bound_is_tight_and_below_a_real_chain(cut):
    """A 200K-token sample under --max-len 128K runs as a sharded chain of two pieces over CP 8: the envelope
    bound on its exchanges exceeds the minorant's (the H100 table is concave over these sizes) and still stays
    at or below what the simulator charges the chain, wherever it is cut."""
    from longpack.sim.bounds import chain_exchange, comm_lower

    cost = make_cost("qwen2.5-0.5b", "h100", dp=1, cp=8)
    s, limit = 200_000, 128 * 1024
    x = np.array([float(s)])
    env = chain_exchange(x, cost, float(limit), np.array([2.0]))
    assert env[0] > comm_lower(x, cost, 2)[0] + 1e-4
    head = max(int(s * cut), s - limit)
    step = Step(cp=8, token_cap=10**9, replicas=(Replica((MicroBatch((Piece(0, 0, head, None),)),
                                                          MicroBatch((Piece(0, head, s, None),)))),))
    plan = Plan("t", 8, {0: s}, (step,), meta={"overlong": {"split_len": limit}})
    rep = simulate(plan, cost).steps[0]
    assert rep.lower_bound_s <= rep.time_s * (1 + 1e-12)
    assert cost.cp_comm_s(float(head)) + cost.cp_comm_s(float(s - head)) >= env[0] - per_mb(cost)


def test_lower_bound_counts_the_micro_batches_a_rank_must_run():
    """Short samples on one GPU: any plan runs their tokens in micro-batches of at most cap(k) tokens, paying h
    each (or recomputing checkpointed layers to hold more), so the bound charges Σ s / cap(0) micro-batches here
    and sits within 1% of the packed plan, which needs ceil of that."""
    from longpack.planners import PlanContext, get_planner, global_batches
    from longpack.sim.bounds import memory_caps

    cost = make_cost("qwen2.5-0.5b", "h100", dp=1, cp=1)
    cap0 = float(memory_caps(cost)[0])
    x = np.random.default_rng(0).integers(500, 3000, 4000)
    x = x[: np.searchsorted(np.cumsum(x), 5.5 * cap0)]
    work = float(sample_forms(x, cost).work.sum())
    lb = step_lower_bound(x, cost)
    assert lb >= (work + per_mb(cost) * x.sum() / cap0 + cost.grad_allreduce_s()) * (1 - 1e-9)
    plan = get_planner("bfd").plan(x, global_batches(len(x), len(x), seed=0, steps=1), PlanContext(cost=cost))
    step = simulate(plan, cost).steps[0]
    assert len(plan.steps[0].replicas[0].micro_batches) == int(np.ceil(x.sum() / cap0))
    assert 0.99 * step.time_s <= lb <= step.time_s


@pytest.mark.parametrize("seed,layout", [(32, (2, 4)), (48, (2, 4)), (50, (2, 8))])
def test_replica_program_raises_the_bound_and_stays_below_the_exact_optimum(seed, layout, monkeypatch):
    """Two replicas, one or more long samples among short ones: the per-replica program (sim/replica_bound.py)
    lifts the bound above what the aggregate terms give, and it still stays at or below the MILP's optimum."""
    pytest.importorskip("scipy")
    from longpack.sim import replica_bound
    from longpack.sim.exact import optimal_step

    rng = np.random.default_rng(1000 + seed)
    dp, cp = layout
    long = int(rng.integers(1, 4))
    x = np.concatenate([rng.integers(200, 6000, int(rng.integers(4, 9))),
                        rng.integers(8000, 40000, long)]).astype(float)
    cost = make_cost("qwen2.5-0.5b", "h100", dp=dp, cp=cp, token_cap=int(rng.choice([16000, 30000, 60000])))
    res = optimal_step(x, cost)
    assert res.status == "optimal"
    with_program = step_lower_bound(x, cost, degrees=[cp])
    monkeypatch.setattr(replica_bound, "REPLICA_LIMIT", 0)
    aggregate = step_lower_bound(x, cost, degrees=[cp])
    assert with_program > aggregate * (1 + 1e-3)
    assert with_program <= res.time_s * (1 + 1e-6)  # HiGHS's optimum is exact to its tolerance


def test_recomputed_tokens_pay_their_attention_forward_in_the_bound():
    """A sample too long for its ranks' memory recomputes the forward of what they cannot hold, attention
    included (the simulator charges both): the bound counts the attention forward of the shortest prefixes (7% more
    than the linear recompute alone here), and a real chain of recomputed chunks still costs more."""
    from longpack.sim.simulate import micro_batch_times

    cost = make_cost("qwen2.5-7b", "h100", dp=16, cp=2)  # cap ~12K tokens a rank: 81,822 / 2 needs recompute
    s = np.array([81_822.0])
    share = float(sample_forms(s, cost).shard[0])
    fwd = float(cost.linear_s(1.0, 0, ideal=True)) / 3
    dropped = s[0] / 2 - cost.token_caps[0]
    linear_only = (float(cost.linear_s(s[0] / 2, 0, ideal=True)) + fwd * dropped
                   + float(cost.attn_s(0.5 * s[0] ** 2 / 2, s[0] / 4, 0)))
    attention_fwd = float(cost.attn_s(0.5 * (2 * dropped) ** 2 / 2, s[0] / 4, 0)) / (1 + cost.cfg.attn_bwd_factor)
    # the least over checkpointing: dropping the 28.9K tokens (k = 0) or checkpointing some layers instead, both
    # now dearer than the linear recompute alone
    assert share >= linear_only + 0.5 * attention_fwd
    cuts = [0, 24_000, 47_000, 57_822, 81_822]  # three recomputed chunks, the last kept
    chain = sum(float(micro_batch_times(MicroBatch((Piece(0, a, b, None),), recompute=i < 3), 2, cost)[2][0])
                for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)))
    assert chain >= share


def test_two_piece_exchange_is_the_least_over_every_cut():
    """The two-piece chain exchange of the bound is the least, over every cut, of the two pieces' exchanges (a dense
    scan of cuts finds nothing lower), on an intra-node and an inter-node group."""
    from longpack.sim.bounds import _two_pieces, comm_floor

    for cp in (8, 32):
        cost = make_cost("qwen2.5-0.5b", "h100", dp=1, cp=cp)
        s = np.array([9_000.0, 31_757.0, 80_000.0])
        limit = 50_000.0
        exact = _two_pieces(s, cost, limit)
        for n, e in zip(s.tolist(), exact.tolist(), strict=True):
            cuts = np.linspace(max(1.0, n - limit), min(limit, n - 1.0), 4001)
            scan = float(np.min(comm_floor(cuts, cost) + comm_floor(n - cuts, cost)))
            assert e <= scan * (1 + 1e-12)
            assert e >= scan - 1e-3 * scan  # the scan's grid is 0.025% of the range apart


def test_micro_batch_overhead_charges_checkpointing_that_forced_sharding_does_not_pay_for():
    """7B at CP 2: 14–23K samples fit no rank whole without checkpointing, so their cheapest form is sharded
    (W above the memory-free work by the sharded attention's lower efficiency, and no recompute). The overhead
    term charges their tokens h/cap(k) at the k a plan may use for the difference, not h/cap(L): here several
    times more. Every way to run them, sharded or whole on one rank, with or without checkpointing, as a chain,
    alone or packed, still pays in GPU-seconds at least Σ W plus that charge."""
    from longpack.sim.bounds import memory_caps, micro_batch_overhead

    cost = make_cost("qwen2.5-7b", "h100", dp=16, cp=2)  # cap ~12K tokens a rank
    x = np.array([14_000.0, 18_000.0, 23_000.0])
    forms = sample_forms(x, cost)
    free = sample_forms(x, cost, memory=False)
    assert np.all(forms.work > free.work)  # forced to shard: W is above the memory-free work
    charge = micro_batch_overhead(x, forms, free, cost)
    assert charge >= 3 * per_mb(cost) * x.sum() / float(memory_caps(cost).max())
    n = x.astype(int).tolist()

    def busy(mbs: list[list[Piece]], ckpt: list[int], recompute: list[bool] | None = None) -> float | None:
        rep0 = Replica(tuple(MicroBatch(tuple(p), ckpt_layers=k, recompute=bool(r)) for p, k, r in
                             zip(mbs, ckpt, recompute or [False] * len(mbs), strict=True)))
        idle = Replica(tuple(MicroBatch(()) for _ in mbs))
        step = Step(cp=2, token_cap=60_000, replicas=(rep0,) + (idle,) * 15)
        plan = Plan("forms", 32, dict(enumerate(n)), (step,))
        plan.validate()
        rep = simulate(plan, cost, bounds=False).steps[0]
        return None if rep.oom else sum(rep.replica_s[0] - t for t in rep.idle_s)

    k_min = [cost.min_ckpt_for(s) for s in n]
    plans = [
        ([[Piece(i, 0, s, None)] for i, s in enumerate(n)], [0, 0, 0]),  # each sharded whole
        ([[Piece(i, 0, s, None)] for i, s in enumerate(n)], [4, 4, 4]),  # sharded, checkpointed
        ([[Piece(i, 0, s, 0)] for i, s in enumerate(n)], k_min),  # each whole on rank 0, fewest layers
        ([[Piece(i, 0, s, i % 2)] for i, s in enumerate(n)], [k + 3 for k in k_min]),
        ([[Piece(0, 0, n[0], 0), Piece(1, 0, n[1], 1)], [Piece(2, 0, n[2], None)]], [cost.layers, 0]),
        ([[Piece(0, 0, 7_000, 0)], [Piece(0, 7_000, n[0], 0), Piece(1, 0, n[1], None)], [Piece(2, 0, n[2], None)]],
         [0, 0, 0], [True, False, False]),  # a local chain, its head recomputed
        ([[Piece(2, 0, 11_500, None)], [Piece(2, 11_500, n[2], None)], [Piece(0, 0, n[0], None)],
          [Piece(1, 0, n[1], None)]], [0, 0, 0, 0], [True, False, False, False]),  # a sharded chain
    ]
    checked = 0
    for mbs, *policy in plans:
        gpu_s = busy(mbs, *policy)
        if gpu_s is None:
            continue
        checked += 1
        assert gpu_s >= (forms.work.sum() + charge) * (1 - 1e-12), (mbs, policy)
    assert checked >= 5


def test_the_per_replica_program_keeps_highs_prints_off_stdout(capfd):
    """HiGHS prints a debug line to descriptor 1 on this program (a batch of Skrull's Fig. 4a sweep), which would
    break a command's --json output; the bound must come back with stdout untouched."""
    from longpack.reproduce._common import calibrated_cost

    lengths = np.array([28417, 243, 661, 13909, 6597, 18283, 11257, 20401, 5970, 11722, 14398, 9042, 23307, 5770,
                        441, 10584], dtype=np.float64)
    cost = calibrated_cost("qwen2.5-0.5b", "h100", token_cap=26 * 1024, dp=1, cp=8)
    print("before")
    bound = step_lower_bound(lengths, cost, degrees=[1, 2, 4, 8])
    print("after")
    out, err = capfd.readouterr()
    assert out == "before\nafter\n" and err == ""
    assert bound == pytest.approx(0.24815, rel=1e-3)


def test_native_stdout_silenced_drops_c_prints_and_keeps_python_order(capfd):
    import ctypes

    from longpack.sim.quiet import native_stdout_silenced

    libc = ctypes.CDLL(None)
    print("one")
    with native_stdout_silenced():
        libc.printf(b"native\n")
        os.write(1, b"raw\n")
    print("two")
    libc.printf(b"three\n")
    libc.fflush(None)
    assert capfd.readouterr().out == "one\ntwo\nthree\n"
