"""The unified planner's search space: the discrete knobs of one global batch's layout.

A :class:`Candidate` is one setting of four knobs, each one paper's lever made a choice:

* ``degree`` d: the CP group size (HBP's per-group SP degree), over the divisors of ``--cp``; with ``--opt
  widen=1`` also 2·cp, 4·cp, ... while the longest sample's share and exchange exceed a quarter of a rank's load.
* ``tail``: samples longer than a group holds run as ChunkFlow chains of equal chunks whose first N − K are
  recomputed, or (the twin) memory-sized, recomputing only what memory cannot keep (planners/unified/tail.py).
  Checkpointing more layers for such samples (HBP's lever) is no knob here: the twin serves the same samples
  with the least recompute memory allows.
* ``split`` K: a micro-batch holds at most cap // K tokens a rank; longer samples become ChunkFlow chains whose
  last K chunks keep their activations. Tried with pipeline stages (1, 2, 4, 8: smaller micro-batches shorten
  the bubbles); with one stage (1, 2, 4) only where a chain's unit sets the step's bound (the chain is the
  critical path, and more kept chunks recompute less of it), elsewhere K = 1 unless ``--opt splits`` asks.
* ``alpha`` α: a sample that fits a rank is still sharded when its whole-rank time exceeds α·τ (τ: the mean rank
  load), or the step's longest unit (``unit``).

A degree's candidates come plain (K = 1, no twin) first, one per α; the others are ``variant`` s, which the
planner builds only for the α its plain ones rank best, and (with one pipeline stage) only where its best plain
one is no slower than every layout so far. Cost: O(|degrees| · 2 · |splits| · |alphas|) candidates, O(n) a degree
to list (its :class:`~.layout.Rates`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..base import Batch, PlanContext
from .groups import divisors
from .layout import Rates

__all__ = ["Candidate", "candidates", "UNIT"]

UNIT = -1.0  # the sharding threshold at the step's longest unit, not a multiple of τ
ALPHAS = (math.inf, 2.0, 1.0, 0.5, UNIT)


class Candidate(NamedTuple):
    degree: int
    split: int
    alpha: float
    tail: bool = False  # chains memory-sized instead of in equal chunks
    variant: bool = False  # a smaller split or the tail twin


def candidates(batch: Batch, ctx: PlanContext, rates: Callable[[int, int], Rates]) -> list[Candidate]:
    """Every candidate of one batch, in the order the search breaks ties by (the plain packing first);
    ``rates(d, k)``: the batch's Eq. 2 terms at a degree."""
    cost, world, k0 = ctx.cost, ctx.world, ctx.ckpt_layers
    degrees = ctx.numbers("degrees", int, "8,4,2,1", "integers") or _degrees(batch, ctx, rates)
    for d in degrees:
        if d < 1 or world % d:
            raise ValueError(f"--opt degrees: {d} must divide the world size {world} (--dp x --cp)")
    given = ctx.numbers("splits", int, "1,2,4", "integers")
    splits = given or ([1, 2, 4, 8] if cost.cfg.pp > 1 else [1, 2, 4])
    alphas = ctx.numbers("alphas", _alpha, "inf,1,0.5,unit", "positive numbers, inf or unit") or list(ALPHAS)
    longest, limit, out = int(batch.lengths.max()), batch.split_len or np.iinfo(np.int64).max, []
    for d in degrees:
        work, unit = rates(d, k0).forms
        critical = given or float(unit.max()) > float(work.sum()) / world  # a chain's unit sets the bound
        chains, ours = longest > min(cost.token_cap(k0) * d, limit), []
        for split in splits if cost.cfg.pp > 1 or (chains and critical) else splits[:1]:
            twin = chains and split == splits[0] and (d == 1 or ctx.flag("shard_chains", True))
            for tail in (False, True) if twin else (False,):
                ours += [Candidate(d, split, a, tail, tail or split != splits[0]) for a in (alphas if d > 1 else
                                                                                            alphas[:1])]
        out += sorted(ours, key=lambda c: c.variant)  # the plain ones first: they rank the alphas
    return out


def _degrees(batch: Batch, ctx: PlanContext, rates: Callable[[int, int], Rates]) -> list[int]:
    """Divisors of --cp, largest first; with ``--opt widen=1`` also wider groups while the longest sample's share
    and exchange at the previous degree exceed a quarter of the mean rank load."""
    out, d, i = divisors(ctx.cp), ctx.cp, int(np.argmax(batch.lengths))
    tau = float(rates(1, ctx.ckpt_layers).own_a.sum()) / ctx.world if ctx.flag("widen", False) else math.inf
    while 2 * d <= ctx.world and ctx.world % (2 * d) == 0:
        if rates(d, ctx.ckpt_layers).share_a[i] + ctx.cost.cp_comm_s(float(batch.lengths[i])) <= tau / 4:
            break
        d *= 2
        out.insert(0, d)
    return out


def _alpha(text: str) -> float:
    """A threshold of ``--opt alphas``: a float (a multiple of τ, ``inf`` for none) or ``unit``."""
    if text.strip().lower() == "unit":
        return UNIT
    if not (value := float(text)) > 0:
        raise ValueError(text)
    return value
