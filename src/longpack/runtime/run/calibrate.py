"""``longpack calibrate``: fit the cost model's compute coefficients to real training steps on this machine.

Times forward + backward of the runtime's model (transformers' class of the spec, run by the engine) on a grid of
packed micro-batches that vary Σ s_i (linear work) and Σ s_i² (attention work) independently, then fits by
non-negative least squares

    t = a · F_lin + b · F_attn + d · L · documents + c

where F_lin = tokens · (L·F_token + F_head) · 3 and F_attn = pairs · L · F_pair · 3.5 are the cost model's FLOP
counts (cost.py). Documents in a grid point have distinct lengths, as real packs do, so every document costs an
attention call. The fitted rates become a HardwareSpec: ``peak_flops`` = 1/a with ``mfu_gemm`` = 1,
``mfu_attn`` = a/b, ``doc_overhead_s`` = d, ``layer_overhead_s`` = c / L, and no small-work terms. The fit's error
is reported per grid point; the spec is saved as JSON for ``--hardware my.json``. On a GPU (CUDA available) the
same procedure runs there. With ``nproc`` > 1 that many processes time every grid point at the same moment (a
barrier before each), so the fit sees the memory-bandwidth and cache contention a multi-process training run has.

Cost: |grid| x (1 warm-up + ``repeats``) training steps; ~1 minute for tiny-llama on 2 CPU cores.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...cost import CostModel, TrainConfig
from ...hardware import HardwareSpec, get_hardware
from ...model import ModelSpec
from ...plan import MicroBatch, Piece, Plan, Replica, Step
from ..kernel.cp import CPContext
from ..kernel.data import SyntheticCorpus
from ..kernel.step import run_micro_batches
from .hf_model import build

__all__ = ["GRID", "GPU_GRID", "GRIDS", "calibrate"]

# (document length, documents): 512 to 4096 tokens, from many short documents to one long one
GRID = [(64, 8), (64, 32), (256, 2), (256, 8), (256, 16), (512, 4), (1024, 1), (1024, 2), (1024, 4), (2048, 1),
        (2048, 2), (4096, 1), (128, 24), (512, 1)]
# A GPU needs longer packs to leave the launch-bound regime: 8K to 32K tokens per micro-batch.
GPU_GRID = [(256, 32), (512, 16), (1024, 8), (2048, 4), (4096, 2), (8192, 1), (512, 64), (2048, 8), (4096, 4),
            (8192, 2), (16384, 1), (1024, 32), (8192, 4), (16384, 2), (32768, 1)]
GRIDS = {"cpu": GRID, "gpu": GPU_GRID}


def _doc_lengths(doc: int, count: int) -> dict[int, int]:
    """``count`` distinct lengths around ``doc`` (same total within a few tokens), like a real pack."""
    return {i: doc + i - count // 2 for i in range(count)}


def _time_step(model: torch.nn.Module, corpus: SyntheticCorpus, doc: int, count: int, repeats: int,
               device: torch.device) -> float:
    lengths = _doc_lengths(doc, count)
    mb = MicroBatch(pieces=tuple(Piece(i, 0, n) for i, n in lengths.items()))
    plan = Plan("calibrate", 1, lengths, (Step(cp=1, token_cap=sum(lengths.values()), replicas=(Replica((mb,)),)),))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        run_micro_batches(model, plan, 0, (mb,), corpus, CPContext(device=device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _measure(spec: ModelSpec, grid: list[tuple[int, int]], repeats: int, barrier: Any = None,
             dtype: torch.dtype = torch.float32) -> list[float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build(spec, 0, dtype).to(device).train()  # transformers' class, through the engine
    corpus = SyntheticCorpus(spec.vocab)
    out = []
    for doc, count in grid:
        if barrier is not None:
            barrier()
        out.append(_time_step(model, corpus, doc, count, repeats, device))
    return out


def _worker(rank: int, nproc: int, port: int, spec: ModelSpec, timing: tuple[list, int, int], path: str) -> None:
    """One of ``nproc`` processes timing the grid at once; ``timing``: (grid, repeats, threads)."""
    import os

    grid, repeats, threads = timing

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    times = torch.tensor(_measure(spec, grid, repeats, barrier=dist.barrier), dtype=torch.float64)
    gathered = [torch.empty_like(times) for _ in range(nproc)]
    dist.all_gather(gathered, times)
    if rank == 0:  # plain JSON: nothing is unpickled on the way back
        Path(path).write_text(json.dumps([g.tolist() for g in gathered]))
    from ..dist import leave

    leave()  # together out of the group, no interpreter teardown: gloo can abort there (SIGABRT, seen in the tests)


def calibrate(spec: ModelSpec, *, base: str = "cpu", repeats: int = 3, threads: int | None = None,
              grid: list[tuple[int, int]] | None = None, nproc: int = 1, dtype: str = "float32",
              ) -> tuple[HardwareSpec, dict[str, Any]]:
    """Measure, fit, and return (HardwareSpec, report with per-point measured/predicted times and errors).
    ``dtype`` (float32 or bfloat16) is the model's parameter and activation type."""
    grid = grid or GRID
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    if nproc > 1 and dtype != "float32":
        raise ValueError("--nproc > 1 calibrates CPU processes in float32; drop --dtype or --nproc")
    if threads:
        torch.set_num_threads(threads)
    if nproc > 1:
        import tempfile

        from ..dist import free_port

        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/times.json"
            timing = (grid, repeats, threads or torch.get_num_threads())
            torch.multiprocessing.spawn(_worker, args=(nproc, free_port(), spec, timing, path), nprocs=nproc)
            per_rank = json.loads(Path(path).read_text())
        measured = [float(np.mean(col)) for col in zip(*per_rank, strict=True)]
    else:
        measured = _measure(spec, grid, repeats, dtype=torch_dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref = CostModel(spec, get_hardware(base), TrainConfig())
    rows = []
    for doc, count in grid:
        sizes = np.array(list(_doc_lengths(doc, count).values()), dtype=np.float64)
        tokens, pairs = sizes.sum(), 0.5 * float((sizes * sizes).sum())
        lin = tokens * (ref.layers * spec.linear_flops_per_token + spec.head_flops_per_token) * 3.0
        attn = pairs * ref.layers * spec.attn_flops_per_pair * (1.0 + ref.cfg.attn_bwd_factor)
        rows.append((lin, attn, ref.layers * count, 1.0))
    x, y = np.array(rows), np.array(measured)
    coef = _nnls(x, y)
    pred = x @ coef
    a, b = (max(float(v), 1e-30) for v in coef[:2])
    d, c = float(coef[2]), float(coef[3])
    hw = replace(get_hardware(base), name=f"{base}-calibrated", peak_flops=1.0 / a, mfu_gemm=1.0,
                 mfu_attn=min(1.0, a / b), gemm_half_tokens=0.0, attn_half_len=0.0, doc_overhead_s=d,
                 layer_overhead_s=c / ref.layers)
    errors = (pred - y) / y
    report = {"points": [{"doc_len": d, "docs": n, "measured_s": float(m), "predicted_s": float(p),
                          "error": float(e)} for (d, n), m, p, e in zip(grid, y, pred, errors, strict=True)],
              "nproc": nproc,
              "rms_relative_error": float(np.sqrt(np.mean(errors ** 2))),
              "max_relative_error": float(np.abs(errors).max()), "device": str(device),
              "threads": torch.get_num_threads(), "model": spec.name, "dtype": dtype,
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None}
    return hw, report


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (every point weighs the same), by active-set elimination."""
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    active = list(range(x.shape[1]))
    while True:
        sol = np.zeros(x.shape[1])
        sol[active] = np.linalg.lstsq(xw[:, active], yw, rcond=None)[0]
        neg = [i for i in active if sol[i] < 0]
        if not neg:
            return sol
        active.remove(min(neg, key=lambda i: sol[i]))
