"""FSDP2 parity: the engine sharded per layer over 2 gloo ranks (ZeRO-3: a gather per layer and pass, a
reduce-scatter per layer and backward, on one pass schedule with empty passes where a rank has less to do) gives
the single-process unpacked loss and gradients in float64 — packed, with CP-sharded pieces, with a chunk chain,
with checkpointed layers, and with ranks of uneven work (a chain with a recomputed chunk beside an empty
micro-batch); and gathered once per step instead (``longpack train --shard step``, what ``auto`` picks when the
whole model leaves room) on the same uneven ranks."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import pool  # noqa: E402  (tests/pool.py: warm worker processes)
from dist_workers import fsdp_worker, step_reference  # noqa: E402

from longpack.plan import Plan  # noqa: E402
from longpack.runtime.dist import free_port  # noqa: E402

RTOL = 1e-6  # float64: only the order of additions differs (observed ~1e-15)

CASES = {
    "packed": ("isf", 1, 128, {}, 0),
    "context_parallel": ("skrull", 2, 48, {}, 0),
    "chunk": ("chunkflow", 1, 128, {"chunk_size": 32, "k": 1}, 0),
    "ckpt": ("isf", 1, 128, {}, 1),
    "uneven_passes": ("uneven", 1, 128, {}, 0),
    "gathered_per_step": ("uneven", 1, 128, {}, 0),  # --shard step: uneven ranks need no pass schedule
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_parity(tmp_path, case):
    planner, cp, cap, options, ckpt = CASES[case]
    out = str(tmp_path / f"{case}.pt")
    gathers = "step" if case == "gathered_per_step" else "layer"
    pool.spawn(fsdp_worker, args=(2, free_port(), out, planner, cp, cap, options, ckpt, gathers), nprocs=2)
    got = torch.load(out, weights_only=False)
    # the path under test really ran: sharded pieces, chunks of a chain, checkpointed layers
    assert {"context_parallel": got["sharded"], "chunk": got["chunks"], "ckpt": got["ckpt"],
            "uneven_passes": got["empty_passes"]}.get(case, 1) > 0
    plan = Plan.from_json(got["plan"])
    ref = step_reference(plan, 0)
    for name, g in ref.items():
        assert float((got["grads"][name] - g).norm() / g.norm()) <= RTOL, name
