"""``longpack calibrate``: fit the cost model's compute coefficients to real training steps on this machine.

Times forward + backward of the runtime's model on a grid of packed micro-batches that vary Σ s_i (linear work) and
Σ s_i² (attention work) independently, then fits by non-negative least squares

    t = a · F_lin + b · F_attn + c

where F_lin = tokens · (L·F_token + F_head) · 3 and F_attn = pairs · L · F_pair · 3.5 are the cost model's FLOP
counts (cost.py). The fitted rates become a HardwareSpec: ``peak_flops`` = 1/a with ``mfu_gemm`` = 1,
``mfu_attn`` = a/b, ``layer_overhead_s`` = c / L, and no small-work terms (the fit absorbs them). The fit's error
is reported per grid point; the spec is saved as JSON for ``--hardware my.json``. On a GPU (CUDA available) the
same procedure runs there.

Cost: |grid| x (1 warm-up + ``repeats``) training steps; ~1 minute for tiny-llama on 2 CPU cores.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..cost import CostModel, TrainConfig
from ..hardware import HardwareSpec, get_hardware
from ..model import ModelSpec
from ..plan import MicroBatch, Piece, Plan, Replica, Step
from .data import SyntheticCorpus
from .model import Decoder, DecoderConfig
from .step import run_micro_batches

__all__ = ["GRID", "calibrate"]

# (document length, documents): 512 to 4096 tokens, from many short documents to one long one
GRID = [(64, 8), (64, 32), (256, 2), (256, 8), (256, 16), (512, 4), (1024, 1), (1024, 2), (1024, 4), (2048, 1),
        (2048, 2), (4096, 1), (128, 24), (512, 1)]


def _time_step(model: Decoder, corpus: SyntheticCorpus, doc: int, count: int, repeats: int,
               device: torch.device) -> float:
    lengths = {i: doc for i in range(count)}
    mb = MicroBatch(pieces=tuple(Piece(i, 0, doc) for i in range(count)))
    plan = Plan("calibrate", 1, lengths, (Step(cp=1, token_cap=doc * count, replicas=(Replica((mb,)),)),))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        run_micro_batches(model, plan, 0, (mb,), corpus, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def calibrate(spec: ModelSpec, *, base: str = "cpu", repeats: int = 3, threads: int | None = None,
              grid: list[tuple[int, int]] | None = None) -> tuple[HardwareSpec, dict[str, Any]]:
    """Measure, fit, and return (HardwareSpec, report with per-point measured/predicted times and errors)."""
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.from_spec(spec)).to(device)
    corpus = SyntheticCorpus(spec.vocab)
    ref = CostModel(spec, get_hardware(base), TrainConfig())
    rows, measured = [], []
    for doc, count in grid or GRID:
        measured.append(_time_step(model, corpus, doc, count, repeats, device))
        tokens, pairs = doc * count, 0.5 * doc * doc * count
        lin = tokens * (ref.layers * spec.linear_flops_per_token + spec.head_flops_per_token) * 3.0
        attn = pairs * ref.layers * spec.attn_flops_per_pair * (1.0 + ref.cfg.attn_bwd_factor)
        rows.append((lin, attn, 1.0))
    x, y = np.array(rows), np.array(measured)
    coef = _nnls(x, y)
    pred = x @ coef
    a, b, c = (max(float(v), 1e-30) for v in coef)
    hw = replace(get_hardware(base), name=f"{base}-calibrated", peak_flops=1.0 / a, mfu_gemm=1.0,
                 mfu_attn=min(1.0, a / b), gemm_half_tokens=0.0, attn_half_len=0.0,
                 layer_overhead_s=c / ref.layers)
    errors = (pred - y) / y
    report = {"points": [{"doc_len": d, "docs": n, "measured_s": float(m), "predicted_s": float(p),
                          "error": float(e)} for (d, n), m, p, e in zip(grid or GRID, y, pred, errors, strict=True)],
              "rms_relative_error": float(np.sqrt(np.mean(errors ** 2))),
              "max_relative_error": float(np.abs(errors).max()), "device": str(device),
              "threads": torch.get_num_threads(), "model": spec.name}
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
