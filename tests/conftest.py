"""Shared fixtures: small cost models with round numbers so expected values can be computed by hand."""

from __future__ import annotations

import os

import pytest

# torch's OpenMP threads wait for work by spinning. This suite runs more processes than the machine has cores, and a
# spinning thread takes the core its peer needs: beside a second copy of itself, a 3-step one-process run took 8 to
# 50 s of CPU with the default policy and 3.5 to 5 s with passive waiting. What is computed, and so every figure, is
# the same. Set before any test process imports torch (the workers, the zygote and their commands inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton kernels (Liger's fused loss: runtime/kernel/liger_loss.py) run on the host in Triton's interpreter: this
# machine has no GPU. Read when a kernel module is imported, so set before any test imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")

from longpack.hardware import HardwareSpec
from longpack.model import ModelSpec

# a process of its own (it registers the fake CUDA device before importing torch): run by test_gpu_ready.py
collect_ignore = ["gpu_ready_worker.py"]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the fake-GPU worker of test_gpu_ready.py now, when its tests are selected: it runs beside the suite
    (about half a minute on one core) and its tests read what it saw. Under pytest-xdist the other worker keeps
    the second core busy, and the tests start it themselves."""
    if hasattr(session.config, "workerinput") or session.config.option.collectonly:
        return  # under xdist the worker running the tests starts it; --collect-only runs nothing
    item = next((i for i in session.items if i.nodeid.startswith("tests/test_gpu_ready.py")), None)
    if item is not None:
        session.config.stash[item.module.WORKER] = item.module.start()


# The longest test files, longest first (worker-seconds measured on 2 cores; test_gpu_ready first: its fake-GPU
# worker, which builds its device with g++, runs beside the rest). Under `make test` (pytest-xdist, --dist loadfile
# --no-loadscope-reorder) files are handed out in this order, then the others as collected, so the two workers
# finish together. test_readme_use times the README's commands against their stated times: it waits until the
# start, when both workers and the fake-GPU worker compete for the 2 cores, is over.
LONGEST_FIRST = ["test_gpu_ready", "test_elastic", "test_pipeline", "test_dry_run", "test_trust", "test_hf",
                 "test_trust_second", "test_bounds", "test_bad_input", "test_readme_use", "test_chunked",
                 "test_mixed_groups", "test_hbp", "test_sim", "test_first_hour", "test_cli", "test_skrull",
                 "test_run_options", "test_faults", "test_unified"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


# A flat-table "hardware": every collective costs 100 µs below 1 MB and 1 µs more per MB above.
FLAT = {k: ((1.0, 100.0), (1001.0, 1100.0)) for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}


@pytest.fixture
def toy_model() -> ModelSpec:
    # hidden 8, 2 heads x 4, 1 KV head, ffn 16 gated, vocab 32, 2 layers: every figure is small and exact.
    return ModelSpec(name="toy", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=32)


@pytest.fixture
def toy_hw() -> HardwareSpec:
    return HardwareSpec(name="toy", peak_flops=1e6, memory_gib=1.0, mfu_gemm=1.0, mfu_attn=1.0,
                        gemm_half_tokens=0.0, attn_half_len=0.0, layer_overhead_s=0.0, reserve_gib=0.0,
                        fragmentation=1.0, collectives=dict(FLAT))
