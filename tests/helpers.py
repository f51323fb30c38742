"""Helpers shared by the tests (importable: pytest puts tests/ on the path)."""

from __future__ import annotations

import numpy as np

from longpack.cost import CostModel, TrainConfig
from longpack.hardware import get_hardware
from longpack.model import get_model
from longpack.plan import MicroBatch, Piece, Plan, Replica, Step


def make_cost(model="qwen2.5-0.5b", hw="h100", **cfg) -> CostModel:
    m = get_model(model) if isinstance(model, str) else model
    h = get_hardware(hw) if isinstance(hw, str) else hw
    return CostModel(m, h, TrainConfig(**cfg))


def random_layout(rng: np.random.Generator, degrees: list[int], cap: int) -> Plan:
    """A random one-step plan on replicas of ``degrees`` (all equal: a step of one degree, else groups of several
    sizes): samples on random replicas, sharded or on a random rank, whole or as a chain of pieces in increasing
    micro-batches, random checkpointing and recompute flags. It may break the token cap (callers validate)."""
    n = int(rng.integers(2, 12))
    lengths = rng.integers(50, 3 * cap, n)
    depth = int(rng.integers(3, 7))
    reps: list[list[list[Piece]]] = [[[] for _ in range(depth)] for _ in degrees]
    flags = [(int(rng.integers(0, 25)), bool(rng.integers(0, 2))) for _ in range(depth)]
    for sample, s in enumerate(lengths.tolist()):
        g = int(rng.integers(0, len(degrees)))
        d = degrees[g]
        rank = None if d > 1 and rng.random() < 0.5 else int(rng.integers(0, d))
        fewest = -(-s // (cap * d if rank is None else cap))  # pieces the token cap needs
        parts = int(rng.integers(fewest, fewest + 2)) if fewest < depth else depth
        cuts = np.linspace(0, s, parts + 1).round().astype(int).tolist()
        first = int(rng.integers(0, depth - parts + 1))
        for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            reps[g][first + k].append(Piece(sample, a, b, rank))
    mixed = len(set(degrees)) > 1
    step = Step(cp=max(degrees), token_cap=cap, degrees=tuple(degrees) if mixed else (), replicas=tuple(
        Replica(tuple(MicroBatch(tuple(p), ckpt_layers=f[0], recompute=f[1] and bool(p)) for p, f in
                      zip(mbs, flags, strict=True))) for mbs in reps))
    return Plan("random", sum(degrees), dict(enumerate(lengths.tolist())), (step,))
