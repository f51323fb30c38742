"""The execution paths on fake CUDA tensors (tests/fakegpu.py): no tensor of a step left on the host, no
CPU-only kernel, no host tensor in a collective, no attention mask, and host syncs that do not grow with layers or
documents. One process runs every scenario (tests/gpu_ready_worker.py: the fake device must be registered before
torch is imported), about a minute on two cores: the price of building and running each path once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
if shutil.which("g++") is None:  # the fake device is a small C++ library built against torch's headers
    pytest.skip("g++ is needed to build the fake CUDA device", allow_module_level=True)

PATHS = ["documents", "cp2_sharded", "cp4_sharded", "chain_cp1", "chain_cp2", "pp2_first_stage", "pp2_last_stage",
         "step_no_fsdp", "step_fsdp_path", "step_sync_last_backward", "trainer"]
SYNCS = [f"syncs_{layers}_layers_{docs}_docs" for layers in (2, 8) for docs in (4, 64)]
HERE = Path(__file__).parent
WORKER = pytest.StashKey[subprocess.Popen]()


def start() -> subprocess.Popen:
    """The worker process, started by conftest.py once collection ends (it runs beside the other tests: one
    process, mostly one core)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    names = [*PATHS, "cpu_weights_bug", "cp_groups_before_step_0", *SYNCS]
    return subprocess.Popen([sys.executable, str(HERE / "gpu_ready_worker.py"), *names],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def seen(request) -> dict:
    proc = request.config.stash.get(WORKER, None) or start()
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("path", PATHS)
def test_gpu_ready_path_keeps_every_tensor_on_the_device(seen, path):
    got = seen[path]
    assert got["error"] is None, got["error"]
    assert got["violations"] == []
    assert got["counts"].get("attention_calls", 0) > 0  # the path reached the attention backend on the device


def test_gpu_ready_harness_catches_token_weights_left_on_the_host(seen):
    got = seen["cpu_weights_bug"]
    assert got["error"] is not None and "device" in got["error"]
    assert any("mixed with CUDA tensors" in v for v in got["violations"])


def test_gpu_ready_one_host_read_per_step_and_no_blocking_copy(seen):
    """A whole training step as the loop runs it (step runner, clipping, AdamW, every rank's figures, the read),
    for 2 and 8 layers, 4 and 64 documents: one host read per step; every host-to-device copy from pinned memory
    and not blocking (0 blocking), and the same copies whatever the layers or documents (the micro-batch in one
    copy, the step's counts in another)."""
    counts = {name: seen[name]["counts"] for name in SYNCS}
    for name in counts:
        assert seen[name]["error"] is None and seen[name]["violations"] == [], name
        assert counts[name].get("syncs", 0) == 1, (name, counts[name])
        assert counts[name].get("h2d_blocking", 0) == 0, (name, counts[name])
    assert len({c.get("h2d", 0) for c in counts.values()}) == 1, counts
    assert counts["syncs_2_layers_4_docs"].get("h2d", 0) <= 3
    # attention: the same backend calls for 4 and 64 documents (no per-document loop), growing with layers only
    for layers in (2, 8):
        calls = {counts[f"syncs_{layers}_layers_{d}_docs"]["attention_calls"] for d in (4, 64)}
        assert calls == {2 * layers}, counts  # one forward and one backward call per layer


def test_gpu_ready_gather_once_sync_runs_no_closing_pass(seen):
    """StepSync (FSDP2 gathered once a step) turns gradient sync on before the rank's last backward instead of
    closing the step with a one-token pass: the attention backend is called once forward and once backward per
    layer for each micro-batch the rank holds, and no more."""
    from dist_workers import SPEC, make_plan

    got = seen["step_sync_last_backward"]
    assert got["error"] is None and got["violations"] == [], got
    held = [mb for mb in make_plan("isf", 2).steps[0].replicas[0].micro_batches if mb.pieces]
    assert len(held) >= 2  # a step of several micro-batches: the last backward is not the only one
    assert got["counts"]["attention_calls"] == 2 * SPEC.layers * len(held), (got["counts"], len(held))


@pytest.mark.parametrize("cp", [2, 4])
def test_gpu_ready_context_parallel_kv_gradients_are_reduce_scattered(seen, cp):
    """The K/V gradient of a CP step's sharded pieces goes to its owners by one reduce-scatter per layer and
    micro-batch, of each rank's rows padded to the largest share — on NCCL's ring (c−1)/c of that per rank, half
    of the all-reduce that moved it before — and no all-reduce or fp64 tensor at all in the step's exchanges."""
    from dist_workers import SPEC, make_plan

    from longpack.runtime.kernel.context_parallel import zigzag_blocks

    got = seen[f"cp{cp}_sharded"]
    assert got["error"] is None and got["violations"] == [], got
    counts = got["counts"]
    payload = 0  # bytes of [cp · largest share, kv_heads, 2 · head_dim] bf16 per layer and micro-batch
    for mb in make_plan("fixed_cp", 1, cp=cp).steps[0].replicas[0].micro_batches:
        shared = [p for p in mb.pieces if p.cp_rank is None]
        if shared:
            top = max(sum(b - a for p in shared for a, b in zigzag_blocks(p.start, p.stop, cp, r)) for r in range(cp))
            payload += SPEC.layers * cp * top * SPEC.kv_heads * 2 * SPEC.head_dim * 2
    assert payload > 0
    assert counts.get("collective_reduce_scatter_base_bytes", 0) == payload, (counts, payload)
    assert counts.get("collective_allreduce_calls", 0) == 0, counts
    assert counts.get("collective_bytes_float64", 0) == 0, counts
    print(f"cp {cp}: K/V gradients reduce-scattered, {payload} bytes handed in; "
          f"{payload * (cp - 1) // cp} bytes per rank on a ring (an all-reduce: {2 * payload * (cp - 1) // cp})")


def test_gpu_ready_context_parallel_groups_are_made_before_step_0(seen):
    """A run at --cp 4 on 4 ranks: its step runner makes the CP groups of degrees 2 and 4 before the first step, so
    NCCL's communicators are not set up inside a step; steps at CP 2 and then 4 make no group."""
    got = seen["cp_groups_before_step_0"]
    assert got["error"] is None and got["violations"] == [], got
    assert got["counts"].get("attention_calls", 0) > 0


def test_gpu_ready_gradients_travel_in_their_own_dtype_not_fp64(seen):
    """Without FSDP the step all-reduces the gradients beside its fp64 statistics: the bf16 gradients travel as
    bf16 (one flat bucket per dtype), the fp64 bucket holds only the statistics' few numbers."""
    got = seen["step_no_fsdp"]
    assert got["error"] is None, got["error"]
    moved = {k.removeprefix("collective_bytes_"): v for k, v in got["counts"].items()
             if k.startswith("collective_bytes_")}
    params = sum(p.numel() for p in _spec_model_params())
    assert moved.get("bfloat16", 0) >= 2 * params, moved  # every gradient, in bf16
    assert moved.get("float64", 0) <= 8 * 64, moved  # the statistics only (before: every gradient as fp64)


def _spec_model_params():
    import torch
    from dist_workers import SPEC  # the worker's model shape

    from longpack.runtime.run.hf_model import build

    with torch.device("meta"):
        return list(build(SPEC, 0, torch.bfloat16).parameters())
