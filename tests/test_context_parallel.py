"""Context-parallel runtime parity: sharded (zigzag, all-gathered K/V) and local pieces in one micro-batch give
the single-process unpacked loss and gradients in float64."""

import pytest

torch = pytest.importorskip("torch")

from dist_workers import cp_worker, reference_grads  # noqa: E402

from longpack.runtime.context_parallel import zigzag_blocks  # noqa: E402
from longpack.runtime.dist import free_port  # noqa: E402

RTOL = 1e-6  # float64: only the order of additions differs


def _run(tmp_path, world, planner, cp, cap, options=None, overlap=True):
    out = str(tmp_path / f"{planner}_{world}_{cp}.pt")
    torch.multiprocessing.spawn(cp_worker, args=(world, free_port(), out, planner, cp, cap, options or {}, overlap),
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


def test_context_parallel_parity_dp2_cp2(tmp_path):
    """DP 2 x CP 2: gradients summed over all four ranks (CP ranks share parameters)."""
    got = _run(tmp_path, 4, "skrull", 2, 48)
    _assert_parity(got)
