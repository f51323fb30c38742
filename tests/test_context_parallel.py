"""Context-parallel runtime parity: sharded (zigzag, all-gathered K/V) and local pieces in one micro-batch give
the single-process unpacked loss and gradients in float64."""

import pytest

torch = pytest.importorskip("torch")

import pool  # noqa: E402  (tests/pool.py: warm worker processes)
from dist_workers import cp_worker, reference_grads  # noqa: E402

from longpack.runtime.dist import free_port  # noqa: E402
from longpack.runtime.kernel.context_parallel import zigzag_blocks  # noqa: E402

RTOL = 1e-6  # float64: only the order of additions differs


def _run(tmp_path, world, planner, cp, cap, options=None, overlap=True):
    out = str(tmp_path / f"{planner}_{world}_{cp}.pt")
    pool.spawn(cp_worker, args=(world, free_port(), out, planner, cp, cap, options or {}, overlap),
                                nprocs=world)
    return torch.load(out, weights_only=False)


def _assert_parity(got):
    ref_loss, ref = reference_grads("token_mean")
    assert got["loss"] == pytest.approx(ref_loss, rel=RTOL)
    for name, g in ref.items():
        assert float((got["grads"][name] - g).norm() / g.norm()) <= RTOL, name


def test_zigzag_blocks_cover_each_token_once():
    for n in (1, 3, 7, 16, 29):
        for cp in (2, 3, 4):
            spans = sorted(s for r in range(cp) for s in zigzag_blocks(5, 5 + n, cp, r))
            assert [a for a, _ in spans][0] == 5 and sum(b - a for a, b in spans) == n
            assert all(b1 == a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))


def test_context_parallel_parity_cp2_skrull_mixed(tmp_path):
    """CP 2: Skrull keeps short sequences local and shards the ones over the 48-token cap (GQA, uneven lengths)."""
    got = _run(tmp_path, 2, "skrull", 2, 48)
    assert got["sharded"] > 0 and got["local"] > 0
    _assert_parity(got)


def test_context_parallel_parity_cp2_fixed_cp_no_overlap(tmp_path):
    got = _run(tmp_path, 2, "fixed_cp", 2, 128, overlap=False)
    assert got["sharded"] > 0 and got["local"] == 0
    _assert_parity(got)


def test_context_parallel_parity_cp4_skrull(tmp_path):
    got = _run(tmp_path, 4, "skrull", 4, 40)
    assert got["sharded"] > 0 and got["local"] > 0
    _assert_parity(got)


def test_context_parallel_parity_cp2_unified(tmp_path):
    """unified at CP 2 (degree pinned): samples over the 48-token cap sharded, short ones local, equal to unpacked."""
    got = _run(tmp_path, 2, "unified", 2, 48, {"degrees": "2"})
    assert got["sharded"] > 0 and got["local"] > 0 and got["cp"] == 2
    _assert_parity(got)


def test_context_parallel_parity_dp2_cp2_unified_own_choice(tmp_path):
    """unified on 4 processes choosing the step's CP degree itself (any of 4, 2, 1): still the reference."""
    got = _run(tmp_path, 4, "unified", 2, 48)
    _assert_parity(got)


def test_context_parallel_parity_dp2_cp2(tmp_path):
    """DP 2 x CP 2: gradients summed over all four ranks (CP ranks share parameters)."""
    got = _run(tmp_path, 4, "skrull", 2, 48)
    _assert_parity(got)


def test_context_parallel_parity_adaptive_cp_hbp(tmp_path):
    """HBP plan on 4 processes whose steps use CP 1, 2 and 4 (groups built once): every step's gradients equal the
    unpacked reference of that step's samples."""
    from dist_workers import adaptive_worker, step_reference

    from longpack.plan import Plan

    out = str(tmp_path / "adaptive.pt")
    pool.spawn(adaptive_worker, args=(4, free_port(), out, "16:1:0,48:2:0,96:4:0"), nprocs=4)
    got = torch.load(out, weights_only=False)
    plan = Plan.from_json(got["plan"])
    assert {s.cp for s in plan.steps} == {1, 2, 4}
    for step, grads in enumerate(got["grads"]):
        ref = step_reference(plan, step)
        for name, g in ref.items():
            assert float((grads[name] - g).norm() / g.norm()) <= RTOL, (step, name)


def test_context_parallel_parity_mixed_groups_1_2_1(tmp_path):
    """One step on CP groups of 1, 2 and 1 ranks (Step.degrees; the group of 2 is ranks 1-2): the summed loss and
    gradients equal the single-process unpacked reference."""
    from dist_workers import mixed_worker

    out = str(tmp_path / "mixed.pt")
    pool.spawn(mixed_worker, args=(4, free_port(), out), nprocs=4)
    _assert_parity(torch.load(out, weights_only=False))


def test_train_cli_skrull_cp2_and_hbp_mixed_cp():
    import json

    for extra in (["--planner", "skrull", "--cp", "2", "--token-cap", "2048"],
                  ["--planner", "hbp", "--opt", "groups=512:1:0,4096:2:0", "--opt", "curriculum=0"]):
        proc = pool.cli(["train", "--workload", "tiny-longtail", "--model", "tiny", "--nproc", "2",
                         "--steps", "2", "--global-batch",
                         "48", "--samples", "200", "--json", *extra])
        assert proc.returncode == 0, proc.stderr
        steps = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]
        assert steps and all(s["loss"] > 0 for s in steps)
