"""Plan.validate: each of the invariants fails with a message naming where; JSON round-trips exactly."""

import pytest

from longpack.plan import MicroBatch, Piece, Plan, PlanError, Replica, Step


def mb(*pieces, **kw):
    return MicroBatch(pieces=tuple(Piece(*p) for p in pieces), **kw)


def plan(steps, lengths, world=2, **kw):
    return Plan(planner="t", world=world, lengths=lengths, steps=tuple(steps), **kw)


def step(*replicas, cp=1, cap=100):
    return Step(cp=cp, token_cap=cap, replicas=tuple(Replica(tuple(r)) for r in replicas))


GOOD = plan([step([mb((0, 0, 10)), mb((1, 0, 5), (2, 0, 5))], [mb((3, 0, 30)), mb()])],
            {0: 10, 1: 5, 2: 5, 3: 30})


def test_good_plan_validates_and_round_trips():
    GOOD.validate()
    text = GOOD.to_json()
    again = Plan.from_json(text)
    assert again == GOOD and again.to_json() == text


def test_coverage_missing_sample():
    p = plan([step([mb((0, 0, 10))], [mb()])], {0: 10, 1: 4})
    with pytest.raises(PlanError, match="sample 1: 4 tokens never scheduled"):
        p.validate()


def test_coverage_gap_and_overlap():
    gap = plan([step([mb((0, 0, 4)), mb((0, 5, 10))], [mb(), mb()])], {0: 10})
    with pytest.raises(PlanError, match="sample 0: token gap at 4"):
        gap.validate()
    overlap = plan([step([mb((0, 0, 6)), mb((0, 5, 10))], [mb(), mb()])], {0: 10})
    with pytest.raises(PlanError, match="sample 0: token overlap"):
        overlap.validate()


def test_dropped_and_truncated_samples_are_accounted():
    ok = plan([step([mb((0, 0, 8))], [mb()])], {0: 10, 1: 500}, truncated={0: 8}, dropped={1: "too long"})
    ok.validate()
    scheduled_dropped = plan([step([mb((0, 0, 10))], [mb((1, 0, 5))])], {0: 10, 1: 5}, dropped={1: "x"})
    with pytest.raises(PlanError, match="sample 1: dropped"):
        scheduled_dropped.validate()
    with pytest.raises(PlanError, match="sample 0: dropped without"):
        plan([step([mb()], [mb()])], {0: 10}, dropped={0: ""}).validate()


def test_capacity_counts_local_whole_and_sharded_by_ceil():
    # cp=2: sample 0 (9 tokens) sharded -> 5 per rank; sample 1 local on rank 1 -> rank 1 holds 5 + 4 = 9.
    p = plan([step([mb((0, 0, 9, None), (1, 0, 4, 1))], cp=2, cap=8)], {0: 9, 1: 4})
    with pytest.raises(PlanError, match="step 0, replica 0, micro-batch 0: CP rank 1 holds 9 tokens > token cap 8"):
        p.validate()
    plan([step([mb((0, 0, 9, None), (1, 0, 4, 1))], cp=2, cap=9)], {0: 9, 1: 4}).validate()


def test_capacity_counts_padding():
    p = plan([step([mb((0, 0, 3), (1, 0, 10), pad_to=10)], [mb()], cap=19)], {0: 3, 1: 10})
    with pytest.raises(PlanError, match="holds 20 tokens"):
        p.validate()


def test_chunk_order_same_replica_and_increasing_start():
    split = plan([step([mb((0, 0, 5))], [mb((0, 5, 10))])], {0: 10})
    with pytest.raises(PlanError, match="sample 0: pieces in step 0 replica 0 and step 0 replica 1"):
        split.validate()
    backwards = plan([step([mb((0, 5, 10)), mb((0, 0, 5))], [mb(), mb()])], {0: 10})
    with pytest.raises(PlanError, match="increasing start order"):
        backwards.validate()
    two_in_one = plan([step([mb((0, 0, 5), (0, 5, 10))], [mb()])], {0: 10})
    with pytest.raises(PlanError, match="two pieces in one micro-batch"):
        two_in_one.validate()


def test_shape_replica_count_and_equal_depth():
    wrong_count = plan([step([mb((0, 0, 10))])], {0: 10})
    with pytest.raises(PlanError, match="1 replicas, expected world // cp = 2"):
        wrong_count.validate()
    uneven = plan([step([mb((0, 0, 5)), mb((1, 0, 5))], [mb((2, 0, 5))])], {0: 5, 1: 5, 2: 5})
    with pytest.raises(PlanError, match="different micro-batch counts"):
        uneven.validate()
    bad_cp = plan([step([mb((0, 0, 10))], cp=3)], {0: 10})
    with pytest.raises(PlanError, match="cp=3 does not divide world=2"):
        bad_cp.validate()


def test_piece_ranges_and_cp_rank_bounds():
    with pytest.raises(PlanError, match=r"piece \[0, 11\) outside \[0, 10\)"):
        plan([step([mb((0, 0, 11))], [mb()])], {0: 10}).validate()
    with pytest.raises(PlanError, match="cp_rank=2 not in"):
        plan([step([mb((0, 0, 10, 2))], cp=2)], {0: 10}).validate()
    with pytest.raises(PlanError, match="sample 7 is not in"):
        plan([step([mb((7, 0, 1))], [mb()])], {0: 1}).validate()


def test_from_json_rejects_other_documents():
    with pytest.raises(PlanError, match="format"):
        Plan.from_json('{"format": "other"}')
    with pytest.raises(PlanError, match="not a longpack plan"):
        Plan.from_json("{not json")
