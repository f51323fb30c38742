"""Lower bounds on step time: no plan on this cost model can beat them.

For one step with samples of lengths s_i on dp replicas of cp ranks (PAPERS.md §5; used for efficiency):

    LB = max( Σ_i W(s_i) / (dp·cp),  max_i U(s_i) ) + T_fixed + T_allreduce

* ``W(s)``, the fewest GPU-seconds sample s can cost: held whole on one rank when memory allows (with the fewest
  checkpointed layers that make it fit), else sharded over the CP group (memory-forced sharding: cp ranks each
  do 1/cp); GEMMs at full efficiency, attention at the efficiency of its own length, no padding, no
  communication (it may all be hidden).
* ``U(s)``, the shortest time sample s can take (the largest indivisible unit): whole on one rank, or its 1/cp
  share when sharded; the better of the allowed options.
* ``T_fixed``: the busiest replica runs at least one micro-batch.

Why it is a bound: the simulator charges every rank at least the work of its pieces at these (ideal) rates, the
slowest replica at least the average, and every sample is run by one rank or one CP group, which takes at least
U(s). Cost: O(samples).
"""

from __future__ import annotations

import numpy as np

from ..cost import CostModel, attention_pairs

__all__ = ["sample_work", "step_lower_bound"]


def sample_work(lengths: np.ndarray, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(W, U) per sample: fewest GPU-seconds, and shortest time, on this cost model (see module docstring)."""
    s = np.asarray(lengths, dtype=np.float64)
    cp = cost.cfg.cp
    pairs = np.asarray(attention_pairs(0, s, cost.cfg.causal_factor), dtype=np.float64)
    # Sharded over cp: every rank does 1/cp of the tokens and pairs in blocks of s/(2cp) queries.
    q_shard = s / (2 * cp) if cp > 1 else s
    # (per-document call costs are left out: padded rows share one call, so they are not a per-sample lower bound)
    shard_unit = (np.asarray(cost.linear_s(s / cp, 0, ideal=True)) + np.asarray(cost.attn_s(pairs / cp, q_shard, 0)))
    work = cp * shard_unit
    unit = shard_unit.copy()
    for i, n in enumerate(s.tolist()):
        k = cost.min_ckpt_for(n)
        if k is None:
            continue
        local = float(cost.linear_s(n, k, ideal=True)) + float(cost.attn_s(pairs[i], n, k))
        work[i] = min(work[i], local)
        unit[i] = min(unit[i], local)
    return work, unit


def step_lower_bound(lengths: np.ndarray, cost: CostModel) -> float:
    """Lower bound on the time of one step holding samples of ``lengths`` (see module docstring)."""
    if len(lengths) == 0:
        return 0.0
    work, unit = sample_work(lengths, cost)
    gpus = cost.cfg.dp * cost.cfg.cp
    return max(float(work.sum()) / gpus, float(unit.max())) + cost.fixed_s + cost.grad_allreduce_s()
